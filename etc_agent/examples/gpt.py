"""A small GPT trained through the worker API, parallelised from the context it is given.

- tensor parallel with DTensor (``parallelize_module``): q/k/v and fc1 column-parallel, attention
  output and fc2 row-parallel, the token embedding vocab-parallel, the head column-parallel with
  replicated logits; layer norms replicated;
- pipeline parallel: layers split into ``pp`` contiguous stages (earlier stages take the extra layer),
  embedding on the first stage, final norm and head on the last; activations and their gradients
  go between stages with send/recv, one micro-batch at a time;
- data parallel: gradients all-reduced over the dp group; ``zero=1`` splits the AdamW state of every
  parameter's local shard across the dp group (each rank updates its range, then the ranges are
  all-gathered);
- the global batch stays fixed when dp changes (with pp > 1 each replica accumulates
  ``global/(dp*micro)`` micro-batches; with pp = 1 its ``global/dp`` sequences are one batch), the
  LR schedule is a carried LambdaLR;
- data: a token dataset (``--data``; by default the Python documentation, tokenized once per machine)
  read through :class:`etc_agent.data.ElasticData`, every sample once through every change, its
  position in the state; ``--data synthetic`` makes each step's sequences from the step number.

Run it with ``etcrun --parallel tp=2,dp=auto ... -m etc_agent.examples.gpt`` or, as a world of 1,
``python -m etc_agent.examples.gpt``. ``--elementwise`` replaces the gradient by an elementwise
function of each parameter, so the whole state evolves layout-independently and can be compared
bit for bit with a run in any other layout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

import etc_agent
from etc_agent.data import ElasticData, Share, TokenDataset, dp_share
from etc_agent.data.prepare import default_dataset
from etc_agent.layout.boxes import balanced_range


# ---- model ---------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, hidden)
        self.k = nn.Linear(hidden, hidden)
        self.v = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor, tp: int) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln1(x)
        heads = self.heads // tp  # column-parallel q/k/v hold whole heads
        q, k, v = (t.view(b, s, heads, -1).transpose(1, 2) for t in (self.q(h), self.k(h), self.v(h)))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stage(nn.Module):
    """The layers of one pipeline stage; names are global (``layers.<i>``) so keys do not depend on pp."""

    def __init__(self, args: argparse.Namespace, first: bool, last: bool, layers: range):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.embed = nn.Embedding(args.vocab, args.hidden)
            self.pos = nn.Embedding(args.seq, args.hidden)
        self.layers = nn.ModuleDict({str(i): Block(args.hidden, args.heads, args.ffn) for i in layers})
        if last:
            self.norm = nn.LayerNorm(args.hidden)
            self.head = nn.Linear(args.hidden, args.vocab, bias=False)

    def forward(self, x: torch.Tensor, tp: int) -> torch.Tensor:
        if self.first:
            x = self.embed(x) + self.pos(torch.arange(x.shape[1]))
        for block in self.layers.values():
            x = block(x, tp)
        if self.last:
            x = self.head(self.norm(x))
        return x


def stage_layers(num_layers: int, pp: int, stage: int) -> range:
    base, extra = divmod(num_layers, pp)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def init_weights(module: nn.Module, seed: int) -> None:
    """Every parameter from its own generator seeded by its global name: identical in every layout."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            g = torch.Generator().manual_seed(
                seed * 1_000_003 + sum(ord(c) * 31**i for i, c in enumerate(name)) % (1 << 31)
            )
            if name.endswith("bias"):
                p.zero_()
            elif "ln" in name or "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


