"""`meshfn audit ...`: verify the chains against the witness, query, erase a subject, export for
auditors, apply retention (witnessed by the signer), run a collector or the signer, create or
migrate a store and its PostgreSQL roles (`init`).

Mounted by the main CLI with `app.add_typer(audit_app, name="audit")`. `--store` takes an SQLite
file or a `postgresql://` DSN (or $MESHFN_AUDIT_STORE); for a store at STATE/audit/audit.db the
signer's public key and the witness default to STATE/audit-signer/ and STATE/audit-witness/.
"""

from __future__ import annotations

import asyncio
import csv
import hmac
import json
import logging
import re
import signal
import sys
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from prometheus_client import CollectorRegistry, start_http_server
from rich.table import Table

from meshfn.common import adminauth, env
from meshfn.common.cli import command_app, fail, out, run_cli
from meshfn.contracts.journal import journal_dir

from . import layout, offline, roles, signing
from .access import access_event, accessed, record_access, redact_journals
from .checkpoint import now_iso
from .collector import AuditCollector, CollectorMetrics
from .postgres import PostgresStore
from .salt import load as load_salt
from .signer import PruneRefused, PruneResult, Signer, SignerClient, SignerError, serve
from .store import CONTROL_CHAIN, DEFAULT_RETENTION_DAYS, AuditStore, StoreError
from .stores import open_store
from .verify import VerifyReport
from .verify import verify as verify_store
from .witness import FileWitness, Witness, WitnessError

audit_app = command_app(
    "audit",
    "The audit trail: verify, query, erase, export, retention, collector, signer, init.",
)

