"""A generation's training groups formed beside the current ones, then installed as torch's.

``init_process_group`` and ``init_device_mesh`` need the new generation's default group to be
the process's only one, so they can run only after the old groups are gone, inside the stall.
:func:`form_world` forms the same groups on the generation's store without registering them
with torch: the world (``gen<N>/train/world/``), this rank's group on every mesh dim
(``gen<N>/train/<dim>/<index>/``) and, with FSDP, the flattened ``dp`` dim; it builds the
:class:`~torch.distributed.device_mesh.DeviceMesh` over them. That works while the previous
generation still trains (:mod:`etc_agent.worker.prepare`) as well as inside the switch.
:meth:`TrainingWorld.install`, once the old groups are destroyed, makes the world torch's default
group and registers the others, as ``init_process_group`` and ``new_group`` would have.

Every member of a gloo generation forms its groups here, whether ahead or in the stall (a joiner
has nothing to prepare): the same names on the same store either way, and torch's per-process
group count, which names later ``new_group`` calls, stays equal on every rank. NCCL jobs keep
``init_process_group`` and ``init_device_mesh`` (:func:`supports`): NCCL communicators, their
device binding and ``split_group`` are not reproduced here yet.

The mesh's groups are registered by name as soon as they form, so that a ``build(ctx)`` run
ahead can resolve them (FSDP2 asks the mesh for its groups when it shards a module); the old
groups' teardown unregisters every name, and :meth:`TrainingWorld.install` registers them again.

``DeviceMesh`` finds the calling rank through ``torch.distributed.get_rank()`` when it slices a
mesh (``mesh["tp"]``, FSDP2's ``fsdp_mesh``): the default group's rank, which ahead of the switch
is this process's rank in the old world, or none at all. Inside :meth:`TrainingWorld.as_default`
the thread that builds ahead sees this world as the default group (torch's
``_get_default_group`` answers per thread: the module replaces it with :func:`_default_group`,
which every other thread finds unchanged).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup, _register_process_group, _unregister_process_group
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import GroupName

from etc_agent.layout.config import ParallelConfig
from etc_agent.worker.connect import gloo_group
from etc_agent.worker.context import mesh_shape

_this_thread = threading.local()
_torch_default_group = dist.distributed_c10d._get_default_group


def _default_group() -> ProcessGroup:
    """torch's default group, or in a thread inside :meth:`TrainingWorld.as_default` that world."""
    world = getattr(_this_thread, "world", None)
    return world if world is not None else _torch_default_group()


dist.distributed_c10d._get_default_group = _default_group  # get_rank() and get_world_size() ask it


@contextmanager
def _as_default(formed: list[FormedGroup]) -> Iterator[None]:
    """``formed[0]`` (a world) as this thread's default group until the block ends. The groups'
    entries in torch's group maps (what ``get_backend()``, ``get_rank(group)`` and
    ``get_world_size(group)`` read) are there meanwhile: nothing but a teardown walks those maps,
    and a teardown never runs beside a build ahead (``Preparations.beside_no_build``)."""
    world = dist.distributed_c10d._world
    for f in formed:
        world.pg_map[f.group] = ("gloo", f.store)
        world.pg_group_ranks[f.group] = {g: i for i, g in enumerate(f.global_ranks)}
    _this_thread.world = formed[0].group
    try:
        yield
    finally:
        _this_thread.world = None
        for f in formed:
            world.pg_map.pop(f.group, None)
            world.pg_group_ranks.pop(f.group, None)


def supports(backend: str) -> bool:
    """Whether a job on ``backend`` forms its training groups here (gloo) or through
    ``init_process_group`` (anything else)."""
    return backend == "gloo"


@dataclass(frozen=True)
class FormedGroup:
    """One group formed on the generation's store, not yet known to torch."""

    group: ProcessGroup
    name: GroupName
    store: dist.Store
    global_ranks: tuple[int, ...]
    """The group's members by their rank in the new world (group rank i is ``global_ranks[i]``)."""


@dataclass
class TrainingWorld:
    """The groups and mesh of one generation for one rank (see the module docstring)."""

    world: FormedGroup
    dims: dict[str, FormedGroup]
    """This rank's group on each mesh dim (and on the flattened ``dp`` with FSDP)."""
    mesh: DeviceMesh
    store: dist.Store
    """The generation's store, which the groups' C++ stores call back into (a Python store): held as
    long as the groups live."""
    installed: bool = False

    @property
    def groups(self) -> list[FormedGroup]:
        """The world first, then the dims' groups."""
        return [self.world, *self.dims.values()]

    def install(self, timeout: timedelta) -> None:
        """Make these torch's groups: the world the default group, the rest its subgroups. Call it
        once the previous generation's groups are destroyed (torch then has none)."""
        assert not dist.is_initialized(), "the previous generation's groups must be destroyed first"
        c10d = dist.distributed_c10d
        config = str(c10d.BackendConfig(c10d.Backend("gloo")))
        for formed in self.groups:
            _unregister_process_group(formed.name)  # registered ahead for build(ctx); registered again below
            c10d._register_pg_in_world(
                formed.group,
                backend_name="gloo",
                store=formed.store,
                group_name=formed.name,
                backend_config=config,
                rank_mapping={g: i for i, g in enumerate(formed.global_ranks)},
                add_to_default_tag=True,
            )
        c10d._update_default_pg(self.world.group)
        c10d._set_pg_timeout(timeout)
        self.installed = True

    def as_default(self) -> AbstractContextManager[None]:
        """In this thread, until the block ends: this world is the default group (its rank and size
        are the ones ``DeviceMesh`` slices by); other threads keep seeing torch's (see
        :func:`_as_default`)."""
        assert not self.installed
        return _as_default(self.groups)

    def discard(self) -> None:
        """Never installed (the generation was superseded): forget the names, so that dropping
        this object closes the groups' connections."""
        if not self.installed:
            for formed in self.groups:
                _unregister_process_group(formed.name)