# ---- optimizer -----------------------------------------------------------------------------
class ShardedAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) on each parameter's local shard, optionally ZeRO-1 split.

    With ``ctx`` (zero=1) each dp rank keeps ``exp_avg``/``exp_avg_sq`` for a balanced range of
    the flattened local shard only, updates that range and all-gathers the updated ranges; the state
    is described as :class:`~etc_agent.migrate.describe.BoxedTensor` flat ranges so it migrates to
    any other layout. The update uses separate elementwise ops (no fused kernels), so each element's
    result is the same whatever the layout.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        lr: float,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.01,
        ctx: etc_agent.ParallelContext | None = None,
        zero_state: bool = True,
    ):
        params = [p for _, p in named_params]
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        # The context, not its group: holding a group object would keep its connections open after
        # a failure (see ParallelContext).
        self.ctx = ctx
        dp_group = ctx.dp_group if ctx is not None else None
        dp = dist.get_world_size(dp_group) if dp_group is not None else 1
        dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
        self.ranges: dict[nn.Parameter, tuple[int, int]] = {}
        for _, p in named_params:
            local = p.to_local() if isinstance(p, DTensor) else p
            start, length = balanced_range(local.numel(), dp, dp_rank)
            self.ranges[p] = (start, start + length)
            state = {"step": torch.zeros((), dtype=torch.float32)}
            # Uninitialised when a migration fills every element anyway.
            like, alloc = (torch.zeros_like, torch.zeros) if zero_state else (torch.empty_like, torch.empty)
            for name in ("exp_avg", "exp_avg_sq"):
                if dp_group is None:
                    state[name] = like(p)
                else:
                    state[name] = etc_agent_boxed(alloc(length, dtype=local.dtype), p, (start, start + length))
            self.state[p] = state

    @torch.no_grad()
    def step(self, closure=None):
        pending = []
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                local = (p.to_local() if isinstance(p, DTensor) else p).view(-1)
                grad = p.grad
                if isinstance(grad, DTensor):
                    # e.g. the vocab-parallel embedding's gradient comes back replicated (or partial)
                    if grad.placements != p.placements:
                        grad = grad.redistribute(p.device_mesh, p.placements)
                    grad = grad.to_local()
                grad = grad.reshape(-1)
                m, v = (_storage(state[n]) for n in ("exp_avg", "exp_avg_sq"))
                start, stop = self.ranges[p] if self.ctx is not None else (0, local.numel())
                step = float(state["step"].item()) + 1
                x, g = local[start:stop], grad[start:stop]
                new_x = x * (1 - lr * wd)
                new_m = m * beta1 + g * (1 - beta1)
                new_v = v * beta2 + (g * g) * (1 - beta2)
                denom = (new_v / (1 - beta2**step)).sqrt() + eps
                new_x = new_x - (new_m / (1 - beta1**step)) / denom * lr
                pending.append((p, state, local, new_x, new_m, new_v, m, v, step))
        gathered = None
        if self.ctx is not None:
            gathered = self._gather([(item[0], item[3]) for item in pending])
            # Every rank has its gathered update before any commits: a peer lost during the gather
            # fails all ranks here, so no dp group steps while another cannot.
            dist.all_reduce(torch.zeros(1))
        # Commit only after every collective completed: a failure above leaves the state at the last step.
        for i, (_p, state, local, new_x, new_m, new_v, m, v, step) in enumerate(pending):
            if gathered is None:
                local.copy_(new_x)
            else:
                local.copy_(gathered[i])
            m.copy_(new_m)
            v.copy_(new_v)
            state["step"].fill_(step)

    def _gather(self, items: list[tuple[nn.Parameter, torch.Tensor]]) -> list[torch.Tensor]:
        """All-gather every parameter's updated range over dp (one padded flat buffer per rank)."""
        assert self.ctx is not None  # only with zero=1 (a context) are the ranges split
        dp_group = self.ctx.dp_group
        dp = dist.get_world_size(dp_group)
        sizes = [(p.to_local() if isinstance(p, DTensor) else p).numel() for p, _ in items]
        ranges_of = [[balanced_range(n, dp, r) for r in range(dp)] for n in sizes]
        width = max(sum(rs[r][1] for rs in ranges_of) for r in range(dp))
        mine = torch.zeros(width)
        pos = 0
        for _, x in items:
            mine[pos : pos + x.numel()] = x
            pos += x.numel()
        outs = [torch.empty(width) for _ in range(dp)]
        dist.all_gather(outs, mine, group=dp_group)
        full = []
        cursor = [0] * dp
        for n, rs in zip(sizes, ranges_of):
            parts = []
            for r in range(dp):
                length = rs[r][1]
                parts.append(outs[r][cursor[r] : cursor[r] + length])
                cursor[r] += length
            full.append(torch.cat(parts) if n else torch.empty(0))
        return full


