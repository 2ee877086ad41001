"""Ready layouts: the leader's layout decisions for the likely next memberships, made while training.

A new generation's layout is the fit of ``--parallel`` to the members (:func:`layoutfit.fit`) and
the placement of its ranks on their devices (:func:`layoutfit.place`), both pure functions of
:class:`LayoutInputs`. While a generation runs, the leader works them out in a background thread
for the memberships the next event most likely leaves (each member's loss, with the waiting spares
taking its place) and keeps them keyed by their complete inputs. When the event comes, the decision
finds its own inputs among the keys and takes the ready result instead of computing it: the stall
spends nothing on it. A ready layout made for another membership, another previous placement or
other settings has another key and is never used; the record of the generation says whether its
layout was ready (``GenerationRecord.layout_ready``) and how long the decision spent on it
(``layout_seconds``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from etc_agent.agent.layoutfit import fit, place
from etc_agent.layout.config import ParallelSpec
from etc_agent.layout.model import ModelSpec
from etc_agent.rendezvous.records import GenerationRecord

MAX_READY = 64
"""Ready layouts kept per running generation (the first members' losses first)."""


@dataclass(frozen=True)
class LayoutInputs:
    """Everything a layout decision reads; equal inputs give an equal layout."""

    spec: str | None
    """``--parallel`` (or the layout asked for at run time), short form; None: no layout."""
    model: str | None
    """The model spec's name (it bounds which layouts shard it)."""
    min_nodes: int
    ordered: tuple[str, ...]
    """Candidate members in order (survivors first, then newcomers)."""
    devices: tuple[int, ...]
    """Devices of each candidate member."""
    previous: tuple[object, ...]
    """What the placement keeps from the current generation: number, status, layout, placement."""
    resilient: bool


@dataclass(frozen=True)
class LayoutChoice:
    """A layout decision: the members the layout uses and its placement, or why none fits."""

    ordered: tuple[str, ...]
    parallel: str | None
    placement: tuple[str, ...] | None
    gaps: tuple[str, ...]
    why_not: str | None
    """Set when ``--parallel`` fits no group of the members (a waiting generation says it)."""
    seconds: float
    """Time the decision took when it was made."""


@dataclass(frozen=True)
class LayoutQuestion:
    """What one layout decision reads (what :func:`layoutfit.fit` and :func:`layoutfit.place` take):
    its :meth:`key` names it, its :meth:`answer` works it out."""

    spec: ParallelSpec | None
    model: ModelSpec | None
    min_nodes: int
    ordered: tuple[str, ...]
    devices: tuple[int, ...]
    """Devices of each of ``ordered``."""
    current: GenerationRecord | None
    resilient: bool

    def key(self) -> LayoutInputs:
        previous: tuple[object, ...] = ()
        if self.current is not None:
            placement = tuple(self.current.placement or self.current.member_devices())
            previous = (self.current.number, self.current.status, self.current.parallel, placement)
        return LayoutInputs(
            spec=self.spec.short() if self.spec is not None else None,
            model=self.model.name if self.model is not None else None,
            min_nodes=self.min_nodes,
            ordered=self.ordered,
            devices=self.devices,
            previous=previous,
            resilient=self.resilient,
        )

    def answer(self) -> LayoutChoice:
        """Fit and place, timed (what a decision computes when no ready layout has its key)."""
        started = time.perf_counter()
        ordered, devices = list(self.ordered), dict(zip(self.ordered, self.devices))
        fitted = fit(self.spec, self.model, ordered, devices, self.min_nodes)
        if isinstance(fitted, str):
            return LayoutChoice(self.ordered, None, None, (), fitted, time.perf_counter() - started)
        used, parallel = fitted
        placement: list[str] | None = None
        gaps: list[str] = []
        if parallel is not None and len(used) >= self.min_nodes:
            placement, gaps = place(parallel, used, devices, self.current, self.resilient)
        return LayoutChoice(
            tuple(used),
            parallel,
            tuple(placement) if placement is not None else None,
            tuple(gaps),
            None,
            time.perf_counter() - started,
        )


class ReadyLayouts:
    """The leader's ready layouts (thread-safe): prepared in a background thread, read by decisions."""

    def __init__(self, limit: int = MAX_READY) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._ready: dict[LayoutInputs, LayoutChoice] = {}
        self._for: object = None
        self._thread: threading.Thread | None = None

    def snapshot(self) -> Mapping[LayoutInputs, LayoutChoice]:
        with self._lock:
            return dict(self._ready)

    def prepare(self, basis: object, jobs: Sequence[Callable[[], tuple[LayoutInputs, LayoutChoice]]]) -> bool:
        """Start working out ``jobs`` for ``basis`` (the running generation they assume) in the
        background, dropping what was ready for another basis; False if that basis is already
        being or has been prepared."""
        with self._lock:
            if self._for == basis:
                return False
            self._for = basis
            self._ready = {}
        thread = threading.Thread(target=self._run, args=(basis, jobs[: self.limit]), name="etc-ready", daemon=True)
        self._thread = thread
        thread.start()
        return True

    def _run(self, basis: object, jobs: Sequence[Callable[[], tuple[LayoutInputs, LayoutChoice]]]) -> None:
        for job in jobs:
            inputs, choice = job()
            with self._lock:
                if self._for != basis:
                    return  # a newer generation: these would never match
                self._ready[inputs] = choice

    def wait(self, timeout: float) -> bool:
        """Whether the preparation in progress finished within ``timeout`` seconds (tests)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True
