"""Megatron-core state through the adapter and the executor, on CPU with gloo.

The models are Megatron's own ``GPTModel`` (local layer specs: column/row-parallel linears, a
vocab-parallel embedding and output layer, RMSNorm, SwiGLU ``linear_fc1`` through its sharded
factory, grouped-query attention) wrapped in Megatron's DDP with the distributed optimizer, built
the way a Megatron training script builds them, in several (tp, pp, dp).
"""

from __future__ import annotations

import zlib
from math import prod
from types import SimpleNamespace

import pytest

pytest.importorskip("megatron.core")

import torch
from dist_harness import run_workers

from etc_agent.examples import megatron_gpt
from etc_agent.layout import Device
from etc_agent.layout.config import ParallelConfig

ARGS = [
    "--layers",
    "4",
    "--hidden",
    "32",
    "--heads",
    "4",
    "--query-groups",
    "2",
    "--ffn",
    "64",
    "--vocab",
    "128",
    "--seq",
    "8",
    "--global-batch",
    "4",
]


def _context(parallel: str, rank: int, restoring: bool = False) -> SimpleNamespace:
    config = ParallelConfig.parse(parallel)
    coord = config.coord(rank)
    return SimpleNamespace(
        config=config,
        rank=rank,
        world_size=config.world_size,
        tp=config.tp,
        pp=config.pp,
        dp=config.dp,
        tp_rank=coord.tp,
        pp_rank=coord.pp,
        dp_rank=coord.dp,
        device=torch.device("cpu"),
        restoring=restoring,
    )


def _build(parallel: str, rank: int, extra: list[str] = (), restoring: bool = False) -> dict:
    from etc_agent.integrations import megatron, megatron_cpu

    megatron_cpu.enable()
    args = megatron_gpt.parse_args(ARGS + list(extra))
    app = megatron_gpt.make_build(args)(_context(parallel, rank, restoring))
    megatron.materialize_optimizer_state(app["optimizer"], zero=True)
    return app


def _boxes(tensors: dict) -> dict:
    return {
        key: (tuple(b.global_shape), tuple(b.offsets), tuple(b.lengths), b.flat_range, str(b.tensor.dtype))
        for key, b in tensors.items()
    }


