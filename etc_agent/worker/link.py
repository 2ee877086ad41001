"""The worker's side of its agent's control channel (``ETC_AGENT_ADDR``), polled in a thread.

Requests are the models of :mod:`etc_agent.protocol.control`; replies are parsed into its reply
models (:class:`~etc_agent.protocol.control.Assignment` above all), so the switch reads typed fields.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

from etc_agent.protocol.control import (
    Assignment,
    AssignmentQuery,
    AssignmentReply,
    Attach,
    CommitCheckpoint,
    CommitReply,
    ControlRequest,
    Exiting,
    Hello,
    HelloReply,
)
from etc_agent.utils import auth
from etc_agent.utils.jsonline import JsonLineError, hold, parse_address, request
from etc_agent.utils.sever import sever
from etc_agent.worker.errors import JobError, JobFinished
from etc_agent.worker.logs import say

log = logging.getLogger("etc_agent.worker")

HOLD_S = 1.0
"""How long the agent holds a poll whose reply has not changed: a change comes back at once (in the
agent's pass that made it), an idle worker asks about once a second (its progress for the metrics
is that fresh)."""
MIN_POLL_GAP_S = 0.01
"""Never ask more often than this, whatever the agent answers."""


class AgentLink:
    """Polls the agent for the newest generation and this worker's assignment; sends its reports."""

    def __init__(self, address: str, local_rank: int, poll_interval: float = 0.1):
        """``poll_interval``: the wait before asking again after a failed poll."""
        self.address = parse_address(address)
        self.local_rank = local_rank
        try:
            self.key = auth.worker_key(address, local_rank)
        except auth.AuthError as err:
            raise JobError(str(err)) from None
        self.poll_interval = poll_interval
        self.latest: int = -1
        """The newest generation number the agent has seen."""
        self.reply: AssignmentReply | None = None
        self.progress: tuple[int, float | None] | None = None
        """(the next step, the last step's seconds), set by the training loop and sent with each poll
        (one tuple assigned: the poll thread reads it whole)."""
        self.error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._held: socket.socket | None = None
        """The connection of the poll in flight (``close`` shuts it down rather than wait for its reply)."""
        self._changed = threading.Condition(self._lock)
        self._stopping = False
        self._severed_for = -1
        """The newest generation whose unreachable hosts this worker's connections were shut to."""
        self.on_reply: Callable[[], None] | None = None
        """Called in the poll thread after each reply (the job starts preparing a new generation there)."""
        hello = request(
            self.address,
            Hello(local_rank=local_rank, pid=os.getpid(), elastic=True).model_dump(),
            timeout=10,
            key=self.key,
        )
        self.hello = HelloReply.model_validate(hello)
        self._attachment: socket.socket | None = None
        if self.hello.sidecar:
            self._attach()
        self._thread = threading.Thread(target=self._poll, name="etc-agent-link", daemon=True)
        self._thread.start()

    @property
    def fenced(self) -> bool:
        """The agent lost the store while its peers reach it: train no step, commit nothing."""
        reply = self.reply
        return reply is not None and reply.fenced

    @property
    def latest_status(self) -> str | None:
        """The status of the newest generation the agent has read (``waiting``, ``running``, ...)."""
        reply = self.reply
        return reply.latest_status if reply is not None else None

    @property
    def finished(self) -> bool:
        """Training rank 0 reported the last step done."""
        reply = self.reply
        return reply is not None and reply.finished

    def _attach(self) -> None:
        """Sidecar mode: hold a connection to the agent for as long as this process lives; the agent is
        not our parent, and that connection closing is how it learns we are gone."""
        try:
            sock, _ = hold(self.address, Attach(local_rank=self.local_rank, pid=os.getpid()).model_dump(), 10, self.key)
        except (OSError, JsonLineError) as err:
            raise JobError(f"the agent at {self.address[0]}:{self.address[1]} refused the attachment: {err}") from None
        self._attachment = sock

    def _poll(self) -> None:
        failures = 0
        while not self._stop.is_set():
            asked_at = time.monotonic()
            try:
                reply = self._ask()
            except (OSError, JsonLineError, ValueError) as err:
                failures += 1
                if failures >= 3 and not self._stop.is_set():
                    with self._changed:
                        self.error = f"agent at {self.address[0]}:{self.address[1]} unreachable: {err}"
                        self._changed.notify_all()
                self._stop.wait(self.poll_interval)
                continue
            failures = 0
            self._take(reply)
            self._stop.wait(max(0.0, MIN_POLL_GAP_S - (time.monotonic() - asked_at)))

    def _ask(self) -> AssignmentReply:
        """One poll, held by the agent up to ``HOLD_S`` while its reply is the one this worker holds."""

        def connected(sock: socket.socket) -> None:
            with self._lock:
                self._held = sock
            if self._stop.is_set():
                sock.shutdown(socket.SHUT_RDWR)

        try:
            answer = request(
                self.address,
                self._query().model_dump(exclude_none=True),
                timeout=10,
                key=self.key,
                on_connect=connected,
            )
        finally:
            with self._lock:
                self._held = None
        return AssignmentReply.model_validate(answer)

    def _take(self, reply: AssignmentReply) -> None:
        if reply.stop and not self._stopping:
            # Sidecar mode: the agent cannot signal a process it did not start; it asks instead.
            self._stopping = True
            say(
                f"local_rank {self.local_rank}: the agent asks this worker to stop",
            )
            os.kill(os.getpid(), signal.SIGTERM)
        if reply.unreachable_hosts and reply.latest is not None and reply.latest > self._severed_for:
            self._severed_for = reply.latest
            self._sever(reply.latest, reply.unreachable_hosts)
        with self._changed:
            self.reply = reply
            if reply.latest is not None:
                self.latest = max(self.latest, reply.latest)
            self.error = None
            self._changed.notify_all()
        self._replied()

    def _replied(self) -> None:
        callback = self.on_reply
        if callback is None:
            return
        try:
            callback()
        except Exception:  # the poll goes on; the switch does what was not prepared
            log.exception("local_rank %d: handling the agent's reply failed", self.local_rank)

    def _query(self) -> AssignmentQuery:
        """The poll, with this worker's progress once it trains (the agent's metrics)."""
        held = self.reply
        known = {"known": held.digest, "hold_s": HOLD_S} if held is not None and held.digest else {}
        progress = self.progress
        if progress is None:
            return AssignmentQuery(local_rank=self.local_rank, **known)
        # Only a job that uses the elastic loader has a data position; this thread never imports it.
        loader = sys.modules.get("etc_agent.data.loader")
        position = loader.reported_position() if loader is not None else None
        return AssignmentQuery(
            local_rank=self.local_rank, step=progress[0], step_s=progress[1], data_position=position, **known
        )

    def _sever(self, generation: int, hosts: list[str]) -> None:
        """The newest generation dropped ``hosts`` as unreachable: end any collective blocked on them
        (:mod:`etc_agent.utils.sever`); the failure then switches this worker to that generation."""
        severed = sever(hosts)
        if severed:
            say(
                f"local_rank {self.local_rank}: generation {generation} dropped unreachable "
                f"{', '.join(hosts)}: shut {severed} connections to them",
            )

    def assignment(self, at_least: int, timeout_s: float, why: str) -> Assignment:
        """The newest assignment for a generation >= ``at_least`` (waiting for the agent to prepare it)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            return self._await_assignment(at_least, timeout_s, why, deadline)

    def _await_assignment(self, at_least: int, timeout_s: float, why: str, deadline: float) -> Assignment:
        """:meth:`assignment`'s wait (the caller holds ``_changed``)."""
        while True:
            reply = self.reply
            if reply is not None:
                if reply.assignment is not None and reply.assignment.generation >= at_least:
                    return reply.assignment
                if reply.latest_status in ("failed", "succeeded") and (reply.latest or -1) >= at_least:
                    raise JobError(f"the job {reply.latest_status} while this worker waited for generation {at_least}")
                if reply.finished:
                    raise JobFinished()
                if reply.standby or reply.fenced:
                    deadline = time.monotonic() + timeout_s  # a warm joiner waits as long as its node does
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                detail = f"; last error: {self.error}" if self.error else ""
                raise JobError(f"no generation >= {at_least} from the agent within {timeout_s:.0f} s ({why}){detail}")
            self._changed.wait(min(remaining, 0.5))

    def newer_than(self, generation: int) -> Assignment | None:
        with self._lock:
            reply = self.reply
            current = reply.assignment if reply is not None else None
            return current if current is not None and current.generation > generation else None

    def commit(self, step: int, generation: int, path: str) -> CommitReply | None:
        """Ask the agent to commit a written checkpoint (:mod:`etc_agent.agent.commits`); None when
        the agent did not answer (it keeps nothing then: the checkpoint stays uncommitted)."""
        req = CommitCheckpoint(step=step, generation=generation, path=path)
        try:
            return CommitReply.model_validate(
                request(self.address, req.model_dump(mode="json"), timeout=10, key=self.key)
            )
        except (OSError, JsonLineError, ValueError) as err:
            log.warning("could not ask the agent to commit the checkpoint of step %d: %s", step, err)
            return None

    def send(self, req: ControlRequest) -> None:
        """One request to the agent (a model of :mod:`etc_agent.protocol.control`); a failure is logged."""
        try:
            request(self.address, req.model_dump(mode="json"), timeout=10, key=self.key)
        except (OSError, JsonLineError) as err:
            log.warning("could not send %s to the agent: %s", req.op, err)

    def close(self, exit_code: int = 0) -> None:
        """Stop polling; a sidecar's worker reports ``exit_code`` and detaches."""
        self._stop.set()
        with self._lock:
            held = self._held
        if held is not None:
            try:
                held.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # answered and closed meanwhile
        self._thread.join(timeout=2)
        if self._attachment is not None:
            self.send(Exiting(local_rank=self.local_rank, pid=os.getpid(), code=exit_code))
            self._attachment.close()
            self._attachment = None
