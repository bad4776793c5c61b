"""Build-time training of the tiny-lm generative example (runs on the host, not in the guest).

Data: the help topics that ship with CPython itself (`pydoc_data.topics`: the language
reference's prose and examples, ~460 KB of text on every machine with Python), topics in name
order, each followed by the end-of-text token. Bytes are the tokens (0-255) and 256 ends a text:
a byte-level model, so the usage it reports counts bytes as the model sees them. The last 5% of
the bytes are held out; the report gives the held-out loss in nats and bits per byte.

Model: one GRU layer (gru.py, numpy, a hand-written backward pass through time, Adam), trained
with truncated BPTT on consecutive windows that carry their state, for a fixed number of steps
from a fixed seed. The weights go into step.onnx, the decode step as an ONNX graph
(step_onnx.py), which meshfn's model compiler turns into the module the backend runs.
Usage: python -P train.py OUTDIR   (run in the function's staging directory)
"""

from __future__ import annotations

import os

# One BLAS thread: on a small shared machine OpenBLAS's threads fight each other and the build
# (measured: 0.11 s per 4,096-token batch with one thread, 0.6-1.3 s with two).
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import json
import math
import sys
import time
import tomllib
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gru
import step_onnx

SEED = 7
SEQ = 64  # BPTT window
BATCH = 64  # parallel streams through the corpus
STEPS = 900  # ~8 passes over the training text
LR = 6e-3
CLIP = 5.0
HELDOUT = 0.05


def corpus(eos: int) -> np.ndarray:
    """The training text as token ids (bytes, `eos` after each topic)."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for name in sorted(topics):
        ids.extend(topics[name].encode("utf-8"))
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def evaluate(p: gru.Params, ids: np.ndarray) -> float:
    """Mean nats per token over `ids`, read as BATCH parallel streams."""
    span = (len(ids) - 1) // BATCH
    streams = ids[: span * BATCH + 1]
    inputs = streams[:-1].reshape(BATCH, span).T
    targets = streams[1:].reshape(BATCH, span).T
    h = np.zeros((BATCH, p.hidden), np.float32)
    total = 0.0
    for start in range(0, span, 256):
        loss, _, h = gru.loss_and_grads(
            p, inputs[start : start + 256], targets[start : start + 256], h
        )
        total += loss * len(inputs[start : start + 256])
    return total / span


def train(settings: dict[str, int]) -> tuple[gru.Params, dict[str, object]]:
    eos, hidden = settings["eos"], settings["state"]
    ids = corpus(eos)
    cut = int(len(ids) * (1 - HELDOUT))
    train_ids, heldout = ids[:cut], ids[cut:]
    rng = np.random.default_rng(SEED)
    params = gru.Params.init(settings["vocab"], hidden, rng)
    opt = gru.Adam(params.arrays(), LR)
    span = (len(train_ids) - 1) // BATCH  # each row of the batch reads its own stretch
    inputs_all = train_ids[: span * BATCH].reshape(BATCH, span).T
    targets_all = train_ids[1 : span * BATCH + 1].reshape(BATCH, span).T
    h = np.zeros((BATCH, hidden), np.float32)
    started, pos, losses = time.time(), 0, []
    for step in range(STEPS):
        if pos + SEQ > span:
            pos, h = 0, np.zeros_like(h)
        opt.lr = LR * 0.5 * (1 + math.cos(math.pi * step / STEPS))  # cosine decay
        loss, grads, h = gru.loss_and_grads(
            params, inputs_all[pos : pos + SEQ], targets_all[pos : pos + SEQ], h
        )
        opt.update(params.arrays(), grads, CLIP)
        losses.append(loss)
        pos += SEQ
    train_loss = float(np.mean(losses[-20:]))
    heldout_loss = evaluate(params, heldout)
    report = {
        "model": "GRU language model, 1 layer, byte-level",
        "data": "CPython's pydoc_data.topics (the help topics), "
        f"{len(ids)} tokens: {len(train_ids)} trained on, {len(heldout)} held out",
        "python": sys.version.split()[0],
        "parameters": params.count(),
        "hidden": hidden,
        "vocab": settings["vocab"],
        "steps": STEPS,
        "tokens_seen": STEPS * SEQ * BATCH,
        "train_loss_nats": round(train_loss, 4),
        "heldout_loss_nats": round(heldout_loss, 4),
        "heldout_bits_per_byte": round(heldout_loss / math.log(2), 4),
        "uniform_loss_nats": round(math.log(settings["vocab"]), 4),
        "seconds": round(time.time() - started, 1),
    }
    return params, report


def main(out: Path) -> None:
    manifest = tomllib.loads(Path("function.toml").read_text())
    settings = {k: int(manifest["generate"][k]) for k in ("vocab", "state", "eos")}
    params, report = train(settings)
    graph = step_onnx.step_graph(*params.arrays())
    (out / "step.onnx").write_bytes(graph.SerializeToString())
    (out / "build-report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
