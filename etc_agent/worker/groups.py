"""Process-group lifetime: a destroyed group must really be freed, or peers blocked on it wait out their timeout.

A gloo group closes its sockets only when its C++ object is freed; ``abort()`` and ``shutdown()`` on
the group or on its backend leave them open (torch 2.13, checked with
``scripts/repro_dead_peer_wait.py``). A peer blocked in a collective that needs this process then
sees no error until its own timeout, although this process gave the group up long ago.

What kept destroyed groups alive: ``torch.distributed.nn.functional`` evaluates ``group.WORLD`` in
its default arguments when it is first imported. ``torch._dynamo`` imports it, and the first
functional collective (every DTensor op that communicates) imports ``torch._dynamo``; from then on
ten function defaults hold the default group of that moment. Tuples of pybind objects are untracked
by the garbage collector, so ``gc.get_referrers`` does not show them. The same pattern is in
``torch.distributed.optim.zero_redundancy_optimizer`` and ``torch.distributed.fsdp.sharded_grad_scaler``.

Two remedies: this module imports ``torch.distributed.nn.functional`` (10 ms) before any group
exists, so its defaults are ``None`` (the default group at call time, which is what they mean);
and :func:`destroy_all_groups` replaces every function default in ``torch`` that still holds a
destroyed group, then reports any group that something else keeps alive.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import types
import warnings
import weakref

import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401 - must run before the first group exists (see above)

log = logging.getLogger(__name__)


def live_groups() -> list[dist.ProcessGroup]:
    """Every process group this process has (the default group and its subgroups)."""
    if not dist.is_initialized():
        return []
    return list(dist.distributed_c10d._world.pg_map)


def _functions_of(module: types.ModuleType):
    for value in list(vars(module).values()):
        if isinstance(value, types.FunctionType):
            yield value
        elif isinstance(value, type) and vars(value).get("__module__") == module.__name__:
            for attr in list(vars(value).values()):
                func = getattr(attr, "__func__", attr)
                if isinstance(func, types.FunctionType):
                    yield func


_scanned: set[str] = set()
"""Modules whose functions were looked at: their defaults were evaluated when they were imported."""
_holders: list[types.FunctionType] = []
"""Functions of ``torch`` with a process group among their defaults (found by :func:`_scan`)."""


def _holds_group(func: types.FunctionType) -> bool:
    values = [*(func.__defaults__ or ()), *(func.__kwdefaults__ or {}).values()]
    return any(isinstance(v, dist.ProcessGroup) for v in values)


def _scan() -> None:
    """Find the functions that hold a group in modules imported since the last scan (each module is
    looked at once: the first scan after ``torch._dynamo`` came in costs ~70 ms, later ones nothing)."""
    for name, module in list(sys.modules.items()):
        if name in _scanned or module is None or not (name == "torch" or name.startswith("torch.")):
            continue
        _scanned.add(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # touching deprecated module attributes warns
            _holders.extend(f for f in _functions_of(module) if _holds_group(f))


def mark_loaded_modules_clean() -> None:
    """Call before the first group exists: no module imported so far can hold one in its defaults."""
    if not dist.is_initialized():
        _scanned.update(name for name, module in list(sys.modules.items()) if module is not None)


def release_defaults(groups: list[dist.ProcessGroup]) -> int:
    """Replace every default argument in ``torch``'s loaded modules that is one of ``groups`` with
    ``None``; return how many functions changed."""
    if not groups:
        return 0
    _scan()
    ids = {id(g) for g in groups}
    replaced = 0
    for func in _holders:
        defaults, kwdefaults = func.__defaults__, func.__kwdefaults__
        if defaults and any(id(d) in ids for d in defaults):
            func.__defaults__ = tuple(None if id(d) in ids else d for d in defaults)
            replaced += 1
        if kwdefaults and any(id(d) in ids for d in kwdefaults.values()):
            func.__kwdefaults__ = {k: None if id(d) in ids else d for k, d in kwdefaults.items()}
            replaced += 1
    return replaced


def _forget_world() -> None:
    """Leave ``torch.distributed`` as a fresh process has it, whatever the last formation did.

    torch names every group it creates after a per-process count (the default group too: "0",
    its subgroups "1", "2", ...; the ranks of a group meet under that name in the store) and resets
    the count only when it destroys a default group. A formation that failed inside
    ``init_process_group`` (a peer that never came, a newer generation) has counted a name and left
    no default group to destroy: the next formation on this rank would use "1" where its peers use
    "0", and they would wait for each other until the timeout, generation after generation. A
    ``destroy_process_group`` that raised half-way leaves its registry behind the same way.
    """
    world = dist.distributed_c10d._world
    if dist.is_initialized():
        dist.distributed_c10d._update_default_pg(None)
    for registry in (
        world.pg_map,
        world.pg_names,
        world.pg_group_ranks,
        world.pg_backend_config,
        world.pg_to_tag,
        world.tags_to_pg,
        world.pg_coalesce_state,
    ):
        registry.clear()
    world.group_count = 0


FREE_TIMEOUT_S = 30.0
"""Bound on freeing the destroyed groups (each closes its connections: its peers' sockets)."""


def _free_in_parallel(groups: list[dist.ProcessGroup]) -> None:
    """Drop this list's references (emptying it), one group per thread.

    A gloo group's destructor closes its connections one by one, each waiting for a tick of the
    transport's event loop (~10 ms); torch releases the GIL in a process group's destructor, so
    separate threads free the groups side by side. Six groups of 4 ranks (18 connections a rank: a
    training group, a mesh's subgroups, the migration group): 0.20 s one after the other here,
    0.05 s side by side (``scripts/bench_group_teardown.py``).
    """
    holders = [[group] for group in groups]
    groups.clear()
    threads = [threading.Thread(target=holder.clear, name="etc-free-group", daemon=True) for holder in holders]
    del holders
    deadline = time.monotonic() + FREE_TIMEOUT_S
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = sum(thread.is_alive() for thread in threads)
    if stuck:
        log.warning("%d destroyed process groups still closing after %.0f s", stuck, FREE_TIMEOUT_S)


class GroupRelease:
    """Destroyed groups being freed in a thread of their own (:func:`release_all_groups`).

    Nothing of the next generation waits for the old connections to close: the new groups have
    sockets of their own, and a peer blocked on an old group fails when the destructor runs,
    waited for or not. What is still referenced once the rest is freed is known after :meth:`wait`.
    """

    def __init__(self, groups: list[dist.ProcessGroup]):
        self.names = [f"{g.group_name} ({g.size()} ranks)" for g in groups]
        self._refs = [weakref.ref(g) for g in groups]
        self._kept: list[str] = []
        self._thread = threading.Thread(target=self._free, args=(groups,), name="etc-release-groups", daemon=True)
        self._thread.start()

    def _free(self, groups: list[dist.ProcessGroup]) -> None:
        _free_in_parallel(groups)
        for name, ref in zip(self.names, self._refs, strict=True):
            group = ref()
            if group is not None:
                holders = sorted({type(r).__name__ for r in gc.get_referrers(group)} - {"list", "frame"})
                self._kept.append(
                    f"{name} held by {', '.join(holders) or 'objects the garbage collector does not track'}"
                )
            del group

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout_s: float = FREE_TIMEOUT_S + 5.0) -> list[str]:
        """A description of each group some other holder still keeps (empty when all were freed)."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return [f"{len(self.names)} groups still being freed after {timeout_s:.0f} s"]
        return list(self._kept)


class GroupReleases:
    """The releases of a job's teardowns: each says, once done, which groups something still holds."""

    def __init__(self) -> None:
        self._pending: list[GroupRelease] = []

    def add(self, release: GroupRelease) -> None:
        self._pending.append(release)

    def report(self, wait: bool) -> None:
        """Warn of the groups still held, for the releases that are done (all of them with ``wait``:
        at the end of the job, each within its bound)."""
        pending = []
        for release in self._pending:
            if not wait and not release.done:
                pending.append(release)
                continue
            kept = release.wait()
            if kept:
                log.warning(
                    "destroyed process groups still referenced: %s; peers blocked in them wait until their timeout",
                    ", ".join(kept),
                )
        self._pending = pending


def release_all_groups() -> GroupRelease:
    """Destroy every process group and free them in the background (see :class:`GroupRelease`).

    Synchronous part: unregister every group from torch, replace the function defaults in
    ``torch`` that hold one, and collect what holds a group in a cycle (meshes, DTensor specs).
    """
    if not dist.is_initialized():
        _forget_world()
        return GroupRelease([])
    groups = live_groups()
    try:
        dist.destroy_process_group()
    except Exception as err:  # noqa: BLE001 - a broken group may fail to shut down cleanly
        log.warning("destroying the old process group: %s", err)
    _forget_world()
    replaced = release_defaults(groups)
    if replaced:
        log.debug("released %d function defaults that held a destroyed group", replaced)
    gc.collect()  # what holds a group in a cycle (meshes, DTensor specs) goes; `groups` still holds them
    return GroupRelease(groups)


def destroy_all_groups() -> list[str]:
    """Destroy every process group and make sure nothing in ``torch`` keeps one alive.

    Returns a description of each group some other holder still keeps (empty when all are freed);
    a group kept by a C++ holder (e.g. a live DDP reducer) is not seen here.
    """
    return release_all_groups().wait()
