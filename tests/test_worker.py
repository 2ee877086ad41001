"""Worker API pieces that run in one process: the --parallel spec, app-state splitting and carrying,
optimizer state creation, and a world-of-1 run of the example through the public API."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT
from torch import nn

from etc_agent.layout.config import ParallelConfig, ParallelSpec
from etc_agent.layout.model import ModelSpec
from etc_agent.migrate.describe import BoxedTensor
from etc_agent.planner.policy import resolve_parallel
from etc_agent.worker.appstate import from_json, load_state, materialize_optimizer_state, split_state, to_json


@pytest.mark.parametrize(
    "text, devices, expected",
    [
        ("tp=2,pp=1,dp=auto", 6, "tp=2,pp=1,dp=3,zero=0"),
        ("tp=2", 4, "tp=2,pp=1,dp=2,zero=0"),
        ("tp=2,pp=2,dp=auto,zero=1", 8, "tp=2,pp=2,dp=2,zero=1"),
        ("tp=2,pp=2,dp=auto,zero=1", 4, "tp=2,pp=2,dp=1,zero=0"),  # zero needs dp > 1
        ("tp=2,pp=2,dp=auto", 6, "tp=2,pp=2,dp=1,zero=0"),  # the most devices that fit
        ("tp=4,pp=1,dp=auto", 2, None),
        ("tp=1,pp=1,dp=2", 4, "tp=1,pp=1,dp=2,zero=0"),
    ],
)
def test_parallel_spec_resolves_dp(text, devices, expected):
    config = ParallelSpec.parse(text).resolve(devices)
    assert (config.short() if config else None) == expected


@pytest.mark.parametrize(
    "text, message",
    [
        ("tp=x", "neither an integer nor auto"),
        ("tq=2", "expected items"),
        ("tp=2,tp=4", "given twice"),
        ("zero=2", "zero"),
    ],
)
def test_parallel_spec_rejects_bad_input(text, message):
    with pytest.raises(ValueError, match=message):
        ParallelSpec.parse(text)


def test_parallel_spec_auto_tp_needs_a_model():
    with pytest.raises(ValueError, match="needs --model"):
        ParallelSpec.parse("auto").resolve(8)
    with pytest.raises(ValueError, match="needs --model"):
        resolve_parallel(ParallelSpec.parse("tp=auto,pp=1"), [8])


@pytest.mark.parametrize(
    "text, nodes",
    [("auto", [8, 8]), ("tp=auto,pp=1,dp=auto", [8, 8]), ("tp=2,pp=auto,dp=auto,zero=1", [4, 4]), ("auto", [8])],
)
def test_policy_resolves_auto_degrees_to_a_config_using_every_device(text, nodes):
    spec = ParallelSpec.parse(text)
    model = ModelSpec.from_yaml(ROOT / "configs" / "models" / "llama-7b.yaml")
    config = resolve_parallel(spec, nodes, model)
    assert config is not None and config.world_size == sum(nodes)
    assert spec.tp is None or config.tp == spec.tp
    assert spec.pp is None or config.pp == spec.pp
    assert config.zero == (spec.zero if config.dp > 1 else 0)
    model.check_parallel(config)
    # Fixed tp/pp: only dp fills, and a world that cannot be filled exactly gives None.
    assert resolve_parallel(ParallelSpec.parse("tp=2,pp=1,dp=auto"), [2, 2, 1]) is None


@pytest.mark.parametrize(
    "text, expect",
    [
        ("tp=auto,dp_shard=auto", {"dp_replicate": 1}),
        ("tp=auto,dp_replicate=2,dp_shard=auto", {"dp_replicate": 2}),
        ("pp=auto,tp=2,dp_shard=4", {"tp": 2, "dp_shard": 4}),
    ],
)
def test_policy_keeps_an_fsdp_spec_fsdp_when_it_fills_auto_degrees(text, expect):
    """An FSDP job's script builds FSDP2 modules: auto tp/pp give FSDP / HSDP layouts with the
    spec's fixed degrees, never Megatron's replicas."""
    model = ModelSpec.from_yaml(ROOT / "configs" / "models" / "llama-7b.yaml")
    config = resolve_parallel(ParallelSpec.parse(text), [8, 8], model)
    assert config is not None and config.world_size == 16 and config.dp_shard > 1, config
    assert {name: getattr(config, name) for name in expect} == expect, config.short()
    model.check_parallel(config)


def test_policy_prices_fsdp_sharding_and_chooses_fsdp_for_an_fsdp_job():
    from etc_agent.layout import DeviceSet
    from etc_agent.planner.policy import PolicyOptions, choose_config, estimate_memory, estimate_step_seconds

    model = ModelSpec.from_yaml(ROOT / "configs" / "models" / "llama-7b.yaml")
    opts = PolicyOptions()
    replicated, sharded = ParallelConfig.parse("tp=1,pp=1,dp=8"), ParallelConfig.parse("dp_shard=8")
    # Parameters, gradients and AdamW split 8 ways (two layers gathered): far under a replica's memory.
    assert estimate_memory(model, sharded, opts) < estimate_memory(model, replicated, opts) / 4
    # A shard group inside a node all-gathers over the fast link.
    assert estimate_step_seconds(model, sharded, opts, devices_per_node=8) < estimate_step_seconds(
        model, sharded, opts, devices_per_node=1
    )
    decision = choose_config(
        model,
        DeviceSet.parse("n0:8,n1:8"),
        opts,
        old_config=ParallelConfig.parse("dp_shard=8"),
        old_devices=DeviceSet.parse("n0:8"),
    )
    assert decision.winner.config.dp_shard > 1, decision.reason
    assert all(c.config.zero == 0 for c in decision.candidates)


@pytest.mark.parametrize(
    "value",
    [1, 2.5, "x", None, True, [1, (2, 3)], {"a": {"b": (1.0, 2.0)}, 3: "int key"}, b"\x00\xffbytes", (0.9, 0.999)],
)
def test_plain_values_round_trip_through_json(value):
    assert from_json(json.loads(json.dumps(to_json(value, "v")))) == value


def test_small_tensors_round_trip_and_large_objects_are_refused():
    rng = torch.get_rng_state()
    back = from_json(json.loads(json.dumps(to_json(rng, "rng"))))
    assert torch.equal(back, rng) and back.dtype == rng.dtype
    with pytest.raises(ValueError, match="thing: a object cannot be carried"):
        to_json(object(), "thing")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.register_buffer("count", torch.zeros(2))


def test_split_state_names_optimizer_state_after_parameters_and_carries_plain_values():
    model = Tiny()
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    materialize_optimizer_state(optim)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 0.5**s)
    boxed = BoxedTensor(torch.arange(4.0), (8,), (4,))
    app = {"model": model, "optim": optim, "sched": sched, "extra": boxed, "epoch": 3}
    tensors, plain = split_state(app)
    assert set(tensors) == {
        "model.a.weight",
        "model.a.bias",
        "model.count",
        "extra",
        *(f"optim.state.model.a.{p}.{k}" for p in ("weight", "bias") for k in ("step", "exp_avg", "exp_avg_sq")),
    }
    assert plain["epoch"] == 3 and plain["optim"]["param_groups"][0]["lr"] == 0.1

    # A second app built the same way receives the plain values (tensors are written in place by the executor).
    sched.step()
    sched.step()
    _, plain = split_state(app)
    plain = json.loads(json.dumps(plain))
    model2 = Tiny()
    optim2 = torch.optim.AdamW(model2.parameters(), lr=0.1, betas=(0.8, 0.9))
    sched2 = torch.optim.lr_scheduler.LambdaLR(optim2, lambda s: 0.5**s)
    app2 = {
        "model": model2,
        "optim": optim2,
        "sched": sched2,
        "extra": BoxedTensor(torch.zeros(4), (8,), (4,)),
        "epoch": 0,
    }
    load_state(app2, plain, split_state(app2)[0])
    assert app2["epoch"] == 3
    assert sched2.last_epoch == 2 and optim2.param_groups[0]["lr"] == pytest.approx(0.025)
    assert optim2.param_groups[0]["betas"] == (0.8, 0.9)


def test_adam_state_is_created_as_its_first_step_would():
    model = Tiny()
    optim = torch.optim.Adam(model.parameters(), lr=0.1, amsgrad=True)
    materialize_optimizer_state(optim)
    for p in model.parameters():
        state = optim.state[p]
        assert float(state["step"]) == 0 and state["exp_avg"].shape == p.shape and not state["max_exp_avg_sq"].any()
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()  # the pre-made state is used as is
    assert all(float(optim.state[p]["step"]) == 1 for p in model.parameters())
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_other_optimizers_get_zeroed_state_without_moving_parameters():
    model = Tiny()
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    materialize_optimizer_state(optim)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(not optim.state[p]["momentum_buffer"].any() for p in model.parameters())


def test_plain_python_runs_the_example_on_the_default_data_as_a_world_of_one(tmp_path):
    """No etcrun, no flags: `python -m etc_agent.examples.gpt` builds the default dataset (the pydoc
    one, under $ETC_DATA_DIR), trains on it as one process, and the loss goes down."""
    log, samples = tmp_path / "loss.jsonl", tmp_path / "samples.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "etc_agent.examples.gpt", "--steps", "12", "--loss-log", str(log)]
        + ["--sample-log", str(samples)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "ETC_DATA_DIR": str(tmp_path / "data")},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "data" / "pydoc-bpe4096" / "meta.json").exists()
    logged = [json.loads(line)["samples"] for line in samples.read_text().splitlines()]
    assert len(logged) == 12 and len({i for step in logged for i in step}) == sum(map(len, logged))
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    assert len(losses) == 12 and losses[-1] < losses[0]
    assert all(json.loads(line)["config"] == "tp=1,pp=1,dp=1,zero=0" for line in log.read_text().splitlines())


def test_resumable_checkpoints_skip_incomplete_and_unusable_ones_and_say_so(tmp_path, capsys):
    from etc_agent.worker.checkpoint import STATE_FILE, resumable_checkpoints

    state = {"step": 0, "config": "tp=1,pp=1,dp=1,zero=0", "world_size": 1, "app": {}, "rng": []}

    import torch.distributed.checkpoint as dcp

    def checkpoint(step: int, generation: int, state_text: str | None, metadata: bool = True) -> Path:
        path = tmp_path / f"step{step:08d}-g{generation}"
        dcp.save({"w": torch.arange(1000.0)}, checkpoint_id=str(path), no_dist=True)
        if not metadata:
            (path / ".metadata").unlink()
        if state_text is not None:
            (path / STATE_FILE).write_text(state_text)
        return path

    checkpoint(4, 0, json.dumps({**state, "step": 4}))
    checkpoint(8, 0, json.dumps({**state, "step": 8}), metadata=False)  # DCP's metadata missing
    checkpoint(12, 1, "{not json")  # corrupt state file
    checkpoint(16, 1, json.dumps({"step": 16}))  # lacks the layout and carried state
    checkpoint(20, 1, None)  # incomplete: never marked complete, skipped silently
    [data] = checkpoint(24, 2, json.dumps({**state, "step": 24})).glob("*.distcp")
    data.write_bytes(data.read_bytes()[:100])  # a data file cut short
    [data] = checkpoint(28, 2, json.dumps({**state, "step": 28})).glob("*.distcp")
    data.unlink()  # a data file lost
    (checkpoint(32, 2, json.dumps({**state, "step": 32})) / ".metadata").write_bytes(b"x")  # unreadable
    assert resumable_checkpoints(tmp_path) == {4: str(tmp_path / "step00000004-g0")}
    err = capsys.readouterr().err
    assert "step00000008-g0 is not usable (DCP's .metadata is missing)" in err
    assert "step00000012-g1 is not usable" in err and "step00000016-g1 is not usable" in err
    assert "lacks config, world_size, app, rng" in err and "step00000020" not in err
    assert f"step00000024-g2 is not usable (its data file {data.name} holds 100 bytes of " in err
    assert f"step00000028-g2 is not usable (its data file {data.name} is missing)" in err
    assert "step00000032-g2 is not usable (DCP's .metadata does not load" in err
    assert resumable_checkpoints(tmp_path / "absent") == {}


def test_the_mesh_groups_are_created_and_bounded_with_the_job_timeout(monkeypatch):
    """A mesh's subgroups get the job's timeout (not torch's 30-minute default) when new_group creates
    them: gloo keeps the creation timeout for point-to-point receives, so a shorter connect bound
    there failed a pipeline stage's receive from a neighbour over a second late
    (etc_agent.worker.connect); their collectives are bounded by it too."""
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh

    from etc_agent.layout.config import ParallelConfig
    from etc_agent.worker.context import make_context
    from etc_agent.worker.groups import destroy_all_groups

    created = []
    new_group = device_mesh.new_group

    def recording(*args, **kwargs):
        created.append(kwargs.get("timeout"))
        return new_group(*args, **kwargs)

    monkeypatch.setattr(device_mesh, "new_group", recording)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=10))
    try:
        monkeypatch.setenv("ETC_AGENT_CONNECT_TIMEOUT", "1.5")
        ctx = make_context(
            ParallelConfig.parse("tp=1,pp=1,dp=1"), 0, 0, torch.device("cpu"), timeout=timedelta(seconds=7)
        )
        assert created and all(t == timedelta(seconds=7) for t in created), created
        for name in ctx.mesh.mesh_dim_names:
            backend = ctx.mesh.get_group(name)._get_backend(torch.device("cpu"))
            assert backend.options._timeout == timedelta(seconds=7), name
    finally:
        destroy_all_groups()


def test_gather_state_before_start_says_what_to_call_first(monkeypatch):
    from etc_agent.worker.job import Job

    monkeypatch.delenv("ETC_AGENT_ADDR", raising=False)
    with pytest.raises(RuntimeError, match=r"call job.start\(build\) before job.gather_state\(\)"):
        Job().gather_state()
