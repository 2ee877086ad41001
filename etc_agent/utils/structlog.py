"""One JSON object per line, for agents and workers alike (``etcrun --log-format json``).

An agent's event is ``{"ts", "event", "node", ...its fields}``; a worker's log record is an event
``worker_log`` with the same ``ts`` and ``node`` and its ``local_rank``, ``level``, ``logger``,
``message`` (and ``exception``). Each line is written whole, so lines from several threads or
processes sharing a stream never interleave within a line.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any


def json_line(event: str, node: str, fields: dict[str, Any], ts: float | None = None) -> str:
    """The JSON line of one event (newline included)."""
    record = {"ts": round(time.time() if ts is None else ts, 3), "event": event, "node": node, **fields}
    return json.dumps(record, default=str) + "\n"


class JsonFormatter(logging.Formatter):
    """A log record as a ``worker_log`` event of ``node`` (newline left to the handler)."""

    def __init__(self, node: str, context: dict[str, Any]):
        super().__init__()
        self.node, self.context = node, context

    def format(self, record: logging.LogRecord) -> str:
        fields: dict[str, Any] = {
            **self.context,
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return json_line("worker_log", self.node, fields, ts=record.created).rstrip("\n")
