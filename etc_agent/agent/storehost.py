"""The TCPStores an agent hosts for its workers' process groups, kept out of the agent's process.

Like torchrun's c10d agents, the first member of each generation hosts the workers' store (a fresh
one per generation: stale keys of an old generation would break gloo's connect). A TCPStore needs
torch, whose import costs the agent ~2 s of CPU and ~300 MB; the fork server has imported it
already, so each store runs in a process forked from it (``python -m etc_agent.agent.storehost HOST``
as the fork server runs it: milliseconds), which prints its port and serves until the agent stops it.
It dies with the fork server, which dies with the agent. Without a fork server (``--start-method
spawn``, ``--no-python``, a sidecar) or when it fails, the store is made in the agent's process.

Only the first member of a generation hosts, so without a fork server an agent imports torch only
when it may host: in the background as soon as it is the first or the second member of a generation
it sees (the second is the host once the first leaves), joined before any store is made (a
``TCPStore`` made while torch was still importing in another thread took a half-imported module and
made the workers abort). The other agents of a large job never import it (~50 MB each instead of
~250 MB).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
import threading
import time
from typing import Protocol

from etc_agent.agent.forkserver import ForkedProcess, ForkServer

log = logging.getLogger("etc_agent.agent")

START_TIMEOUT_S = 120.0
"""How long a store host may take to say its port (a first one waits for the fork server's imports)."""


class _Store(Protocol):
    host: str
    port: int

    def close(self) -> None: ...


HOSTS_AHEAD = 2
"""The members that import torch ahead, from the first: the host and the one that hosts after it."""


class TorchImport:
    """torch imported once, in the background, for the stores made in this process."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=_import_torch, name="etc-torch-import", daemon=True)
                self._thread.start()

    def wait(self) -> None:
        """Until torch is imported (started here when it was not)."""
        self.start()
        assert self._thread is not None
        self._thread.join()


def _import_torch() -> None:
    import torch.distributed  # noqa: F401


class _InProcess:
    """A TCPStore in the agent's own process."""

    def __init__(self, host: str, torch_import: TorchImport):
        torch_import.wait()
        from torch.distributed import TCPStore

        self._store: TCPStore | None = TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.host, self.port = host, self._store.port

    def close(self) -> None:
        self._store = None  # its server stops with the last reference


class _Forked:
    """A TCPStore in a process forked from the fork server."""

    def __init__(self, host: str, process: ForkedProcess, port: int):
        self.host, self.port, self._process = host, port, process

    @classmethod
    def start(cls, host: str, forkserver: ForkServer) -> _Forked:
        process = forkserver.spawn(
            ["-m", "etc_agent.agent.storehost", host],
            dict(os.environ),
            os.getcwd(),
            pipe_stdout=True,
            pipe_stderr=False,
            name="etc-store",
        )
        try:
            port = _read_port(process, START_TIMEOUT_S)
        except BaseException:
            process.kill()
            raise
        return cls(host, process, port)

    def close(self) -> None:
        self._process.kill()
        if self._process.stdout is not None:
            self._process.stdout.close()


def _read_port(process: ForkedProcess, timeout_s: float) -> int:
    assert process.stdout is not None
    deadline = time.monotonic() + timeout_s
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the store host said no port within {timeout_s:g} s")
        readable, _, _ = select.select([process.stdout], [], [], min(left, 1.0))
        if readable:
            chunk = os.read(process.stdout.fileno(), 256)
            if not chunk:
                raise OSError(f"the store host exited before it said its port (exit code {process.poll()})")
            line += chunk
        elif process.poll() is not None:
            raise OSError(f"the store host exited before it said its port (exit code {process.poll()})")
    return int(json.loads(line)["port"])


class WorkerStores:
    """The workers' stores this agent hosts: the newest, and the one before it (live workers may still
    be leaving the previous generation's group). With a fork server, one more is started ahead, in
    the background, so that a switch finds its store ready (a fork takes ~20 ms). ``new`` and
    ``close`` are called by the agent's main loop only."""

    def __init__(self, host: str, forkserver: ForkServer | None):
        self.host, self._forkserver = host, forkserver
        self._open: list[_Store] = []
        self._lock = threading.Lock()
        self._spare: _Store | None = None
        self._starting: threading.Thread | None = None
        self._closed = False
        self._torch = TorchImport()

    @property
    def in_process(self) -> bool:
        """Whether this agent's stores are made in its own process (it has no fork server)."""
        return self._forkserver is None

    def may_host(self, members: list[str], node_id: str) -> None:
        """A generation names ``members``: where this agent may host soon and has no fork server to
        host in, torch is imported now, in the background."""
        if self.in_process and node_id in members[:HOSTS_AHEAD]:
            self._torch.start()

    def new(self) -> tuple[str, int]:
        """A fresh store for a generation; the address workers reach it at."""
        if self._starting is not None:
            self._starting.join(START_TIMEOUT_S)
        with self._lock:
            store, self._spare = self._spare, None
        if store is None:
            store = self._forked() or _InProcess(self.host, self._torch)
        for old in self._open[:-1]:
            old.close()
        self._open = [*self._open[-1:], store]
        if isinstance(store, _Forked):
            self._starting = threading.Thread(target=self._start_spare, name="etc-store-spare", daemon=True)
            self._starting.start()
        return store.host, store.port

    def _forked(self) -> _Forked | None:
        if self._forkserver is None or not self._forkserver.available:
            return None
        try:
            return _Forked.start(self.host, self._forkserver)
        except (OSError, TimeoutError, ValueError, KeyError) as err:
            log.warning("workers' store not started by the fork server (%s): hosting it in this process", err)
            return None

    def _start_spare(self) -> None:
        spare = self._forked()
        with self._lock:
            if spare is not None and self._closed:
                spare.close()
            else:
                self._spare = spare

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stores, self._open = [*self._open, *([self._spare] if self._spare else [])], []
            self._spare = None
        for store in stores:
            store.close()


def main() -> None:
    """A store host's life: make the store, say its port, serve until stopped."""
    from torch.distributed import TCPStore

    store = TCPStore(sys.argv[1], 0, is_master=True, wait_for_workers=False)
    sys.stdout.write(json.dumps({"port": store.port}) + "\n")
    sys.stdout.flush()
    while True:
        signal.pause()  # SIGTERM/SIGKILL from the agent, or the fork server's death (PR_SET_PDEATHSIG)


if __name__ == "__main__":
    main()