def form_world(
    store: dist.Store, generation: int, config: ParallelConfig, rank: int, device: torch.device, timeout: timedelta
) -> TrainingWorld:
    """Form ``rank``'s groups of ``generation`` in layout ``config`` on ``store`` (every member of
    the generation calls it; each group forms once all its members are here, bounded by the
    connect timeout and the store's waits) and the mesh over them."""
    assert supports("gloo")
    world_size = config.world_size
    prefix = f"gen{generation}/train"
    world = _form(store, f"{prefix}/world", tuple(range(world_size)), rank, timeout)
    names, shape = mesh_shape(config)
    ranks = torch.arange(world_size).view(shape)
    dims: dict[str, FormedGroup] = {}
    for index, name in enumerate(names):
        dims[name] = _form_dim(
            store, f"{prefix}/{name}", ranks.movedim(index, -1).reshape(-1, shape[index]), rank, timeout
        )
    if config.dp_shard > 1:
        # (pp, dp_replicate, dp_shard, tp): the flattened dp runs over dims 1 and 2.
        flat = ranks.movedim((1, 2), (-2, -1)).reshape(-1, config.dp_replicate * config.dp_shard)
        dims["dp"] = _form_dim(store, f"{prefix}/dp", flat, rank, timeout)
    with _as_default([world, *dims.values()]):  # DeviceMesh asks get_rank() for its sub-meshes
        mesh = _mesh(device, ranks, names, rank, dims)
    return TrainingWorld(world=world, dims=dims, mesh=mesh, store=store)


def _form_dim(store: dist.Store, prefix: str, rows: torch.Tensor, rank: int, timeout: timedelta) -> FormedGroup:
    """This rank's group among ``rows`` (each row one group's members, in group-rank order)."""
    for index, members in enumerate(rows.tolist()):
        if rank in members:
            return _form(store, f"{prefix}/{index}", tuple(members), rank, timeout)
    raise AssertionError(f"rank {rank} is in no group of {prefix}")


def _form(store: dist.Store, name: str, members: tuple[int, ...], rank: int, timeout: timedelta) -> FormedGroup:
    """A gloo group of ``members`` (as ``init_process_group`` makes it: a ProcessGroup with gloo
    for CPU tensors), formed on ``store`` under ``name``, registered by name only."""
    group_store = dist.PrefixStore(f"{name}/", store)
    group_rank, size = members.index(rank), len(members)
    backend = gloo_group(dist.PrefixStore("cpu/", group_store), group_rank, size, timeout)
    backend._set_sequence_number_for_group()
    group = ProcessGroup(group_store, group_rank, size)
    group._set_default_backend(ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    group_name = GroupName(name)
    group._set_group_name(group_name)
    group._set_group_desc(name)
    _register_process_group(group_name, group)
    return FormedGroup(group=group, name=group_name, store=group_store, global_ranks=members)


def _mesh(
    device: torch.device, ranks: torch.Tensor, names: tuple[str, ...], rank: int, dims: dict[str, FormedGroup]
) -> DeviceMesh:
    """The mesh ``init_device_mesh`` would give over these groups (and its flattened ``dp``)."""
    mesh = DeviceMesh(device.type, ranks, mesh_dim_names=names, _init_backend=False, _rank=rank)
    mesh._dim_group_names = [dims[name].name for name in names]
    for formed in dims.values():
        mesh._pg_registry[formed.name] = formed.group
    if "dp" in dims and "dp" not in names:
        from torch.distributed._mesh_layout import _MeshLayout

        # The layout of mesh["dp_replicate", "dp_shard"], without slicing (which asks get_rank()).
        sub_layout = mesh._get_slice_mesh_layout(("dp_replicate", "dp_shard"))
        flat = DeviceMesh(
            mesh._device_type,
            _layout=_MeshLayout([sub_layout.collapse()]),
            _rank_map=mesh._rank_map,
            mesh_dim_names=("dp",),
            _root_mesh=mesh,
            _init_backend=False,
            _rank=rank,
        )
        flat._dim_group_names = [dims["dp"].name]
        mesh._flatten_mapping["dp"] = flat
    return mesh
