"""The backend's configuration: which functions, from which registry, under which limits.

The schema is meshfn.contracts.function (shared with the `Function` policy, so a policy's
`metadata.name` + `spec` is one entry of `functions`):

    registry: /var/lib/meshfn/functions      # where `meshfn fn publish` put the artifacts
    trustedKeys: [/etc/meshfn/keys/dev.pub]   # ed25519 public keys (files or directories)
    workers: 2                                # threads running wasm (the GIL is released)
    processes: 1                              # serving processes on the port (supervisor.py)
    functions:
      - name: iris                            # served as /v2/models/iris
        version: "1"                          # default: the registry's latest
        artifact: iris@1                      # registry entry; default name@version
        isolation: reuse                      # or fresh-instance-per-request
        idleTtl: 5m                           # unload after this long unused (scale to zero)
        codeTtl: 1h                           # optional: keep the loaded code this long unused
        pool: {minIdle: 1, maxIdle: 4}        # warm instances kept while loaded
        limits: {memoryMiB: 64, timeout: 1s, maxConcurrency: 8, maxRequestBytes: 1048576}
        warmup: {mode: predictive, maxWarmIdle: 30s, memoryBudget: 256}   # or off | reactive
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

import yaml
from pydantic import ValidationError

from meshfn.contracts.function import BackendConfig, ServedFunction

from .errors import ConfigError

log = logging.getLogger("meshfn.inference")

__all__ = ["BackendConfig", "ServedFunction", "load_config", "parse_config"]


def _errors(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in exc.errors()
    )


def load_config(path: Path) -> BackendConfig:
    """A YAML or JSON config file; errors name the field."""
    try:
        text = path.read_text()
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    base = path.parent
    if isinstance(raw.get("registry"), str):
        raw["registry"] = str(base / raw["registry"])
    if isinstance(raw.get("trustedKeys"), list):
        raw["trustedKeys"] = [
            str(base / k) if isinstance(k, str) else k for k in raw["trustedKeys"]
        ]
    return parse_config(raw, str(path))


def parse_config(raw: object, where: str = "config") -> BackendConfig:
    try:
        return BackendConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {_errors(exc)}") from None


def reread_for_tracing(path: Path, started: BackendConfig) -> BackendConfig | None:
    """SIGHUP: the config file again, for its `tracing` (server.reload_tracing, the
    supervisor's children): None, logged, when it cannot be read; any other change in it is
    logged as waiting for a restart, since only tracing is taken without one."""
    try:
        fresh = load_config(path)
    except ConfigError as exc:
        log.error("config reload: tracing unchanged: %s", exc)
        return None
    if fresh.model_dump(exclude={"tracing"}) != started.model_dump(exclude={"tracing"}):
        log.warning(
            "a config reload takes tracing only: the other changes in %s apply when the backend restarts",
            path,
        )
    return fresh


def _signature(path: Path) -> tuple[int, int, int, int] | None:
    try:
        found = os.stat(path)  # through the symlinks a ConfigMap volume swaps
    except OSError:
        return None
    return found.st_dev, found.st_ino, found.st_mtime_ns, found.st_size


async def watch_config(path: Path, every: float, changed: Callable[[], None]) -> None:
    """Call `changed` (what SIGHUP calls) once the file at `path` is another: a backend that no
    `meshfn up` signals, on Kubernetes, sees its ConfigMap's new content this way (the kubelet
    swaps a new file in behind the volume's symlinks). One stat every `every` seconds; a
    file that is gone for a moment (mid-swap) changes nothing until it is back."""
    seen = _signature(path)
    while True:
        await asyncio.sleep(every)
        now = _signature(path)
        if now is not None and now != seen:
            seen = now
            changed()


def follow_config(
    path: Path, every: float, reload: Callable[[], None]
) -> asyncio.Task[None] | None:
    """Call `reload` on SIGHUP (what `meshfn up` sends) and, when `every` > 0, on a new file
    at `path` (watch_config); the watching task, if any. On the running loop."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload)
    if every <= 0:
        return None
    return asyncio.create_task(watch_config(path, every, reload))
