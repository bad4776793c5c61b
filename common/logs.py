"""Logging: human lines on a terminal, JSON lines for servers (`--log-format json`)."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from rich.logging import RichHandler

from .cli import console, is_terminal

TIME_FORMAT = "%H:%M:%S"
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
    """Log records to stderr: JSON lines (`json`), or human lines (`human`): rich's columns on a
    terminal, and the same columns as plain text elsewhere, one record a line whatever its
    length (rich would wrap them at the console's width, in the middle of a value)."""
    handler: logging.Handler
    if fmt == "json":
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
    elif is_terminal(sys.stderr):
        handler = RichHandler(
            console=console(stderr=True),
            show_path=False,
            markup=False,
            rich_tracebacks=False,
            log_time_format=TIME_FORMAT,
        )
        handler.setFormatter(ExtrasFormatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            ExtrasFormatter("%(asctime)s %(levelname)-8s %(message)s", TIME_FORMAT)
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("aiohttp.access", "asyncio", "watchfiles"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    logging.Formatter.converter = time.localtime
