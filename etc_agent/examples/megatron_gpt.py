"""A Megatron-core GPT trained through the worker API: its model and distributed optimizer migrate
between (tp, pp, dp) layouts when devices come and go.

The whole integration is the ``build`` function: it rebuilds Megatron's ``parallel_state`` for the
layout it is given and returns the model chunks and the Megatron optimizer in the app state;
``etc_agent`` describes them through their ``sharded_state_dict`` and the optimizer's ranges.

The global batch stays fixed when dp changes (``global_batch / (dp * micro_batch)`` micro-batches per
replica through Megatron's pipeline schedule); the data is a token dataset read exactly once through
every change (``--data``, as in :mod:`etc_agent.examples.gpt`).

Run with ``etcrun --parallel tp=2,pp=1,dp=auto ... -m etc_agent.examples.megatron_gpt`` (a world of 1:
``python -m etc_agent.examples.megatron_gpt``). Without CUDA it runs Megatron on the CPU
(:mod:`etc_agent.integrations.megatron_cpu`, local layer specs); with CUDA it uses NCCL and, when
Transformer Engine is installed, Megatron's Transformer Engine layer specs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import etc_agent
from etc_agent.data import TokenDataset
from etc_agent.examples.gpt import add_data_args, data_entry, log_samples, open_dataset, slowed
from etc_agent.integrations import megatron as etc_megatron


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--query-groups", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--bf16", action="store_true", help="bf16 parameters, fp32 main parameters in the optimizer")
    parser.add_argument(
        "--no-distributed-optimizer",
        dest="distributed_optimizer",
        action="store_false",
        help="replicate the optimizer state across dp instead of sharding it",
    )
    parser.add_argument(
        "--parallel", default=None, help="default parallel spec when etcrun gives none (tp=1,pp=1,dp=auto)"
    )
    parser.add_argument(
        "--step-delay", type=float, default=0.0, help="seconds to sleep per step (tests pace membership events)"
    )
    parser.add_argument(
        "--slow-while",
        default=None,
        metavar="FILE",
        help="while FILE exists, the steps from the number it holds on sleep --slow-step-delay instead "
        "(a test keeps the run from ending before a membership event has taken effect)",
    )
    parser.add_argument("--slow-step-delay", type=float, default=4.0)
    parser.add_argument(
        "--loss-log", default=None, help="rank 0 appends {step, loss, layout, generation} JSON lines here"
    )
    add_data_args(parser)
    parser.add_argument(
        "--dump-state", default=None, help="rank 0 saves the whole state, unsharded, here after the last step"
    )
    parser.add_argument(
        "--digest-log",
        default=None,
        help="rank 0 appends a digest of the whole state before and after every step here (JSON lines): "
        "a migration between two steps must not change it",
    )
    return parser.parse_args(argv)


def make_build(args: argparse.Namespace, dataset: TokenDataset | None = None):
    def build(ctx) -> dict:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.models.gpt import GPTModel
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        etc_megatron.initialize_model_parallel(ctx, seed=args.seed)
        on_cpu = ctx.device.type == "cpu"
        config = transformer_config(args, ctx)
        model = GPTModel(
            config,
            _layer_spec(on_cpu),
            vocab_size=args.vocab,
            max_sequence_length=args.seq,
            pre_process=ctx.pp_rank == 0,
            post_process=ctx.pp_rank == ctx.pp - 1,
            share_embeddings_and_output_weights=False,
        )
        config.finalize_model_grads_func = finalize_model_grads  # dp gradient reduction after the schedule
        if not on_cpu:
            model.cuda(ctx.device)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=args.distributed_optimizer, grad_reduce_in_fp32=True
        )
        chunks = [DistributedDataParallel(config, ddp_config, model)]
        if not ctx.restoring:
            init_weights(chunks, args.seed)  # before the optimizer copies them into its main parameters
        optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=args.lr,
                weight_decay=0.01,
                bf16=args.bf16,
                use_distributed_optimizer=args.distributed_optimizer,
            ),
            chunks,
        )
        state: dict[str, object] = {"model": chunks, "optimizer": optimizer}
        if dataset is not None:
            state["data"] = data_entry(args, dataset, ctx)
        return state

    return build


def transformer_config(args: argparse.Namespace, ctx):
    """The model's shape and this layout's degrees as Megatron's ``TransformerConfig``."""
    from megatron.core.transformer import TransformerConfig

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    return TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        num_query_groups=args.query_groups,
        ffn_hidden_size=args.ffn,
        gated_linear_unit=True,
        add_bias_linear=False,
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=ctx.tp,
        pipeline_model_parallel_size=ctx.pp,
        pipeline_dtype=dtype,
        params_dtype=dtype,
        bf16=args.bf16,
        use_cpu_initialization=ctx.device.type == "cpu",
        perform_initialization=not ctx.restoring,
    )


def _layer_spec(on_cpu: bool):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if not on_cpu:
        try:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec()
        except Exception:  # noqa: BLE001 - Transformer Engine missing: the local spec runs everywhere
            pass
    return get_gpt_layer_local_spec(normalization="RMSNorm")


