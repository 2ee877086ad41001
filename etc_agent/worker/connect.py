"""Forming gloo groups with a short connect bound: a peer that dies while the group forms costs seconds.

Forming a gloo group has two waits. The first is in the store, for every rank's address; the
:class:`~etc_agent.worker.genstore.GenerationStore` ends it as soon as a newer generation exists.
The second is in C++ (``tcp::Pair::waitUntil``, the GIL released), for each peer's TCP connection.
The rank on the passive side of a pair waits up to five times the group's timeout there and
nothing can end that wait from Python (gloo's ``connectAsListener`` drops the timeout; the pair's
condition variable is the only bound). A peer SIGKILLed after it published its address and before
it connected therefore held every other rank of the generation for 5 x ``ETC_AGENT_TIMEOUT``
(10 minutes with the default of 120 s, reproduced with ``scripts/repro_connect_wedge.py``).

By the time the pairs connect, every rank has published its address and is inside the same
constructor (gloo's TCP context reads all addresses before it connects any pair, and a passive
side's peer connects as soon as it reaches that pair), so a live peer connects within
milliseconds. The groups are therefore formed with ``ETC_AGENT_CONNECT_TIMEOUT`` (seconds,
default 1) and given the collective timeout right after: ``ProcessGroupGloo`` reads its
default timeout at every collective, so ``_set_default_timeout`` bounds what follows. A peer that
dies mid-formation now costs the others at most 5 x the connect timeout, after which the
constructor raises and the switch treats it as a peer failure.

NCCL forms its communicators through the store (whose waits the generation store already ends)
and has no such pairwise wait; its groups keep one timeout. Only gloo is checked here.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

from etc_agent.protocol.settings import WorkerSettings
from etc_agent.utils.backends import default_group_backend

CONNECT_WAIT_FACTOR = 5
"""gloo's passive side of a pair waits this many times the group's timeout for its peer."""


def connect_timeout_s() -> float:
    """The bound on forming a gloo group (``ETC_AGENT_CONNECT_TIMEOUT``, default 1 s)."""
    return WorkerSettings.from_env(os.environ).connect_timeout_s


def forming_timeout(backend: str, timeout: timedelta) -> timedelta:
    """The timeout to form a ``backend`` group with, whose collectives get ``timeout`` afterwards."""
    if backend != "gloo":
        return timeout
    return min(timeout, timedelta(seconds=connect_timeout_s()))


def gloo_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta) -> dist.ProcessGroupGloo:
    """A gloo group formed under the connect bound whose collectives are bounded by ``timeout``."""
    group = dist.ProcessGroupGloo(store, rank, world_size, forming_timeout("gloo", timeout))
    group._set_default_timeout(timeout)
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
    """``init_process_group`` on ``store``, formed under the connect bound, collectives bounded by
    ``timeout``; with gloo beside NCCL for CPU tensors (:func:`~etc_agent.utils.backends.default_group_backend`)."""
    dist.init_process_group(
        default_group_backend(backend),
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=forming_timeout(backend, timeout),
    )
    dist.distributed_c10d._set_pg_timeout(timeout)
