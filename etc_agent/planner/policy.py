"""Choosing the parallel configuration for a device set (``--to auto``).

Candidates are every ``(tp, pp, dp, zero)`` that Megatron can shard the model with, whose TP groups
fit inside nodes, that uses at most the available devices (a subset may stay idle) and whose
estimated memory fits the device; for an FSDP job (its layout or its ``--parallel`` has
``dp_shard``), every ``(tp, pp, dp_replicate, dp_shard)`` instead, since its script builds FSDP2
modules, not Megatron's replicas. They are ranked by an estimated step time; among those within
``near_equal`` of the fastest, the one that is cheapest to migrate to from the current layout wins.

Memory per device (bytes), for the heaviest pipeline stage:
  parameters + gradients (fp32 main grads when params are bf16/fp16, as Megatron keeps them)
  + optimizer state (split over DP when zero=1)
  (with FSDP all three split over ``dp_shard``, plus two layers unsharded: the one computing and the
  one prefetched, parameters and gradients)
  + activations: ``34 * seq * micro_batch * hidden / tp`` per layer and micro-batch in flight
    (Korthikanti et al. 2022, sequence parallel with selective recomputation); with 1F1B the first
    stage holds ``pp`` micro-batches
  must stay under 90% of ``device_memory_gib`` (the rest is workspace and fragmentation).

Step time (seconds):
  compute = 6 * params * tokens / (devices used * peak_tflops * mfu), times ``1 + (pp-1)/m`` for the
  1F1B bubble with ``m = ceil(global_batch / (dp * micro_batch))`` micro-batches,
  + TP traffic: per layer and micro-batch 4 all-gather/reduce-scatter of ``seq*mb*hidden`` values
    (2 forward, 2 backward), ``(tp-1)/tp`` of it over the intra-node link, not overlapped,
  + DP gradient reduction: ``2*(dp-1)/dp`` of the rank's gradient bytes over the inter-node link;
    with FSDP, ``3*(dp_shard-1)/dp_shard`` of the rank's parameter bytes (all-gather forward and
    backward, reduce-scatter) over the intra-node link when a shard group fits in a node (else
    inter-node), plus ``2*(dp_replicate-1)/dp_replicate`` of its gradient shard across replicas.
The model only has to rank configurations sensibly; absolute values are rough.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import ceil, prod
from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

from etc_agent.layout.config import ParallelConfig, ParallelSpec
from etc_agent.layout.devices import Device, DeviceSet
from etc_agent.layout.megatron import layer_tensors, stage_layers
from etc_agent.layout.model import DTYPE_BYTES, ModelSpec

if TYPE_CHECKING:  # planner.core imports this module
    from etc_agent.planner.core import PlannerOptions

GiB = 1 << 30


class PolicyOptions(BaseModel):
    """Workload and hardware figures the policy's estimates use."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device_memory_gib: float = Field(80.0, gt=0, description="Memory of one device.")
    seq_length: int = Field(2048, ge=1, description="Tokens per sequence.")
    micro_batch_size: int = Field(1, ge=1, description="Sequences per micro-batch.")
    global_batch_size: int = Field(512, ge=1, description="Sequences per optimizer step.")
    peak_tflops: float = Field(400.0, gt=0, description="Dense bf16 TFLOP/s of one device.")
    mfu: float = Field(0.45, gt=0, le=1, description="Fraction of peak reached by the compute kernels.")
    intra_node_gbps: float = Field(150.0, gt=0, description="GB/s per device for TP collectives inside a node.")
    inter_node_gbps: float = Field(25.0, gt=0, description="GB/s per device for DP gradient reduction.")
    near_equal: float = Field(
        0.05, ge=0, description="Candidates within this fraction of the best step time are compared on migration cost."
    )
    max_migration_candidates: int = Field(
        6, ge=1, description="How many near-equal candidates get a full migration plan."
    )


@dataclass
class Candidate:
    config: ParallelConfig
    memory_bytes: int
    step_seconds: float
    fits: bool
    note: str = ""
    bytes_moved: int | None = None
    migration_seconds: float | None = None

    @property
    def tokens_per_second_per_device(self) -> float:
        return 0.0 if not self.fits else 1.0 / (self.step_seconds * self.config.world_size)


