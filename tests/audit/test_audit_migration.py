"""A store written before retention and prunes were signed (schema 2, version-2 checkpoints)
keeps verifying: readers are told the command that migrates it, `meshfn audit init` (or the
writer's first open) migrates it in place, and the signer of this meshfn witnesses the chains'
existing starts as prunes at its first checkpoint where its own retention allows them. A start
the retention would not have allowed stays a deletion."""

from __future__ import annotations

from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from meshfn.audit import Checkpoint, FileWitness, layout, offline, open_store, signing
from meshfn.audit.checkpoint import now_iso
from meshfn.audit.cli import audit_app
from meshfn.audit.record import canonical
from meshfn.audit.signer import Signer
from meshfn.audit.store import StoreError
from meshfn.testing.audit import Raw

OLD_SQLITE_TRIGGER = """CREATE TRIGGER checkpoints_no_delete BEFORE DELETE ON checkpoints
WHEN old.n >= CAST((SELECT value FROM meta WHERE key = 'checkpoint_floor') AS INTEGER)
BEGIN SELECT RAISE(ABORT, 'audit checkpoints are append-only'); END"""
OLD_POSTGRES_GUARD = """CREATE OR REPLACE FUNCTION meshfn_audit_checkpoints_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'UPDATE'
       OR OLD.n >= (SELECT value::bigint FROM meta WHERE key = 'checkpoint_floor') THEN
        RAISE EXCEPTION 'audit checkpoints are append-only';
    END IF;
    RETURN OLD;
END $$"""


def _schema_2(raw: Raw) -> None:
    """Turn a fresh store's triggers and meta back into schema 2's."""
    if raw.postgres:
        for trigger, table in (
            ("chains_guarded", "chains"),
            ("records_no_truncate", "records"),
            ("checkpoints_no_truncate", "checkpoints"),
            ("chains_no_truncate", "chains"),
        ):
            raw.run(f"DROP TRIGGER {trigger} ON {table}")
        raw.run(OLD_POSTGRES_GUARD)
    else:  # Raw dropped every trigger; schema 2's checkpoint trigger comes back
        raw.run(OLD_SQLITE_TRIGGER)
    raw.run("UPDATE meta SET value = '2' WHERE key = 'schema'")
    raw.run("INSERT INTO meta (key, value) VALUES ('retention_days', '1')")
    raw.run("INSERT INTO meta (key, value) VALUES ('checkpoint_floor', '5')")


def _v2_checkpoint(key: Ed25519PrivateKey, store_id: str, n: int, prev: str,
                   moment: str, heads: dict[str, tuple[int, bytes]]) -> Checkpoint:  # fmt: skip
    body = canonical(
        {
            "type": offline.CHECKPOINT_TYPE,
            "v": 2,
            "store": store_id,
            "n": n,
            "time": moment,
            "prev": prev,
            "chains": {c: [s, h.hex()] for c, (s, h) in heads.items()},
        }
    )
    return Checkpoint(body, key.sign(body), offline.key_id(key.public_key()))


def test_a_schema_2_store_migrates_and_its_old_prunes_are_adopted(
    location: str, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    key = signing.load_or_create(layout.key_path(state))
    witness = FileWitness(layout.witness_path(state))
    store = open_store(location)
    records = [{"v": 2, "status": 200, "path": f"/{i}"} for i in range(30)]
    store.append(records, chain="old")
    store.append(records, chain="young")
    heads = {c: {s: h for s, _, _, h in store.records_after(c, 0)} for c in ("old", "young")}
    # version-2 checkpoints: one from 2020 (records 1-20 of each), one from now (the rest)
    genesis = offline.checkpoint_genesis(store.store_id).hex()
    first = _v2_checkpoint(key, store.store_id, 1, genesis, "2020-01-01T00:00:00.000000Z",
                           {c: (20, heads[c][20]) for c in heads})  # fmt: skip
    second = _v2_checkpoint(key, store.store_id, 2, first.digest, now_iso(),
                            {c: (30, heads[c][30]) for c in heads})  # fmt: skip
    raw = Raw(location)
    for checkpoint in (first, second):
        witness.append(checkpoint)
        raw.run(
            "INSERT INTO checkpoints (n, body, signature, key_id, created) VALUES (?, ?, ?, ?, ?)",
            (checkpoint.n, checkpoint.body.decode(), checkpoint.signature, "k", checkpoint.time),
        )
    # schema 2's retention (1 day, the store's own setting): "old" up to the 2020 checkpoint,
    # "young" up to the one made now (which no 730-day retention would have let go)
    for chain, seq in (("old", 20), ("young", 30)):
        raw.run(
            "UPDATE chains SET anchor_seq = ?, anchor_hash = ? WHERE chain = ?",
            (seq, heads[chain][seq], chain),
        )
        raw.run("DELETE FROM records WHERE chain = ? AND seq <= ?", (chain, seq))
    _schema_2(raw)
    raw.close()
    store.close()

    with pytest.raises(StoreError, match=r"schema 2.*meshfn audit init --store STORE"):
        open_store(location, readonly=True)
    runner = CliRunner()
    done = runner.invoke(audit_app, ["init", "--store", location])
    assert done.exit_code == 0 and "schema ready" in done.output, done.output
    owner = open_store(location)
    assert owner.meta("schema") == "3"
    with pytest.raises(StoreError, match="retention_days missing"):
        owner.meta("retention_days")
    with pytest.raises(StoreError, match="append-only"):  # schema 2 allowed it (n < floor 5)
        owner._count("DELETE FROM checkpoints WHERE n = 1")
    with pytest.raises(StoreError, match="signer witnessed"):  # no chain guard in schema 2
        owner._count("UPDATE chains SET anchor_seq = 25 WHERE chain = 'old'")

    verify = ["verify", "--store", location, "--public-key",
              str(layout.public_key_path(state)), "--witness", str(witness.path)]  # fmt: skip
    before = runner.invoke(audit_app, verify)
    assert before.exit_code == 1, before.output
    assert "records 1-20 were pruned before prunes were witnessed" in before.output
    assert "(`meshfn up`, or `meshfn audit signer`) and verify again" in " ".join(
        before.output.split()
    )
    # this meshfn's signer (730 days): its first checkpoint witnesses the 2020 start only
    signer = Signer(owner, key, witness, retention_days=730)
    assert signer.sign().checkpoint is not None
    adopted = witness.read()[0][-1]
    assert adopted.prune == {"old": (20, heads["old"][20].hex())} and adopted.retention_days == 730
    after = runner.invoke(audit_app, verify)
    owner.close()
    assert after.exit_code == 1, after.output
    text = " ".join(after.output.split())
    assert "journal old" not in text, text
    assert (
        "deleted: seq 1: journal young: records 1-30 were removed, but no prune the signer"
        " witnessed covers them"
    ) in text
    assert "TAMPERED: 1 problem(s)" in text and "retention: 730 day(s)" in text
