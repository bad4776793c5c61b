"""The one wasmtime engine configuration and the key that ties precompiled artifacts to it.

A `.cwasm` is native code for exactly one wasmtime version, CPU architecture and set of
code-generation settings (epoch interruption changes the emitted code); wasmtime refuses a
mismatch at load time. Keying the registry by `engine_key()` makes the mismatch a clean
"not published for this engine" instead of a load failure in the serving process.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import threading
from typing import Any

import wasmtime

WASMTIME_VERSION = importlib.metadata.version("wasmtime")

# Only settings that change generated code belong here; anything else must not split the cache.
ENGINE_SETTINGS: dict[str, Any] = {
    "epoch_interruption": True,
    "consume_fuel": False,
    "cranelift_opt_level": "speed",
    # .eh_frame registration is ~35% of deserializing a Python guest (4.4 -> 2.8 ms measured).
    # Only native unwinders need it; wasmtime's own backtraces and traps use frame pointers,
    # and nothing unwinds through our guests (they import no host functions).
    "native_unwind_info": False,
}

# Epoch tick: deadlines are enforced with this granularity. 5 ms keeps the ticker's wake-ups
# (200/s while a deadline is pending) negligible next to the requests while a 100 ms deadline
# fires within 5%.
EPOCH_TICK_S = 0.005
_TICKER = "_meshfn_ticker"  # the engine's EpochTicker, an attribute of the engine object


def engine_settings() -> dict[str, Any]:
    return {"wasmtime": WASMTIME_VERSION, "arch": platform.machine(), **ENGINE_SETTINGS}


def engine_key() -> str:
    digest = hashlib.sha256(json.dumps(engine_settings(), sort_keys=True).encode()).hexdigest()
    return f"wasmtime-{WASMTIME_VERSION}-{platform.machine()}-{digest[:12]}"


def new_engine() -> wasmtime.Engine:
    return wasmtime.Engine(new_config())


def new_config() -> wasmtime.Config:
    """The engine's configuration (bench/coldstart.py adds allocators to it to measure them)."""
    config = wasmtime.Config()
    config.epoch_interruption = ENGINE_SETTINGS["epoch_interruption"]
    config.consume_fuel = ENGINE_SETTINGS["consume_fuel"]
    config.cranelift_opt_level = ENGINE_SETTINGS["cranelift_opt_level"]
    config.native_unwind_info = ENGINE_SETTINGS["native_unwind_info"]
    config.wasm_component_model = True
    return config


def deadline_ticks(timeout_s: float) -> int:
    """Epoch ticks for a wall-clock deadline: never early, at most one tick late."""
    return max(1, int(timeout_s / EPOCH_TICK_S + 0.999999)) + 1


class EpochTicker:
    """Advances the engine's epoch from a daemon thread so deadlines fire inside running wasm,
    and only while a deadline is pending: every deadline is set through `arm` (host.py), which
    wakes the thread and keeps it ticking until the epoch has passed that deadline. An idle
    backend then makes no wake-ups at all (ticking always, 200/s, was most of an idle backend's
    CPU), and a stuck guest is interrupted whenever its deadline was set, since the thread
    counts epochs, not seconds: a starved ticker ticks late, never too few times.

    `time.sleep` releases the GIL; each tick holds it only for one FFI call.
    """

    def __init__(self, engine: wasmtime.Engine, tick_s: float = EPOCH_TICK_S) -> None:
        self._engine = engine
        self._tick_s = tick_s
        self._lock = threading.Lock()
        # epochs this thread advanced (the engine's epoch, less where it stood at the start:
        # only differences count) and the count to tick to (past the latest pending deadline)
        self._epoch = 0
        self._until = 0
        self._asleep = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshfn-epoch", daemon=True)
        setattr(engine, _TICKER, self)

    def start(self) -> EpochTicker:
        self._thread.start()
        return self

    def arm(self, ticks: int) -> None:
        """A deadline `ticks` epochs from now was just set: tick until it has passed (the +1:
        the engine's epoch may be one ahead of the count while a tick is being counted)."""
        with self._lock:
            self._until = max(self._until, self._epoch + ticks + 1)
            if self._asleep:
                self._asleep = False
                self._wake.set()

    @property
    def asleep(self) -> bool:
        return self._asleep

    @property
    def ticks(self) -> int:
        """Epochs advanced so far."""
        return self._epoch

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                idle = self._epoch >= self._until
                if idle:
                    self._asleep = True
                    self._wake.clear()
            if idle:
                self._wake.wait()  # arm() or stop()
                continue
            if self._stop.wait(self._tick_s):
                return
            self._engine.increment_epoch()
            with self._lock:
                self._epoch += 1

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)


def arm(engine: wasmtime.Engine, ticks: int) -> None:
    """A deadline of `ticks` was just set in a store of `engine`: keep its ticker awake (an
    engine without a ticker has deadlines that never fire, as before)."""
    ticker: EpochTicker | None = getattr(engine, _TICKER, None)
    if ticker is not None:
        ticker.arm(ticks)
