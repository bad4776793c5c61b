from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshfn.testing.postgres import PostgresServer, postgres


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite the golden files (tests/golden: ir.yaml and out.<type>.yaml per case) from the current code (review the diff!)",
    )


@pytest.fixture(scope="session")
def pg() -> Iterator[PostgresServer]:
    """One real PostgreSQL server (Debian's) for the session; each test takes a new database."""
    with postgres() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgres"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where an audit store lives: an SQLite file, or a fresh database on the real server."""
    if request.param == "sqlite":
        return str(tmp_path / "state" / "audit" / "audit.db")
    server: PostgresServer = request.getfixturevalue("pg")
    return server.database()
