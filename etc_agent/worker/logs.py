"""The worker's own log records (``etc_agent.*`` loggers), as the agent's: ``--log-format json``
turns them into JSON lines on stderr (:mod:`etc_agent.utils.structlog`), INFO and above; with the
default text format the script's own logging setup decides, as before."""

from __future__ import annotations

import json
import logging
import sys

from etc_agent.protocol.settings import WorkerSettings
from etc_agent.utils.structlog import JsonFormatter

_HANDLER_NAME = "etc_agent.worker.json"
NOTICE = 25
"""What the user is told (between INFO and WARNING, as the agent's console level of that name)."""
logging.addLevelName(NOTICE, "NOTICE")
_said = logging.getLogger("etc_agent.worker")
_package = logging.getLogger("etc_agent")


def _json_configured() -> bool:
    """Whether ``--log-format json`` is configured in this process: the handler itself is the one
    record of it, so that removing the handler (a test, an embedding program) also ends the mode."""
    return any(h.get_name() == _HANDLER_NAME for h in _package.handlers)


def say(message: str) -> None:
    """One line for the user on stderr: ``[etc_agent] message``, or with ``--log-format json`` one
    ``worker_log`` record (through the JSON handler). One write per line, so that lines from several
    threads never share one."""
    if _json_configured():
        _said.log(NOTICE, message)
        return
    sys.stderr.write(f"[etc_agent] {message}\n")
    sys.stderr.flush()


def write_json(record: dict) -> None:
    """A JSON record the tools read from a worker's stderr, written as one line in one write."""
    sys.stderr.write(json.dumps(record, default=str) + "\n")
    sys.stderr.flush()


def configure_worker_logging(settings: WorkerSettings) -> None:
    """Once per process (a second call changes nothing)."""
    if settings.log_format != "json" or _json_configured():
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter(settings.node_id, {"local_rank": settings.local_rank}))
    _package.addHandler(handler)
    _package.setLevel(logging.INFO)
    _package.propagate = False  # each record once, as JSON, not again through the script's root handlers
