"""`meshfn audit ...`: verify the chain, query records, apply retention, run a collector.

Mounted by the main CLI with `app.add_typer(audit_app, name="audit")`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import signal
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from . import signing
from .collector import AuditCollector
from .salt import load as load_salt
from .store import AuditStore, StoreError

audit_app = typer.Typer(
    name="audit",
    help="The audit trail: verify its hash chain, query records, retention, collector.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 200)

DEFAULT_STORE = Path(".meshfn/audit/audit.db")
StoreOpt = Annotated[Path, typer.Option("--store", help="audit store (SQLite file)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"[red]error:[/red] {message}", highlight=False, markup=True)
    return typer.Exit(code)


def _open(path: Path, readonly: bool = True) -> AuditStore:
    try:
        return AuditStore(path, readonly=readonly)
    except StoreError as exc:
        raise _fail(str(exc)) from None


_RELATIVE = re.compile(r"^(\d+)([smhd])$")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_time(text: str, now: datetime | None = None) -> str:
    """ISO 8601 (date, or date and time with optional offset; naive means UTC) or a relative
    `30m` / `12h` / `7d` (that long ago) -> the records' UTC time format."""
    moment: datetime
    match = _RELATIVE.match(text.strip())
    if match:
        delta = timedelta(**{_UNITS[match.group(2)]: int(match.group(1))})
        moment = (now or datetime.now(UTC)) - delta
    else:
        try:
            moment = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
        except ValueError:
            raise typer.BadParameter(
                f"{text!r} is not a time: use ISO 8601 (2026-01-31T12:00:00Z) or 30m/12h/7d"
            ) from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _status(text: str | None) -> tuple[int | None, int | None]:
    if text is None:
        return None, None
    value = text.strip().lower()
    if re.fullmatch(r"[1-5]xx", value):
        return None, int(value[0])
    if re.fullmatch(r"\d{1,3}", value):
        return int(value), None
    raise typer.BadParameter(f"{text!r}: use a status code (503) or a class (5xx)")


