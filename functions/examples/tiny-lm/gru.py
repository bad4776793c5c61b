"""A byte-level GRU language model in numpy: forward, a hand-written backward pass through time
(BPTT), Adam. Imported by train.py (build time, on the host) and by the unit tests, which check
the backward pass against numerical gradients. Nothing here runs in the served function: the
served step is `step` below as an ONNX graph (step_onnx.py), compiled by meshfn's model compiler.

One layer, PyTorch's GRU equations, with the input projection folded into a table (a token's
row of `x` is its embedding times the input weights plus the input bias):

    r = sigmoid(x[tok]_r + h W_r + b_r)      z = sigmoid(x[tok]_z + h W_z + b_z)
    n = tanh(x[tok]_n + r * (h W_n + b_n))   h' = (1 - z) * n + z * h
    logits = h' W_o + b_o
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

F = np.float32


@dataclass
class Params:
    x: np.ndarray  # [V, 3H] input table (r, z, n)
    wh: np.ndarray  # [H, 3H] recurrent weights (r, z, n)
    bh: np.ndarray  # [3H] recurrent bias
    wo: np.ndarray  # [H, V] output weights
    bo: np.ndarray  # [V] output bias

    @classmethod
    def init(cls, vocab: int, hidden: int, rng: np.random.Generator) -> Params:
        scale = 1.0 / np.sqrt(hidden)
        return cls(
            x=(rng.standard_normal((vocab, 3 * hidden)) * 0.1).astype(F),
            wh=(rng.uniform(-scale, scale, (hidden, 3 * hidden))).astype(F),
            bh=np.zeros(3 * hidden, F),
            wo=(rng.uniform(-scale, scale, (hidden, vocab))).astype(F),
            bo=np.zeros(vocab, F),
        )

    def arrays(self) -> list[np.ndarray]:
        return [self.x, self.wh, self.bh, self.wo, self.bo]

    @property
    def hidden(self) -> int:
        return int(self.wh.shape[0])

    @property
    def vocab(self) -> int:
        return int(self.x.shape[0])

    def count(self) -> int:
        return sum(a.size for a in self.arrays())


def _sigmoid(v: np.ndarray) -> np.ndarray:
    return (1.0 / (1.0 + np.exp(-v))).astype(F)


def step(p: Params, tokens: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One decode step for a batch: tokens [B], state [B, H] -> logits [B, V], state [B, H]."""
    H = p.hidden
    gx = p.x[tokens]
    gh = h @ p.wh + p.bh
    r = _sigmoid(gx[:, :H] + gh[:, :H])
    z = _sigmoid(gx[:, H : 2 * H] + gh[:, H : 2 * H])
    n = np.tanh(gx[:, 2 * H :] + r * gh[:, 2 * H :])
    out = (1 - z) * n + z * h
    return out @ p.wo + p.bo, out


def loss_and_grads(
    p: Params, inputs: np.ndarray, targets: np.ndarray, h0: np.ndarray
) -> tuple[float, list[np.ndarray], np.ndarray]:
    """Mean cross-entropy (nats per token) over inputs/targets [T, B] from state h0 [B, H], its
    gradients (in `Params.arrays()` order) and the final state."""
    T, B = inputs.shape
    H = p.hidden
    hs = np.empty((T + 1, B, H), F)
    hs[0] = h0
    rs, zs, ns, ghn = (np.empty((T, B, H), F) for _ in range(4))
    for t in range(T):
        h = hs[t]
        gx = p.x[inputs[t]]
        gh = h @ p.wh + p.bh
        r = _sigmoid(gx[:, :H] + gh[:, :H])
        z = _sigmoid(gx[:, H : 2 * H] + gh[:, H : 2 * H])
        n = np.tanh(gx[:, 2 * H :] + r * gh[:, 2 * H :])
        hs[t + 1] = (1 - z) * n + z * h
        rs[t], zs[t], ns[t], ghn[t] = r, z, n, gh[:, 2 * H :]
    flat = hs[1:].reshape(T * B, H)
    logits = flat @ p.wo + p.bo
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    rows = np.arange(T * B)
    gold = targets.reshape(T * B)
    loss = float(-np.log(probs[rows, gold] + 1e-12).mean())
    dlogits = probs
    dlogits[rows, gold] -= 1.0
    dlogits /= T * B
    dwo = flat.T @ dlogits
    dbo = dlogits.sum(axis=0)
    dhs = (dlogits @ p.wo.T).reshape(T, B, H)
    dx = np.zeros_like(p.x)
    dwh = np.zeros_like(p.wh)
    dbh = np.zeros_like(p.bh)
    dh = np.zeros((B, H), F)
    for t in range(T - 1, -1, -1):
        dh = dh + dhs[t]
        h, r, z, n = hs[t], rs[t], zs[t], ns[t]
        dn = dh * (1 - z)
        dz = dh * (h - n)
        dn_pre = dn * (1 - n * n)
        dr = dn_pre * ghn[t]
        dr_pre = dr * r * (1 - r)
        dz_pre = dz * z * (1 - z)
        dgx = np.concatenate([dr_pre, dz_pre, dn_pre], axis=1)
        dgh = np.concatenate([dr_pre, dz_pre, dn_pre * r], axis=1)
        dwh += h.T @ dgh
        dbh += dgh.sum(axis=0)
        np.add.at(dx, inputs[t], dgx)
        dh = dh * z + dgh @ p.wh.T
    return loss, [dx, dwh, dbh, dwo, dbo], hs[T]


class Adam:
    def __init__(self, arrays: list[np.ndarray], lr: float) -> None:
        self.lr = lr
        self.m = [np.zeros_like(a) for a in arrays]
        self.v = [np.zeros_like(a) for a in arrays]
        self.t = 0

    def update(self, arrays: list[np.ndarray], grads: list[np.ndarray], clip: float) -> None:
        norm = float(np.sqrt(sum(float((g * g).sum()) for g in grads)))
        scale = min(1.0, clip / (norm + 1e-6))
        self.t += 1
        b1, b2 = 0.9, 0.999
        for param, grad, m, v in zip(arrays, grads, self.m, self.v, strict=True):
            scaled = grad * scale
            m[...] = b1 * m + (1 - b1) * scaled
            v[...] = b2 * v + (1 - b2) * scaled * scaled
            mhat = m / (1 - b1**self.t)
            vhat = v / (1 - b2**self.t)
            param[...] = param - (self.lr * mhat / (np.sqrt(vhat) + 1e-8)).astype(F)