def _storage(value):
    return (
        value.tensor
        if hasattr(value, "flat_range")
        else (value.to_local() if isinstance(value, DTensor) else value).view(-1)
    )


def etc_agent_boxed(tensor: torch.Tensor, param: nn.Parameter, flat_range: tuple[int, int]):
    """The ZeRO range ``flat_range`` of ``param``'s local shard, described for migration."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from etc_agent.migrate.describe import BoxedTensor

    if isinstance(param, DTensor):
        shape, offsets = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    else:
        shape, offsets = tuple(param.shape), (0,) * param.dim()
    return BoxedTensor(tensor, tuple(param.shape), tuple(offsets), tuple(shape), flat_range)


# ---- build ---------------------------------------------------------------------------------
def make_build(args: argparse.Namespace, dataset: TokenDataset | None = None):
    def build(ctx: etc_agent.ParallelContext) -> dict:
        cfg = ctx.config
        if args.heads % cfg.tp or args.ffn % cfg.tp or args.vocab % cfg.tp:
            raise ValueError(f"tp={cfg.tp} must divide heads ({args.heads}), ffn ({args.ffn}) and vocab ({args.vocab})")
        first, last = ctx.pp_rank == 0, ctx.pp_rank == cfg.pp - 1
        layers = stage_layers(args.layers, cfg.pp, ctx.pp_rank)
        if ctx.restoring:
            # A migration overwrites every element: build on meta, split, then allocate only the
            # local shards, uninitialised (no full-size weights, no init kernels).
            with torch.device("meta"):
                model = Stage(args, first, last, layers)
        else:
            model = Stage(args, first, last, layers)
            init_weights(model, args.seed)
        if cfg.tp > 1:
            plan: dict[str, ParallelStyle] = {}
            for i in model.layers:
                for name in ("q", "k", "v", "fc1"):
                    plan[f"layers.{i}.{name}"] = ColwiseParallel()
                for name in ("proj", "fc2"):
                    plan[f"layers.{i}.{name}"] = RowwiseParallel()
            if first:
                plan["embed"] = RowwiseParallel(input_layouts=Replicate())
            if last:
                plan["head"] = ColwiseParallel(output_layouts=Replicate())
            # Every rank built the same full weights: keep the local slices, no scatter.
            parallelize_module(model, ctx.mesh["tp"], plan, src_data_rank=None)
        if ctx.restoring:
            model.to_empty(device=ctx.device)
        optim: torch.optim.Optimizer
        if args.optimizer == "torch":
            if cfg.zero:
                raise ValueError("--optimizer torch has no ZeRO-1 split; use the default optimizer with zero=1")
            # Parameters mix DTensors (TP-split) and plain tensors (norms): no foreach kernels.
            optim = torch.optim.AdamW(
                model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, foreach=False
            )
        else:
            optim = ShardedAdamW(
                list(model.named_parameters()),
                lr=args.lr,
                weight_decay=args.weight_decay,
                ctx=ctx if cfg.zero else None,
                zero_state=not ctx.restoring,
            )
        state: dict[str, object] = {"model": model, "optim": optim, "sched": lr_schedule(optim, args.steps)}
        if dataset is not None:
            state["data"] = data_entry(args, dataset, ctx)
        return state

    return build


def lr_schedule(optim: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup over a tenth of the run, then cosine down to a tenth (carried across layouts)."""
    warmup = max(1, steps // 10)
    return torch.optim.lr_scheduler.LambdaLR(
        optim,
        lambda s: min(1.0, (s + 1) / warmup) * (0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)) * 0.9 + 0.1),
    )


# ---- data and step -------------------------------------------------------------------------
def batch(args: argparse.Namespace, step: int, index: int) -> torch.Tensor:
    """Sequence ``index`` of global step ``step``: a noisy affine token walk (learnable, deterministic)."""
    g = torch.Generator().manual_seed(args.seed * 7919 + step * 104729 + index)
    start = int(torch.randint(args.vocab, (1,), generator=g))
    mult = 1 + 2 * int(torch.randint(3, (1,), generator=g))
    seq = [start]
    for _ in range(args.seq):
        seq.append((seq[-1] * mult + 1) % args.vocab)
    tokens = torch.tensor(seq)
    noise = torch.rand(args.seq + 1, generator=g) < 0.1
    return torch.where(noise, torch.randint(args.vocab, (args.seq + 1,), generator=g), tokens)


