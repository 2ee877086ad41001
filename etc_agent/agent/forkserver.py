"""The agent's side of its fork server: start it, ask it for workers, learn how they end.

:class:`ForkServer` starts ``python -u -m etc_agent.worker.forkserver`` (under the parent-death
shim: it dies with the agent) as soon as the agent starts, so its imports overlap the rendezvous;
:meth:`ForkServer.spawn` returns a :class:`ForkedProcess` at once, with the :class:`subprocess.Popen`
interface the worker group uses (``pid``, ``poll``, ``wait``, ``send_signal``, ``stdout``/``stderr``
pipes). A spawn asked for before the server is ready is forked once it is; one signalled before
that is cancelled (it never runs, and counts as ended by the signal at once). Where the server cannot
start or dies, :attr:`ForkServer.available` turns false and the agent starts workers as fresh
interpreters again (one log line says why); workers forked by a server that died die with it and
are reported as killed (``-SIGKILL``).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from typing import IO

from etc_agent.agent._exec_with_parent import dying_with_this_process
from etc_agent.utils.forkserver import receive, send

log = logging.getLogger("etc_agent.agent")

PID_TIMEOUT_S = 120.0
"""How long a caller waits for the pid of a process whose fork is queued behind the server's
imports (they take seconds; a server that has not forked by then is treated as dead)."""


class ForkedProcess:
    """A worker forked by the fork server, seen through :class:`subprocess.Popen`'s interface."""

    def __init__(self, server: ForkServer, request_id: int, args: list[str], stdout: IO | None, stderr: IO | None):
        self._server = server
        self.request_id = request_id
        self.args = args
        self.stdout, self.stderr = stdout, stderr
        self._pid: int | None = None
        self.returncode: int | None = None
        self._forked = threading.Event()
        self._ended = threading.Event()

    @property
    def known_pid(self) -> int | None:
        """The process id once forked, without waiting."""
        return self._pid

    @property
    def pid(self) -> int:
        """The process id (waits while the fork is still queued); -1 for one never forked."""
        if not self._forked.wait(PID_TIMEOUT_S):
            self._server.fail(f"no fork within {PID_TIMEOUT_S:g} s of the request")
        return self._pid if self._pid is not None else -1

    def _set_forked(self, pid: int | None, error: str = "") -> None:
        self._pid = pid
        self._forked.set()
        if pid is None:
            log.error("the fork server could not start a worker: %s", error)
            self._set_exited(1)

    def _set_exited(self, code: int) -> None:
        if self.returncode is None:
            self.returncode = code
        self._forked.set()
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            assert timeout is not None  # wait(None) blocks until the event is set: only a number times out
            raise subprocess.TimeoutExpired(self.args, timeout)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the process; one whose fork is still queued behind the server's imports is
        cancelled instead (it then never runs, and counts as ended by ``sig`` at once)."""
        if self.returncode is not None:
            return
        pid = self._pid if self._forked.is_set() else self._server.cancel(self, sig)
        # A process not yet reaped by the server keeps its pid (a zombie at worst): safe to signal.
        if pid is not None and pid > 0:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One agent's fork server (see the module docstring); thread-safe."""

    def __init__(self, env: dict[str, str] | None = None):
        self._lock = threading.Lock()
        self._processes: dict[int, ForkedProcess] = {}
        """Request id -> process, for every spawn not yet exited."""
        self._by_pid: dict[int, ForkedProcess] = {}
        self._next_id = 0
        self._cancelled: set[int] = set()
        """Request ids cancelled before their pid came: a fork reported for one is killed at once."""
        self._dead = ""
        self._closing = False
        self.ready = threading.Event()
        self.preload_s: float | None = None
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        command = dying_with_this_process(
            [sys.executable, "-u", "-m", "etc_agent.worker.forkserver", str(theirs.fileno())]
        )
        try:
            self.process = subprocess.Popen(
                command,
                env=env if env is not None else dict(os.environ),
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C reaches the agent, not the server
            )
        finally:
            theirs.close()
        self._reader = threading.Thread(target=self._read, name="etc-forkserver", daemon=True)
        self._reader.start()

    @property
    def available(self) -> bool:
        return not self._dead

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        pipe_stdout: bool,
        pipe_stderr: bool,
        name: str,
        fd_variables: dict[str, int] | None = None,
    ) -> ForkedProcess:
        """Fork ``python -u ARGV`` with ``env``; the streams not piped go where the agent's go.
        ``fd_variables``: environment variable -> a descriptor of this process the worker gets (the
        variable says its number there); closed here once sent."""
        fds, names, ours = [], [], {}
        for variable, fd in (fd_variables or {}).items():
            fds.append(fd)
            names.append(f"env:{variable}")
        for wanted, stream in ((pipe_stdout, "stdout"), (pipe_stderr, "stderr")):
            if wanted:
                read_end, write_end = os.pipe()
                fds.append(write_end)
                names.append(stream)
                ours[stream] = os.fdopen(read_end, "rb")
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
            process = ForkedProcess(
                self, request_id, [sys.executable, "-u", *argv], ours.get("stdout"), ours.get("stderr")
            )
            self._processes[request_id] = process
            dead = self._dead
        # Not under the lock: a send blocked on a full socket must not stop the reader handling replies.
        try:
            if dead:
                raise OSError(dead)
            send(
                self._sock,
                {"op": "spawn", "id": request_id, "argv": argv, "env": env, "cwd": cwd, "fds": names, "name": name},
                fds,
            )
        except OSError as err:
            with self._lock:
                self._processes.pop(request_id, None)
            process._set_forked(None, str(err))
        finally:
            for fd in fds:
                os.close(fd)
        return process

    def cancel(self, process: ForkedProcess, sig: int) -> int | None:
        """Cancel a spawn whose pid has not come back (the caller's stop must not wait for the
        server's imports); returns the pid instead when it came meanwhile (the caller signals it)."""
        with self._lock:
            if process._forked.is_set():
                return process._pid
            self._cancelled.add(process.request_id)
            self._processes.pop(process.request_id, None)
        try:
            send(self._sock, {"op": "cancel", "id": process.request_id, "signal": int(sig)})
        except OSError:
            pass  # a dead server forks nothing more
        process._set_exited(-int(sig))
        return None

    def fail(self, why: str) -> None:
        """Give the server up: every process it has not reported ended counts as killed."""
        with self._lock:
            if not self._dead:
                self._dead = why
                if not self._closing:
                    log.error("fork server of this agent unavailable (%s): workers start as new interpreters", why)
            pending = list(self._processes.values())
            self._processes.clear()
            self._by_pid.clear()
        self.ready.set()
        for process in pending:
            if process._pid is not None:
                try:
                    os.kill(process._pid, signal.SIGKILL)  # dies with the server anyway (PR_SET_PDEATHSIG)
                except ProcessLookupError:
                    pass
            process._set_exited(-signal.SIGKILL)
        try:
            self.process.kill()
        except ProcessLookupError:
            pass

    def _read(self) -> None:
        while True:
            try:
                message, fds = receive(self._sock)
            except (OSError, ValueError) as err:
                self.fail(f"its socket failed: {err}")
                return
            for fd in fds:
                os.close(fd)
            if message is None:
                code = self.process.wait()
                self.fail(f"it exited with code {code}")
                return
            self._handle(message)

    def _handle(self, message: dict) -> None:
        op = message.get("op")
        if op == "ready":
            self.preload_s = message.get("preload_s")
            self.ready.set()
        elif op == "failed":
            self.fail(f"its imports failed: {message.get('error')}")
        elif op in ("spawned", "spawn_failed"):
            with self._lock:
                if message["id"] in self._cancelled:
                    self._cancelled.discard(message["id"])
                    if op == "spawned":  # the cancel crossed the fork: it must not run on
                        try:
                            os.kill(message["pid"], signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    return
                process = self._processes.get(message["id"])
                if process is not None and op == "spawned":
                    self._by_pid[message["pid"]] = process
                elif process is not None:
                    self._processes.pop(message["id"], None)
            if process is not None:
                process._set_forked(message.get("pid"), message.get("error", ""))
        elif op == "exited":
            with self._lock:
                process = self._by_pid.pop(message["pid"], None)
                if process is not None:
                    self._processes.pop(process.request_id, None)
            if process is not None:
                process._set_exited(int(message["code"]))

    def close(self) -> None:
        """Stop the server (its workers, stopped by the agent before, are gone)."""
        self._closing = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            if not self.ready.is_set():
                raise subprocess.TimeoutExpired(self.process.args, 0)  # still importing: nothing to finish
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)
        self._reader.join(timeout=2)
        self._sock.close()
