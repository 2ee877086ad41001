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
So :func:`gloo_group` forms the group with the job's timeout and bounds the connect another way:

1. every rank arrives in the store first (a barrier through the generation store, whose wait a
   newer generation ends, and whose timeout names the ranks that did not come);
2. then the constructor runs in a thread the caller waits on for at most
   ``CONNECT_WAIT_FACTOR x ETC_AGENT_CONNECT_TIMEOUT`` (5 s by default): with every peer inside
   the same constructor a live pair connects within milliseconds, so a longer wait means a peer
   died while connecting. The caller then raises (the switch takes it for a peer failure) and the
   abandoned constructor ends by itself in C++, at its own timeout, on a daemon thread.

NCCL forms its communicators through the store (whose waits the generation store already ends)
and has no such pairwise wait; the gloo half of a ``cpu:gloo,cuda:nccl`` default group
(:func:`init_default_group`) and the groups of a mesh torch forms itself (a job without an agent)
are formed by torch with the job's timeout, without this bound.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import torch.distributed as dist

from etc_agent.protocol.settings import WorkerSettings
from etc_agent.utils.backends import default_group_backend

CONNECT_WAIT_FACTOR = 5
"""Once every rank arrived, a group that has not connected within this many connect timeouts
(``ETC_AGENT_CONNECT_TIMEOUT``) has lost a peer (gloo's own passive side waits 5 x its timeout)."""

ARRIVED = "arrived"
"""Store keys of the barrier before the constructor (under the group's own prefix)."""


def connect_timeout_s() -> float:
    """The connect bound of a gloo group's forming (``ETC_AGENT_CONNECT_TIMEOUT``, default 1 s)."""
    return WorkerSettings.from_env(os.environ).connect_timeout_s


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """A gloo group whose collectives and point-to-point receives are bounded by ``timeout``, formed
    on ``store`` at most ``CONNECT_WAIT_FACTOR`` connect timeouts after every rank arrived.

    Every rank of the group calls this with the same ``store`` prefix and ``world_size``. Raises
    ``RuntimeError`` (a peer failure to the switch) when a rank does not arrive (the store's wait:
    its timeout, or a newer generation) or does not connect."""
    if world_size > 1:
        _all_arrived(store, rank, world_size)
    return _construct_bounded(store, rank, world_size, timeout, CONNECT_WAIT_FACTOR * connect_timeout_s())


def _all_arrived(store: dist.Store, rank: int, world_size: int) -> None:
    """Wait until every rank of the group reached :func:`gloo_group` (one key awaited, however many
    ranks; each rank's own key names the missing ones when the wait fails)."""
    store.set(f"{ARRIVED}/{rank}", "1")
    if store.add(f"{ARRIVED}/count", 1) == world_size:
        store.set(f"{ARRIVED}/all", "1")
    try:
        store.wait([f"{ARRIVED}/all"])
    except RuntimeError as err:
        missing = [r for r in range(world_size) if not store.check([f"{ARRIVED}/{r}"])]
        shown = ", ".join(map(str, missing[:16])) + (f" and {len(missing) - 16} more" if len(missing) > 16 else "")
        raise RuntimeError(f"{err} (group ranks that did not arrive: {shown or 'none'})") from err


def _construct_bounded(
    store: dist.Store, rank: int, world_size: int, timeout: timedelta, bound_s: float
) -> dist.ProcessGroupGloo:
    """``ProcessGroupGloo(store, rank, world_size, timeout)``, given up after ``bound_s``."""
    outcome: dict[str, object] = {}

    def construct() -> None:
        try:
            outcome["group"] = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        except BaseException as err:  # noqa: BLE001  # handed to the waiting caller
            outcome["error"] = err

    thread = threading.Thread(target=construct, name="etc-agent-gloo-connect", daemon=True)
    thread.start()
    thread.join(bound_s)
    if thread.is_alive():
        raise RuntimeError(
            f"gloo group of {world_size} ranks (this one rank {rank}) did not form within {bound_s:g} s "
            "after every rank arrived: a peer died while it formed (gloo could not connect to it)"
        )
    if "error" in outcome:
        raise outcome["error"]  # type: ignore[misc]  # a BaseException, set above
    group = outcome["group"]
    assert isinstance(group, dist.ProcessGroupGloo)
    return group


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
