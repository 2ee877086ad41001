"""What an agent prints, and at which level: quiet by default, the whole event stream on request.

A clean ``etcrun`` run prints what ``torchrun`` prints (the ``OMP_NUM_THREADS`` banner, warnings,
the failure report) plus one line per generation (a membership change, the start and the end of the
job): events at :data:`NOTICE` and above. ``--log-level info`` (or torchrun's ``LOGLEVEL=INFO``)
prints every event; the agent's log file in its log directory always has every event.

Pure but for :func:`configure_logging`, which sets up the ``etc_agent`` loggers of the etcrun
process.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TextIO

from etc_agent.utils.structlog import json_line

NOTICE = 25
"""Between INFO and WARNING: what a quiet console still says (one line per generation)."""
logging.addLevelName(NOTICE, "NOTICE")

LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "notice": NOTICE,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
DEFAULT_CONSOLE_LEVEL = "notice"

NOTICE_EVENTS = frozenset(
    {
        "generation_seen",
        "metrics_serving",
        "signal",
        "departed",
        "store_host_staying",
        "waiting_for_nodes",
        "workers_still_running",
        "sidecar",
        "store_outage_over",
        "store_reachable",
        "unfenced",
    }
)
"""Said on a quiet console: the job's generations, a signal, how a departure ended, what an
agent waits for."""

WARNING_EVENTS = frozenset(
    {
        "agent_gone",
        "control_refused",
        "departure_timeout",
        "departure_unacknowledged",
        "checkpoint_commit_refused",
        "fatal",
        "fenced",
        "fork_server_not_warm",
        "generation_abandoned",
        "giving_up",
        "job_failed",
        "job_unfinished",
        "join_timeout",
        "lease_expired",
        "leader_error",
        "leadership_lost",
        "node_record_vanished",
        "not_resilient",
        "peer_failure",
        "rejected_record",
        "state_not_sent",
        "store_outage_shared",
        "store_records_vanished",
        "store_unreachable",
        "worker_hung",
        "workers_failed",
        "workers_warming_failed",
    }
)
"""Something went wrong, or may have: always said."""

CONSOLE_ATTR = "etc_console"
"""A log record with this attribute set to False goes to the log file only (json mode prints the
event itself on stdout)."""


def event_level(event: str) -> int:
    """The logging level of an agent event."""
    if event in WARNING_EVENTS:
        return logging.WARNING
    if event in NOTICE_EVENTS:
        return NOTICE
    return logging.INFO


def console_level(flag: str | None, environ: Mapping[str, str]) -> int:
    """``--log-level``, else torchrun's ``LOGLEVEL``, else :data:`DEFAULT_CONSOLE_LEVEL`;
    ValueError naming where an unknown name came from."""
    name, source = (flag, "--log-level") if flag else (environ.get("LOGLEVEL"), "LOGLEVEL")
    if not name:
        return LEVELS[DEFAULT_CONSOLE_LEVEL]
    level = LEVELS.get(name.strip().lower())
    if level is None:
        raise ValueError(f"{source} {name!r}: use one of {', '.join(LEVELS)}")
    return level


class _ConsoleFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, CONSOLE_ATTR, True)


FORMAT = "%(asctime)s etcrun %(levelname)s %(message)s"


class _JsonLogFormatter(logging.Formatter):
    """A log record that is no agent event (a library's warning, the store client's) as one JSON
    line, so that ``--log-format json`` output stays machine-readable throughout."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {"level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        return json_line("agent_log", "", fields, ts=record.created).rstrip("\n")


def configure_logging(level: int, log_format: str = "text") -> None:
    """The etcrun process's console: stderr at ``level`` (records marked file-only left out); with
    ``log_format="json"`` each line is a JSON object (events themselves go to stdout then)."""
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level)
    console.addFilter(_ConsoleFilter())
    console.setFormatter(_JsonLogFormatter() if log_format == "json" else logging.Formatter(FORMAT))
    root = logging.getLogger()
    root.addHandler(console)
    root.setLevel(min(level, logging.INFO))


def add_log_file(path: Path) -> logging.Handler:
    """Every event (INFO and above) also goes to ``path`` (the agent's log file); the handler, to
    remove once the agent is done."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter(FORMAT))
    logging.getLogger().addHandler(handler)
    return handler


class EventFile:
    """Every event of one agent as one JSON line in ``path`` (``events.jsonl`` beside ``agent.log``),
    whatever the console's level and format: what ``etc-agent timeline`` reads. Opened on the first
    event; each line written and flushed whole, under a lock (events come from several threads)."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        self._file: TextIO | None = None

    def write(self, line: str) -> None:
        with self._lock:
            try:
                if self._file is None:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    self._file = self.path.open("a", encoding="utf-8")
                self._file.write(line)
                self._file.flush()
            except OSError:
                pass  # a full or vanished log directory must not stop the agent; agent.log says the rest
