"""Entering the next generation while this process still trains in the current one.

A worker hears of a new generation from its agent's poll before every rank stops at the boundary
that takes it over (:mod:`etc_agent.worker.boundary`). What of the switch needs neither the old
world's groups nor the training thread is done in that time, in a thread of its own: connecting
to the generation's store, counting this process in there, waiting for everyone else, forming the
migration group (``gen<N>/migrate/``: gloo's pairwise connects run with the GIL released, beside
the training steps) and, for a member of a gloo job, its training groups and mesh
(:mod:`etc_agent.worker.worldgroups`) and, where the job allows it, its new state
(:func:`etc_agent.worker.member.prepare_member`). The switch then starts from the training group
(:func:`etc_agent.worker.entry.form`).

Call sequence: the training thread calls :meth:`Preparations.notice` at every step boundary (it
arms the preparations with the generation training); the agent link's poll thread calls
:meth:`Preparations.poll` after every reply, which starts a :class:`Preparation` as soon as the
agent serves this process a newer generation (once per generation; an older one is dropped);
:meth:`Preparations.take` in the switch disarms them and hands over the one made for the generation
entered, once its thread ended (bounded by the job's timeout, which the waits inside honour too), or
None. Until a rank's preparation ended it votes ``preparing`` at the step-boundary vote, and every
rank trains on (:meth:`Preparations.preparing`, at most :data:`PREPARE_GRACE_S`). A
preparation that failed (a peer gone while it formed) hands over its error, which the switch
treats as a failure of that generation, as it would have treated the same failure in
:func:`~etc_agent.worker.entry.form`. Memory: a TCPStore client and the new groups' sockets (one
connection per peer and group) and, with a state built ahead, the new shards, resident from then on
(:func:`etc_agent.worker.member.touch_new_shards`). Groups of a preparation never entered are unregistered
when it is dropped, or at the next teardown if its thread was still running then.
``etcrun --prepare off`` (``ETC_AGENT_PREPARE=0``) turns it off.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch.distributed as dist

from etc_agent.migrate.exchange import PlanAhead
from etc_agent.protocol.control import Assignment
from etc_agent.worker.entry import connect_store, generation_store, mark_arrived, migration_group, wait_for_arrivals
from etc_agent.worker.link import AgentLink
from etc_agent.worker.member import Member


class Preparer(Protocol):
    """What a preparation does for the job once everyone arrived and the migration group formed
    (:class:`etc_agent.worker.ahead.JobPreparer`)."""

    def member(self, store: dist.Store, assignment: Assignment) -> Member | None:
        """A member's groups and context (and its state where allowed): :func:`~etc_agent.worker.member.prepare_member`."""

    def plan_ahead(
        self, store: dist.Store, assignment: Assignment, member: Member | None, newer: Callable[[], bool]
    ) -> PlanAhead | None:
        """The migration's plan, from every process's description (:mod:`etc_agent.worker.ahead`)."""


PREPARE_GRACE_S = 2.0
"""How long a rank asks the others to train on (:meth:`Preparations.preparing`) for a generation
it has seen: its agent may not serve this node's part of it (a spare node), or a peer may never
arrive; the switch then does what is left inside the stall."""
JOIN_MARGIN_S = 5.0
"""Beyond the job's timeout, how long the switch waits for a preparation's thread (its waits end first)."""


class Preparation:
    """One generation's store arrival and migration group, made in a thread (see the module docstring)."""

    def __init__(
        self,
        assignment: Assignment,
        link: AgentLink,
        timeout_s: float,
        preparer: Preparer | None = None,
        member_lock: threading.Lock | None = None,
    ):
        self.assignment = assignment
        self.generation = assignment.generation
        self._link, self._timeout_s, self._preparer = link, timeout_s, preparer
        self._member_lock = member_lock or threading.Lock()
        self.store: dist.Store | None = None
        """Set once this process is counted in: the switch must not count it in again."""
        self.group: dist.ProcessGroupGloo | None = None
        """The generation's migration group, once everyone arrived and it formed."""
        self.member: Member | None = None
        """A member's training groups, context and (where the job allows) state, made ahead."""
        self.published = False
        """This process's description went to the store for a plan ahead (:mod:`etc_agent.worker.ahead`)."""
        self.ahead: PlanAhead | None = None
        """The migration's plan, made ahead from everyone's descriptions (None: none could be)."""
        self.superseded = False
        """A newer generation came while this one's processes arrived."""
        self.error: BaseException | None = None
        self._wanted = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"etc-prepare-gen{self.generation}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            store = connect_store(self.assignment, self._timeout_s)
            mark_arrived(store, self.assignment)
            self.store = store
            if not wait_for_arrivals(store, self.assignment, self._timeout_s, self._link):
                self.superseded = True
                return
            self.group = migration_group(store, self.assignment, self._link, self._timeout_s)
            if self._preparer is not None:
                waits = generation_store(store, self.generation, self._link, self._timeout_s)
                with self._member_lock:  # never beside a teardown of the old groups (it unregisters names)
                    self.member = self._preparer.member(waits, self.assignment)
                self.published = True
                self.ahead = self._preparer.plan_ahead(store, self.assignment, self.member, self._stop_waiting)
        except BaseException as err:  # noqa: BLE001 - handed to the switch, which decides
            self.error = err

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def discard(self) -> None:
        """Not entered: let what it formed go (once its thread ended)."""
        if self.done and self.member is not None:
            self.member.discard()
            self.member = None

    def _stop_waiting(self) -> bool:
        """Whether a wait that only gives a head start (the plan ahead) should end: a newer
        generation came, or the switch wants this preparation now."""
        return self._wanted.is_set() or self._link.newer_than(self.generation) is not None

    def join(self) -> bool:
        """Wait for the thread (a wait for the plan ahead ends at once); False if it is still
        running after the job's timeout (and the margin)."""
        self._wanted.set()
        self._thread.join(self._timeout_s + JOIN_MARGIN_S)
        return not self._thread.is_alive()