@audit_app.command()
def verify(
    store: StoreOpt = DEFAULT_STORE,
    public_key: Annotated[
        Path | None,
        typer.Option("--public-key", help="ed25519 public key PEM (default: STORE.key.pub)"),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Check every record against the hash chain and every checkpoint signature. Exit 1 and name
    each edited, deleted, inserted or reordered record if the trail was tampered with."""
    db = _open(store)
    try:
        key = signing.load_public(public_key or signing.public_path(db.key_path))
        report = db.verify(key)
    except (signing.KeyError_, StoreError) as exc:
        raise _fail(str(exc)) from None
    finally:
        db.close()
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        span = f"records {report.first_seq}-{report.last_seq}" if report.records else "no records"
        if report.ok:
            out.print(
                f"[green]ok[/green]: {report.records} record(s) ({span}), chain intact,"
                f" {report.checkpoints} signed checkpoint(s), last at {report.last_checkpoint_seq}"
                f"; {report.unsigned_tail} record(s) after it not yet signed",
                highlight=False,
            )
        else:
            for problem in report.problems:
                where = f"seq {problem.seq}: " if problem.seq is not None else ""
                out.print(f"[red]{problem.kind}[/red]: {where}{problem.detail}", highlight=False)
            if report.truncated_problems:
                out.print("(more problems not shown)")
            out.print(
                f"[red]TAMPERED[/red]: {len(report.problems)} problem(s) in {report.records}"
                f" record(s) ({span})",
                highlight=False,
            )
    raise typer.Exit(0 if report.ok else 1)


def _local_salt(store: Path) -> str | None:
    """`meshfn up` keeps STATE/audit/audit.db and STATE/audit/subject.salt side by side."""
    try:
        found = load_salt(store.parent.parent)
    except (OSError, ValueError) as exc:
        raise _fail(f"cannot read the subject salt: {exc}") from None
    return found.hex if found is not None else None


@audit_app.command()
def query(
    store: StoreOpt = DEFAULT_STORE,
    since: Annotated[str | None, typer.Option(help="from (ISO 8601 or 30m/12h/7d ago)")] = None,
    until: Annotated[str | None, typer.Option(help="until, exclusive (same formats)")] = None,
    subject: Annotated[
        str | None, typer.Option(help="subject hash (64 hex digits, as in the records)")
    ] = None,
    subject_raw: Annotated[
        str | None,
        typer.Option("--subject-raw", help="raw JWT sub, hashed with the subject salt"),
    ] = None,
    salt: Annotated[
        str | None,
        typer.Option(
            help="the audit filter's subject_salt (hex), for --subject-raw (default: the one"
            " `meshfn up` keeps next to the store)"
        ),
    ] = None,
    status: Annotated[str | None, typer.Option(help="status code (503) or class (5xx)")] = None,
    route: Annotated[str | None, typer.Option(help="Envoy route name")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1_000_000)] = 100,
    as_json: JsonOpt = False,
) -> None:
    """Records matching all given filters, oldest first."""
    if subject_raw is not None:
        if subject is not None:
            raise typer.BadParameter("give --subject or --subject-raw, not both")
        if salt is None:
            salt = _local_salt(store)
        if salt is None or not re.fullmatch(r"([0-9a-fA-F]{2}){16,64}", salt):
            raise typer.BadParameter("--subject-raw needs --salt with 32-128 hex digits")
        subject = hmac.new(bytes.fromhex(salt), subject_raw.encode(), "sha256").hexdigest()
    if subject is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", subject):
        raise typer.BadParameter("--subject must be 64 hex digits")
    code, klass = _status(status)
    db = _open(store)
    try:
        rows = db.query(
            since=parse_time(since) if since else None,
            until=parse_time(until) if until else None,
            subject=subject,
            status=code,
            status_class=klass,
            route=route,
            limit=limit,
        )
    except StoreError as exc:
        raise _fail(str(exc)) from None
    finally:
        db.close()
    if as_json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return
    table = Table("seq", "time", "method", "path", "status", "us", "route", "subject", "tenant")
    for row in rows:
        table.add_row(
            str(row["seq"]),
            str(row.get("time")),
            str(row.get("method")),
            str(row.get("path")),
            str(row.get("status")),
            str(row.get("duration_us")),
            str(row.get("route")),
            (row.get("subject") or "-")[:16],
            str(row.get("tenant") or "-"),
        )
    out.print(table)
    out.print(f"{len(rows)} record(s)")


@audit_app.command()
def prune(
    store: StoreOpt = DEFAULT_STORE,
    days: Annotated[int, typer.Option(min=0, help="keep this many days")] = 730,
) -> None:
    """Apply retention now: delete records older than DAYS up to a signed checkpoint."""
    db = _open(store, readonly=False)
    try:
        deleted = db.apply_retention(days=days)
    except StoreError as exc:
        raise _fail(str(exc)) from None
    finally:
        db.close()
    out.print(f"deleted {deleted} record(s) older than {days} day(s)")


@audit_app.command()
def collect(
    journal: Annotated[
        list[str], typer.Option("--journal", help="SOURCE=PATH of an Envoy audit journal")
    ],
    store: StoreOpt = DEFAULT_STORE,
    max_bytes: Annotated[
        int | None, typer.Option("--max-bytes", min=4096, help="cap the store's size")
    ] = None,
    checkpoint_every: Annotated[int, typer.Option(min=1)] = 1000,
) -> None:
    """Run a collector in the foreground until SIGTERM/SIGINT (the control plane runs the same
    collector in-process)."""
    pairs = []
    for item in journal:
        source, sep, path = item.partition("=")
        if not sep or not source or not path:
            raise typer.BadParameter(f"{item!r}: use SOURCE=PATH")
        pairs.append((source, Path(path)))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        db = AuditStore(store, max_bytes=max_bytes)
    except StoreError as exc:
        raise _fail(str(exc)) from None

    async def run() -> None:
        collector = AuditCollector(db, checkpoint_every=checkpoint_every)
        for source, path in pairs:
            collector.watch(path, source)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await collector.start()
        logging.getLogger("meshfn.audit").info(
            "collecting %d journal(s) into %s", len(pairs), store
        )
        await stop.wait()
        await collector.stop()

    try:
        asyncio.run(run())
    finally:
        db.close()


if __name__ == "__main__":  # `python -P -m meshfn.control_plane.audit.cli ...` before it is mounted
    audit_app()
