"""Least privilege in a PostgreSQL audit store: one database role per component.

- the owner (whoever runs `meshfn audit init`) owns the tables and triggers, creates and
  migrates the schema, and erases subjects (an erasure rewrites the subjects table);
- collectors insert records and chains, advance journals, pseudonymise subjects, and delete
  what a prune the signer witnessed covers (triggers check every delete and anchor move);
- the signer reads the chains and inserts checkpoints, nothing else;
- auditors read everything and append access records to the control chain, nothing else (a
  query by subject, an export and an erasure attempt each leave one: meshfn.audit.access),
  through `meshfn_audit_append_control` (postgres.py), never an INSERT of their own;
- readers (verify, queries not by subject) only read.

Neither a collector's role nor the signer's may change a trigger, a table or another's rows: a
collector's credentials cannot insert a checkpoint, edit or delete a record, or move a chain's
start; the signer's cannot insert a record. `init` grants exactly this and revokes the rest, so
running it again repairs drifted grants.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from .postgres import CONTROL_DDL, CONTROL_SIGNATURE, PostgresStore
from .store import StoreError

TABLES = ("meta", "chains", "records", "checkpoints", "journals", "subjects")

# kind -> (privileges, objects): what each component's statements need, nothing more.
GRANTS: dict[str, tuple[tuple[str, str], ...]] = {
    "collector": (
        ("SELECT", "meta, chains, records, checkpoints, journals, subjects"),
        ("INSERT", "records, chains, journals, subjects"),
        ('UPDATE (path, inode, "offset", fingerprint)', "journals"),
        ("UPDATE (anchor_seq, anchor_hash, anchor_checkpoint)", "chains"),
        ("DELETE", "records"),
        ("USAGE", "SEQUENCE records_id_seq"),
    ),
    "signer": (
        ("SELECT", "meta, chains, records, checkpoints"),
        ("INSERT", "checkpoints"),
    ),
    "reader": (("SELECT", "meta, chains, records, checkpoints, journals, subjects"),),
    "auditor": (
        ("SELECT", "meta, chains, records, checkpoints, journals, subjects"),
        ("EXECUTE", f"FUNCTION {CONTROL_SIGNATURE}"),
    ),
}
KINDS = tuple(GRANTS)


@dataclass(frozen=True)
class Role:
    kind: str  # collector, signer, auditor or reader
    name: str
    password: str | None = None  # set (created or changed) only with create=True


def role_of(kind: str, given: str) -> Role:
    """A role given as a DSN (its user and password) or as a bare role name."""
    if "://" in given or "=" in given:
        try:
            info = psycopg.conninfo.conninfo_to_dict(given)
        except psycopg.ProgrammingError as exc:
            raise StoreError(f"the {kind}'s DSN is not a DSN: {exc}") from None
        if not info.get("user"):
            raise StoreError(f"the {kind}'s DSN names no user")
        password = info.get("password")
        return Role(kind, str(info["user"]), str(password) if password else None)
    if not given:
        raise StoreError(f"the {kind}'s role has no name")
    return Role(kind, given)


def init_roles(store: PostgresStore, roles: list[Role], create: bool = False) -> list[str]:
    """Grant each role what its component needs and revoke everything else (`create`: first
    create missing login roles, and set the passwords given). `store`: opened by the owner
    (it created or migrated the schema). Returns one line per role saying what it may do."""
    names = [r.name for r in roles]
    if len(set(names)) != len(names):
        raise StoreError(f"each component needs a role of its own, not one for several: {names}")
    lines = []
    with store.session() as conn:
        owner = conn.execute("SELECT tableowner FROM pg_tables WHERE tablename = 'records'")
        row = owner.fetchone()
        if row is None:
            raise StoreError(f"{store.location}: no audit tables (run init as the owner)")
        conn.execute(CONTROL_DDL.encode())  # stores made before the auditor's role had none
        for role in roles:
            if create:
                _create(conn, role)
            _check(conn, role, str(row[0]))
            _grant(conn, role)
            granted = "; ".join(f"{what} on {on}" for what, on in GRANTS[role.kind])
            lines.append(f"{role.kind} {role.name}: {granted}")
    return lines


def _create(conn: psycopg.Connection[tuple[object, ...]], role: Role) -> None:
    exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role.name,)).fetchone()
    verb = "ALTER" if exists else "CREATE"
    statement = sql.SQL(
        "{} ROLE {} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS"
    ).format(sql.SQL(verb), sql.Identifier(role.name))
    if role.password is not None:
        statement += sql.SQL(" PASSWORD {}").format(sql.Literal(role.password))
    conn.execute(statement)


def _check(conn: psycopg.Connection[tuple[object, ...]], role: Role, owner: str) -> None:
    found = conn.execute(
        "SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = %s", (role.name,)
    ).fetchone()
    if found is None:
        raise StoreError(
            f"the {role.kind}'s role {role.name} does not exist: create it (or pass"
            " --create-roles with DSNs that carry the passwords)"
        )
    if found[0] or found[1]:
        raise StoreError(
            f"the {role.kind}'s role {role.name} is a superuser (or bypasses row security):"
            " it ignores every grant; give the component a role of its own"
        )
    if role.name == owner:
        raise StoreError(
            f"the {role.kind}'s role {role.name} owns the audit tables (and could drop their"
            " triggers): give the component a role of its own"
        )


def _grant(conn: psycopg.Connection[tuple[object, ...]], role: Role) -> None:
    who = sql.Identifier(role.name)
    tables = sql.SQL(", ").join(sql.Identifier(t) for t in TABLES)
    conn.execute(sql.SQL("REVOKE ALL ON {} FROM PUBLIC").format(tables))
    conn.execute(sql.SQL("REVOKE ALL ON {} FROM {}").format(tables, who))
    conn.execute(sql.SQL("REVOKE ALL ON SEQUENCE records_id_seq FROM {}").format(who))
    conn.execute(sql.SQL(f"REVOKE ALL ON FUNCTION {CONTROL_SIGNATURE} FROM {{}}").format(who))
    conn.execute(sql.SQL("GRANT CONNECT ON DATABASE {} TO {}").format(
        sql.Identifier(str(conn.info.dbname)), who
    ))  # fmt: skip
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(who))
    for privileges, objects in GRANTS[role.kind]:
        # the privilege lists above are constants of this module, never input
        conn.execute(sql.SQL(f"GRANT {privileges} ON {objects} TO {{}}").format(who))