def replica_share(args: argparse.Namespace, config: etc_agent.ParallelConfig, dp_rank: int) -> Share:
    """This data-parallel rank's part of the global batch. Without a pipeline a replica's part is one
    batch, so any dp up to the global batch goes (as-even-as-possible parts, :func:`dp_share`;
    the loss scale weights each by its size); a pipeline feeds whole micro-batches, so there dp must
    divide the global batch's micro-batches (``ValueError`` otherwise)."""
    if config.pp == 1:
        return dp_share(args.global_batch, config.dp, dp_rank)
    num_micro = args.global_batch // args.micro_batch
    if num_micro % config.dp:
        raise ValueError(
            f"{config.short()}: dp={config.dp} does not divide the {num_micro} micro-batches of a step "
            f"(--global-batch {args.global_batch}, --micro-batch {args.micro_batch}); without a pipeline any dp "
            f"up to {args.global_batch} does"
        )
    per_replica = args.global_batch // config.dp
    return Share(dp_rank * per_replica, per_replica)


def train_step(job: etc_agent.Job, args: argparse.Namespace, step: int) -> float | None:
    """One optimizer step over the global batch; returns the global mean loss on the reporting rank."""
    ctx, model, optim, sched = job.ctx, job.state["model"], job.state["optim"], job.state["sched"]
    cfg = ctx.config
    share = replica_share(args, cfg, ctx.dp_rank)
    # Micro-batches feed the pipeline; without one, a replica's batch is one forward and backward
    # (the same gradient up to rounding, and a third of the tensor-parallel collectives at dp=2).
    micro = args.micro_batch if cfg.pp > 1 else share.count
    optim.zero_grad(set_to_none=True)
    data = job.state.get("data")
    local = data.batch(step) if data is not None else None
    # Each sample's loss over the global batch: the dp sum of the gradients is the global batch's
    # mean whatever each rank's share.
    loss_sum = pipeline_step(
        ctx, args, step, lambda x: model(x, cfg.tp), micro, args.seq, micro / args.global_batch, local
    )
    if cfg.dp > 1:
        reduce_gradients(model, ctx.dp_group)
    return optimizer_step(ctx, optim, sched, loss_sum, replicas_average=False)


def optimizer_step(
    ctx: etc_agent.ParallelContext,
    optim: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    loss_sum: torch.Tensor,
    replicas_average: bool,
) -> float | None:
    """The optimizer and LR-schedule step once the gradients are reduced; the global mean loss on
    the reporting rank (last stage, dp 0, tp 0). ``replicas_average``: each data-parallel rank's
    ``loss_sum`` is its own mean (FSDP2's scaling), not its share of the global one."""
    cfg = ctx.config
    optim.step()
    sched.step()
    if ctx.pp_rank == cfg.pp - 1:
        if cfg.dp > 1:
            dist.all_reduce(loss_sum, group=ctx.dp_group)
            if replicas_average:
                loss_sum /= cfg.dp
        if ctx.dp_rank == 0 and ctx.tp_rank == 0:
            return float(loss_sum)
    return None


