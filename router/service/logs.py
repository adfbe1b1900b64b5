"""Structured logging: one line per event, JSON or plain, with the `extra` fields.

Tokens are never logged; callers pass session keys, not header values.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from router.config import LogConfig

# Attributes every LogRecord has; anything else came in through `extra=`.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in record.__dict__.items() if k not in _STANDARD}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_extras(record),
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class PlainFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = " ".join(f"{k}={v}" for k, v in _extras(record).items())
        text = f"{stamp} {record.levelname.lower():7} {record.getMessage()} {fields}".rstrip()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(config: LogConfig) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if config.format == "json" else PlainFormatter())
    root = logging.getLogger("episode_router")
    root.handlers[:] = [handler]
    root.setLevel(config.level.upper())
    root.propagate = False
