"""Chaos guest: each request parameter `mode` exercises one host limit or isolation property."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import meshfn_sdk


def probe(kind: str) -> dict[str, Any]:
    """What the guest can see of the host: it should be nothing."""
    if kind == "env":
        return {"env": dict(os.environ)}
    seen: dict[str, Any] = {}
    for path in ("/", "/etc/passwd", "/proc/self/environ", ".", "/tmp"):
        try:
            if os.path.isdir(path):
                seen[path] = os.listdir(path)
            else:
                with open(path, "rb") as f:
                    seen[path] = f.read(64).decode("latin-1")
        except OSError as exc:
            seen[path] = f"{type(exc).__name__}: {exc.strerror or exc}"
    return seen


class Chaos(meshfn_sdk.Model):
    def predict(
        self, inputs: dict[str, meshfn_sdk.Tensor], parameters: dict[str, Any]
    ) -> list[meshfn_sdk.Tensor]:
        mode = parameters.get("mode", "echo")
        x = inputs["x"]
        if mode == "spin":
            n = 0
            while True:
                n += 1
        if mode == "hog":
            hoard = []
            while True:
                hoard.append(bytearray(1 << 20))
        if mode == "sleep":
            time.sleep(float(parameters.get("seconds", 0.1)))
        if mode in ("env", "fs"):
            return [meshfn_sdk.Tensor("y", "FP32", [0], [], {"probe": json.dumps(probe(mode))})]
        if mode == "print":
            print("a guest print must not reach the host or trap")
        if mode == "raise":
            raise ValueError("chaos asked to fail")
        if mode == "reject":
            raise meshfn_sdk.BadRequest("chaos rejects this input")
        if mode == "counter":
            STATE["calls"] += 1
            return [meshfn_sdk.Tensor("y", "FP32", [1], [float(STATE["calls"])])]
        if POISON in x.data:  # data-dependent failure: one bad request inside a batch
            raise meshfn_sdk.BadRequest(f"chaos rejects {POISON:g} (a poisoned row)")
        return [meshfn_sdk.Tensor("y", "FP32", x.shape, x.data)]


POISON = -13.0
STATE = {"calls": 0}  # per instance: shows whether an instance was reused
MODEL = Chaos()