def pipeline_step(
    ctx: etc_agent.ParallelContext,
    args: argparse.Namespace,
    step: int,
    forward: Callable[[torch.Tensor], torch.Tensor],
    micro: int,
    seq: int,
    loss_scale: float,
    local: torch.Tensor | None = None,
) -> torch.Tensor:
    """Forward and backward of this data-parallel rank's share of the global batch, ``micro``
    sequences at a time through the pipeline: a stage receives its input activations from the
    previous one and sends them on, the last computes the loss (times ``loss_scale``), gradients of
    the activations go back the same way (``seq`` positions each; fewer than ``--seq`` where a stage
    hands on its rank's part of the sequence). ``local``: this rank's share of the global batch from
    the dataset (None: the synthetic sequences). Returns the summed scaled loss (zero off the last stage)."""
    cfg = ctx.config
    share = replica_share(args, cfg, ctx.dp_rank)
    first, last = ctx.pp_rank == 0, ctx.pp_rank == cfg.pp - 1
    shape = (micro, seq, args.hidden)
    loss_sum = torch.zeros(())
    for mb in range(share.count // micro):
        lo = share.start + mb * micro
        if local is not None:
            data = local[mb * micro : (mb + 1) * micro]
        else:
            data = torch.stack([batch(args, step, i) for i in range(lo, lo + micro)])
        inputs, targets = data[:, :-1], data[:, 1:]
        if first:
            x = inputs
        else:
            x = torch.empty(shape)
            dist.recv(x, src=ctx.pp_peer(ctx.pp_rank - 1))
            x.requires_grad_(True)
        out = forward(x)
        if last:
            loss = F.cross_entropy(out.reshape(-1, args.vocab), targets.reshape(-1)) * loss_scale
            loss.backward()
            loss_sum += loss.detach()
        else:
            dist.send(out.detach(), dst=ctx.pp_peer(ctx.pp_rank + 1))
            grad = torch.empty(shape)
            dist.recv(grad, src=ctx.pp_peer(ctx.pp_rank + 1))
            out.backward(grad)
        if not first:
            assert x.grad is not None  # a later stage's input requires its gradient
            dist.send(x.grad, dst=ctx.pp_peer(ctx.pp_rank - 1))
    return loss_sum


def reduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Sum the gradients over the data-parallel group in one all-reduce of a flat buffer (one
    collective per parameter costs a round trip each: most of a step on a busy CPU)."""
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
        grads.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def elementwise_step(job: etc_agent.Job) -> None:
    """A layout-independent update: every gradient element is a function of its parameter element."""
    model, optim, sched = job.state["model"], job.state["optim"], job.state["sched"]
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        g = torch.sin(local.detach() * 3.0 + 0.5) * 0.01
        p.grad = (
            DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
            if isinstance(p, DTensor)
            else g
        )
    optim.step()
    sched.step()


# ---- main ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument(
        "--stop-at", type=int, default=None, help="Stop before this step (the LR schedule still spans --steps)."
    )
    ap.add_argument("--global-batch", type=int, default=12, help="Sequences per step, whatever dp is.")
    ap.add_argument("--micro-batch", type=int, default=2, help="Sequences per pipeline micro-batch (pp > 1).")
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", default="tp=1,pp=1,dp=auto", help="Layout when etcrun --parallel does not give one.")
    ap.add_argument(
        "--optimizer",
        choices=("sharded", "torch"),
        default="sharded",
        help="sharded: this file's AdamW (ZeRO-1 capable); torch: torch.optim.AdamW (zero=0 only).",
    )
    ap.add_argument("--elementwise", action="store_true", help="Layout-independent update (for bitwise state checks).")
    ap.add_argument("--step-delay", type=float, default=0.0, help="Seconds to sleep per step (to watch a run).")
    ap.add_argument(
        "--slow-while",
        default=None,
        metavar="FILE",
        help="While FILE exists, the steps from the number it holds on sleep --slow-step-delay instead (a "
        "test keeps the run from ending before a membership event has taken effect, however long a "
        "busy machine takes).",
    )
    ap.add_argument("--slow-step-delay", type=float, default=4.0)
    ap.add_argument("--loss-log", default=None, help="Append {step, loss, ...} JSON lines here.")
    add_data_args(ap)
    ap.add_argument("--dump-state", default=None, help="At the end, save the full unsharded state here (torch.save).")
    return ap.parse_args(argv)


def add_data_args(ap: argparse.ArgumentParser) -> None:
    """``--data``, ``--data-workers``, ``--sample-log`` (every example takes them)."""
    ap.add_argument(
        "--data",
        default="pydoc",
        metavar="PATH|pydoc|synthetic",
        help="The token dataset to train on with exactly-once sampling: a directory scripts/prepare_data.py "
        "wrote, or pydoc (the default: the Python documentation, tokenized once per machine under "
        "$ETC_DATA_DIR or ~/.cache/etc_agent); synthetic: sequences made from the step number, no dataset.",
    )
    ap.add_argument("--data-workers", type=int, default=2, help="Loader worker processes per rank (with a dataset).")
    ap.add_argument(
        "--sample-log",
        default=None,
        metavar="FILE",
        help='With a dataset: one JSON line per step and data-parallel rank, {"step", "generation", "dp_rank", '
        '"samples"} (the global sample indices it trained on).',
    )


def open_dataset(args: argparse.Namespace) -> TokenDataset | None:
    """``--data``'s dataset (None: synthetic), checked before any state is built; the model's
    vocabulary becomes its."""
    if args.data == "synthetic":
        return None
    path = default_dataset() if args.data == "pydoc" else args.data
    dataset = TokenDataset(path, seq_len=args.seq)
    args.vocab = dataset.vocab_size
    return dataset


def data_entry(args: argparse.Namespace, dataset: TokenDataset, ctx: etc_agent.ParallelContext) -> ElasticData:
    """The app state's ``data``: this data-parallel rank's exactly-once batches; its position
    travels with the state through every switch."""
    return ElasticData(
        dataset, args.global_batch, ctx.config.dp, ctx.dp_rank, seed=args.seed, num_workers=args.data_workers
    )


def pace(args: argparse.Namespace, step: int) -> None:
    time.sleep(args.slow_step_delay if slowed(args.slow_while, step) else args.step_delay)


def slowed(slow_file: str | None, step: int) -> bool:
    """Whether ``--slow-while`` holds this step back."""
    if not slow_file:
        return False
    try:
        with open(slow_file) as f:
            return step >= int(f.read().strip() or 0)
    except (FileNotFoundError, ValueError):
        return False  # absent, or caught mid-write: the next step reads it again


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.global_batch % args.micro_batch:
        raise ValueError("--global-batch must be a multiple of --micro-batch")
    dataset = open_dataset(args)
    # The elementwise update reduces nothing across ranks: without the commit barrier a peer's death
    # would surface only at the next vote, after steps trained without the dead rank's share.
    job = etc_agent.init(parallel=args.parallel, commit_barrier=True if args.elementwise else None)
    job.start(make_build(args, dataset), build_ahead=True)
    for step in job.steps(args.steps if args.stop_at is None else min(args.stop_at, args.steps)):
        replica_share(args, job.ctx.config, job.ctx.dp_rank)  # a layout that cannot share the batch: one line
        started = time.perf_counter()
        if args.elementwise:
            elementwise_step(job)
            loss = 0.0 if job.ctx.rank == 0 else None  # progress marker; the check is on the final state
        else:
            loss = train_step(job, args, step)
        log_samples(job, args, step)  # the samples of this step's position (the elementwise update reads none)
        if loss is not None:
            report_step(job, args, step, loss, started)
        pace(args, step)
    finish(job, args)


def log_samples(job: etc_agent.Job, args: argparse.Namespace, step: int) -> None:
    """``--sample-log``: the samples this data-parallel rank trained on at ``step`` (one line per
    replica: its first tensor- and pipeline-parallel rank writes it)."""
    data = job.state.get("data")
    ctx = job.ctx
    if not args.sample_log or data is None or ctx.tp_rank != 0 or ctx.pp_rank != 0:
        return
    line = {"step": step, "generation": ctx.generation, "dp_rank": ctx.dp_rank, "samples": data.samples(step)}
    with open(args.sample_log, "a") as f:
        f.write(json.dumps(line) + "\n")


def report_step(job: etc_agent.Job, args: argparse.Namespace, step: int, loss: float, started: float) -> None:
    """One JSON line per step on stdout (and ``--loss-log``): what the tests and benchmarks read."""
    record = {
        "step": step,
        "loss": loss,
        "config": job.ctx.config.short(),
        "generation": job.ctx.generation,
        "node": job.node_id,
        "step_s": round(time.perf_counter() - started, 4),
        "wall": round(time.time(), 4),
    }
    print(json.dumps(record), flush=True)
    if args.loss_log:
        with open(args.loss_log, "a") as f:
            f.write(json.dumps(record) + "\n")


def finish(job: etc_agent.Job, args: argparse.Namespace) -> None:
    """``--dump-state`` (the full unsharded state, on rank 0), then the job's end."""
    full = job.gather_state()
    if full is not None and args.dump_state:
        torch.save(full, args.dump_state)
        print(f"saved the full state ({len(full)} tensors) to {args.dump_state}", file=sys.stderr, flush=True)
    job.finish()


if __name__ == "__main__":
    main()