def init_weights(chunks: list, seed: int) -> None:
    """Initialise every parameter from its global tensor, so a run starts from the same weights in any layout.

    Megatron's own initialisation draws each rank's shards from the RNG in build order, which
    depends on pp; here each tensor is drawn whole from a generator seeded by its key, then sliced.
    """
    import zlib

    tensors, _ = etc_megatron.model_tensors(chunks)
    with torch.no_grad():
        for key, box in tensors.items():
            if "norm" in key:  # RMSNorm scales
                full = torch.ones(box.global_shape)
            else:
                gen = torch.Generator().manual_seed(seed * 7919 + zlib.crc32(key.encode()))
                full = torch.randn(box.global_shape, generator=gen) * 0.02
            assert box.lengths is not None  # BoxedTensor fills it in
            region = full[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]
            box.tensor.copy_(region.to(box.tensor.dtype))


def batch(args: argparse.Namespace, step: int, first_sample: int, num_samples: int) -> torch.Tensor:
    """Tokens ``[num_samples, seq + 1]`` of samples ``first_sample..`` of the global batch of ``step``."""
    rows = []
    for sample in range(first_sample, first_sample + num_samples):
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 10_007 + sample)
        rows.append(torch.randint(0, args.vocab, (args.seq + 1,), generator=gen))
    return torch.stack(rows)


def train_step(args: argparse.Namespace, job, step: int) -> float | None:
    """One optimizer step on the global batch of ``step``; the mean loss on the last stage's rank 0 of dp."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ctx, state = job.ctx, job.state
    chunks, optimizer = state["model"], state["optimizer"]
    per_replica = args.global_batch // ctx.dp
    num_micro = per_replica // args.micro_batch
    data = state.get("data")
    local = data.batch(step) if data is not None else batch(args, step, ctx.dp_rank * per_replica, per_replica)
    tokens = local.to(ctx.device)
    micro = iter(tokens.split(args.micro_batch))
    positions = torch.arange(args.seq, device=ctx.device).unsqueeze(0).expand(args.micro_batch, -1)

    def loss_func(output: torch.Tensor):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides loss in place

    def forward_step(data_iterator, model):
        sample = next(data_iterator)
        output = model(sample[:, :-1], positions, None, labels=sample[:, 1:])
        return output, loss_func

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=micro,
        model=chunks,
        num_microbatches=num_micro,
        seq_length=args.seq,
        micro_batch_size=args.micro_batch,
        forward_only=False,
    )
    optimizer.step()
    if ctx.pp_rank != ctx.pp - 1:
        return None
    mean = torch.stack([entry["lm loss"] for entry in losses]).mean().reshape(1)
    dist.all_reduce(mean, group=parallel_state.get_data_parallel_group())
    return float(mean.item() / ctx.dp)


def state_digest(full: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor of a whole (unsharded) state, in key order."""
    digest = hashlib.sha256()
    for key in sorted(full):
        digest.update(key.encode())
        digest.update(full[key].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:24]


def _append(path: str | None, record: dict) -> None:
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")


def _log_digest(args: argparse.Namespace, job, step: int, when: str) -> None:
    full = job.gather_state()  # every rank takes part
    if full is not None:
        _append(
            args.digest_log,
            {"step": step, "when": when, "digest": state_digest(full), "layout": job.ctx.config.short()},
        )


def compare_digests(path: str | os.PathLike) -> tuple[list[tuple[str, str]], list[str]]:
    """Read a ``--digest-log``: ``(layout changes seen between two steps, mismatches)``. A change is
    ``(layout the step before ended in, layout the step began in)``, in log order; steps trained
    again after a restore from a checkpoint count again. A mismatch is a step whose state on entry
    differs from the state the step before left (it names both layouts)."""
    after: dict[int, dict] = {}
    crossings: list[tuple[str, str]] = []
    mismatches: list[str] = []
    for line in Path(path).read_text().splitlines():
        record = json.loads(line)
        if record["when"] == "after":
            after[record["step"]] = record
        elif record["step"] - 1 in after:
            before = after[record["step"] - 1]
            if before["layout"] != record["layout"]:
                crossings.append((before["layout"], record["layout"]))
            if before["digest"] != record["digest"]:
                mismatches.append(
                    f"step {record['step']}: state differs from the end of the step before "
                    f"({before['layout']} -> {record['layout']})"
                )
    return crossings, mismatches


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        from etc_agent.integrations import megatron_cpu

        megatron_cpu.enable()
    dataset = open_dataset(args)
    job = etc_agent.init(parallel=args.parallel or "tp=1,pp=1,dp=auto")
    job.start(make_build(args, dataset))
    for step in job.steps(args.steps):
        ctx = job.ctx
        if args.digest_log:
            _log_digest(args, job, step, "before")
        loss = train_step(args, job, step)
        log_samples(job, args, step)
        value = torch.tensor([loss if loss is not None else 0.0], dtype=torch.float64)
        dist.broadcast(value, src=ctx.config.rank(ctx.pp - 1, 0, 0))
        record = {"step": step, "loss": float(value.item()), "layout": ctx.config.short(), "generation": ctx.generation}
        if ctx.rank == 0:
            print(f"step {step} loss {record['loss']:.6f} layout {record['layout']}", flush=True)
            _append(args.loss_log, record)
        if args.digest_log:
            _log_digest(args, job, step, "after")
        time.sleep(args.slow_step_delay if slowed(args.slow_while, step) else args.step_delay)
    full = job.gather_state()
    if full is not None and args.dump_state:
        torch.save(full, args.dump_state)
    job.finish()


if __name__ == "__main__":
    main()