def layer_parameters(spec: ModelSpec, tp: int) -> int:
    """Parameters of one transformer layer on one TP rank."""
    return sum((prod(k.shape) // tp if k.split_dim is not None else prod(k.shape)) for k in layer_tensors(spec))


def rank_parameters(spec: ModelSpec, config: ParallelConfig) -> int:
    """Parameters held by a rank of the heaviest pipeline stage (before any FSDP sharding)."""
    per_layer = layer_parameters(spec, config.tp)
    vocab_rows = spec.padded_vocab_size // config.tp * spec.hidden_size
    norm = spec.hidden_size * (2 if spec.normalization == "layernorm" else 1)
    worst = 0
    for stage in range(config.pp):
        n = len(stage_layers(spec.num_layers, config.pp, stage)) * per_layer
        if stage == 0:
            n += vocab_rows
            if spec.position_embedding_type == "learned":
                n += spec.max_position_embeddings * spec.hidden_size
        if stage == config.pp - 1:
            n += norm
            if not spec.tied_embeddings or config.pp > 1:
                n += vocab_rows
        worst = max(worst, n)
    return worst


def estimate_memory(spec: ModelSpec, config: ParallelConfig, opts: PolicyOptions) -> int:
    params = rank_parameters(spec, config)
    param_bytes = DTYPE_BYTES[spec.params_dtype]
    grad_bytes = 4 if spec.uses_master_weights else param_bytes
    optim = params * 4 * len(spec.optimizer_state_names())
    if config.zero:
        optim = ceil(optim / config.dp)
    unsharded = 0
    if config.dp_shard > 1:
        optim = ceil(optim / config.dp_shard)
        unsharded = 2 * layer_parameters(spec, config.tp) * (param_bytes + grad_bytes)
        params = ceil(params / config.dp_shard)
    layers_first = len(stage_layers(spec.num_layers, config.pp, 0))
    per_layer_act = 34 * opts.seq_length * opts.micro_batch_size * spec.hidden_size / config.tp
    activations = layers_first * config.pp * per_layer_act
    logits = 4 * opts.seq_length * opts.micro_batch_size * spec.padded_vocab_size / config.tp
    return int(params * (param_bytes + grad_bytes) + optim + unsharded + activations + logits)


def estimate_step_seconds(
    spec: ModelSpec, config: ParallelConfig, opts: PolicyOptions, devices_per_node: int = 1
) -> float:
    """``devices_per_node``: the smallest node's devices (whether an FSDP shard group fits in one)."""
    tokens = opts.global_batch_size * opts.seq_length
    flops = 6 * spec.num_parameters() * tokens
    compute = flops / (config.world_size * opts.peak_tflops * 1e12 * opts.mfu)
    micro_batches = ceil(opts.global_batch_size / (config.dp * opts.micro_batch_size))
    compute *= 1 + (config.pp - 1) / micro_batches
    layers = len(stage_layers(spec.num_layers, config.pp, 0))
    act_bytes = opts.seq_length * opts.micro_batch_size * spec.hidden_size * DTYPE_BYTES[spec.params_dtype]
    tp_comm = layers * micro_batches * 4 * act_bytes * (config.tp - 1) / config.tp / (opts.intra_node_gbps * 1e9)
    params = rank_parameters(spec, config)
    grad_bytes = params * (4 if spec.uses_master_weights else DTYPE_BYTES[spec.params_dtype])
    if config.dp_shard > 1:
        shards, replicas = config.dp_shard, config.dp_replicate
        link = opts.intra_node_gbps if config.tp * shards <= devices_per_node else opts.inter_node_gbps
        param_bytes = params * DTYPE_BYTES[spec.params_dtype]
        shard_comm = 3 * (shards - 1) / shards * param_bytes / (link * 1e9)
        replica_comm = 2 * (replicas - 1) / replicas * grad_bytes / shards / (opts.inter_node_gbps * 1e9)
        return compute + tp_comm + shard_comm + replica_comm
    dp_comm = 2 * (config.dp - 1) / config.dp * grad_bytes / (opts.inter_node_gbps * 1e9)
    return compute + tp_comm + dp_comm


def _data_parallel_splits(dp: int, fsdp: bool) -> list[tuple[int, int]]:
    """``(zero, dp_shard)`` of the candidates with ``dp`` data-parallel ranks."""
    if fsdp:
        return [(0, shard) for shard in range(1, dp + 1) if dp % shard == 0]
    return [(0, 1), (1, 1)] if dp > 1 else [(0, 1)]


def candidate_configs(spec: ModelSpec, devices: DeviceSet, opts: PolicyOptions, fsdp: bool = False) -> list[Candidate]:
    """Every shardable configuration on at most ``len(devices)`` devices, fastest first; ``fsdp``:
    the FSDP / HSDP ones (every ``dp_shard`` dividing dp) instead of Megatron's zero=0/1."""
    node_sizes = [len(devices.node_devices(n)) for n in devices.nodes]
    out: list[Candidate] = []
    for tp in range(1, max(node_sizes) + 1):
        for pp in range(1, spec.num_layers + 1):
            for dp in range(1, len(devices) // (tp * pp) + 1):
                if sum(size // tp for size in node_sizes) < pp * dp:
                    continue
                for zero, dp_shard in _data_parallel_splits(dp, fsdp):
                    config = ParallelConfig(tp=tp, pp=pp, dp=dp, zero=zero, dp_shard=dp_shard)
                    try:
                        spec.check_parallel(config)
                    except ValueError:
                        continue
                    memory = estimate_memory(spec, config, opts)
                    fits = memory <= 0.9 * opts.device_memory_gib * GiB
                    out.append(
                        Candidate(
                            config,
                            memory,
                            estimate_step_seconds(spec, config, opts, min(node_sizes)),
                            fits,
                            "" if fits else f"needs {memory / GiB:.1f} GiB of {opts.device_memory_gib:g}",
                        )
                    )
    out.sort(
        key=lambda c: (
            not c.fits,
            c.step_seconds,
            c.config.world_size,
            c.config.tp,
            c.config.pp,
            c.config.zero,
            -c.config.dp_shard,
        )
    )
    return out


def fastest_fitting(candidates: list[Candidate], opts: PolicyOptions) -> list[Candidate]:
    """Fitting candidates within ``near_equal`` of the fastest; raises ValueError when none fits."""
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        smallest = min(candidates, key=lambda c: c.memory_bytes, default=None)
        detail = f" (the smallest needs {smallest.memory_bytes / GiB:.1f} GiB)" if smallest else ""
        raise ValueError(f"no parallel configuration fits {opts.device_memory_gib:g} GiB devices{detail}")
    best = fitting[0].step_seconds
    return [c for c in fitting if c.step_seconds <= best * (1 + opts.near_equal)][: opts.max_migration_candidates]


@dataclass
class PolicyDecision:
    winner: Candidate
    candidates: list[Candidate]
    """All candidates, fastest first (the near-equal ones carry migration figures)."""
    reason: str


def choose_config(
    spec: ModelSpec,
    new_devices: DeviceSet,
    opts: PolicyOptions,
    *,
    old_config: ParallelConfig | None = None,
    old_devices: DeviceSet | None = None,
    failed: Iterable[Device] = (),
    planner_options: PlannerOptions | None = None,
) -> PolicyDecision:
    """Pick the configuration for ``new_devices``; with an old layout, migration cost breaks near-ties."""
    from etc_agent.planner.core import StateLostError, plan_model_migration

    fsdp = old_config is not None and old_config.dp_shard > 1
    candidates = candidate_configs(spec, new_devices, opts, fsdp=fsdp)
    near = fastest_fitting(candidates, opts)
    if old_config is None or old_devices is None:
        winner = near[0]
        return PolicyDecision(
            winner,
            candidates,
            f"{winner.config.short()} has the lowest estimated step time ({winner.step_seconds:.3g} s)",
        )
    for c in near:
        try:
            plan = plan_model_migration(
                spec, old_config, old_devices, c.config, new_devices, failed=failed, options=planner_options
            )
        except StateLostError as err:
            c.note = f"loses state: {err}"
            continue
        c.bytes_moved = plan.bytes_moved
        c.migration_seconds = plan.estimated_seconds
    movable = [c for c in near if c.migration_seconds is not None]
    if not movable:
        raise ValueError(f"every near-best configuration loses state: {near[0].note}")
    winner = min(movable, key=lambda c: (c.migration_seconds, c.bytes_moved, c.step_seconds))
    fastest = near[0]
    if winner is fastest:
        reason = f"{winner.config.short()}: fastest estimated step ({winner.step_seconds:.3g} s)"
        if len(movable) > 1:
            reason += f" and cheapest migration of the {len(movable)} within {opts.near_equal:.0%} ({winner.migration_seconds:.3g} s)"
    else:
        reason = (
            f"{winner.config.short()}: step {winner.step_seconds:.3g} s is within {opts.near_equal:.0%} of the fastest "
            f"({fastest.config.short()}, {fastest.step_seconds:.3g} s) and it migrates in {winner.migration_seconds:.3g} s "
            f"instead of {fastest.migration_seconds if fastest.migration_seconds is not None else float('nan'):.3g} s"
        )
    return PolicyDecision(winner, candidates, reason)


def resolve_parallel(
    spec: ParallelSpec, node_sizes: Sequence[int], model: ModelSpec | None = None, opts: PolicyOptions | None = None
) -> ParallelConfig | None:
    """The configuration of ``spec`` that uses exactly the devices of nodes with ``node_sizes``.

    Fixed ``tp``/``pp`` leave only dp to fill (``dp=auto``); an ``auto`` tp or pp needs ``model``: the
    policy's fastest estimated configuration among those using every device (fixed degrees and the
    zero setting kept; an FSDP spec gets FSDP / HSDP layouts with its fixed ``dp_shard`` or
    ``dp_replicate``). None when nothing fits.
    """
    total = sum(node_sizes)
    if spec.tp is not None and spec.pp is not None:
        config = spec.resolve(total)
        return config if config is not None and config.world_size == total else None
    if model is None:
        raise ValueError(
            f"--parallel {spec.short()}: tp/pp auto needs --model (the policy chooses them from the model spec)"
        )
    devices = DeviceSet.parse(",".join(f"n{i}:{size}" for i, size in enumerate(node_sizes)))
    fsdp = spec.dp_shard != 1 or spec.dp_replicate is not None
    fixed = [(spec.tp, "tp"), (spec.pp, "pp")]
    fixed += [(spec.dp_shard, "dp_shard"), (spec.dp_replicate, "dp_replicate")] if fsdp else [(spec.dp, "dp")]
    for candidate in candidate_configs(model, devices, opts or PolicyOptions(), fsdp=fsdp):
        c = candidate.config
        if not candidate.fits or c.world_size != total:
            continue
        if any(want is not None and getattr(c, name) != want for want, name in fixed):
            continue
        if c.zero != (spec.zero if c.dp > 1 else 0):
            continue
        return c
    return None
