"""Starting, watching and stopping one node's worker processes, with torchrun's environment and logs."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

from pydantic import BaseModel, ConfigDict, Field

from etc_agent.agent._exec_with_parent import dying_with_this_process
from etc_agent.agent.failures import ProcessFailure, format_failures
from etc_agent.agent.forkserver import ForkedProcess, ForkServer
from etc_agent.agent.worker_output import FilteredLog, Route, Routed, start_pump
from etc_agent.protocol.control import SpareAdoption
from etc_agent.protocol.settings import SPARE_FD_VARIABLE

SPARE_PROCESS_NAME = "etc-spare"
"""A warm spare's process name (``ps -o comm``) until its adoption."""
SPARE_RELEASE_S = 5.0
"""How long a spare let go may take to exit before it is killed."""


class WorkerSpec(BaseModel):
    """What to run on every local device and how its output is handled (torchrun's meaning)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    entrypoint: list[str] = Field(description="Script (or module with module=True) and its arguments.")
    module: bool = Field(False, description="-m: run the entrypoint as a Python module.")
    no_python: bool = Field(False, description="--no-python: run the entrypoint as an executable, not through python.")
    role: str = Field("default", description="ROLE_NAME of the workers.")
    log_dir: Path | None = Field(None, description="Per-worker stdout/stderr files and error files go under it.")
    redirects: dict[int, int] = Field(
        default_factory=dict, description="Local rank -> 0 none, 1 stdout, 2 stderr, 3 both to files."
    )
    tee: dict[int, int] = Field(default_factory=dict, description="Like redirects, but also shown on the console.")
    local_ranks_filter: set[int] | None = Field(None, description="Only these local ranks' output reaches the console.")
    duplicate_filters: dict[str, list[str]] = Field(
        default_factory=dict,
        description="'stdout'/'stderr' -> substrings: matching lines of every local worker are also "
        "written to filtered_<stream>.log in the attempt's directory (torchrun's --duplicate-*-filters).",
    )
    virtual_local_rank: bool = Field(
        False, description="LOCAL_RANK=0 in every worker, CUDA_VISIBLE_DEVICES narrowed to its device."
    )
    start_method: Literal["forkserver", "spawn"] = Field(
        "forkserver",
        description="forkserver: Python workers are forked from a process of the agent that imported torch "
        "once (milliseconds to start one); spawn: each worker is a new interpreter (seconds).",
    )

    def python_argv(self) -> list[str] | None:
        """What follows ``python -u`` for a Python worker; None with ``--no-python``."""
        if self.no_python:
            return None
        # Python workers run under a thin launcher that lets worker-API scripts survive a peer's
        # crash without a restart (it re-enters the script with the state kept in memory).
        return ["-m", "etc_agent.worker.launch", *(["-m"] if self.module else []), *self.entrypoint]

    def command(self) -> list[str]:
        argv = self.python_argv()
        return list(self.entrypoint) if argv is None else [sys.executable, "-u", *argv]


def parse_std_spec(text: str, nproc: int) -> dict[int, int]:
    """torchrun's ``-r/-t`` syntax: ``3`` (all ranks) or ``0:1,1:2`` (per local rank)."""
    text = (text or "0").strip()
    if text.isdigit():
        value = int(text)
        if value not in range(4):
            raise ValueError(f"bad redirect/tee value {text!r}: use 0-3 or rank:value pairs")
        return {r: value for r in range(nproc)}
    out = {}
    for item in text.split(","):
        rank, sep, code = item.partition(":")
        if not sep or not rank.strip().isdigit() or code.strip() not in {"0", "1", "2", "3"}:
            raise ValueError(f"bad redirect/tee value {text!r}: use 0-3 or rank:value pairs like 0:1,1:2")
        out[int(rank)] = int(code)
    return out


