"""What each local worker is told: its environment (torchrun's variables and ours) and, for
worker-API processes, its :class:`~etc_agent.protocol.control.Assignment` in a generation. The
transport and training ranks come from the generation record's helpers, the same for both."""

from __future__ import annotations

import os
from typing import Any

from etc_agent.agent.node import Node
from etc_agent.protocol.control import Assignment
from etc_agent.protocol.settings import WorkerSettings
from etc_agent.rendezvous.records import GenerationRecord, MasterRecord
from etc_agent.utils import auth

SOCKET_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
"""Where gloo and NCCL bind their sockets; a user's own setting wins."""


def node_env(node: Node, local_rank: int, generation: int) -> dict[str, str]:
    """What a worker gets from this node whatever its place in a generation."""
    config, spec = node.config, node.spec
    optional: dict[str, Any] = {}
    if config.fresh_start:
        optional["fresh_start"] = True
    if config.log_format == "json":
        optional["log_format"] = "json"
    if config.prepare == "off":
        optional["prepare"] = False
    if config.checkpoint_interval:
        optional.update(checkpoint_interval=config.checkpoint_interval, checkpoint_keep=config.checkpoint_keep)
    settings = WorkerSettings(
        agent_addr=node.control_address,
        local_rank=local_rank,
        device_index=0 if spec.virtual_local_rank else local_rank,
        node_id=node.node_id,
        generation=generation,
        migration=config.migration,
        checkpoint_dir=config.checkpoint_dir,
        **optional,
    )
    env = {
        **settings.to_env(),
        "ROLE_NAME": spec.role,
        "LOCAL_WORLD_SIZE": str(config.nproc_per_node),
        "TORCHELASTIC_MAX_RESTARTS": str(config.job_restarts),
        "TORCHELASTIC_RUN_ID": config.run_id,
        auth.TOKEN_ENV: node.control_keys.token(local_rank),
    }
    if config.local_interface:
        # The workers' sockets on the interface the peers reach this node on: without it gloo takes
        # the address this host's name resolves to, loopback in many containers and namespaces.
        for variable in SOCKET_INTERFACE_VARIABLES:
            if variable not in os.environ:
                env[variable] = config.local_interface
    if "OMP_NUM_THREADS" in os.environ:
        env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
    if spec.virtual_local_rank:
        # As torchrun does: each worker sees only its own device, as device 0.
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        env["CUDA_VISIBLE_DEVICES"] = visible[local_rank] if local_rank < len(visible) else str(local_rank)
    return env


def standby_env(node: Node, local_rank: int, generation: int) -> dict[str, str]:
    """A worker started before it has a rank (a warm joiner, a crash restart): it learns the rank
    from its assignment once the node is a member of ``generation`` or a later one."""
    return {**node_env(node, local_rank, generation), "RANK": "-1"}


SPARE_OMITS = ("LOCAL_RANK", "ETC_AGENT_LOCAL_RANK", auth.TOKEN_ENV)
"""What a warm spare does not have before its adoption: it has no rank (and no channel key) yet."""


def spare_env(node: Node, generation: int) -> dict[str, str]:
    """A warm spare's environment until it is adopted (:mod:`etc_agent.worker.spare`): a worker's,
    less what names a local rank. Under ``--virtual-local-rank`` its device is narrowed only then."""
    env = {k: v for k, v in node_env(node, 0, generation).items() if k not in SPARE_OMITS}
    if node.spec.virtual_local_rank:
        env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def worker_env(node: Node, gen: GenerationRecord, master: MasterRecord, local_rank: int) -> dict[str, str]:
    rank = gen.training_rank(node.node_id, local_rank)
    env = {
        **node_env(node, local_rank, gen.number),
        "RANK": str(rank),
        "GROUP_RANK": str(gen.members.index(node.node_id)),
        "ROLE_RANK": str(rank),
        "WORLD_SIZE": str(gen.world_size),
        "GROUP_WORLD_SIZE": str(len(gen.members)),
        "ROLE_WORLD_SIZE": str(gen.world_size),
        "MASTER_ADDR": master.addr,
        "MASTER_PORT": str(master.port),
        "TORCHELASTIC_RESTART_COUNT": str(gen.restart_count),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if gen.parallel:
        env.update(WorkerSettings(parallel=gen.parallel).to_env())
    return env


def assignments(node: Node, gen: GenerationRecord, master: MasterRecord, trained: bool) -> dict[int, Assignment]:
    """What each local worker is in ``gen`` (a worker that sends nothing into it gets none)."""
    # Checkpoint mode: departing workers saved and exited already, they send nothing.
    live = node.config.migration == "live"
    devices = gen.transport_devices(with_senders=live)
    leaving = node.node_id not in gen.members
    state = node.state.state
    return {
        local: Assignment(
            generation=gen.number,
            pg_rank=gen.transport_rank(node.node_id, local),
            pg_world_size=len(devices),
            rank=None if leaving else gen.training_rank(node.node_id, local),
            world_size=gen.world_size,
            parallel=gen.parallel,
            store_addr=master.addr,
            store_port=master.port,
            devices=devices,
            leaving=leaving,
            standby_after=leaving and not state.ready and not state.leaving,
            started=gen.started,
            trained=trained,
            reason=gen.reason,
            published_at=gen.published_at,
            node_id=node.node_id,
        )
        for local in range(node.config.nproc_per_node)
        if not leaving or gen.sends(node.node_id, local)
    }
