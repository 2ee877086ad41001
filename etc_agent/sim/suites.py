"""Scenario suites for the simulator.

``paper``: preemption, failure and scale-out of Megatron-style jobs (gpt-1.3b, llama-7b, llama-13b,
llama-70b) on 8 to 1024 GPUs, 8 per node. Each job starts in the smallest model-parallel layout that
fits the devices' memory (TP inside a node first, then PP; the distributed optimizer (zero=1) when
dp > 1), as Megatron users size jobs; the change keeps TP and PP and changes DP:

- ``preempt 1 node``: the last node is reclaimed with notice (it sends its state before it goes);
- ``fail 1 node``: the last node crashes; the job runs without ZeRO (a ZeRO-1 optimizer shard has no
  replica, so a crash there needs a checkpoint either way);
- ``scale out``: nodes for one more replica join.

``scale``: llama-70b at tp=8, pp=8 on 1,024, 4,096 and 16,384 GPUs (the shape of
``scripts/bench_planner.py``) losing a node with notice, losing one to a crash, and growing by one
replica's nodes; without the distributed optimizer (a crash needs a replica of every shard). Meant
with the control round fitted to ``scripts/bench_control_plane.py`` (``--control-plane``).

``bench``: the transitions of ``scripts/bench_migration.py`` (the example GPT at 1.0 GB on two or
three agents of two processes, placed in member order as live workers are), to validate the model
against what that benchmark measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import ceil
from pathlib import Path

from etc_agent.layout.config import ParallelConfig, ParallelSpec
from etc_agent.layout.devices import DeviceSet
from etc_agent.layout.model import ModelSpec
from etc_agent.planner.policy import PolicyOptions, estimate_memory
from etc_agent.sim.estimate import Scenario

MODELS_DIR = Path(__file__).resolve().parents[2] / "configs" / "models"
GPUS_PER_NODE = 8

PAPER_SIZES: dict[str, tuple[int, ...]] = {
    "gpt-1.3b": (8, 32, 128),
    "llama-7b": (16, 64, 256),
    "llama-13b": (32, 128, 512),
    "llama-70b": (128, 512, 1024),
}
"""Model -> cluster sizes (GPUs) of the paper suite."""


def load_model(name_or_path: str) -> ModelSpec:
    """A model spec by file path or by name under ``configs/models``."""
    path = Path(name_or_path)
    if not path.exists():
        path = MODELS_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in MODELS_DIR.glob("*.yaml")))
        raise ValueError(
            f"model {name_or_path!r}: no such file, and no configs/models/{name_or_path}.yaml (known: {known})"
        )
    return ModelSpec.from_yaml(path)


def cluster(num_devices: int, per_node: int = GPUS_PER_NODE, first_node: int = 0) -> DeviceSet:
    if num_devices % per_node:
        raise ValueError(f"{num_devices} devices are not whole nodes of {per_node}")
    return DeviceSet.parse(",".join(f"n{first_node + i}:{per_node}" for i in range(num_devices // per_node)))


def smallest_layout(
    spec: ModelSpec, num_devices: int, zero: bool, memory: PolicyOptions | None = None
) -> ParallelConfig:
    """The smallest TP x PP (TP up to a node first, then PP) whose ranks fit in device memory, with DP
    using every device; ``zero`` turns on the distributed optimizer where dp > 1."""
    memory = memory or PolicyOptions()
    options = []
    for pp in range(1, spec.num_layers + 1):
        for tp in (1, 2, 4, 8):
            if num_devices % (tp * pp):
                continue
            dp = num_devices // (tp * pp)
            config = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=int(zero and dp > 1))
            try:
                spec.check_parallel(config)
            except ValueError:
                continue
            if estimate_memory(spec, config, memory) <= 0.9 * memory.device_memory_gib * (1 << 30):
                options.append((tp * pp, pp, config))
    if not options:
        raise ValueError(f"{spec.name} does not fit on {num_devices} devices of {memory.device_memory_gib:g} GiB")
    return min(options, key=lambda o: (o[0], o[1]))[2]


def _shrunk(config: ParallelConfig, num_devices: int) -> ParallelConfig | None:
    dp = num_devices // (config.tp * config.pp)
    return ParallelConfig(tp=config.tp, pp=config.pp, dp=dp, zero=config.zero if dp > 1 else 0) if dp >= 1 else None


FSDP_JOBS: tuple[tuple[str, int, int], ...] = (("llama-70b", 8, 128), ("llama-13b", 1, 64), ("llama-13b", 4, 16))
"""PyTorch-native jobs of the fsdp suite: ``(model, dp_replicate, dp_shard)`` on 8-GPU nodes (HSDP
8 x 128 = 1024 GPUs, plain FSDP over 64, HSDP 4 x 16)."""


def fsdp_suite() -> list[Scenario]:
    """FSDP2 / HSDP jobs (torchtitan's dp_replicate x dp_shard) losing a node to preemption and to a
    failure, and growing by one: the shard groups shrink or grow (uneven shards), the replicas stay.
    Pure FSDP has no replica, so its node failure is left out (that state comes from a checkpoint)."""
    out: list[Scenario] = []
    for name, replicate, shard in FSDP_JOBS:
        spec = load_model(name)
        n = replicate * shard
        devices = cluster(n)
        config = ParallelConfig(dp=n, dp_shard=shard)
        label = f"HSDP {replicate}x{shard}" if replicate > 1 else f"FSDP {shard}"
        # A node's 8 devices leave every shard group they were in: each group gives up 8 / replicate.
        lost = GPUS_PER_NODE // replicate if replicate <= GPUS_PER_NODE else 1
        smaller = cluster(n - GPUS_PER_NODE)
        shrunk = ParallelConfig(dp=replicate * (shard - lost), dp_shard=shard - lost)
        out.append(Scenario(f"{label} preempt 1 node", spec, config, devices, shrunk, smaller))
        if replicate > 1:
            last_node = devices.node_devices(devices.nodes[-1])
            out.append(
                Scenario(f"{label} fail 1 node", spec, config, devices, shrunk, smaller, failed=tuple(last_node))
            )
        grown = ParallelConfig(dp=replicate * (shard + lost), dp_shard=shard + lost)
        out.append(Scenario(f"{label} scale out 1 node", spec, config, devices, grown, cluster(n + GPUS_PER_NODE)))
    return out


SCALE_SIZES = (1024, 4096, 16384)
"""GPUs of the scale suite."""


def scale_config(num_devices: int) -> ParallelConfig:
    """The scale suite's layout on ``num_devices``: tp=8, pp=8 (smaller below 512 devices, one stage
    per 64), dp over the rest. ``scripts/bench_planner.py`` keeps its own copy (``shape_for``): it
    times the planner's imports in its first plan, so it must not import the simulator first."""
    tp, pp = 8, min(8, max(1, num_devices // 64))
    return ParallelConfig(tp=tp, pp=pp, dp=num_devices // (tp * pp))


def scale_suite(model: str = "llama-70b", sizes: tuple[int, ...] = SCALE_SIZES) -> list[Scenario]:
    """A node's planned leave and its crash (the job shrinks by one replica, whose other nodes wait
    as spares) and one replica's nodes joining, at tp=8, pp=8 (pp smaller below 512 GPUs)."""
    spec = load_model(model)
    out: list[Scenario] = []
    for n in sizes:
        config = scale_config(n)
        tp, pp, replica = config.tp, config.pp, config.tp * config.pp
        devices = cluster(n)
        last_node = devices.node_devices(devices.nodes[-1])
        survivors = DeviceSet([d for d in devices if d.node != devices.nodes[-1]])
        if config.dp > 1:
            shrunk = ParallelConfig(tp=tp, pp=pp, dp=config.dp - 1)
            out.append(Scenario("preempt 1 node", spec, config, devices, shrunk, survivors))
            out.append(Scenario("fail 1 node", spec, config, devices, shrunk, survivors, failed=tuple(last_node)))
        grown = ParallelConfig(tp=tp, pp=pp, dp=config.dp + 1)
        out.append(Scenario("join 1 replica", spec, config, devices, grown, cluster(n + replica)))
    return out


def paper_suite(models: dict[str, tuple[int, ...]] | None = None) -> list[Scenario]:
    out: list[Scenario] = []
    for name, sizes in (models or PAPER_SIZES).items():
        spec = load_model(name)
        for n in sizes:
            devices = cluster(n)
            last_node = devices.node_devices(devices.nodes[-1])
            config = smallest_layout(spec, n, zero=True)
            smaller = cluster(n - GPUS_PER_NODE) if n > GPUS_PER_NODE else None
            shrunk = _shrunk(config, n - GPUS_PER_NODE) if smaller else None
            if shrunk is not None and smaller is not None:
                out.append(Scenario("preempt 1 node", spec, config, devices, shrunk, smaller))
            plain = smallest_layout(spec, n, zero=False)
            shrunk_plain = _shrunk(plain, n - GPUS_PER_NODE) if smaller else None
            if plain.dp > 1 and shrunk_plain is not None and smaller is not None:
                out.append(
                    Scenario("fail 1 node", spec, plain, devices, shrunk_plain, smaller, failed=tuple(last_node))
                )
            added = ceil(config.tp * config.pp / GPUS_PER_NODE) * GPUS_PER_NODE
            grown = ParallelConfig(tp=config.tp, pp=config.pp, dp=(n + added) // (config.tp * config.pp), zero=1)
            out.append(Scenario("scale out", spec, config, devices, grown, cluster(n + added)))
    return out


@dataclass(frozen=True)
class BenchTransition:
    """One transition of ``scripts/bench_migration.py`` (which runs this list) as a job sees it."""

    name: str
    parallel: str
    """Layout the job starts with (``--parallel``, dp may be auto)."""
    event: str
    """join, leave, or reconfigure:<spec>."""
    initial_agents: int = 2

    @property
    def final_agents(self) -> int:
        return self.initial_agents + {"join": 1, "leave": -1}.get(self.event, 0)

    @property
    def final_parallel(self) -> str:
        return self.event.split(":", 1)[1] if self.event.startswith("reconfigure:") else self.parallel


BENCH_TRANSITIONS = [
    BenchTransition("dp-up (node join)", "tp=2,pp=1,dp=auto", "join"),
    BenchTransition("dp-down (node leave)", "tp=2,pp=1,dp=auto", "leave", initial_agents=3),
    BenchTransition("tp-down", "tp=2,pp=1,dp=auto", "reconfigure:tp=1,pp=1,dp=auto"),
    BenchTransition("tp-up", "tp=1,pp=1,dp=auto", "reconfigure:tp=2,pp=1,dp=auto"),
    BenchTransition("pp-up", "tp=1,pp=1,dp=auto", "reconfigure:tp=1,pp=2,dp=auto"),
    BenchTransition("pp-down", "tp=1,pp=2,dp=auto", "reconfigure:tp=1,pp=1,dp=auto"),
    BenchTransition("zero-on", "tp=1,pp=1,dp=auto", "reconfigure:tp=1,pp=1,dp=auto,zero=1"),
    BenchTransition("zero-off", "tp=1,pp=1,dp=auto,zero=1", "reconfigure:tp=1,pp=1,dp=auto"),
    BenchTransition("combined (tp down, pp up, zero on)", "tp=2,pp=1,dp=auto", "reconfigure:tp=1,pp=2,dp=auto,zero=1"),
]

FSDP_BENCH_TRANSITIONS = [
    BenchTransition("fsdp+tp join", "tp=2,dp_shard=auto", "join"),
    BenchTransition("fsdp+tp leave", "tp=2,dp_shard=auto", "leave", initial_agents=3),
    BenchTransition("fsdp+tp -> fsdp (tp down)", "tp=2,dp_shard=auto", "reconfigure:dp_shard=auto"),
    BenchTransition("fsdp -> fsdp+tp (tp up)", "dp_shard=auto", "reconfigure:tp=2,dp_shard=auto"),
    BenchTransition("fsdp+tp -> hsdp", "tp=2,dp_shard=auto", "reconfigure:dp_replicate=2,dp_shard=auto"),
    BenchTransition("fsdp+tp -> pp2 x fsdp", "tp=2,dp_shard=auto", "reconfigure:pp=2,dp_shard=auto"),
]
"""``scripts/bench_migration.py --fsdp``: the Llama example under FSDP2 (+ TP, HSDP, pipeline stages)."""


def bench_suite(model: str = "gpt-bench", per_agent: int = 2) -> list[Scenario]:
    spec = load_model(model)
    out = []
    for t in BENCH_TRANSITIONS:
        old_world, new_world = t.initial_agents * per_agent, t.final_agents * per_agent
        old, new = (
            ParallelSpec.parse(t.parallel).resolve(old_world),
            ParallelSpec.parse(t.final_parallel).resolve(new_world),
        )
        if old is None or new is None:
            raise ValueError(f"bench transition {t.name!r} does not fit {old_world} -> {new_world} devices")
        out.append(
            Scenario(t.name, spec, old, cluster(old_world, per_agent), new, cluster(new_world, per_agent), ordered=True)
        )
    return out
