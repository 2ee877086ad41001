"""``etc-agent workers``: start one node's worker processes beside an ``etc-agent sidecar``.

For deployments where the agent does not start the workers (a Kubernetes pod's trainer container
next to the agent's container, a node's processes started by a scheduler): it starts
``--nproc-per-node`` processes of the script under the worker launcher, each with ``LOCAL_RANK`` and
``ETC_AGENT_ADDR``, and starts again a process that dies (as a container restart would) while the
job goes on. A process that exits 0 (training finished, or its node left the job after sending its
state) is not restarted. Exits 0 once every process exited 0, 1 when the job failed or a process
kept failing.

SIGTERM (or SIGINT) is a planned departure of the node, as the same signal to the sidecar is: a
terminating pod signals every container at once, and the workers must not die before they hand
their state over. The launcher asks the sidecar to leave (:class:`~etc_agent.protocol.control.Leave`)
and waits up to ``--departure-timeout`` for the workers to exit on their own, then sends them
SIGTERM; a second signal, or a sidecar that cannot be asked, sends it at once.

    etc-agent workers --nproc-per-node 8 --agent 127.0.0.1:29401 train.py --lr 3e-4

Under Slurm, run one task per node that starts the sidecar and this (``srun --ntasks-per-node 1``);
``srun`` starting the workers directly also works (``SLURM_LOCALID`` is read as the local rank), but
then nothing starts a dead process again and the job waits for one until ``ETC_AGENT_TIMEOUT``.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

from pydantic import ValidationError

from etc_agent.agent._exec_with_parent import dying_with_this_process
from etc_agent.agent.forkserver import ForkedProcess, ForkServer
from etc_agent.agent.workers import WorkerSpec
from etc_agent.protocol.control import GenerationQuery, GenerationReply, Leave
from etc_agent.utils import auth
from etc_agent.utils.jsonline import JsonLineError, parse_address, request


def _job_over(address: tuple[str, int]) -> str | None:
    """'succeeded'/'failed' once the agent says the job ended; None while it runs or cannot be asked."""
    try:
        key = auth.worker_key(f"{address[0]}:{address[1]}", 0)
        reply = GenerationReply.model_validate(request(address, GenerationQuery().model_dump(), timeout=5, key=key))
    except (OSError, JsonLineError, auth.AuthError, ValidationError):
        return None
    status = reply.latest.status if reply.latest is not None else None
    return status if status in ("succeeded", "failed") else None


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="etc-agent workers", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--nproc-per-node", type=int, required=True, help="Processes to start (the sidecar's --nproc-per-node)."
    )
    ap.add_argument(
        "--agent", default=os.environ.get("ETC_AGENT_ADDR", "127.0.0.1:29401"), help="The sidecar's --control-addr."
    )
    ap.add_argument("--max-restarts", type=int, default=100, help="Restarts of one local rank before giving up.")
    ap.add_argument(
        "--agent-wait",
        type=float,
        default=60.0,
        help="Seconds to wait for the sidecar to answer before starting anything (containers start in any order).",
    )
    ap.add_argument(
        "--departure-timeout",
        type=float,
        default=60.0,
        help="After SIGTERM: seconds the workers get to hand their state over and exit before they get SIGTERM.",
    )
    ap.add_argument("-m", "--module", action="store_true", help="Run the script as a Python module.")
    ap.add_argument(
        "--start-method",
        choices=("forkserver", "spawn"),
        default="forkserver",
        help="forkserver: fork the processes from one that imported torch once; spawn: new interpreters.",
    )
    ap.add_argument("script")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.nproc_per_node < 1:
        ap.error("--nproc-per-node must be at least 1")
    return args


def _agent_answers(address: tuple[str, int]) -> str | None:
    """None when the sidecar at ``address`` answers; else why not."""
    try:
        socket.create_connection(address, timeout=5).close()
    except OSError as err:
        return f"cannot reach it: {err}"
    try:
        key = auth.worker_key(f"{address[0]}:{address[1]}", 0)
        request(address, GenerationQuery().model_dump(), timeout=5, key=key)
    except (OSError, JsonLineError, auth.AuthError) as err:
        return str(err)
    return None


def _ask_departure(address: tuple[str, int], why: str) -> str | None:
    """None when the sidecar took the departure request; else why it could not be asked."""
    try:
        key = auth.worker_key(f"{address[0]}:{address[1]}", 0)
        request(address, Leave(reason=why).model_dump(), timeout=5, key=key)
    except (OSError, JsonLineError, auth.AuthError) as err:
        return str(err)
    return None


def _wait_for_agent(address: tuple[str, int], wait_s: float) -> str | None:
    deadline = time.monotonic() + wait_s
    while (why := _agent_answers(address)) is not None:
        if time.monotonic() >= deadline:
            return why
        time.sleep(0.5)
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        address = parse_address(args.agent)
    except ValueError as err:
        _say(f"--agent: {err}")
        return 2
    why = _wait_for_agent(address, args.agent_wait)
    if why is not None:
        _say(f"no sidecar answered at {args.agent} within {args.agent_wait:g} s ({why}); nothing started")
        return 2
    # Forked from one process that imported torch once (a restart runs within milliseconds), as
    # etcrun's --start-method forkserver; new interpreters with --start-method spawn.
    forkserver = ForkServer() if args.start_method == "forkserver" else None
    try:
        return _Workers(args, address, forkserver).supervise()
    finally:
        if forkserver is not None:
            forkserver.close()


class _Workers:
    """The node's worker processes, restarted (up to ``--max-restarts`` each) while the job goes on."""

    def __init__(self, args: argparse.Namespace, address: tuple[str, int], forkserver: ForkServer | None):
        self.args, self.address, self.forkserver = args, address, forkserver
        self.spec = WorkerSpec(entrypoint=[args.script, *args.script_args], module=args.module)
        # The workers die with this process (a container's main process going away takes them along).
        self.command = dying_with_this_process(self.spec.command())
        self.procs = {r: self.start(r) for r in range(args.nproc_per_node)}
        self.restarts = {r: 0 for r in self.procs}
        self.signals: list[signal.Signals] = []
        self.departure_deadline: float | None = None
        """Set by the first signal: when the workers get SIGTERM unless they exited by then."""
        self.terminated = False

    def start(self, local_rank: int) -> subprocess.Popen | ForkedProcess:
        env = {**os.environ, "LOCAL_RANK": str(local_rank), "ETC_AGENT_ADDR": f"{self.address[0]}:{self.address[1]}"}
        if self.forkserver is not None and self.forkserver.available:
            name = os.path.basename(self.args.script) or "worker"
            argv = self.spec.python_argv()
            assert argv is not None  # None only with no_python, which this spec never sets
            return self.forkserver.spawn(argv, env, os.getcwd(), False, False, name)
        return subprocess.Popen(self.command, env=env)

    @property
    def stopping(self) -> bool:
        """A signal came: processes that exit are not started again."""
        return self.departure_deadline is not None

    def _on_term(self, signum: int, frame: object) -> None:
        # The departure request is a network call: the supervision loop makes it, not the handler.
        self.signals.append(signal.Signals(signum))

    def _terminate(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)

    def _handle_signals(self) -> None:
        """The first signal asks the sidecar for a planned departure; a second one, a sidecar that
        cannot be asked, or the departure timeout sends SIGTERM to the workers."""
        if self.signals and self.departure_deadline is None:
            name = self.signals[0].name
            why = _ask_departure(self.address, f"{name} to etc-agent workers")
            if why is None:
                _say(f"{name}: the sidecar leaves the job; the workers exit once their state is handed over")
                self.departure_deadline = time.monotonic() + self.args.departure_timeout
            else:
                _say(f"{name}: the sidecar cannot be asked to leave ({why}); stopping the workers")
                self.departure_deadline = time.monotonic()
                self.terminated = True
                self._terminate()
        elif self.departure_deadline is not None and not self.terminated:
            second = len(self.signals) > 1
            if second or time.monotonic() >= self.departure_deadline:
                _say("a second signal: stopping the workers" if second else "departure timeout: stopping the workers")
                self.terminated = True
                self._terminate()

    def supervise(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_term)
        done: dict[int, int] = {}
        while len(done) < len(self.procs):
            time.sleep(0.2)
            self._handle_signals()
            for r, p in list(self.procs.items()):
                if r in done or (code := p.poll()) is None:
                    continue
                why = self._why_not_restarted(r, code)
                if why is not None:
                    done[r] = code
                    if code != 0:
                        _say(f"local_rank {r} exited {code}; not restarted ({why})")
                    continue
                self.restarts[r] += 1
                _say(f"local_rank {r} exited {code}; starting it again ({self.restarts[r]}/{self.args.max_restarts})")
                self.procs[r] = self.start(r)
        return 0 if all(code == 0 for code in done.values()) else 1

    def _why_not_restarted(self, local_rank: int, code: int) -> str | None:
        """None where the process is started again; else why not (code 0: it finished)."""
        if code == 0:
            return "finished"
        if self.stopping:
            return "stopping"
        over = _job_over(self.address)
        if over is not None:
            return f"the job {over}"
        gone = _agent_answers(self.address)
        if gone is not None:
            return f"the sidecar does not answer: {gone}"
        if self.restarts[local_rank] >= self.args.max_restarts:
            return f"{self.restarts[local_rank]} restarts used"
        return None


def _say(line: str) -> None:
    print(f"[etc-agent workers] {line}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
