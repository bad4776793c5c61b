"""`meshfn serve`: only the control plane (ADS + admin + policy watch), no child processes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from pathlib import Path

from meshfn import wasm_filters as filters
from meshfn.common.adminauth import owner_token_path
from meshfn.common.files import secure_state_dir

from ..service import ControlPlane, tune_gc
from .admin import AdminServer

log = logging.getLogger("meshfn.serve")


async def run_serve(
    policies: Path,
    state_dir: Path,
    xds_port: int | None,
    admin_port: int | None,
    watch: bool = True,
    admin_host: str = "127.0.0.1",
    admin_token: str | None = None,
) -> int:
    secure_state_dir(state_dir)
    wasm_dir, wasm_missing = await asyncio.to_thread(filters.prepare)
    cp = ControlPlane(policies, state_dir, wasm_dir=wasm_dir, wasm_missing=wasm_missing)
    result = await cp.reload()
    tune_gc()
    if not result.ok:
        return 1
    assert cp.model is not None
    admin = AdminServer(cp, token=admin_token)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tasks: list[asyncio.Task[None]] = []
    try:
        try:
            bound_xds = await cp.start(xds_port=xds_port)
            bound_admin = await admin.start(
                admin_host, port=cp.model.admin_port if admin_port is None else admin_port
            )
        except OSError as exc:
            log.error("cannot start the control plane: %s", exc)
            return 1
        log.info(
            "control plane ready; the admin port wants a token (%s; `meshfn console --state-dir"
            " %s` prints a login link)",
            owner_token_path(state_dir),
            state_dir,
            extra={"xds_port": bound_xds, "admin_port": bound_admin},
        )
        if watch:
            tasks.append(asyncio.create_task(cp.watch(stop)))
        tasks.append(asyncio.create_task(cp.rotate_credentials_forever(stop)))
        tasks.append(asyncio.create_task(cp.drift_forever(stop)))
        await stop.wait()
        return 0
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await admin.stop()
        await cp.stop()
