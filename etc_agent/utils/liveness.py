"""A liveness port: how a leader tells, within milliseconds, that another node's agent process is gone.

A SIGKILLed agent's lease expires only after ``--lease-ttl`` seconds, and until then the job waits
for it. Each agent therefore listens on one more TCP port (all interfaces, an ephemeral port
published in its node record) that accepts a connection, writes one status line (what the agent
gives it: how long its store has been silent, the generation it serves; :mod:`etc_agent.agent.fence`
asks peers for it) and closes it: nothing is read, so nothing can be asked of it. When peers report a failure, the leader connects to each member's
port: a refused connection means no process listens there any more (the kernel answers for a
process that died, at once), so the agent is gone; an accepted one means it lives; a timeout or
any other error says nothing (a host that went away altogether, a firewall), and the lease decides
as before.
"""

from __future__ import annotations

import errno
import select
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Literal

Probe = Literal["alive", "gone", "unknown"]


class LivenessPort:
    """The listening side: accept, write ``status()``, close, nothing else (a daemon thread)."""

    def __init__(self, status: Callable[[], bytes] | None = None) -> None:
        self.status = status
        if socket.has_dualstack_ipv6():
            self._sock = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True, backlog=64)
        else:
            self._sock = socket.create_server(("", 0), backlog=64)
        self.port: int = self._sock.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._serve, name="etc-liveness", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            if self.status is not None:
                try:
                    conn.setblocking(False)  # a line fits the socket buffer; a prober never reads it
                    conn.send(self.status())
                except Exception:  # noqa: BLE001 - a prober that already closed; a status that failed
                    pass
            conn.close()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def probe(host: str, port: int, timeout_s: float = 0.5) -> Probe:
    """Whether an agent listens at ``host:port``: ``gone`` only for a refused connection."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return "alive"
    except ConnectionRefusedError:
        return "gone"
    except OSError:
        return "unknown"


def _connect_all(targets: Mapping[str, tuple[str, int]]) -> tuple[dict[socket.socket, str], dict[str, Probe]]:
    """Non-blocking connects to every target: (the sockets still connecting, by target; the targets
    settled at once: ``gone`` for a refused connection, ``unknown`` for any other failure)."""
    pending: dict[socket.socket, str] = {}
    settled: dict[str, Probe] = {}
    for key, (host, port) in targets.items():
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            settled[key] = "unknown"
            continue
        sock.setblocking(False)
        code = sock.connect_ex((host, port))
        if code in (0, errno.EINPROGRESS):
            pending[sock] = key
        else:
            settled[key] = "gone" if code == errno.ECONNREFUSED else "unknown"
            sock.close()
    return pending, settled


def probe_many(targets: Mapping[str, tuple[str, int]], timeout_s: float) -> dict[str, Probe]:
    """:func:`probe` for many ports at once (non-blocking connects, one wait of at most ``timeout_s``):
    a leader probing every member each fraction of a second must not wait for them one by one."""
    pending, results = _connect_all(targets)
    deadline = time.monotonic() + timeout_s
    last_look = False
    while pending and not last_look:
        left = deadline - time.monotonic()
        # Once the time is up, one more look without waiting: a prober that was not scheduled for a
        # while must not count the connects the kernel completed meanwhile as unanswered.
        last_look = left <= 0
        _, writable, _ = select.select([], list(pending), [], max(0.0, left))
        for sock in writable:
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            key = pending.pop(sock)
            results[key] = "alive" if code == 0 else "gone" if code == errno.ECONNREFUSED else "unknown"
            sock.close()
    for sock, key in pending.items():
        results[key] = "unknown"
        sock.close()
    return results


def ask_many(targets: Mapping[str, tuple[str, int]], timeout_s: float) -> dict[str, bytes | None]:
    """The status line of each liveness port of ``targets`` (None where none came within
    ``timeout_s``: no answer, refused, or a port that writes nothing), all at once."""
    answers: dict[str, bytes | None] = {key: None for key in targets}
    connecting, _ = _connect_all(targets)
    pending = {sock: (key, bytearray()) for sock, key in connecting.items()}
    deadline = time.monotonic() + timeout_s
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        readable, _, _ = select.select(list(pending), [], [], left)
        for sock in readable:
            key, buf = pending[sock]
            try:
                chunk = sock.recv(512)
            except OSError:
                chunk = b""
            buf.extend(chunk)
            if not chunk or b"\n" in buf or len(buf) > 4096:
                answers[key] = bytes(buf).split(b"\n", 1)[0] or None
                del pending[sock]
                sock.close()
    for sock in pending:
        sock.close()
    return answers
