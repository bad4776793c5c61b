"""Fixtures for the end-to-end tests; helpers live in meshfn_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from meshfn_e2e import Processes

from meshfn.testing.policies import Policies


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    processes = Processes(tmp_path)
    yield processes
    processes.stop_all()


@pytest.fixture(params=["delta", "sotw"])
def policies(request: pytest.FixtureRequest, tmp_path: Path) -> Policies:
    return Policies(tmp_path / "policies", protocol=request.param)


@pytest.fixture
def delta_policies(tmp_path: Path) -> Policies:
    return Policies(tmp_path / "policies", protocol="delta")