class Preparations:
    """The preparation of the newest generation this process is served (at most one at a time).

    Armed by the training thread at every step boundary (:meth:`notice`, with the generation it
    trains in) and disarmed by :meth:`take` when a switch begins, so that a preparation starts only
    for a generation newer than the one training and never for one a switch entered (its arrival
    would be counted twice). Between boundaries the agent link's thread starts it as soon as the
    agent serves the assignment (:meth:`poll`), not a step later.
    """

    def __init__(self, link: AgentLink | None, timeout_s: float, enabled: bool):
        self._link, self._timeout_s = link, timeout_s
        self.enabled = enabled and link is not None
        """False without an agent (nothing to switch to), with ``--prepare off`` or ``--migration checkpoint``."""
        self.current: Preparation | None = None
        self.preparer: Preparer | None = None
        """Set by the job once it knows its build (:meth:`etc_agent.worker.job.Job.start`)."""
        self.member_lock = threading.Lock()
        """Held while a member's groups form and its state builds ahead, and by the job's teardown of
        the old groups (:meth:`beside_no_build`)."""
        self._lock = threading.Lock()
        self._armed: int | None = None
        """The generation training (None inside a switch: nothing may start then)."""
        self._started_up_to = -1
        """The newest generation a preparation started for or a switch entered."""
        self._asked_since: dict[int, float] = {}
        """When this rank first asked the others to train on for each generation (monotonic)."""
        if self.enabled and link is not None:
            link.on_reply = self.poll

    def notice(self, generation: int) -> None:
        """Training thread, at a step boundary of ``generation``: arm, and start preparing a newer
        generation the agent serves (once per generation)."""
        with self._lock:
            self._armed = generation
        self.poll()

    def poll(self) -> None:
        """Any thread (the agent link's after each reply): while armed, start preparing the newest
        generation the agent serves this process, once per generation."""
        if not self.enabled or self._link is None:
            return
        with self._lock:
            if self._armed is None:
                return
            newer = self._link.newer_than(self._armed)
            if newer is None or newer.generation <= self._started_up_to:
                return
            self._started_up_to = newer.generation
            # An older preparation's waits end on their own now that a newer generation exists.
            if self.current is not None:
                self.current.discard()
            self.current = Preparation(newer, self._link, self._timeout_s, self.preparer, self.member_lock)

    def preparing(self, seen: int, seen_status: str | None, generation: int) -> bool:
        """Whether this rank, training in ``generation``, asks every rank to train on because it
        still prepares ``seen`` (the newest generation its agent has read, in status
        ``seen_status``): its part of ``seen`` is not served yet, or its thread still runs. For at
        most :data:`PREPARE_GRACE_S` after it first asked; never for a generation that waits for
        nodes (the ranks hold at the boundary for it) or when preparing is off."""
        if not self.enabled or seen <= generation or seen_status == "waiting":
            return False
        now = time.monotonic()
        first = self._asked_since.setdefault(seen, now)
        if now - first > PREPARE_GRACE_S:
            return False
        current = self.current
        return current is None or current.generation != seen or not current.done

    @contextmanager
    def beside_no_build(self) -> Iterator[None]:
        """The block runs while no member's groups form and no state builds ahead: a teardown of the
        old groups unregisters every group name and clears DTensor's caches under them. Waits for a
        running one at most the job's timeout and :data:`JOIN_MARGIN_S` (its own waits end first)."""
        bound = self._timeout_s + JOIN_MARGIN_S
        if not self.member_lock.acquire(timeout=bound):
            current = self.current
            what = f"generation {current.generation}" if current is not None else "the next generation"
            raise RuntimeError(f"preparing {what} (its groups or its build ahead) did not end within {bound:.0f} s")
        try:
            yield
        finally:
            self.member_lock.release()

    def take(self, generation: int) -> Preparation | None:
        """A switch enters ``generation``: disarm, and hand over the preparation made for it once
        its thread ended (None: there is none; an older one is dropped, a newer one kept). Its
        ``group``, ``error`` or ``superseded`` says how it went."""
        with self._lock:
            self._armed = None
            self._started_up_to = max(self._started_up_to, generation)
            current = self.current
            if current is None or current.generation > generation:
                return None  # a newer generation's preparation stays for its own switch
            self.current = None
        if current.generation != generation:
            current.discard()
            return None
        if not current.join():
            raise RuntimeError(
                f"generation {generation}: preparing it did not end within {self._timeout_s + JOIN_MARGIN_S:.0f} s"
            )
        return current