def test_layer_numbers_go_into_the_key_and_swiglu_boxes_fold_into_one():
    """Pure geometry on real ShardedTensors (no process group): the prepended layer axis becomes part
    of the key, and SwiGLU's two boxes per rank ([gate; up] halves of [2*ffn, h]) one [2, ffn, h] box
    whose tensor is a view of the parameter."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from etc_agent.integrations.megatron import _fold, _unprepend

    weight = torch.zeros(16, 8)
    sh = ShardedTensor.from_rank_offsets(
        "decoder.layers.mlp.linear_fc2.weight", weight, (0, 5, 7), (2, 1, 2), prepend_axis_num=1
    )
    key, (global_shape, offsets, lengths, data) = _unprepend(sh)
    assert key == "decoder.layers.mlp.linear_fc2.weight[5]"
    assert (global_shape, offsets, lengths) == ((16, 16), (0, 8), (16, 8)) and data is weight

    # tp=2, rank 1, ffn=8 (4 per rank): local [gate(4); up(4)] = 8 rows of global [gate(8); up(8)].
    fc1 = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    gate, up = torch.chunk(fc1, 2)
    boxes = [
        _unprepend(ShardedTensor.from_rank_offsets("fc1", part, (0, index, 4))) for part, index in ((gate, 1), (up, 3))
    ]
    key, (global_shape, offsets, lengths, data) = _fold("fc1", fc1, boxes)
    assert (key, global_shape, offsets, lengths) == ("fc1", (2, 8, 3), (0, 4, 0), (2, 4, 3))
    assert data is fc1

    # Boxes that do not cut one axis into equal parts are refused with the key named.
    uneven = [boxes[0], _unprepend(ShardedTensor.from_rank_offsets("fc1", up, (0, 2, 4)))]
    with pytest.raises(ValueError, match="fc1: boxes along axis 0"):
        _fold("fc1", fc1, uneven)
    other_key = [boxes[0], _unprepend(ShardedTensor.from_rank_offsets("fc2", up, (0, 3, 4)))]
    with pytest.raises(ValueError, match="several keys"):
        _fold("fc1", fc1, other_key)


def test_megatron_parallel_state_takes_tp_and_pp_from_the_job_only():
    from etc_agent.integrations.megatron import initialize_model_parallel

    ctx = _context("tp=2,pp=1,dp=1", 0)
    with pytest.raises(ValueError, match="tensor_model_parallel_size comes from the job's parallel configuration"):
        initialize_model_parallel(ctx, tensor_model_parallel_size=4)
    with pytest.raises(ValueError, match="context_parallel_size=2: etc_agent lays out tp, pp and dp only"):
        initialize_model_parallel(ctx, context_parallel_size=2)


def _describe_worker(rank: int, world: int, layouts: list[str], variants: dict[str, list[str]]) -> dict:
    from etc_agent.integrations.megatron import destroy_model_parallel
    from etc_agent.worker.appstate import split_state

    out: dict[str, dict] = {}
    for variant, extra in variants.items():
        for parallel in layouts:
            app = _build(parallel, rank, extra)
            tensors, plain = split_state(app)
            out.setdefault(variant, {})[parallel] = _boxes(tensors)
            destroy_model_parallel()
    return out


LAYOUTS = ["tp=4,pp=1,dp=1", "tp=2,pp=2,dp=1", "tp=1,pp=2,dp=2", "tp=2,pp=1,dp=2", "tp=1,pp=1,dp=4"]
VARIANTS = {"distributed-optimizer": [], "plain-optimizer": ["--no-distributed-optimizer"]}


@pytest.fixture(scope="module")
def described() -> dict[str, list[dict]]:
    """Each variant's boxes per rank and layout (one set of 4 processes builds them all)."""
    per_rank = run_workers(4, _describe_worker, LAYOUTS, VARIANTS, timeout_s=300)
    return {variant: [per_rank[rank][variant] for rank in range(4)] for variant in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_adapter_describes_megatron_gpt_the_same_way_in_every_layout(described, variant):
    """Every layout of 4 ranks names the same keys with the same global shapes, and each layout's
    boxes (and flat ranges of them) cover every element of every tensor."""
    layouts, extra = LAYOUTS, VARIANTS[variant]
    per_rank = described[variant]
    shapes_by_layout = {}
    for parallel in layouts:
        shapes: dict[str, tuple] = {}
        covered: dict[str, torch.Tensor] = {}
        for rank in range(4):
            for key, (global_shape, offsets, lengths, flat, _dtype) in per_rank[rank][parallel].items():
                assert shapes.setdefault(key, global_shape) == global_shape, (parallel, key)
                mask = covered.setdefault(key, torch.zeros(global_shape, dtype=torch.bool))
                region = mask[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
                if flat is None:
                    region.fill_(True)
                else:
                    marks = torch.zeros(prod(lengths), dtype=torch.bool)
                    marks[flat[0] : flat[1]] = True
                    region |= marks.view(lengths)
        for key, mask in covered.items():
            assert bool(mask.all()), f"{parallel}: {key} has elements no rank holds"
        shapes_by_layout[parallel] = shapes
    reference = shapes_by_layout[layouts[0]]
    for parallel, shapes in shapes_by_layout.items():
        assert shapes == reference, f"{parallel} names other tensors than {layouts[0]}"
    keys = set(reference)
    # Layer numbers are in the keys; SwiGLU's fc1 is folded to [2, ffn, hidden]; GQA qkv is one tensor.
    assert "model.module.decoder.layers.mlp.linear_fc1.weight[3]" in keys
    assert reference["model.module.decoder.layers.mlp.linear_fc1.weight[3]"] == (2, 64, 32)
    assert reference["model.module.decoder.layers.self_attention.linear_qkv.weight[0]"] == ((4 + 2 * 2) * 8, 32)
    assert reference["model.module.embedding.word_embeddings.weight"] == (128, 32)
    assert reference["model.module.output_layer.weight"] == (128, 32)
    assert "optimizer.exp_avg_sq.model.module.decoder.layers.mlp.linear_fc2.weight[2]" in keys
    if extra:  # the plain optimizer: whole boxes, replicated over dp
        assert all(flat is None for rank in range(4) for *_, flat, _ in per_rank[rank]["tp=1,pp=1,dp=4"].values())
    else:  # the distributed optimizer: flat ranges split over dp
        ranged = [k for k, (*_, flat, _) in per_rank[0]["tp=1,pp=1,dp=4"].items() if flat is not None]
        assert ranged and all(k.startswith("optimizer.") for k in ranged)


def _value(key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Every element distinct within a key (its global flat index), keys told apart by a salt; exact in fp32."""
    salt = (zlib.crc32(key.encode()) % 200) * 65536
    assert prod(shape) < 65536
    return (torch.arange(prod(shape), dtype=torch.float64) + salt).view(shape)


def _fill(tensors: dict) -> None:
    for key, box in tensors.items():
        full = _value(key, box.global_shape)[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]
        if box.flat_range is not None:
            full = full.reshape(-1)[box.flat_range[0] : box.flat_range[1]]
        box.tensor.copy_(full.reshape(box.tensor.shape).to(box.tensor.dtype))


def _mismatches(tensors: dict) -> list[str]:
    bad = []
    for key, box in tensors.items():
        expected = _value(key, box.global_shape)[tuple(slice(o, o + n) for o, n in zip(box.offsets, box.lengths))]
        if box.flat_range is not None:
            expected = expected.reshape(-1)[box.flat_range[0] : box.flat_range[1]]
        if not torch.equal(box.tensor.reshape(-1).double(), expected.reshape(-1).to(box.tensor.dtype).double()):
            bad.append(key)
    return bad


def _migrate_case(rank: int, old: str, new: str, extra: list[str]) -> dict:
    from etc_agent.integrations.megatron import destroy_model_parallel
    from etc_agent.migrate import migrate_state
    from etc_agent.migrate.transport import TorchTransport
    from etc_agent.worker.appstate import load_state, split_state

    old_app = _build(old, rank, extra)
    old_tensors, old_plain = split_state(old_app)
    with torch.no_grad():
        _fill(old_tensors)
    for opt in old_app["optimizer"].chained_optimizers:
        for state in opt.optimizer.state.values():
            state["step"].fill_(7)
    old_tensors, old_plain = split_state(old_app)  # the step count is plain
    destroy_model_parallel()

    new_app = _build(new, rank, extra, restoring=True)
    new_tensors, _ = split_state(new_app)
    result = migrate_state(
        old_tensors,
        new_tensors,
        device=Device(f"n{rank // 2}", rank % 2),
        old_rank=rank,
        new_rank=rank,
        transport=TorchTransport(),
        tp=ParallelConfig.parse(new).tp,
    )
    load_state(new_app, old_plain, new_tensors)
    bad = _mismatches(new_tensors)
    # The boxes alias the live model: a parameter read through the module has the migrated values.
    module = new_app["model"][0].module
    ctx = _context(new, rank)
    proj = module.decoder.layers[0].self_attention.linear_proj.weight
    layer = module.decoder.layers[0].layer_number - 1
    cols = proj.shape[1]
    expected_proj = _value(f"model.module.decoder.layers.self_attention.linear_proj.weight[{layer}]", (32, 32))[
        :, ctx.tp_rank * cols : (ctx.tp_rank + 1) * cols
    ]
    proj_migrated = bool(torch.equal(proj.detach().double(), expected_proj))
    steps = {float(s["step"]) for opt in new_app["optimizer"].chained_optimizers for s in opt.optimizer.state.values()}
    # And the model trains on: one full Megatron step (pipeline schedule, optimizer) in the new layout.
    loss = megatron_gpt.train_step(
        megatron_gpt.parse_args(ARGS + list(extra)), SimpleNamespace(ctx=ctx, state=new_app), 0
    )
    destroy_model_parallel()
    return {
        "bad": bad,
        "keys": len(new_tensors),
        "proj": proj_migrated,
        "steps": sorted(steps),
        "moved": result.plan.bytes_moved,
        "loss": loss,
    }


def _migrate_worker(rank: int, world: int, cases: list[tuple[str, str, list[str]]]) -> list[dict]:
    return [_migrate_case(rank, old, new, extra) for old, new, extra in cases]


MIGRATIONS = [
    ("tp=2,pp=2,dp=1", "tp=1,pp=2,dp=2", []),
    ("tp=1,pp=1,dp=4", "tp=4,pp=1,dp=1", []),
    ("tp=2,pp=1,dp=2", "tp=1,pp=2,dp=2", ["--no-distributed-optimizer"]),
]


def test_megatron_state_migrates_bitwise_through_the_executor():
    """tp2,pp2 -> pp2,dp2 and dp4 -> tp4 with the distributed optimizer, tp2,dp2 -> pp2,dp2 with the plain one."""
    per_rank = run_workers(4, _migrate_worker, MIGRATIONS, timeout_s=300)
    for case, (old, new, extra) in enumerate(MIGRATIONS):
        label = f"{old} -> {new} {' '.join(extra)}"
        results = [per_rank[rank][case] for rank in range(4)]
        for rank, r in enumerate(results):
            assert r["bad"] == [], (
                f"{label}, rank {rank}: {len(r['bad'])} of {r['keys']} tensors differ, e.g. {r['bad'][:3]}"
            )
            assert r["proj"], f"{label}, rank {rank}: the module's linear_proj does not hold the migrated values"
            assert r["steps"] == [7.0], f"{label}, rank {rank}: optimizer steps after migration {r['steps']}"
        assert results[0]["moved"] > 0, label
        assert any(r["loss"] is not None for r in results), label  # the last stage computed a loss


def test_megatron_gpt_trains_through_join_leave_reconfigure_and_crash_under_etcrun_on_data_once(etcd_server, tmp_path):
    """Megatron's GPTModel, DDP and distributed optimizer under ``etcrun`` over a real etcd, 2 agents x 2
    workers, on real tokens: a node joins (dp 2 -> 3), leaves (3 -> 2), the job is reconfigured on the
    same devices (tp=2,pp=1 -> tp=1,pp=2) and a worker is SIGKILLed (its distributed-optimizer range
    has no live copy: read from the periodic checkpoint, the steps since trained again, on the same
    samples: the position comes back with the checkpoint). Across every event the whole state before
    a step is bitwise the state after the previous one, every step's samples are the global order's,
    and the losses match an uninterrupted single-process run."""
    import sys

    from conftest import LEAVE_SPREAD_S, ROOT, etcd_rdzv

    sys.path.insert(0, str(ROOT / "scripts"))
    from elastic_demo import reference_losses, run_scenario

    module = "etc_agent.examples.megatron_gpt"
    steps = 48
    work = tmp_path / "elastic"
    work.mkdir()
    digests = work / "digests.jsonl"
    from test_data_elastic import check_samples, prepare_pydoc

    from etc_agent.data import TokenDataset

    dataset = prepare_pydoc(tmp_path / "pydoc", 16)
    sample_log = work / "samples.jsonl"
    data = ["--data", str(dataset), "--seq", "16"]
    script = ["--global-batch", "12", "--micro-batch", "2", "--digest-log", str(digests), *data]
    script += ["--sample-log", str(sample_log)]
    rdzv = etcd_rdzv(etcd_server, "megatron")
    events = ("join", "leave", "reconfigure:tp=1,pp=2,dp=auto", "kill")
    result = run_scenario(
        "tp=2,pp=1,dp=auto",
        2,
        steps,
        0.2,
        work,
        echo=False,
        rdzv=rdzv,
        events=events,
        extra_script_args=script,
        agent_args=["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-interval", "3"],
        module=module,
        event_steps=[3, 10, 17, 24],
        gap_before={"kill": 7},
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0] * len(result["codes"]), f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs

    records = sorted(result["migrations"], key=lambda m: m["generation"])
    layouts = [(r["old_config"], r["new_config"]) for r in records]
    assert layouts == [
        ("tp=2,pp=1,dp=2,zero=0", "tp=2,pp=1,dp=3,zero=0"),
        ("tp=2,pp=1,dp=3,zero=0", "tp=2,pp=1,dp=2,zero=0"),
        ("tp=2,pp=1,dp=2,zero=0", "tp=1,pp=2,dp=2,zero=0"),
        ("tp=1,pp=2,dp=2,zero=0", "tp=1,pp=2,dp=2,zero=0"),
    ], logs
    assert all(r["bytes_moved"] > 0 and r["bytes_restored"] == 0 for r in records[:3])
    crash = records[3]
    # Only the killed worker's optimizer range (and no parameter: each stage has a dp replica) is read.
    assert 0 < crash["bytes_restored"] < crash["state_bytes"] / 2, crash
    assert crash["restored_from"], crash
    assert crash["leave_spread_s"] is not None and crash["leave_spread_s"] <= LEAVE_SPREAD_S, (
        crash
    )  # every survivor left at once

    # Lossless: the state entering each step equals the state the previous step left, in any layout.
    crossings, mismatches = megatron_gpt.compare_digests(digests)
    assert mismatches == [], mismatches
    # Each layout change was crossed between two logged steps. A restore from a periodic checkpoint
    # taken before the reconfigure trains those steps again in the new layout: one more crossing
    # (still checked above), depending on where the kill lands.
    changes = [
        ("tp=2,pp=1,dp=2,zero=0", "tp=2,pp=1,dp=3,zero=0"),
        ("tp=2,pp=1,dp=3,zero=0", "tp=2,pp=1,dp=2,zero=0"),
        ("tp=2,pp=1,dp=2,zero=0", "tp=1,pp=2,dp=2,zero=0"),
    ]
    assert list(dict.fromkeys(crossings)) == changes and len(crossings) <= len(changes) + 1, crossings

    check_samples(sample_log, len(TokenDataset(dataset, seq_len=16)), 12, steps, logs, seed=1234)  # the example's

    reference, _ = reference_losses(steps, work, ["--global-batch", "12", "--micro-batch", "2", *data], module=module)
    worst = max(abs(result["losses"][s] - reference[s]) / abs(reference[s]) for s in range(steps))
    assert worst < 1e-5, f"worst relative loss difference {worst:.2e} against the uninterrupted run"


def test_megatron_gpt_survives_a_hung_worker_and_a_whole_node_killed_under_etcrun(etcd_server, tmp_path):
    """Megatron's GPTModel, DDP and distributed optimizer under ``etcrun``, 2 agents x 2 workers
    (tp=2, dp=2), ``--nnodes 1:2``: a worker is SIGSTOPped (its agent kills it after the heartbeat
    timeout, the other node goes on alone, the node rejoins once its worker runs again), then a whole
    agent is SIGKILLed (its workers die with it; the job ends on one node). Each lost
    distributed-optimizer range is read from the periodic checkpoint; every survivor leaves its
    collective at once (conftest.LEAVE_SPREAD_S); the state is lossless across every step and the losses match
    an uninterrupted run."""
    import json
    import sys

    from conftest import LEAVE_SPREAD_S, ROOT, etcd_rdzv

    sys.path.insert(0, str(ROOT / "scripts"))
    from elastic_demo import reference_losses, run_scenario

    module = "etc_agent.examples.megatron_gpt"
    steps = 30
    work = tmp_path / "elastic"
    work.mkdir()
    digests = work / "digests.jsonl"
    script = ["--global-batch", "12", "--micro-batch", "2", "--digest-log", str(digests)]
    rdzv = etcd_rdzv(etcd_server, "megatron-crash")
    result = run_scenario(
        "tp=2,pp=1,dp=auto",
        2,
        steps,
        0.2,
        work,
        echo=False,
        rdzv=rdzv,
        events=("hang", "kill-agent"),
        extra_script_args=script,
        agent_args=[
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--checkpoint-interval",
            "3",
            "--worker-heartbeat-timeout",
            "3",
            "--lease-ttl",
            "30",
        ],
        module=module,
        min_nodes=1,
        event_steps=[4, 16],
        gap_before={"kill-agent": 7},
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0, -9], f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    hung = [json.loads(line) for line in result["cluster"].outputs[1] if '"worker_hung"' in line]
    assert len(hung) == 1 and hung[0]["silent_s"] >= 3, logs

    records = sorted(result["migrations"], key=lambda m: m["generation"])
    crashes = [r for r in records if r["lost"]]
    assert [r["new_config"] for r in crashes] == ["tp=2,pp=1,dp=1,zero=0"] * 2, [r["reason"] for r in records]
    for crash in crashes:
        assert crash["restored_from"] and 0 < crash["bytes_restored"] < crash["state_bytes"], crash
        assert crash["leave_spread_s"] is not None and crash["leave_spread_s"] <= LEAVE_SPREAD_S, crash
        assert crash["total_stall_s"] < 15, crash  # the node's 30 s lease was not waited for
    assert any("joined" in r["reason"] and r["new_world_size"] == 4 for r in records), [r["reason"] for r in records]

    _, mismatches = megatron_gpt.compare_digests(digests)
    assert mismatches == [], mismatches
    reference, _ = reference_losses(steps, work, ["--global-batch", "12", "--micro-batch", "2"], module=module)
    worst = max(abs(result["losses"][s] - reference[s]) / abs(reference[s]) for s in range(steps))
    assert worst < 1e-5, f"worst relative loss difference {worst:.2e} against the uninterrupted run"
