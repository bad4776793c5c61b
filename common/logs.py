"""Logging: human lines on a terminal, JSON lines for servers (`--log-format json`)."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in _STANDARD})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class ExtrasFormatter(logging.Formatter):
    """Human format that still shows structured extras (node=..., workload=...)."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        extras = {k: v for k, v in record.__dict__.items() if k not in _STANDARD}
        if extras:
            message += "  " + " ".join(f"{k}={v}" for k, v in extras.items())
        return message


def setup_logging(fmt: str = "human", level: str = "INFO") -> None:
    """`human` on a terminal: rich's columns, wrapped to the terminal; `human` into a file or a
    pipe: one plain line per record, never wrapped (a log file has no width); `json`: one JSON
    object per line."""
    handler: logging.Handler
    if fmt == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
    elif not sys.stderr.isatty():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(ExtrasFormatter("%(asctime)s %(levelname)-7s %(message)s", "%H:%M:%S"))
    else:
        handler = RichHandler(
            console=Console(stderr=True),
            show_path=False,
            markup=False,
            rich_tracebacks=False,
            log_time_format="%H:%M:%S",
        )
        handler.setFormatter(ExtrasFormatter("%(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiohttp.access", "asyncio", "watchfiles"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.Formatter.converter = time.localtime
