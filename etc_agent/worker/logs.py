"""The worker's own log records (``etc_agent.*`` loggers), as the agent's: ``--log-format json``
turns them into JSON lines on stderr (:mod:`etc_agent.utils.structlog`), INFO and above; with the
default text format the script's own logging setup decides, as before."""

from __future__ import annotations

import logging
import sys

from etc_agent.protocol.settings import WorkerSettings
from etc_agent.utils.structlog import JsonFormatter

_HANDLER_NAME = "etc_agent.worker.json"


def configure_worker_logging(settings: WorkerSettings) -> None:
    """Once per process (a second call changes nothing)."""
    if settings.log_format != "json":
        return
    package = logging.getLogger("etc_agent")
    if any(h.get_name() == _HANDLER_NAME for h in package.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(JsonFormatter(settings.node_id, {"local_rank": settings.local_rank}))
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    package.propagate = False  # each record once, as JSON, not again through the script's root handlers