@dataclass
class _Worker:
    local_rank: int
    global_rank: int
    proc: subprocess.Popen | ForkedProcess
    error_file: Path
    pumps: list[threading.Thread] = field(default_factory=list)
    files: list[IO] = field(default_factory=list)
    killed_because: str = ""
    """Set when the agent killed it (e.g. it stopped responding)."""
    exited_at: float | None = None
    """When the agent first saw it exited (orders failures without an error file for the root cause)."""


class WorkerGroup:
    """The workers of one node for one generation (or one restart of it)."""

    def __init__(
        self,
        spec: WorkerSpec,
        envs: list[dict[str, str]],
        attempt_dir: Path,
        forkserver: ForkServer | None = None,
    ):
        """``forkserver``: where Python workers are forked from (while it is available); without
        one, or with ``--no-python``, each worker is a new process."""
        self.spec = spec
        self.forkserver = forkserver
        self.frozen = False
        """SIGSTOPped by a fence (stop() continues them so that they take its signal)."""
        self.workers: list[_Worker] = []
        self.spare: _Spare | None = None
        """A warm spare process, while one waits (:meth:`start_spare`)."""
        self.attempt_dir = attempt_dir
        self._filtered: dict[str, FilteredLog] = {}
        for env in envs:
            self.workers.append(self._start(env))

    def _filtered_log(self, stream: str) -> FilteredLog | None:
        filters = self.spec.duplicate_filters.get(stream)
        if not filters:
            return None
        path = self.attempt_dir / f"filtered_{stream}.log"
        if stream not in self._filtered or self._filtered[stream].path != path:
            if stream in self._filtered:
                self._filtered[stream].close()  # a restart moved on to a new attempt directory
            self._filtered[stream] = FilteredLog(path, filters)
        return self._filtered[stream]

    def _for_rank(self, env: dict[str, str]) -> tuple[dict[str, str], Path, dict[str, Route | None], list[IO]]:
        """What a worker of ``env``'s local rank gets in this attempt: its whole environment, its
        (cleared) error file, where each of its streams goes and the log files opened for them."""
        local_rank = int(env["ETC_AGENT_LOCAL_RANK"])
        rank_dir = self.attempt_dir / str(local_rank)
        rank_dir.mkdir(parents=True, exist_ok=True)
        error_file = rank_dir / "error.json"
        if error_file.exists():
            error_file.unlink()
        full_env = {**os.environ, **env, "TORCHELASTIC_ERROR_FILE": str(error_file)}
        files: list[IO] = []
        return full_env, error_file, self._routes(local_rank, env["RANK"], rank_dir, files), files

    def _routes(self, local_rank: int, rank: str, rank_dir: Path, files: list[IO]) -> dict[str, Route | None]:
        """Where each stream of ``local_rank``'s worker goes (None: not piped, the agent's own
        stream); the files opened are appended to ``files``."""
        redirect = self.spec.redirects.get(local_rank, 0)
        tee = self.spec.tee.get(local_rank, 0)
        shown = self.spec.local_ranks_filter is None or local_rank in self.spec.local_ranks_filter
        routes: dict[str, Route | None] = {}
        for bit, name, console in ((1, "stdout", sys.stdout), (2, "stderr", sys.stderr)):
            to_file = bool((redirect | tee) & bit) and self.spec.log_dir is not None
            to_console = shown and (not (redirect & bit) or bool(tee & bit))
            if not (to_file or not to_console or self.spec.duplicate_filters.get(name)):
                routes[name] = None
                continue
            sink = open(rank_dir / f"{name}.log", "w") if to_file else None
            if sink:
                files.append(sink)
            prefix = f"[{self.spec.role}{rank}]:"
            routes[name] = Route(sink, console if to_console else None, prefix, self._filtered_log(name))
        return routes

    def _start(self, env: dict[str, str]) -> _Worker:
        full_env, error_file, routes, files = self._for_rank(env)
        proc = self._launch(full_env, routes["stdout"] is not None, routes["stderr"] is not None)
        worker = _Worker(int(env["ETC_AGENT_LOCAL_RANK"]), int(env["RANK"]), proc, error_file, files=files)
        for name, route in routes.items():
            if route is not None:
                worker.pumps.append(start_pump(getattr(proc, name), Routed(route)))
        return worker

    def _launch(
        self, env: dict[str, str], pipe_stdout: bool, pipe_stderr: bool, spare_fd: int | None = None
    ) -> subprocess.Popen | ForkedProcess:
        argv = self.spec.python_argv()
        if argv is not None and self.forkserver is not None and self.forkserver.available:
            return self.forkserver.spawn(
                argv,
                env,
                os.getcwd(),
                pipe_stdout,
                pipe_stderr,
                # A spare shows as one in ps/top until it becomes a worker (then it takes the script's name).
                name=SPARE_PROCESS_NAME if spare_fd is not None else self._process_name(),
                fd_variables={SPARE_FD_VARIABLE: spare_fd} if spare_fd is not None else None,
            )
        try:
            return subprocess.Popen(
                dying_with_this_process(self.spec.command()),
                env={**env, SPARE_FD_VARIABLE: str(spare_fd)} if spare_fd is not None else env,
                stdout=subprocess.PIPE if pipe_stdout else None,
                stderr=subprocess.PIPE if pipe_stderr else None,
                pass_fds=(spare_fd,) if spare_fd is not None else (),
                start_new_session=True,  # its own process group: stopping it stops its children too
            )
        finally:
            if spare_fd is not None:
                os.close(spare_fd)

    def _process_name(self) -> str:
        """What ``ps -o comm`` shows for a forked worker: the script's name."""
        return (os.path.basename(self.spec.entrypoint[0]) if self.spec.entrypoint else "") or "worker"

    def _retire(self, local_rank: int) -> _Worker:
        """The exited worker of ``local_rank``, its output drained and its files closed."""
        old = next(w for w in self.workers if w.local_rank == local_rank)
        assert old.proc.poll() is not None, "restart of a live worker"
        for t in old.pumps:
            t.join(timeout=2)
        for f in old.files:
            f.close()
        return old

    def restart(self, local_rank: int, env: dict[str, str], attempt_dir: Path) -> None:
        """Start the worker of ``local_rank`` again (after it exited) with ``env``."""
        old = self._retire(local_rank)
        self.attempt_dir = attempt_dir
        self.workers[self.workers.index(old)] = self._start(env)

    # ---- the warm spare (etc_agent.worker.spare) -------------------------------------------------
    def start_spare(self, env: dict[str, str]) -> None:
        """Start the spare process (a worker without a rank, waiting in ``etc_agent.init()``)."""
        assert self.spare is None, "one spare at a time"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Piped both ways whatever the spec says: where its output goes is known at its adoption.
        proc = self._launch({**os.environ, **env}, True, True, spare_fd=theirs.detach())
        routed = {
            name: Routed(Route(None, console, "[spare]:", None))
            for name, console in (("stdout", sys.stdout), ("stderr", sys.stderr))
        }
        pumps = [start_pump(getattr(proc, name), routed[name]) for name in ("stdout", "stderr")]
        self.spare = _Spare(proc, ours, routed, pumps, time.monotonic())

    def spare_exit_code(self) -> int | None:
        """The exit code of a spare that ended before it was adopted (None: none, or it lives)."""
        return self.spare.proc.poll() if self.spare is not None else None

    def adopt_spare(self, local_rank: int, env: dict[str, str], attempt_dir: Path) -> bool:
        """The spare takes the place of ``local_rank``'s exited worker with ``env`` (what
        :meth:`restart` would start it with); False where no live spare could take it."""
        spare, self.spare = self.spare, None
        if spare is None or spare.proc.poll() is not None:
            if spare is not None:
                spare.release()
            return False
        old = self._retire(local_rank)
        self.attempt_dir = attempt_dir
        full_env, error_file, routes, files = self._for_rank(env)
        # Routed before the adoption is sent: what the worker says from then on is that rank's.
        for name, routed in spare.streams.items():
            # Not piped for this rank: its lines go where the agent's own stream goes, unprefixed.
            console = sys.stdout if name == "stdout" else sys.stderr
            routed.route = routes[name] or Route(None, console, "", None)
        worker = _Worker(local_rank, int(env["RANK"]), spare.proc, error_file, pumps=spare.pumps, files=files)
        self.workers[self.workers.index(old)] = worker
        try:
            spare.adopt(SpareAdoption(local_rank=local_rank, env=full_env, process_name=self._process_name()))
        except OSError:
            worker.killed_because = "its adoption could not be sent"
            _signal_group(spare.proc, signal.SIGKILL)
            spare.proc.wait(timeout=10)
            return False
        return True

    def stop_spare(self, timeout_s: float) -> None:
        """Let the spare go (it exits 0 when its channel closes), SIGKILL once ``timeout_s`` passed."""
        spare, self.spare = self.spare, None
        if spare is None:
            return
        spare.release()
        try:
            spare.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(spare.proc, signal.SIGKILL)
            spare.proc.wait(timeout=10)
        for t in spare.pumps:
            t.join(timeout=2)

    def poll(self) -> dict[int, int | None]:
        """Local rank -> exit code (None while running)."""
        codes = {}
        for w in self.workers:
            codes[w.local_rank] = w.proc.poll()
            if codes[w.local_rank] is not None and w.exited_at is None:
                w.exited_at = time.time()
        return codes

    def pids(self) -> dict[int, int]:
        """Local rank -> pid of every worker started (a fork still queued behind the fork server's
        imports has none yet)."""
        pids = {}
        for w in self.workers:
            pid = w.proc.known_pid if isinstance(w.proc, ForkedProcess) else w.proc.pid
            if pid is not None and pid > 0:
                pids[w.local_rank] = pid
        return pids

    def kill(self, local_rank: int, why: str) -> None:
        """SIGKILL one worker's process group; ``why`` goes into its failure summary."""
        worker = next(w for w in self.workers if w.local_rank == local_rank)
        worker.killed_because = why
        _signal_group(worker.proc, signal.SIGKILL)

    def freeze(self, frozen: bool) -> None:
        """SIGSTOP (or SIGCONT) every worker's process group: a fenced node's plain script stops
        training without failing its peers' collectives (:mod:`etc_agent.agent.fence`)."""
        self.frozen = frozen
        for w in self.workers:
            if w.proc.poll() is None:
                _signal_group(w.proc, signal.SIGSTOP if frozen else signal.SIGCONT)

    def stop(self, timeout_s: float, sig: int = signal.SIGTERM) -> None:
        """Signal every worker's process group, wait up to ``timeout_s``, then SIGKILL what is left
        (the spare, let go, too)."""
        if self.spare is not None:
            self.spare.release()
        for w in self.workers:
            if w.proc.poll() is None:
                _signal_group(w.proc, sig)
                if self.frozen:
                    _signal_group(w.proc, signal.SIGCONT)  # a stopped process takes the signal once continued
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            remaining = max(0.0, deadline - time.monotonic())
            try:
                w.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                _signal_group(w.proc, signal.SIGKILL)
                w.proc.wait(timeout=10)
            if w.exited_at is None:
                w.exited_at = time.time()
        self.stop_spare(max(0.0, deadline - time.monotonic()))
        self.close()

    def close(self) -> None:
        """The workers ended: their output drained, files closed, the spare let go."""
        self.stop_spare(SPARE_RELEASE_S)
        for w in self.workers:
            for t in w.pumps:
                t.join(timeout=2)
            for f in w.files:
                f.close()
        for filtered in self._filtered.values():
            filtered.close()

    def failure_report(self, name: str) -> str:
        """torchrun's ``ChildFailedError`` text for the workers that failed: each failure (time, host,
        rank, exit code, error file, the error file's traceback) and the root cause, the first one
        observed (an error file's own timestamp where the worker wrote one)."""
        failures: list[tuple[int, float, int, ProcessFailure]] = []
        for w in self.workers:
            code = w.proc.poll()
            if code in (None, 0):
                continue
            try:
                failure = ProcessFailure(
                    local_rank=w.local_rank, pid=w.proc.pid, exitcode=code, error_file=str(w.error_file)
                )
            except (OSError, ValueError, KeyError, TypeError):  # an error file the worker left half-written
                failure = ProcessFailure(local_rank=w.local_rank, pid=w.proc.pid, exitcode=code, error_file="")
                failure.message = f"(unreadable error file {w.error_file}) {failure.message}"
            if not w.error_file.exists():
                failure.timestamp = int(w.exited_at or time.time())
            if w.killed_because:
                failure.message = f"{failure.message}; killed by the agent: {w.killed_because}"
            failures.append((failure.timestamp, w.exited_at or math.inf, w.global_rank, failure))
        if not failures:
            return ""
        # torch's root cause is the first of the smallest timestamp: equal ones (one-second
        # resolution) go in the order the agent saw the exits.
        return format_failures(name, {rank: failure for _, _, rank, failure in sorted(failures, key=lambda f: f[:3])})

    def failure_summary(self, host: str) -> str:
        """One line per failed worker (what the store's status record carries)."""
        lines = []
        for w in self.workers:
            code = w.proc.poll()
            if code in (None, 0):
                continue
            message = ""
            if w.error_file.exists():
                try:
                    data = json.loads(w.error_file.read_text())
                    message = (
                        data.get("message", {}).get("message", "")
                        if isinstance(data.get("message"), dict)
                        else str(data.get("message", ""))
                    )
                except (OSError, ValueError):
                    message = f"(unreadable error file {w.error_file})"
            reason = f"signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exit code {code}"
            if w.killed_because:
                reason += f", killed by the agent: {w.killed_because}"
            lines.append(
                f"  rank {w.global_rank} (local_rank {w.local_rank}) on {host}: {reason}"
                + (
                    f"; error_file {w.error_file}: {message.splitlines()[0] if message else ''}"
                    if w.error_file.exists()
                    else ""
                )
            )
        return "\n".join(lines)