DEFAULT_STORE = str(layout.store_path(Path(".meshfn")))
StoreOpt = Annotated[
    str,
    typer.Option(
        "--store",
        envvar=env.AUDIT_STORE.name,
        help="audit store: an SQLite file or a postgresql:// DSN",
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]
KeyOpt = Annotated[
    Path | None,
    typer.Option(
        "--public-key",
        envvar=env.AUDIT_PUBLIC_KEY.name,
        help="the signer's ed25519 public key (PEM); default STATE/audit-signer/checkpoint.key.pub",
    ),
]
SignerOpt = Annotated[
    str | None,
    typer.Option(
        "--signer",
        envvar=env.AUDIT_SIGNER.name,
        help="the signer's address (unix:PATH or tcp:HOST:PORT)",
    ),
]
WitnessOpt = Annotated[
    Path | None,
    typer.Option(
        "--witness",
        envvar=env.AUDIT_WITNESS.name,
        help="the witness file; default STATE/audit-witness/checkpoints.jsonl",
    ),
]


# `meshfn audit` exits 2 when it cannot do what was asked (1: it did, and found a problem).
FAILED = 2


def _open(location: str, readonly: bool = True) -> AuditStore:
    try:
        return open_store(location, readonly=readonly)
    except StoreError as exc:
        fail(exc, FAILED)


def _public_key(store: str, given: Path | None) -> Ed25519PublicKey:
    state = layout.state_of(store)
    path = given or (layout.public_key_path(state) if state is not None else None)
    if path is None:
        fail("give --public-key (the signer's public key) for a store outside a state dir", FAILED)
    try:
        return signing.load_public(path)
    except signing.KeyError_ as exc:
        fail(exc, FAILED)


def _witness(store: str, given: Path | None, skip: bool) -> Witness | None:
    if skip:
        return None
    state = layout.state_of(store)
    path = given or (layout.witness_path(state) if state is not None else None)
    if path is None:
        fail("give --witness FILE (or --no-witness) for a store outside a state dir", FAILED)
    return FileWitness(path)


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


def _print_report(report: VerifyReport) -> None:
    chains = len(report.chains)
    witness = (
        f"; witness {report.witness}: {report.witnessed} checkpoint(s)"
        if report.witness
        else "; NO WITNESS checked"
    )
    if report.ok:
        out.print(
            f"[green]ok[/green]: {report.records} record(s) in {chains} chain(s), chains intact,"
            f" {report.checkpoints} signed checkpoint(s), last {report.last_checkpoint}"
            f" ({report.last_checkpoint_time}){witness};"
            f" {report.unsigned_tail} record(s) after it not yet signed",
            highlight=False,
        )
        _print_unsigned(report)
    else:
        for problem in report.problems:
            where = f"seq {problem.seq}: " if problem.seq is not None else ""
            out.print(f"[red]{problem.kind}[/red]: {where}{problem.detail}", highlight=False)
        if report.truncated_problems:
            out.print("(more problems not shown)")
        out.print(
            f"[red]TAMPERED[/red]: {len(report.problems)} problem(s) in {report.records}"
            f" record(s) of {chains} chain(s){witness}",
            highlight=False,
        )
        _print_unsigned(report)
    if report.retention_days is not None:
        out.print(f"retention: {report.retention_days} day(s), as the signer signed it")
    for note in report.notes:
        out.print(f"note: {note}", highlight=False)


def _print_unsigned(report: VerifyReport) -> None:
    """The unsigned tail, journal by journal: what a writer could still cut undetected."""
    for name, chain in sorted(report.chains.items()):
        if chain.unsigned:
            first = max(chain.signed_seq, chain.anchor_seq) + 1
            last = chain.last_seq if chain.last_seq is not None else chain.anchor_seq
            span = f"record {last}" if first == last else f"records {first}-{last}"
            out.print(
                f"unsigned: journal {name}: {span} ({chain.unsigned}) not yet signed",
                highlight=False,
            )


@audit_app.command()
def verify(
    store: StoreOpt = DEFAULT_STORE,
    public_key: KeyOpt = None,
    witness: WitnessOpt = None,
    no_witness: Annotated[
        bool, typer.Option("--no-witness", help="check the store alone (weaker: see the note)")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Check every chain (one per journal) against its hashes, the signed checkpoints and the
    witness. Exit 1 and name each edited, deleted, inserted, reordered, rewritten or truncated
    record (journal and seq) and any re-signed checkpoint."""
    key = _public_key(store, public_key)
    checked = _witness(store, witness, no_witness)
    db = _open(store)
    try:
        report = verify_store(db, key, checked, workers=None)
    except StoreError as exc:
        fail(exc, FAILED)
    finally:
        db.close()
    if as_json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        _print_report(report)
    raise typer.Exit(0 if report.ok else 1)


def _local_salt(store: str) -> str | None:
    """`meshfn up` keeps STATE/audit/audit.db and STATE/audit/subject.salt side by side."""
    state = layout.state_of(store)
    if state is None:
        return None
    try:
        found = load_salt(state)
    except (OSError, ValueError) as exc:
        fail(f"cannot read the subject salt: {exc}", FAILED)
    return found.hex if found is not None else None


def _subject(
    store: str, subject: str | None, subject_raw: str | None, salt: str | None, name: str
) -> str | None:
    """--subject-raw (hashed with the salt as the audit filter does) or a subject hash."""
    if subject_raw is not None:
        if subject is not None:
            raise typer.BadParameter(f"give {name} or --subject-raw, not both")
        if salt is None:
            salt = _local_salt(store)
        if salt is None or not re.fullmatch(r"([0-9a-fA-F]{2}){16,64}", salt):
            raise typer.BadParameter("--subject-raw needs --salt with 32-128 hex digits")
        return hmac.new(bytes.fromhex(salt), subject_raw.encode(), "sha256").hexdigest()
    if subject is not None and not re.fullmatch(r"[0-9a-fA-F]{64}|[0-9a-fA-F]{32}", subject):
        raise typer.BadParameter(
            f"{name} must be 64 hex digits (the filter's HMAC) or 32 (a record's pseudonym)"
        )
    return subject


SaltOpt = Annotated[
    str | None,
    typer.Option(
        help="the audit filter's subject_salt (hex), for --subject-raw (default: the one"
        " `meshfn up` keeps next to the store)"
    ),
]
SubjectRawOpt = Annotated[
    str | None,
    typer.Option("--subject-raw", help="raw JWT sub, hashed with the subject salt"),
]


@audit_app.command()
def query(
    store: StoreOpt = DEFAULT_STORE,
    since: Annotated[str | None, typer.Option(help="from (ISO 8601 or 30m/12h/7d ago)")] = None,
    until: Annotated[str | None, typer.Option(help="until, exclusive (same formats)")] = None,
    subject: Annotated[
        str | None,
        typer.Option(help="subject: the filter's HMAC (64 hex) or a record's pseudonym (32 hex)"),
    ] = None,
    subject_raw: SubjectRawOpt = None,
    salt: SaltOpt = None,
    status: Annotated[str | None, typer.Option(help="status code (503) or class (5xx)")] = None,
    route: Annotated[
        str | None, typer.Option(help="mesh route (namespace/name, e.g. default/function-iris)")
    ] = None,
    chain: Annotated[str | None, typer.Option(help="journal (proxy node id)")] = None,
    limit: Annotated[int, typer.Option(min=1, max=1_000_000)] = 100,
    as_json: JsonOpt = False,
    show_accessed: Annotated[
        bool,
        typer.Option(
            "--accessed",
            help="list who read personal data instead: every query by subject, export and"
            " erasure (newest first)",
        ),
    ] = False,
) -> None:
    """Records matching all given filters, oldest first. A query by subject is itself recorded
    in the trail (who, when, the pseudonym, how many records came back): it is refused when the
    store cannot take that record."""
    if show_accessed:
        _print_accessed(store, limit, as_json)
        return
    wanted = _subject(store, subject, subject_raw, salt, "--subject")
    code, klass = _status(status)
    db = _open(store)
    try:
        pseudonyms = db.pseudonyms(wanted) if wanted is not None else []
        rows = db.query(
            since=parse_time(since) if since else None,
            until=parse_time(until) if until else None,
            subject=wanted,
            status=code,
            status_class=klass,
            route=route,
            chain=chain,
            limit=limit,
        )
    except StoreError as exc:
        fail(exc, FAILED)
    finally:
        db.close()
    if wanted is not None:  # before anything is shown: an unrecorded read must not happen
        _record(store, "query", pseudonyms, len(rows))
    if as_json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return
    table = Table(
        "chain", "seq", "time", "method", "path", "status", "us", "route", "subject", "tenant"
    )
    for row in rows:
        table.add_row(
            str(row["chain"]),
            str(row["seq"]),
            str(row.get("time")),
            str(row.get("method")),
            str(row.get("path")),
            str(row.get("status")),
            str(row.get("duration_us")),
            str(row.get("route") or row.get("route_source") or "-"),
            (row.get("subject") or "-")[:16],
            str(row.get("tenant") or "-"),
        )
    out.print(table)
    out.print(f"{len(rows)} record(s)")


def _record(store: str, action: str, pseudonyms: list[str], records: int, **detail: Any) -> None:
    """Record this command's read of personal data (as the local user: whoever can open the
    store's files); refuse to go on when the store will not take the record."""
    event = access_event(
        principal=adminauth.local_principal(),
        action=action,
        via="cli",
        pseudonyms=pseudonyms,
        records=records,
        **detail,
    )
    db = _open(store, readonly=False)
    try:
        record_access(db, event)
    except StoreError as exc:
        fail(
            f"this {action} reads personal data and must be recorded in the trail, which"
            f" refused the record: {exc}",
            FAILED,
        )
    finally:
        db.close()


def _print_accessed(store: str, limit: int, as_json: bool) -> None:
    db = _open(store)
    try:
        rows = accessed(db, limit)
    except StoreError as exc:
        fail(exc, FAILED)
    finally:
        db.close()
    if as_json:
        for row in rows:
            print(json.dumps(row, sort_keys=True))
        return
    table = Table("seq", "time", "principal", "via", "action", "pseudonyms", "records")
    for row in rows:
        table.add_row(
            str(row["seq"]),
            str(row.get("time")),
            str(row.get("principal") or "-"),
            str(row.get("via") or "-"),
            str(row.get("action") or row.get("event")),
            ", ".join(p[:16] for p in row.get("pseudonyms") or []) or "-",
            str(row.get("records", 0)),
        )
    out.print(table)
    out.print(f"{len(rows)} access(es) to personal data")


@audit_app.command()
def erase(
    store: StoreOpt = DEFAULT_STORE,
    subject_raw: SubjectRawOpt = None,
    subject_hash: Annotated[
        str | None,
        typer.Option(
            "--subject-hash",
            help="the filter's HMAC of the subject (64 hex) or a record's pseudonym (32 hex)",
        ),
    ] = None,
    salt: SaltOpt = None,
) -> None:
    """GDPR Art. 17: make the subject's records unlinkable to the subject (crypto-shredding:
    its pseudonym key is destroyed; the records stay and still verify), and overwrite the
    subject's HMAC in the proxies' journals. With `meshfn up` running on the store's state
    directory, that control plane does it (with its auditor token from STATE/admin/token), so
    no line of the subject is stored after the erasure. Records the erasure itself (who, the
    destroyed pseudonym, how many records), never the subject. A subject the store does not
    know: "nothing to erase", exit 0, and the attempt is recorded."""
    wanted = _subject(store, subject_hash, subject_raw, salt, "--subject-hash")
    if wanted is None:
        raise typer.BadParameter("give --subject-raw or --subject-hash")
    state = layout.state_of(store)
    url = adminauth.running_admin_url(state) if state is not None else None
    if state is not None and url is not None:
        _erase_online(state, url, wanted)
        return
    db = _open(store, readonly=False)
    try:
        done = db.erase(wanted, principal=adminauth.local_principal(), via="cli")
        copies = 0
        if done is not None and state is not None:
            copies = redact_journals(db, journal_dir(state), done.hashes)
        elif done is None:
            record_access(
                db,
                access_event(principal=adminauth.local_principal(), action="erase", via="cli"),
            )
    except (StoreError, OSError) as exc:
        fail(exc, FAILED)
    finally:
        db.close()
    if done is None:
        out.print("nothing to erase: the store holds no pseudonym for this subject (recorded)")
        return
    _print_erasure(done.records, done.seq, copies, done.residue)


def _print_erasure(records: int, seq: int, copies: int, residue: Any) -> None:
    out.print(
        f"erased: {records} record(s) can no longer be linked to the subject; erasure"
        f" recorded as {CONTROL_CHAIN} record {seq}; {copies} copy(ies) of the subject's"
        " HMAC overwritten in the journals"
    )
    for line in residue:
        out.print("[yellow]warning[/yellow]: ", end="", highlight=False)
        out.print(str(line), markup=False, highlight=False)


def _erase_online(state: Path, url: str, subject: str) -> None:
    token = adminauth.read_owner_token(state)
    try:
        answer = adminauth.call_admin(
            f"{url}/audit/erase", token, "POST", {"subject": subject}, timeout=60
        )
    except adminauth.AdminCallError as exc:
        fail(f"the control plane running on {state} did not erase: {exc}", FAILED)
    if not answer.get("erased"):
        out.print("nothing to erase: the store holds no pseudonym for this subject (recorded)")
        return
    _print_erasure(
        int(answer["records"]),
        int(answer["seq"]),
        int(answer.get("journal_copies", 0)),
        answer.get("residue") or [],
    )


def _export_entries(
    db: AuditStore,
    since: str,
    until: str | None,
    key_pem: str,
    before: Callable[[int], None] | None = None,
) -> Iterator[dict[str, Any]]:
    """Header, the checkpoints, then per chain the records from the first at or after
    `since` up to the newest signed head (the unsigned tail is left out: everything exported
    is covered by a signature). `before(records)` runs before the first entry is produced,
    with how many records follow (the access record of an export is written there)."""
    checkpoints = db.checkpoints()
    signed: dict[str, int] = {}
    for checkpoint in checkpoints:
        for chain, (seq, _) in checkpoint.heads.items():
            signed[chain] = seq
    runs: dict[str, tuple[int, int]] = {}
    for chain in db.chains():
        first = db.records_since(chain, since)
        top = signed.get(chain)
        if first is None or top is None or first > top:
            continue
        runs[chain] = (first, top)
    if before is not None:
        before(sum(top - first + 1 for first, top in runs.values()))
    yield {
        "type": offline.EXPORT_TYPE,
        "v": 1,
        "store": db.store_id,
        "since": since,
        "until": until,
        "created": now_iso(),
        "public_key": key_pem,
    }
    needed_from = min(
        (
            c.n
            for c in checkpoints
            if any(ch in runs and s >= runs[ch][0] for ch, (s, _) in c.heads.items())
        ),
        default=None,
    )
    for checkpoint in checkpoints:
        if needed_from is not None and checkpoint.n >= needed_from:
            yield {"type": "checkpoint", **checkpoint.as_json()}
    for chain, (first, top) in sorted(runs.items()):
        for seq, body, prev, digest in db.records_after(chain, first - 1):
            if seq > top:
                break
            if until is not None and json.loads(body).get("time", "") >= until:
                break
            yield {
                "type": "record",
                "chain": chain,
                "seq": seq,
                "prev": prev.hex(),
                "hash": digest.hex(),
                "record": body,
            }


@audit_app.command()
def export(
    since: Annotated[str, typer.Option(help="from (ISO 8601 or 30m/12h/7d ago)")],
    store: StoreOpt = DEFAULT_STORE,
    fmt: Annotated[Literal["jsonl", "csv"], typer.Option("--format")] = "jsonl",
    output: Annotated[Path | None, typer.Option("--out", help="file (default: stdout)")] = None,
    public_key: KeyOpt = None,
) -> None:
    """Records since a time, with the checkpoints and signatures that cover them, for an
    auditor: `python3 audit/offline.py FILE --public-key KEY` verifies the file
    without meshfn or its database (so does `meshfn audit verify-export`). Each chain's run
    ends at its newest signed record."""
    key = _public_key(store, public_key)
    pem = key.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
    start = parse_time(since)

    def recorded(records: int) -> None:  # before any record is written out
        _record(store, "export", [], records, since=start)

    db = _open(store)
    try:
        handle = output.open("w", newline="", encoding="utf-8") if output else sys.stdout
        try:
            entries = _export_entries(db, start, None, pem, recorded)
            count = _write_export(handle, entries, fmt)
        finally:
            if output:
                handle.close()
    except StoreError as exc:
        fail(exc, FAILED)
    finally:
        db.close()
    if output:
        out.print(f"exported {count} record(s) to {output}")


def _write_export(handle: Any, entries: Iterator[dict[str, Any]], fmt: str) -> int:
    count = 0
    writer = csv.DictWriter(handle, offline.CSV_COLUMNS) if fmt == "csv" else None
    if writer is not None:
        writer.writeheader()
    for entry in entries:
        count += entry["type"] == "record"
        if writer is None:
            handle.write(json.dumps(entry, sort_keys=True) + "\n")
            continue
        row: dict[str, Any] = {"type": entry["type"]}
        if entry["type"] == "record":
            record = json.loads(entry["record"])
            row.update(
                {k: entry[k] for k in ("chain", "seq", "prev", "hash")},
                body=entry["record"],
                **{k: record.get(k) for k in ("time", "method", "path", "status", "route")},
                subject=record.get("subject"),
                tenant=record.get("tenant"),
            )
        elif entry["type"] == "checkpoint":
            row.update(body=entry["body"], signature=entry["signature"], key_id=entry["key_id"])
        else:
            row.update(type="export", body=json.dumps(entry, sort_keys=True))
        writer.writerow(row)
    return count


@audit_app.command("verify-export")
def verify_export(
    export_file: Annotated[Path, typer.Argument(help="a file `meshfn audit export` wrote")],
    public_key: Annotated[
        Path | None, typer.Option("--public-key", help="trusted copy of the signer's key")
    ] = None,
) -> None:
    """Check an export on its own (the same code as the standalone offline.py)."""
    argv = [str(export_file)] + (["--public-key", str(public_key)] if public_key else [])
    raise typer.Exit(offline.main(argv))


@audit_app.command()
def prune(
    store: StoreOpt = DEFAULT_STORE,
    signer: SignerOpt = None,
    days: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="prune only what is older than this (never less than the signer's retention)",
        ),
    ] = None,
) -> None:
    """Apply retention now: the signer witnesses a prune of every journal up to its newest
    record signed longer ago than its retention (or DAYS, if longer), then those records are
    deleted. The retention is the signer's, never the store's."""
    state = layout.state_of(store)
    address = signer or (layout.signer_socket(state) if state is not None else None)
    if address is None:
        fail(
            "give --signer (the signer witnesses every prune) for a store outside a state dir",
            FAILED,
        )
    db = _open(store, readonly=False)
    try:
        result = SignerClient(address).prune(days)
        deleted = db.apply_prune(result.points)
    except PruneRefused as exc:
        fail(f"refused: {exc}", FAILED)
    except SignerError as exc:
        fail(
            f"{exc}: every prune is witnessed by the signer; start it (`meshfn up` runs it, or"
            " `meshfn audit signer`) or give --signer",
            FAILED,
        )
    except StoreError as exc:
        fail(exc, FAILED)
    finally:
        db.close()
    _print_prune(result, deleted)


def _print_prune(result: PruneResult, deleted: int) -> None:
    if result.checkpoints:
        new = result.checkpoints[-1]
        reach = ", ".join(f"journal {c} up to record {s}" for c, (s, _) in new.prune.items())
        out.print(
            f"the signer witnessed a prune in checkpoint {new.n} (retention"
            f" {result.retention_days} day(s)): {reach}",
            highlight=False,
        )
    else:
        out.print(
            f"nothing new to prune: no record signed longer ago than the retention"
            f" ({result.retention_days} day(s)) is left to witness",
            highlight=False,
        )
    out.print(f"deleted {deleted} record(s)")


@audit_app.command()
def init(
    store: StoreOpt = DEFAULT_STORE,
    collector: Annotated[
        str | None,
        typer.Option(
            envvar=env.AUDIT_COLLECTOR_DSN.name,
            help="the collectors' role: a DSN (its user, and password for --create-roles) or a"
            " role name (PostgreSQL)",
        ),
    ] = None,
    signer: Annotated[
        str | None,
        typer.Option(envvar=env.AUDIT_SIGNER_DSN.name, help="the signer's role (the same forms)"),
    ] = None,
    reader: Annotated[
        str | None,
        typer.Option(envvar=env.AUDIT_READER_DSN.name, help="the readers' role (the same forms)"),
    ] = None,
    auditor: Annotated[
        str | None,
        typer.Option(
            envvar=env.AUDIT_AUDITOR_DSN.name,
            help="the auditors' role: queries by subject and exports, each recorded (the same"
            " forms)",
        ),
    ] = None,
    create_roles: Annotated[
        bool,
        typer.Option(
            "--create-roles", help="create missing login roles (and set the DSNs' passwords)"
        ),
    ] = False,
) -> None:
    """Create the store, or migrate an older one, as its owner; on PostgreSQL also give each
    component its own role: collectors insert records and advance journals, the signer only
    inserts checkpoints, auditors read and record their reads of personal data, readers only
    read. Safe to run again (grants are reset to these)."""
    given = {"collector": collector, "signer": signer, "reader": reader, "auditor": auditor}
    wanted = {kind: value for kind, value in given.items() if value}
    db = _open(store, readonly=False)
    try:
        if not isinstance(db, PostgresStore):
            if wanted:
                fail(
                    "an SQLite store has no roles: whoever can write its file writes it all",
                    FAILED,
                )
            out.print(f"audit store {db.location}: schema ready")
            return
        lines = roles.init_roles(
            db, [roles.role_of(k, v) for k, v in wanted.items()], create=create_roles
        )
    except StoreError as exc:
        fail(exc, FAILED)
    finally:
        db.close()
    out.print(f"audit store {db.location}: schema ready", highlight=False)
    for line in lines:
        out.print(f"role {line}", highlight=False)
    missing = [kind for kind in roles.KINDS if kind not in wanted]
    if missing:
        out.print(
            f"[yellow]warning[/yellow]: no role given for {', '.join(missing)}: such a"
            " component would need the owner's credentials, which can rewrite the trail",
            highlight=False,
        )


@audit_app.command()
def collect(
    journal: Annotated[
        list[str], typer.Option("--journal", help="SOURCE=PATH of an Envoy audit journal")
    ],
    store: StoreOpt = DEFAULT_STORE,
    signer: SignerOpt = None,
    max_bytes: Annotated[
        int | None, typer.Option("--max-bytes", min=4096, help="cap the store's size (SQLite)")
    ] = None,
    checkpoint_every: Annotated[int, typer.Option(min=1)] = 1000,
    checkpoint_interval: Annotated[float, typer.Option(min=0.05)] = 5.0,
    metrics_port: Annotated[
        int | None, typer.Option(help="serve /metrics (Prometheus) on this port")
    ] = None,
) -> None:
    """Run a collector in the foreground until SIGTERM/SIGINT (the control plane runs the same
    collector in-process). Several may write one store, each with its own journals."""
    pairs = []
    for item in journal:
        source, sep, path = item.partition("=")
        if not sep or not source or not path:
            raise typer.BadParameter(f"{item!r}: use SOURCE=PATH")
        pairs.append((source, Path(path)))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        db = open_store(store, max_bytes=max_bytes)
    except StoreError as exc:
        fail(exc, FAILED)
    if signer is None:
        logging.getLogger("meshfn.audit").warning(
            "no --signer: records are chained but not signed (no checkpoints)"
        )

    async def run() -> None:
        collector = AuditCollector(
            db,
            checkpoint_every=checkpoint_every,
            checkpoint_interval=checkpoint_interval,
            signer=SignerClient(signer) if signer else None,
        )
        for source, path in pairs:
            collector.watch(path, source)
        if metrics_port is not None:
            registry = CollectorRegistry()
            registry.register(CollectorMetrics(lambda: collector))
            start_http_server(metrics_port, registry=registry)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await collector.start()
        logging.getLogger("meshfn.audit").info(
            "collecting %d journal(s) into %s", len(pairs), db.location
        )
        await stop.wait()
        await collector.stop()

    try:
        asyncio.run(run())
    finally:
        db.close()


@audit_app.command("signer")
def signer_command(
    store: StoreOpt = DEFAULT_STORE,
    key: Annotated[
        Path | None,
        typer.Option(
            help="the private key (created on first use, 0600); default"
            " STATE/audit-signer/checkpoint.key"
        ),
    ] = None,
    witness: WitnessOpt = None,
    listen: Annotated[
        str | None, typer.Option(help="unix:PATH or tcp:HOST:PORT (default: STATE's socket)")
    ] = None,
    retention_days: Annotated[
        int,
        typer.Option(
            min=0,
            help="keep records this many days: signed into every checkpoint; the signer"
            " witnesses no prune of younger records",
        ),
    ] = DEFAULT_RETENTION_DAYS,
) -> None:
    """Run the checkpoint signer: the only holder of the signing key and of the retention.
    It reads the store, signs only chain heads it has re-verified, appends every checkpoint
    to the witness before inserting it (its only write), and witnesses each prune."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    state = layout.state_of(store)
    key = key or (layout.key_path(state) if state else None)
    witness = witness or (layout.witness_path(state) if state else None)
    listen = listen or (layout.signer_socket(state) if state else None)
    if key is None or witness is None or listen is None:
        fail("give --key, --witness and --listen for a store outside a state dir", FAILED)
    try:
        private = signing.load_or_create(key)
        db = open_store(store)
    except (signing.KeyError_, StoreError, OSError) as exc:
        fail(exc, FAILED)
    try:
        the_signer = Signer(db, private, FileWitness(witness), retention_days)
    except (SignerError, WitnessError, StoreError) as exc:
        db.close()
        fail(exc, FAILED)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await serve(the_signer, listen, stop)

    try:
        asyncio.run(run())
    finally:
        db.close()


if __name__ == "__main__":  # `python -P -m meshfn.audit.cli ...` before it is mounted
    run_cli(audit_app)
