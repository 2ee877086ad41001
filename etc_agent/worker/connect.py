"""Forming gloo groups whose every wait keeps the job's timeout, and whose forming a dead peer cannot wedge.

Forming a gloo group has two waits. The first is in the store, for every rank's address; the
:class:`~etc_agent.worker.genstore.GenerationStore` ends it as soon as a newer generation exists.
The second is in C++ (``tcp::Pair::waitUntil``, the GIL released), for each peer's TCP connection.
The rank on the passive side of a pair waits up to five times the group's timeout there and
nothing can end that wait from Python (gloo's ``connectAsListener`` drops the timeout; the pair's
condition variable is the only bound). A peer SIGKILLed after it published its address and before
it connected therefore held every other rank of the generation for 5 x ``ETC_AGENT_TIMEOUT``
(10 minutes with the default of 120 s, reproduced with ``scripts/repro_connect_wedge.py``).

The group's timeout cannot simply be short while it forms: gloo copies it into its transport
context at construction, and a point-to-point receive without a timeout of its own (``dist.recv``,
``work.wait()``: a pipeline stage waiting for its neighbour) waits that long; neither
``_set_default_timeout`` nor ``set_timeout`` reaches it (``scripts/repro_gloo_p2p_timeout.py``).
So :func:`gloo_group` forms the group with the job's timeout and bounds the connect another way.
gloo's constructor reads every rank's address from the store before it connects any pair (each
rank publishes its own, then waits for and reads all of them; checked on torch 2.13's gloo, and
``tests/test_groups.py`` forms a group whose last rank comes later than the bound). Once its last
store call has returned, every peer has published and is inside the same constructor, so a live
pair connects within milliseconds. The constructor therefore runs in a thread and sees the store
through :class:`_Watched`, which notes its calls; the caller gives up when no store call has been
in progress for ``CONNECT_WAIT_FACTOR x ETC_AGENT_CONNECT_TIMEOUT`` (5 s by default) and the group
has not formed: a peer died while connecting. It raises (the switch takes it for a peer failure)
and the abandoned constructor ends by itself in C++, at gloo's own timeout, on a daemon thread.
Waits in the store stay the store's: a :class:`~etc_agent.worker.genstore.GenerationStore` ends
them when a newer generation exists or at its timeout, naming the keys (ranks) that did not come.

NCCL forms its communicators through the store (whose waits the generation store already ends)
and has no such pairwise wait; the gloo half of a ``cpu:gloo,cuda:nccl`` default group
(:func:`init_default_group`) and the groups of a mesh torch forms itself (a job without an agent)
are formed by torch with the job's timeout, without this bound.
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from etc_agent.protocol.settings import WorkerSettings
from etc_agent.utils.backends import default_group_backend
from etc_agent.worker.genstore import ForwardingStore

CONNECT_WAIT_FACTOR = 5
"""Once a group's store calls are over, a group that has not connected within this many connect
timeouts (``ETC_AGENT_CONNECT_TIMEOUT``) has lost a peer (gloo's own passive side waits 5 x its timeout)."""

POLL_S = 0.005
"""Seconds between two looks of the caller at the forming thread."""


def connect_timeout_s() -> float:
    """The connect bound of a gloo group's forming (``ETC_AGENT_CONNECT_TIMEOUT``, default 1 s)."""
    return WorkerSettings.from_env(os.environ).connect_timeout_s


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """A gloo group whose collectives and point-to-point receives are bounded by ``timeout``, formed
    on ``store``; given up ``CONNECT_WAIT_FACTOR`` connect timeouts after its store calls are over.

    Every rank of the group calls this with the same ``store`` prefix and ``world_size``. Raises
    ``RuntimeError`` (a peer failure to the switch) when a rank does not come (the store's wait: its
    timeout, or a newer generation) or does not connect."""
    watched = _Watched(store)
    outcome: dict[str, object] = {}

    def construct() -> None:
        try:
            outcome["group"] = dist.ProcessGroupGloo(watched, rank, world_size, timeout)
        except BaseException as err:  # noqa: BLE001  # handed to the waiting caller
            outcome["error"] = err

    thread = threading.Thread(target=construct, name="etc-agent-gloo-connect", daemon=True)
    thread.start()
    bound_s = CONNECT_WAIT_FACTOR * connect_timeout_s()
    while thread.is_alive():
        thread.join(POLL_S)
        if thread.is_alive() and watched.quiet_s() > bound_s:
            raise RuntimeError(
                f"gloo group of {world_size} ranks (this one rank {rank}) did not connect within {bound_s:g} s "
                "after every rank's address was read: a peer died while it formed"
            )
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]  # a BaseException, set above
    group = outcome["group"]
    assert isinstance(group, dist.ProcessGroupGloo)
    return group


class _Watched(ForwardingStore):
    """The store as gloo's constructor sees it: how long since its last call returned, none running."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._calls_running = 0
        self._last_return = time.monotonic()

    def _forward(self, method: str, *args: Any) -> Any:
        with self._lock:
            self._calls_running += 1
        try:
            return super()._forward(method, *args)
        finally:
            with self._lock:
                self._calls_running -= 1
                self._last_return = time.monotonic()

    def quiet_s(self) -> float:
        """Seconds since the last call returned, while none runs (0 while one does)."""
        with self._lock:
            return 0.0 if self._calls_running else time.monotonic() - self._last_return


def init_static_group(backend: str, timeout: timedelta) -> tuple[int, int]:
    """Without an agent: the default group from torchrun's environment, unless the script made one
    (one process without ``MASTER_ADDR`` gets a group of its own). Returns (rank, world size)."""
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if not dist.is_initialized():
        backend = default_group_backend(backend)
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world, timeout=timeout)
    return rank, world


def init_default_group(backend: str, store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> None:
    """``init_process_group`` on ``store`` with ``timeout``; with gloo beside NCCL for CPU tensors
    (:func:`~etc_agent.utils.backends.default_group_backend`)."""
    dist.init_process_group(
        default_group_backend(backend), store=store, rank=rank, world_size=world_size, timeout=timeout
    )