def _signal_group(proc: subprocess.Popen | ForkedProcess, sig: int) -> None:
    if isinstance(proc, ForkedProcess) and proc.known_pid is None:
        proc.send_signal(sig)  # still queued behind the fork server's imports: cancelled, never waited for
        return
    if proc.pid <= 0:
        return  # a fork that never happened
    # Also once the worker exited: its process group lives on while its children do.
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass


@dataclass
class _Spare:
    """The warm spare: its process, the agent's end of its channel, its streams."""

    proc: subprocess.Popen | ForkedProcess
    channel: socket.socket | None
    """A socket pair's end: the spare says ``ready`` on it once it waits in ``etc_agent.init()``; the
    agent writes its adoption (closing it lets the spare go)."""
    streams: dict[str, Routed]
    pumps: list[threading.Thread]
    started_at: float
    ready_at: float | None = None

    def poll_ready(self) -> bool:
        """Whether the spare said it waits (read without blocking)."""
        if self.ready_at is None and self.channel is not None:
            try:
                said = self.channel.recv(64, socket.MSG_DONTWAIT)
            except OSError:  # BlockingIOError: nothing said yet
                said = b""
            if said.startswith(b"ready"):
                self.ready_at = time.monotonic()
        return self.ready_at is not None

    def adopt(self, adoption: SpareAdoption) -> None:
        assert self.channel is not None, "a spare is adopted once"
        try:
            self.channel.sendall((adoption.model_dump_json() + "\n").encode())
        finally:
            self.release()

    def release(self) -> None:
        """Close the channel: a spare not adopted yet exits 0."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
