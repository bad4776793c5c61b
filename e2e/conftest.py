"""Fixtures for the end-to-end tests; helpers live in meshfn_e2e.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from _pytest.runner import runtestprotocol
from meshfn_e2e import Processes

from meshfn.testing.policies import Policies
from meshfn.testing.ports import ADDRESS_IN_USE

PORT_CLASH_ATTEMPTS = 3


def _port_clash(report: pytest.TestReport) -> bool:
    return report.failed and ADDRESS_IN_USE in report.longreprtext.lower()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool:
    """Run a test again (its function-scoped fixtures, so its ports, anew) when it failed
    because a port picked for it was taken by another process before it bound it
    (`meshfn.testing.ports`: picked by bind-then-close); module-scoped rigs retry inside
    (`retry_on_port_clash`). Any other failure is reported at once."""
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    for attempt in range(1, PORT_CLASH_ATTEMPTS + 1):
        reports = runtestprotocol(item, nextitem=nextitem, log=False)
        if attempt < PORT_CLASH_ATTEMPTS and any(_port_clash(r) for r in reports):
            item.add_report_section("call", "port clash", f"attempt {attempt}: a port was taken")
            continue
        break
    for report in reports:
        item.ihook.pytest_runtest_logreport(report=report)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


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
