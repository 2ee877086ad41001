"""The parallel context a training script builds its model for: config, ranks, mesh and groups."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from etc_agent.layout.config import ParallelConfig
from etc_agent.utils.backends import data_backend

MESH_DIMS = ("pp", "dp", "tp")
FSDP_MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""torchtitan's dims (without cp), the mesh of a layout with ``dp_shard > 1``; ``dp`` is their
flattened ``dp_replicate x dp_shard`` there."""


@dataclass(frozen=True)
class ParallelContext:
    """Where this process sits in the current generation's layout.

    Ranks follow Megatron's order (tp fastest, then dp, then pp). Everything here belongs to one
    generation: after a migration the job hands out a new context; keep none of the old one.
    """

    config: ParallelConfig
    """The parallel configuration of this generation."""
    rank: int
    """Training rank in ``[0, world_size)``."""
    world_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    mesh: DeviceMesh
    """Device mesh over the whole world: dims ``("pp", "dp", "tp")``, or with FSDP (``dp_shard > 1``)
    torchtitan's ``("pp", "dp_replicate", "dp_shard", "tp")`` with ``dp`` flattened from the two."""
    device: torch.device
    """The device this process computes on."""
    generation: int
    """The agent's generation number (0 for a plain ``python script.py`` run)."""
    restoring: bool = False
    """True when the state ``build`` returns will be overwritten (a migration or a checkpoint load
    follows): ``build`` may skip expensive initialisation and only allocate."""
    timeout_s: float | None = None
    """The bound on every collective of the mesh's groups (``ETC_AGENT_TIMEOUT``); groups a script
    makes itself (Megatron's) should use it too."""

    # Groups are looked up through the mesh rather than held: after a failure the job drops the
    # mesh's groups so their connections close and peers blocked on this process fail at once,
    # even while a script still holds this context.
    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("tp")

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("dp")

    @property
    def pp_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group("pp")

    @property
    def tp(self) -> int:
        return self.config.tp

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def dp(self) -> int:
        return self.config.dp

    @property
    def fsdp_mesh(self) -> DeviceMesh:
        """The mesh ``fully_shard`` takes: ``dp_shard`` (FSDP), ``(dp_replicate, dp_shard)`` (HSDP);
        without FSDP the ``dp`` dim (``fully_shard`` on it shards over every data-parallel rank)."""
        if self.config.dp_shard == 1:
            return self.mesh["dp"]
        if self.config.dp_replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh["dp_shard"]

    def pp_peer(self, pp_rank: int) -> int:
        """Global rank of the process at ``pp_rank`` in this process's pipeline (same dp, tp)."""
        return self.config.rank(pp_rank, self.dp_rank, self.tp_rank)


def _bounded_groups(timeout: timedelta) -> dict | None:
    """``init_device_mesh``'s per-dimension backend options carrying ``timeout`` (DeviceMesh passes
    an option's timeout to ``new_group``); None for a backend string it cannot express so."""
    import torch._C._distributed_c10d as c10d

    backend = data_backend(str(dist.get_backend()))  # the mesh's groups carry the data: NCCL beside gloo
    options: c10d.Backend.Options
    if backend == "nccl" and hasattr(c10d, "ProcessGroupNCCL"):
        options = c10d.ProcessGroupNCCL.Options()
    elif backend in ("gloo", "nccl"):
        options = c10d.Backend.Options(backend)
    else:
        return None
    options._timeout = timeout
    return {name: (backend, options) for name in (*MESH_DIMS, *FSDP_MESH_DIMS)}


def mesh_shape(config: ParallelConfig) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The mesh's dim names and sizes for ``config`` (ranks in Megatron's order: tp fastest)."""
    if config.dp_shard > 1:
        return FSDP_MESH_DIMS, (config.pp, config.dp_replicate, config.dp_shard, config.tp)
    return MESH_DIMS, (config.pp, config.dp, config.tp)


def context_for(
    config: ParallelConfig,
    rank: int,
    generation: int,
    device: torch.device,
    mesh: DeviceMesh,
    restoring: bool = False,
    timeout: timedelta | None = None,
) -> ParallelContext:
    """The context of ``rank`` in ``config`` over ``mesh`` (its groups formed already)."""
    coord = config.coord(rank)
    return ParallelContext(
        config=config,
        rank=rank,
        world_size=config.world_size,
        tp_rank=coord.tp,
        pp_rank=coord.pp,
        dp_rank=coord.dp,
        mesh=mesh,
        device=device,
        generation=generation,
        restoring=restoring,
        timeout_s=timeout.total_seconds() if timeout is not None else None,
    )


def make_context(
    config: ParallelConfig,
    rank: int,
    generation: int,
    device: torch.device,
    restoring: bool = False,
    timeout: timedelta | None = None,
) -> ParallelContext:
    """Build the mesh and groups of ``config`` on the default process group (which must span the world).

    ``timeout`` bounds every collective of the mesh's groups (as the default group's is bounded):
    subgroups otherwise get torch's default of 30 minutes, and a rank blocked in one of them on a
    peer that went into recovery would wait that long. They are formed with it too: a gloo group
    keeps its forming timeout for point-to-point receives (:mod:`etc_agent.worker.connect`), and a
    rank still connecting a subgroup of a generation its peer had given up once waited 30 minutes there.
    """
    config.check_world_size(dist.get_world_size())
    overrides = _bounded_groups(timeout) if timeout is not None else None
    names, shape = mesh_shape(config)
    mesh = init_device_mesh(
        device.type,
        shape,
        mesh_dim_names=names,
        backend_override={n: overrides[n] for n in names} if overrides else None,
    )
    if config.dp_shard > 1:
        # Registered on the root mesh: ``mesh.get_group("dp")`` and the job's teardown see it.
        mesh["dp_replicate", "dp_shard"]._flatten("dp", backend_override=overrides["dp"] if overrides else None)
    if timeout is not None:
        for name in {*names, "dp"}:
            mesh.get_group(name).set_timeout(timeout)
    return context_for(config, rank, generation, device, mesh, restoring, timeout)
