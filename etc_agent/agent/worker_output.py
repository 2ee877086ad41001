"""Where a worker's piped output goes: its log file, the console with its rank's prefix, the
attempt's filtered logs (torchrun's ``--redirects``, ``--tee``, ``--local-ranks-filter``,
``--duplicate-*-filters``). A stream's route can change while it is pumped: a warm spare's output
goes to the console as ``[spare]`` until it becomes a worker, then where that rank's goes."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO


class FilteredLog:
    """One attempt's ``filtered_stdout.log`` / ``filtered_stderr.log``, shared by its workers' pumps."""

    def __init__(self, path: Path, filters: list[str]):
        self.path, self.filters = path, filters
        self._lock = threading.Lock()
        self._file: IO | None = None

    def offer(self, prefix: str, line: str) -> None:
        if not any(f in line for f in self.filters):
            return
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a")
            self._file.write(f"{prefix}{line}")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


@dataclass
class Route:
    """Where the lines of one piped stream of a worker go."""

    sink: IO | None
    console: IO | None
    prefix: str
    filtered: FilteredLog | None


@dataclass
class Routed:
    """A stream's current route: replaced whole when a spare becomes a worker (the pump reads it per line)."""

    route: Route


def start_pump(stream: IO[bytes], routed: Routed) -> threading.Thread:
    thread = threading.Thread(target=_pump, args=(stream, routed), daemon=True)
    thread.start()
    return thread


def _pump(stream: IO[bytes], routed: Routed) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode(errors="replace")
        route = routed.route
        if route.filtered is not None:
            route.filtered.offer(route.prefix, line)
        if route.sink is not None:
            route.sink.write(line)
            route.sink.flush()
        if route.console is not None:
            route.console.write(f"{route.prefix}{line}")
            route.console.flush()
    stream.close()
