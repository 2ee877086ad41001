"""Sidecar mode: workers another launcher started (``etc-agent sidecar``), attached to this node's
agent over held connections, behind :class:`~etc_agent.agent.workers.WorkerGroup`'s interface."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

UNREPORTED_EXIT = 1
"""Exit code recorded for an attached worker whose connection closed without an exit report (it
died: killed, crashed, or its container stopped)."""


@dataclass
class Attachment:
    """One worker process attached to its node's agent (``etc-agent sidecar``) over a held connection."""

    local_rank: int
    pid: int
    sock: object
    exit_code: int | None = None
    """Set when the connection closed: the reported code, or :data:`UNREPORTED_EXIT` without one."""
    reported: int | None = None
    killed_because: str = ""
    stop_requested: bool = False


class Attachments:
    """Every attachment of this agent, by local rank (the newest process of each rank), thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.current: dict[int, Attachment] = {}
        self.failed: dict[int, Attachment] = {}
        """Ended with a failure and not yet handled (restarted) by the agent, even if a replacement
        already attached: the failure must still reach the leader."""

    def attach(self, local_rank: int, pid: int, sock: object) -> Attachment:
        with self._lock:
            previous = self.current.get(local_rank)
            if previous is not None and previous.exit_code not in (None, 0):
                self.failed.setdefault(local_rank, previous)
            attachment = Attachment(local_rank, pid, sock)
            self.current[local_rank] = attachment
            return attachment

    def report_exit(self, local_rank: int, pid: int, code: int) -> None:
        with self._lock:
            attachment = self.current.get(local_rank)
            if attachment is not None and attachment.pid == pid:
                attachment.reported = code

    def closed(self, attachment: Attachment) -> None:
        with self._lock:
            if attachment.exit_code is None:
                attachment.exit_code = attachment.reported if attachment.reported is not None else UNREPORTED_EXIT

    def get(self, local_rank: int) -> Attachment | None:
        """The failed process of this rank not yet handled, else the newest one."""
        with self._lock:
            return self.failed.get(local_rank) or self.current.get(local_rank)

    def handled(self, local_rank: int) -> None:
        """The agent dealt with this rank's end: from now on its newest process (or none) counts."""
        with self._lock:
            self.failed.pop(local_rank, None)
            current = self.current.get(local_rank)
            if current is not None and current.exit_code is not None:
                del self.current[local_rank]

    def stop_requested(self, local_rank: int) -> bool:
        with self._lock:
            attachment = self.current.get(local_rank)
        return attachment is not None and attachment.stop_requested


class AttachedWorkers:
    """:class:`WorkerGroup`'s interface over workers this agent did not start (sidecar mode).

    A worker is running while its attachment is open; when the connection closes it has exited with
    the code it reported (``Job.finish``, a departing sender) or, without a report, as failed. The
    agent cannot signal such a process: ``stop``/``kill`` ask it to exit (its next poll of the agent
    says so) and close the connection from this side; restarting is the other launcher's part (a
    container restart, ``etc-agent workers``), and a replacement attaches under the same local rank.
    """

    def __init__(self, attachments: Attachments, local_ranks: list[int]):
        self.attachments = attachments
        self.local_ranks = list(local_ranks)

    def _state(self, local_rank: int) -> Attachment | None:
        return self.attachments.get(local_rank)

    def poll(self) -> dict[int, int | None]:
        out = {}
        for r in self.local_ranks:
            a = self._state(r)
            out[r] = a.exit_code if a is not None else None  # not attached yet: starting
        return out

    def pids(self) -> dict[int, int]:
        return {r: a.pid for r in self.local_ranks if (a := self._state(r)) is not None and a.exit_code is None}

    def kill(self, local_rank: int, why: str) -> None:
        """Ask it to exit and detach it; a hung process (it cannot hear) is killed when this agent can
        see it as what it claims to be (same PID namespace: srun, a pod sharing its process namespace)."""
        a = self.attachments.current.get(local_rank)
        if a is None:
            return
        a.killed_because, a.stop_requested = why, True
        if _is_worker(a.pid, local_rank):
            try:
                os.kill(a.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        _close(a.sock)

    def restart(self, local_rank: int, env: dict[str, str], attempt_dir: Path) -> None:
        """The other launcher starts the replacement; forget the ended one so the rank counts as starting."""
        self.attachments.handled(local_rank)

    def stop(self, timeout_s: float, sig: int = signal.SIGTERM) -> None:
        for r in self.local_ranks:
            a = self.attachments.current.get(r)
            if a is not None and a.exit_code is None:
                a.stop_requested = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and any(
            (a := self._state(r)) is not None and a.exit_code is None for r in self.local_ranks
        ):
            time.sleep(0.05)
        for r in self.local_ranks:
            a = self._state(r)
            if a is not None and a.exit_code is None:
                a.killed_because = f"did not exit within {timeout_s:g} s of being asked to"
                _close(a.sock)

    def close(self) -> None:
        pass

    def failure_report(self, name: str) -> str:
        """The failures in torchrun's layout, as far as an agent that did not start them knows (no
        error files: those are the other launcher's)."""
        body = self.failure_summary(socket.getfqdn())
        rule = "=" * 60
        return f"{rule}\n{name} FAILED (attached workers)\n{'-' * 60}\nFailures:\n{body}\n{rule}" if body else ""

    def failure_summary(self, host: str) -> str:
        lines = []
        for r in self.local_ranks:
            a = self._state(r)
            if a is None or a.exit_code in (None, 0):
                continue
            reason = (
                f"exit code {a.reported}"
                if a.reported is not None
                else "its connection to the agent closed without an exit report (killed or crashed)"
            )
            if a.killed_because:
                reason += f", stopped by the agent: {a.killed_because}"
            lines.append(f"  local_rank {r} (pid {a.pid}) on {host}: {reason}")
        return "\n".join(lines)


def _is_worker(pid: int, local_rank: int) -> bool:
    """Whether ``pid`` here is a worker-API process of ``local_rank`` (not some other process that
    happens to have that number in this PID namespace)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    if b"etc_agent.worker.forkserver" in cmdline:
        # Forked by a fork server: /proc shows the server's command and start-up environment, not
        # the worker's. A child of a fork server, then, never the server itself (killing it would
        # take every worker of its node along).
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            parent = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
            return b"etc_agent.worker.forkserver" in Path(f"/proc/{parent}/cmdline").read_bytes()
        except (OSError, StopIteration, ValueError):
            return False
    return b"etc_agent" in cmdline and f"LOCAL_RANK={local_rank}".encode() in environ


def _close(sock: object) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)  # type: ignore[attr-defined]
    except OSError:
        pass
