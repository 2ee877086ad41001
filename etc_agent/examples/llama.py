"""A Llama-style model (RMSNorm, RoPE, grouped-query attention, SwiGLU) trained through the worker
API with PyTorch's own parallelism, structured as torchtitan parallelises its Llama:

- tensor parallel (``parallelize_module`` on ``ctx.mesh["tp"]``): ``wq``/``wk``/``wv`` and
  ``w1``/``w3`` column-parallel, ``wo`` and ``w2`` row-parallel, the token embedding row-parallel
  over the vocabulary, the output head column-parallel with replicated logits; with sequence
  parallel (the default when ``tp > 1``; ``--no-sequence-parallel`` turns it off) the residual
  stream and the RMSNorms run on ``Shard(1)`` (this rank's part of the sequence), gathered before
  attention and the feed-forward and reduce-scattered after them, as torchtitan's plan does;
- FSDP2 (``dp_shard > 1``, ``--parallel tp=2,dp_shard=auto`` or HSDP ``dp_replicate=2,dp_shard=auto``):
  ``fully_shard`` on every block, then on the stage's root, over ``ctx.fsdp_mesh``; gradients are
  reduce-scattered (and all-reduced across replicas) by FSDP2; without FSDP (``dp=N``) gradients
  are summed over the dp group in one flat all-reduce;
- pipeline parallel: layers split into ``pp`` contiguous stages, activations and their gradients
  sent between stages one micro-batch at a time (as in :mod:`etc_agent.examples.gpt`), or with
  ``--pipeline-schedule gpipe|1f1b`` under ``torch.distributed.pipelining``'s schedules;
- the global batch is fixed whatever the layout; the data a token dataset read exactly once through
  every change (``--data``, as in :mod:`etc_agent.examples.gpt`); the LR schedule (warmup + cosine)
  is a carried ``LambdaLR``, the optimizer ``torch.optim.AdamW``.

``etcrun --nproc-per-node 4 --parallel dp_shard=auto -m etc_agent.examples.llama`` trains it with
FSDP2 over 4 workers; membership changes and ``etc-agent reconfigure`` move the sharded parameters
and AdamW state into the module built for the new mesh. ``--elementwise`` replaces the gradient by
an elementwise function of each parameter, so the state evolves layout-independently and can be
compared bit for bit with a run in any other layout.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import etc_agent
from etc_agent.data import TokenDataset
from etc_agent.examples.gpt import (
    add_data_args,
    batch,
    data_entry,
    finish,
    init_weights,
    log_samples,
    lr_schedule,
    open_dataset,
    optimizer_step,
    pace,
    pipeline_step,
    reduce_gradients,
    replica_share,
    report_step,
    stage_layers,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        weight: torch.Tensor = self.weight
        if isinstance(weight, DTensor) and not isinstance(x, DTensor):
            weight = weight.to_local()  # replicated on the TP mesh, applied to a plain activation
        return normed * weight


def rope_tables(seq: int, head_dim: int, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x`` (``[batch, heads, seq, head_dim]``) by their position's angles."""
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.wq = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, s, _ = x.shape
        # Column-parallel projections hold whole heads: -1 is this rank's share of them.
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, args: argparse.Namespace):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden)
        self.attention = Attention(args.hidden, args.heads, args.kv_heads)
        self.ffn_norm = RMSNorm(args.hidden)
        self.feed_forward = FeedForward(args.hidden, args.ffn)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class Stage(nn.Module):
    """The layers of one pipeline stage; names are global (``layers.<i>``) so keys do not depend on pp."""

    def __init__(self, args: argparse.Namespace, first: bool, last: bool, layers: range):
        super().__init__()
        self.first, self.last = first, last
        self.rope = rope_tables(args.seq, args.hidden // args.heads)
        if first:
            self.tok_embeddings = nn.Embedding(args.vocab, args.hidden)
        self.layers = nn.ModuleDict({str(i): Block(args) for i in layers})
        if last:
            self.norm = RMSNorm(args.hidden)
            self.output = nn.Linear(args.hidden, args.vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok_embeddings(x)
        for block in self.layers.values():
            x = block(x, self.rope)
        if self.last:
            x = self.output(self.norm(x))
        return x


def parallelize(model: Stage, ctx: etc_agent.ParallelContext, sequence_parallel: bool = True) -> None:
    """torchtitan's order: tensor parallel inside each block, then FSDP2 per block and on the root."""
    from torch.distributed.fsdp import fully_shard

    if ctx.config.tp > 1:
        tensor_parallel(model, ctx.mesh["tp"], sequence_parallel)
    if ctx.config.dp_shard > 1:
        for block in model.layers.values():
            fully_shard(block, mesh=ctx.fsdp_mesh)
        fully_shard(model, mesh=ctx.fsdp_mesh)


def tensor_parallel(model: Stage, tp_mesh, sequence_parallel: bool) -> None:
    """torchtitan's Llama TP plan; with ``sequence_parallel`` the activations between the blocks'
    halves are ``Shard(1)`` (so are those sent between pipeline stages)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sequence_parallel else Replicate()
    plan: dict = {}
    for i in model.layers:
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attention.wo", "feed_forward.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel(output_layouts=between)
        if sequence_parallel:
            plan[f"layers.{i}.attention_norm"] = SequenceParallel()
            plan[f"layers.{i}.ffn_norm"] = SequenceParallel()
            plan[f"layers.{i}.attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
            )
            plan[f"layers.{i}.feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
    if model.first:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if model.last:
        plan["output"] = ColwiseParallel(input_layouts=between, output_layouts=Replicate())
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
    # Every rank built the same full weights: keep the local slices, no scatter.
    parallelize_module(model, tp_mesh, plan, src_data_rank=None)
    for norm in [m for m in model.modules() if isinstance(m, RMSNorm)]:
        if not isinstance(norm.weight, DTensor):  # SequenceParallel made its norms' already
            norm.weight = nn.Parameter(distribute_tensor(norm.weight.data, tp_mesh, [Replicate()], src_data_rank=None))


def make_build(args: argparse.Namespace, dataset: TokenDataset | None = None):
    def build(ctx: etc_agent.ParallelContext) -> dict:
        cfg = ctx.config
        if args.heads % cfg.tp or args.kv_heads % cfg.tp or args.ffn % cfg.tp or args.vocab % cfg.tp:
            raise ValueError(
                f"tp={cfg.tp} must divide heads ({args.heads}), kv heads ({args.kv_heads}), ffn ({args.ffn}) "
                f"and vocab ({args.vocab})"
            )
        if args.sequence_parallel and args.seq % cfg.tp:
            raise ValueError(f"sequence parallel: tp={cfg.tp} must divide --seq ({args.seq})")
        first, last = ctx.pp_rank == 0, ctx.pp_rank == cfg.pp - 1
        layers = stage_layers(args.layers, cfg.pp, ctx.pp_rank)
        if ctx.restoring:
            # A migration overwrites every element: build on meta, shard, then allocate only the
            # local shards (no full-size weights on any rank).
            with torch.device("meta"):
                model = Stage(args, first, last, layers)
            model.rope = rope_tables(args.seq, args.hidden // args.heads)
        else:
            model = Stage(args, first, last, layers)
            init_weights(model, args.seed)
        parallelize(model, ctx, args.sequence_parallel)
        if ctx.restoring:
            model.to_empty(device=ctx.device)
        # Parameters mix TP-split and replicated DTensors and plain tensors: no foreach kernels.
        optim = torch.optim.AdamW(
            model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, foreach=False
        )
        state: dict[str, object] = {"model": model, "optim": optim, "sched": lr_schedule(optim, args.steps)}
        if dataset is not None:
            state["data"] = data_entry(args, dataset, ctx)
        return state

    return build


def train_step(job: etc_agent.Job, args: argparse.Namespace, step: int) -> float | None:
    """One optimizer step over the global batch; the global mean loss on the reporting rank."""
    ctx, model, optim, sched = job.ctx, job.state["model"], job.state["optim"], job.state["sched"]
    cfg = ctx.config
    share = replica_share(args, cfg, ctx.dp_rank)
    micro = args.micro_batch if cfg.pp > 1 else share.count
    fsdp = cfg.dp_shard > 1
    # Each sample's loss over the global batch; FSDP2 averages gradients over the data-parallel
    # ranks (times dp undoes it), the flat all-reduce below sums them. Either way the gradient is
    # the global batch's mean whatever each rank's share.
    scale = micro * cfg.dp / args.global_batch if fsdp else micro / args.global_batch
    # With sequence parallel a stage hands on its rank's part of the sequence.
    seq = args.seq // cfg.tp if args.sequence_parallel else args.seq
    optim.zero_grad(set_to_none=True)
    data = job.state.get("data")
    local = data.batch(step) if data is not None else None
    if cfg.pp > 1 and args.pipeline_schedule != "send-recv":
        loss_sum = scheduled_step(ctx, args, step, model, micro, seq, scale, local)
    else:
        loss_sum = pipeline_step(ctx, args, step, model, micro, seq, scale, local)
    if cfg.dp > 1 and not fsdp:
        reduce_gradients(model, ctx.dp_group)
    return optimizer_step(ctx, optim, sched, loss_sum, replicas_average=fsdp)


def scheduled_step(
    ctx: etc_agent.ParallelContext,
    args: argparse.Namespace,
    step: int,
    model: Stage,
    micro: int,
    seq: int,
    loss_scale: float,
    local: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`pipeline_step` through ``torch.distributed.pipelining`` (``--pipeline-schedule``):
    this stage as a ``PipelineStage`` on the pp group, GPipe or 1F1B over the replica's micro-batches."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    cfg = ctx.config
    share = replica_share(args, cfg, ctx.dp_rank)
    num_micro = share.count // micro
    first, last = ctx.pp_rank == 0, ctx.pp_rank == cfg.pp - 1
    # Made at the stage's first step and kept on it: the schedule goes (with its hold on the pp
    # group) when a switch drops the module, as a new layout builds a new one.
    schedule = getattr(model, "_pipeline_schedule", None)
    if schedule is None:
        # Shapes are inferred at the first step (a forward of metadata along the pipeline).
        stage = PipelineStage(model, ctx.pp_rank, cfg.pp, ctx.device, group=ctx.pp_group)

        def loss_fn(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            # The schedule divides the gradients by the micro-batch count: undo it, scale as pipeline_step does.
            return F.cross_entropy(out.reshape(-1, args.vocab), targets.reshape(-1)) * loss_scale * num_micro

        kind = ScheduleGPipe if args.pipeline_schedule == "gpipe" else Schedule1F1B
        schedule = kind(stage, num_micro, loss_fn=loss_fn)
        setattr(model, "_pipeline_schedule", schedule)  # noqa: B010 - kept on the module: a switch drops it
    lo, count = share.start, share.count
    data = local if local is not None else torch.stack([batch(args, step, i) for i in range(lo, lo + count)])
    inputs, targets = data[:, :-1], data[:, 1:]
    losses: list[torch.Tensor] = []
    if first:
        schedule.step(inputs)
    elif last:
        schedule.step(target=targets, losses=losses)
    else:
        schedule.step()
    return torch.stack([loss.detach() for loss in losses]).sum() / num_micro if losses else torch.zeros(())


def elementwise_step(job: etc_agent.Job) -> None:
    """A layout-independent update: every gradient element is a function of its parameter element."""
    from etc_agent.examples.gpt import elementwise_step as gpt_elementwise_step

    gpt_elementwise_step(job)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--global-batch", type=int, default=12, help="Sequences per step, whatever dp is.")
    ap.add_argument("--micro-batch", type=int, default=2, help="Sequences per pipeline micro-batch (pp > 1).")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2, help="Key/value heads (grouped-query attention).")
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="With tp > 1, run norms and the residual stream on this rank's part of the sequence.",
    )
    ap.add_argument(
        "--pipeline-schedule",
        choices=("send-recv", "gpipe", "1f1b"),
        default="send-recv",
        help="pp > 1: this file's micro-batch loop, or torch.distributed.pipelining's GPipe / 1F1B.",
    )
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", default="dp_shard=auto", help="Layout when etcrun --parallel does not give one.")
    ap.add_argument("--elementwise", action="store_true", help="Layout-independent update (for bitwise state checks).")
    ap.add_argument("--step-delay", type=float, default=0.0, help="Seconds to sleep per step (to watch a run).")
    ap.add_argument("--slow-while", default=None, metavar="FILE", help="As in etc_agent.examples.gpt.")
    ap.add_argument("--slow-step-delay", type=float, default=4.0)
    ap.add_argument("--loss-log", default=None, help="Append {step, loss, ...} JSON lines here.")
    add_data_args(ap)
    ap.add_argument("--dump-state", default=None, help="At the end, save the full unsharded state here (torch.save).")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.global_batch % args.micro_batch:
        raise ValueError("--global-batch must be a multiple of --micro-batch")
    dataset = open_dataset(args)
    # As the GPT example's: the elementwise update reduces nothing across ranks (see its main).
    job = etc_agent.init(parallel=args.parallel, commit_barrier=True if args.elementwise else None)
    job.start(make_build(args, dataset), build_ahead=True)
    for step in job.steps(args.steps):
        replica_share(args, job.ctx.config, job.ctx.dp_rank)  # a layout that cannot share the batch: one line
        started = time.perf_counter()
        if args.elementwise:
            elementwise_step(job)
            loss = 0.0 if job.ctx.rank == 0 else None  # progress marker; the check is on the final state
        else:
            loss = train_step(job, args, step)
            log_samples(job, args, step)
        if loss is not None:
            report_step(job, args, step, loss, started)
        pace(args, step)
    finish(job, args)


if __name__ == "__main__":
    main()
