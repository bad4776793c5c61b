"""A real PostgreSQL server (Debian's `postgresql` package) on loopback, for tests and benchmarks.

PostgreSQL refuses to run as root, so as root `initdb` and `postgres` run as the `postgres` user
(through `runuser`) in a temporary directory that user owns; otherwise as the current user.
`trust` authentication on 127.0.0.1 only; stopped by PID (fast shutdown) and removed.

The server's own user (`meshfn`) is a superuser: it owns what it creates, as the owner of an
audit store does. `role_dsns` gives an audit store's components their own least-privilege roles
(meshfn.audit.roles), as a deployment must, so tests run collectors, the signer and readers
with exactly the grants they get in production.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from .ports import PortInUse, free_port, retry_on_port_clash
from .processes import alive

INSTALL_HINT = "PostgreSQL is not installed: apt-get install postgresql (./dev.sh setup does it)"


AUDIT_ROLES = {
    "collector": "meshfn_audit_collector",
    "signer": "meshfn_audit_signer",
    "reader": "meshfn_audit_reader",
    "auditor": "meshfn_audit_auditor",
}


def with_user(dsn: str, user: str) -> str:
    """`dsn` connecting as `user` instead (trust authentication: no password)."""
    import psycopg

    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info["user"] = user
    info.pop("password", None)
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in info.items()})


def role_dsns(owner_dsn: str) -> dict[str, str]:
    """Create the audit store at `owner_dsn` (as its owner) and the components' roles with
    their grants (`meshfn audit init --create-roles`); the DSN of each role, by kind."""
    from meshfn.audit import roles
    from meshfn.audit.postgres import PostgresStore

    store = PostgresStore(owner_dsn)
    try:
        roles.init_roles(
            store, [roles.Role(k, name) for k, name in AUDIT_ROLES.items()], create=True
        )
    finally:
        store.close()
    return {kind: with_user(owner_dsn, name) for kind, name in AUDIT_ROLES.items()}


def bin_dir() -> Path:
    """The newest installed server's bin directory (Debian: /usr/lib/postgresql/<v>/bin)."""
    found = sorted(
        Path("/usr/lib/postgresql").glob("*/bin/postgres"),
        key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0,
    )
    if not found:
        raise RuntimeError(INSTALL_HINT)
    return found[-1].parent


class PostgresServer:
    """`with PostgresServer() as pg: pg.database("t1")` -> a DSN of a fresh database."""

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        # Tests need no durability; benchmarks pass {} to keep PostgreSQL's defaults. A server
        # that holds audit stores removes old WAL segments instead of recycling them (what the
        # README asks of one: an erasure then leaves nothing in pg_wal; audit/postgres.py).
        self.settings = (
            {
                "fsync": "off",
                "synchronous_commit": "off",
                "full_page_writes": "off",
                "wal_recycle": "off",
            }
            if settings is None
            else settings
        )
        self.dir = Path(tempfile.mkdtemp(prefix="meshfn-pg-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self._as: list[str] = []
        if os.geteuid() == 0:
            try:
                user = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError(
                    f"no `postgres` user to run the server as; {INSTALL_HINT}"
                ) from None
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self.bin = bin_dir()
        self.log = self.dir / "server.log"
        self._count = 0

    @property
    def data(self) -> Path:
        return self.dir / "data"

    def _run(self, *argv: str) -> None:
        done = subprocess.run(
            [*self._as, *argv], capture_output=True, text=True, timeout=120, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"{argv[0]} failed ({done.returncode}): {done.stderr[-2000:]}")

    def start(self) -> PostgresServer:
        self._run(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "meshfn",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        )
        retry_on_port_clash(self._start_server)
        return self

    def _start_server(self) -> None:
        self.port = free_port()
        options = [f"-c{k}={v}" for k, v in self.settings.items()]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [
                    *self._as,
                    str(self.bin / "postgres"),
                    "-D",
                    str(self.data),
                    "-h",
                    "127.0.0.1",
                    "-p",
                    str(self.port),
                    "-k",
                    str(self.dir),
                    *options,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                text = self.log.read_text(errors="replace")
                self.proc = None
                if "already in use" in text.lower():
                    self.log.write_text("")
                    raise PortInUse(f"postgres on port {self.port}")
                raise RuntimeError(f"postgres exited: {text[-3000:]}")
            if self._ready():
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres not ready: {self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def _ready(self) -> bool:
        import psycopg

        try:
            psycopg.connect(self.dsn("postgres"), connect_timeout=1).close()
        except psycopg.OperationalError:
            return False
        return True

    def dsn(self, database: str = "postgres") -> str:
        return f"postgresql://meshfn@127.0.0.1:{self.port}/{database}"

    def database(self, name: str | None = None) -> str:
        """A new, empty database; its DSN."""
        import psycopg

        self._count += 1
        name = name or f"t{self._count}"
        with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"'.encode())
        return self.dsn(name)

    def _postmaster(self) -> int | None:
        """The server's own PID (postmaster.pid's first line). As root `self.proc` is runuser,
        which does not pass a SIGINT on: signalling it left the server running (and every stop
        waited its 30 s for nothing) until the server noticed its data directory was gone."""
        try:
            return int((self.data / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None

    def stop(self) -> None:
        master = self._postmaster()
        if master is not None and alive(master):
            os.kill(master, signal.SIGINT)  # fast shutdown: roll back, stop
            deadline = time.monotonic() + 30
            while alive(master) and time.monotonic() < deadline:
                time.sleep(0.05)
            if alive(master):
                os.kill(master, signal.SIGKILL)
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(10)  # runuser exits with the server
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PostgresServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


@contextlib.contextmanager
def postgres(settings: dict[str, str] | None = None) -> Iterator[PostgresServer]:
    server = PostgresServer(settings)
    try:
        yield server.start()
    finally:
        server.stop()
