"""Executor over FSDP2 state on real processes (gloo): ``fully_shard`` modules, alone (FSDP), on a
replicate x shard mesh (HSDP), over DTensor tensor parallel (2-D, ``_StridedShard``) and inside
pipeline stages, migrated into a module built for another mesh.

Every element of every parameter and AdamW moment gets a distinct value (its global index plus a
per-tensor base). The old module holds them as FSDP2 leaves them (``Shard(0)``, uneven last shards,
empty ones); the new module is built and sharded for the new mesh, its optimizer state created by a
step on zero gradients, and the migration writes into the sharded parameters in place. Each rank
then checks its shards bitwise, and the parameters once more after FSDP2's own all-gather
(``unshard``), which reads the module's sharded storage.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_workers
from torch import nn

from etc_agent.layout import Device
from etc_agent.layout.boxes import balanced_range
from etc_agent.migrate import migrate_state

HIDDEN, FFN, NUM_LAYERS = 6, 10, 3
"""Small and uneven: 10 rows over 3 or 4 shards, 6 over 4 (an empty last shard)."""


@dataclass(frozen=True)
class Layout:
    """A mesh of ``pp x dp_replicate x dp_shard x tp`` ranks, the first ones of the world."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    mixed_precision: bool = False
    """bf16 compute (``MixedPrecisionPolicy``): the sharded parameters stay fp32, the all-gather is bf16."""

    @property
    def num_ranks(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    def __str__(self) -> str:
        return f"pp{self.pp}.rep{self.dp_replicate}.shard{self.dp_shard}.tp{self.tp}" + ".bf16" * self.mixed_precision


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)
        self.scale = nn.Parameter(torch.ones(HIDDEN))


def _expected(key: str) -> torch.Tensor:
    """The full value of one state tensor: distinct in every element and across tensors."""
    layer, name = int(key.split(".")[1]), key.split(".", 2)[2]
    shapes = {"up.weight": (FFN, HIDDEN), "down.weight": (HIDDEN, FFN), "scale": (HIDDEN,)}
    param_name = next(n for n in shapes if name.startswith(n))
    kinds = ["", ".exp_avg", ".exp_avg_sq"]
    kind = kinds.index(name[len(param_name) :])
    base = ((layer * len(shapes) + list(shapes).index(param_name)) * len(kinds) + kind) * 1000
    shape = shapes[param_name]
    return (torch.arange(torch.Size(shape).numel(), dtype=torch.float32) + base).reshape(shape)


def _box_of(tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(local tensor, global offsets, lengths) of a DTensor or a plain full tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if isinstance(tensor, DTensor):
        lengths, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        offsets = tuple(min(o, s) for o, s in zip(offsets, tensor.shape))
        return tensor._local_tensor, offsets, tuple(lengths)
    return tensor, (0,) * tensor.dim(), tuple(tensor.shape)


def _region(full: torch.Tensor, offsets, lengths) -> torch.Tensor:
    return full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]


def _fill(tensor, key: str) -> None:
    local, offsets, lengths = _box_of(tensor)
    with torch.no_grad():
        local.copy_(_region(_expected(key), offsets, lengths))


def _check(tensor, key: str, where: str) -> None:
    local, offsets, lengths = _box_of(tensor)
    expected = _region(_expected(key), offsets, lengths).to(local.dtype)
    assert tuple(local.shape) == tuple(expected.shape), f"{where} {key}: shape {tuple(local.shape)}"
    bits = torch.int32 if local.dtype == torch.float32 else torch.int16
    assert torch.equal(local.view(bits), expected.view(bits)), f"{where} {key}: values differ"


def _mesh(layout: Layout):
    """Every process calls this (subgroups are made by all); a rank outside the layout gets None."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(layout.num_ranks).reshape(layout.pp, layout.dp_replicate, layout.dp_shard, layout.tp)
    mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    return mesh if dist.get_rank() < layout.num_ranks else None


def build(layout: Layout, fill: bool):
    """This rank's stage of the model under ``layout`` (FSDP2 per block, TP inside), its optimizer
    (state made by one step on zero gradients), and the state to migrate; None off the layout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = _mesh(layout)
    if mesh is None:
        return None
    stage = mesh.get_local_rank("pp")
    start, length = balanced_range(NUM_LAYERS, layout.pp, stage)
    layers = {index: Block() for index in range(start, start + length)}
    dp_mesh = mesh["dp_replicate", "dp_shard"] if layout.dp_replicate > 1 else mesh["dp_shard"]
    for index, block in layers.items():
        if fill:
            for name, param in block.named_parameters():
                _fill(param.data, f"layers.{index}.{name}")
        if layout.tp > 1:
            parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            block.scale = nn.Parameter(distribute_tensor(block.scale.data, mesh["tp"], [Replicate()]))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if layout.mixed_precision else MixedPrecisionPolicy()
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    params = [p for block in layers.values() for p in block.parameters()]
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)  # the step on zero grads changes nothing
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad()
    state: dict[str, torch.Tensor] = {}
    for index, block in layers.items():
        for name, param in block.named_parameters():
            key = f"layers.{index}.{name}"
            state[key] = param
            for moment in ("exp_avg", "exp_avg_sq"):
                state[f"{key}.{moment}"] = optimizer.state[param][moment]
    if fill:
        for key, tensor in state.items():
            if key.endswith(("exp_avg", "exp_avg_sq")):
                _fill(tensor, key)
    return layers, state


def run_transition(rank: int, world: int, old: Layout, new: Layout) -> dict:
    built_old = build(old, fill=True)
    built_new = build(new, fill=False)
    old_state = built_old[1] if built_old else None
    new_state = built_new[1] if built_new else None
    placements: set[str] = set()
    empty = 0
    for tensor in [*(old_state or {}).values(), *(new_state or {}).values()]:
        placements.update(type(p).__name__ for p in getattr(tensor, "placements", ()))
        empty += _box_of(tensor)[0].numel() == 0
    for key, tensor in (old_state or {}).items():
        _check(tensor, key, f"rank {rank} before")
    result = migrate_state(
        old_state,
        new_state,
        device=Device("n0", rank),
        old_rank=rank if built_old else None,
        new_rank=rank if built_new else None,
        tp=new.tp,
    )
    checked = 0
    if built_new:
        layers, state = built_new
        for key, tensor in state.items():
            _check(tensor, key, f"rank {rank} after")
            checked += 1
        for index, block in layers.items():
            block.unshard()  # FSDP2's all-gather of its own sharded storage
            for name, param in block.named_parameters():
                _check(param, f"layers.{index}.{name}", f"rank {rank} unsharded")
            block.reshard()
    dist.barrier()
    return {
        "plan_hash": result.plan.plan_hash,
        "checked": checked,
        "bytes_moved": result.plan.bytes_moved,
        "placements": sorted(placements),
        "empty_shards": empty,
    }


TRANSITIONS = [
    ("fsdp-4-to-3-uneven", Layout(dp_shard=4), Layout(dp_shard=3)),
    ("fsdp-2-to-4", Layout(dp_shard=2), Layout(dp_shard=4)),
    ("fsdp-bf16-compute-4-to-3", Layout(dp_shard=4, mixed_precision=True), Layout(dp_shard=3, mixed_precision=True)),
    ("hsdp-2x2-to-fsdp-4", Layout(dp_replicate=2, dp_shard=2), Layout(dp_shard=4)),
    ("fsdp-4-to-hsdp-2x2", Layout(dp_shard=4), Layout(dp_replicate=2, dp_shard=2)),
    ("fsdp-tp-2x2-to-fsdp-4", Layout(dp_shard=2, tp=2), Layout(dp_shard=4)),
    ("pp2-fsdp2-to-pp1-fsdp4", Layout(pp=2, dp_shard=2), Layout(dp_shard=4)),
]


def transitions_worker(rank: int, world: int, transitions) -> list[dict]:
    return [run_transition(rank, world, old, new) for _, old, new in transitions]


@pytest.mark.parametrize("name, old, new", TRANSITIONS, ids=[t[0] for t in TRANSITIONS])
def test_fsdp2_state_migrates_bitwise_into_a_module_sharded_for_the_new_mesh(name, old, new):
    world = max(old.num_ranks, new.num_ranks)
    [per_rank] = zip(*run_workers(world, transitions_worker, [(name, old, new)], timeout_s=240))
    assert len({r["plan_hash"] for r in per_rank}) == 1
    assert sum(r["checked"] for r in per_rank) >= new.num_ranks * 3 * 3 // new.pp
    assert per_rank[0]["bytes_moved"] > 0  # the layouts differ: something moved
    seen = set().union(*(r["placements"] for r in per_rank))
    if old.tp > 1:
        assert "_StridedShard" in seen, seen  # FSDP2 over TP on the same dim
    if old.dp_replicate > 1 or new.dp_replicate > 1:
        assert "Replicate" in seen, seen  # HSDP
    if 4 in (old.dp_shard, new.dp_shard) and old.pp == new.pp == 1 and old.tp == 1:
        assert sum(r["empty_shards"] for r in per_rank) > 0  # 6 rows over 4 shards: 2, 2, 2, 0


def baseline_worker(rank: int, world: int, transitions, root: str) -> list[dict]:
    """The checkpoint way on FSDP2 state: ``get_state_dict`` + DCP save from the old module, DCP load
    into the new one's ``get_state_dict`` + ``set_state_dict`` (what ``--migration checkpoint`` runs)."""
    from pathlib import Path

    from etc_agent.worker.appstate import split_state
    from etc_agent.worker.baseline import _load, _save, checkpoint_api

    out = []
    for name, old, new in transitions:
        apps = []
        for layout, fill in ((old, True), (new, False)):
            layers, state = build(layout, fill=fill)
            model = nn.Module()
            model.layers = nn.ModuleDict({str(i): block for i, block in layers.items()})
            optim = torch.optim.AdamW([p for b in layers.values() for p in b.parameters()], lr=1e-3)
            # build() made the state by a step of its own optimizer: hand it to this one.
            for key, tensor in state.items():
                if key.endswith(".exp_avg"):
                    param = model.get_parameter(key.removesuffix(".exp_avg"))
                    optim.state[param] = {
                        "step": torch.tensor(1.0),
                        "exp_avg": tensor,
                        "exp_avg_sq": state[f"{key.removesuffix('.exp_avg')}.exp_avg_sq"],
                    }
            apps.append(({"model": model, "optim": optim}, state))
        (old_app, _), (new_app, new_state) = apps
        old_tensors, new_tensors = split_state(old_app)[0], split_state(new_app)[0]
        api = checkpoint_api(old_app, old_tensors)
        path = Path(root) / name
        _save(old_app, old_tensors, path, api)
        _load(new_app, new_tensors, path, api)
        for key, tensor in new_state.items():
            _check(tensor, key, f"rank {rank} after load")
        out.append({"api": api, "checked": len(new_state)})
    return out


BASELINE_TRANSITIONS = [
    ("fsdp-tp-2x2-to-fsdp-4", Layout(dp_shard=2, tp=2), Layout(dp_shard=4)),
    ("pp2-fsdp2-to-hsdp-2x2", Layout(pp=2, dp_shard=2), Layout(dp_replicate=2, dp_shard=2)),
]


def test_the_checkpoint_baseline_saves_fsdp2_state_through_get_state_dict_and_loads_it_resharded(tmp_path):
    """The baseline's FSDP2 path, bitwise: ``_StridedShard`` FSDP + TP into plain FSDP, and pipeline
    stages (each saving different parameters, param groups flattened per parameter) into HSDP."""
    results = run_workers(4, baseline_worker, BASELINE_TRANSITIONS, str(tmp_path), timeout_s=240)
    for per_rank in results:
        assert [r["api"] for r in per_rank] == ["state_dict"] * len(BASELINE_TRANSITIONS)
        assert all(r["checked"] == NUM_LAYERS * 3 * 3 for r in per_rank)


def test_a_strided_shard_that_is_not_fsdp_over_tp_is_refused_by_name():
    """A ``_StridedShard`` whose split factor does not match the later ``Shard`` of its dim is no box."""
    pytest.importorskip("torch.distributed.tensor.placement_types")
    from etc_agent.migrate.describe import _check_fsdp_over_tp

    class Fake:
        placements = ()

    from torch.distributed.tensor.placement_types import _StridedShard

    fake = Fake()
    fake.placements = (_StridedShard(0, split_factor=3),)
    with pytest.raises(ValueError, match="layers.0.up.weight: DTensor placement"):
        _check_fsdp_over_tp("layers.0.up.weight", fake, 0, fake.placements[0])


def cut_step_worker(rank: int, world: int) -> dict:
    """A root-wrapped FSDP2 model after one optimizer step, then a forward with no backward (as a
    peer's failure leaves it): the root unit keeps its parameters unsharded."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from etc_agent.worker.appstate import param_names, split_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, HIDDEN), nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, 16, bias=False))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.arange(8).reshape(2, 4)
    model(tokens).sum().backward()
    optim.step()
    optim.zero_grad()
    model(tokens)  # the backward never comes
    app = {"model": model, "optim": optim}
    names = param_names(app)
    named_before = sorted(names[id(p)] for p in optim.param_groups[0]["params"] if id(p) in names)
    tensors, _ = split_state(app)
    return {"named_before": named_before, "keys": sorted(k for k in tensors if k.startswith("optim.state."))}


def test_a_step_cut_between_forward_and_backward_still_names_the_root_units_optimizer_state():
    """The root's parameters (embedding, head) are unsharded after forward; the state to migrate is
    taken from the sharded ones, so the optimizer state of every parameter keeps its name."""
    for result in run_workers(2, cut_step_worker, timeout_s=120):
        assert "model.0.weight" not in result["named_before"]  # the cut step's unsharded root
        params = ["model.0.weight", "model.1.weight", "model.1.bias", "model.2.weight"]
        expected = sorted(f"optim.state.{p}.{k}" for p in params for k in ("exp_avg", "exp_avg_sq", "step"))
        assert result["keys"] == expected


def context_worker(rank: int, world: int, config_text: str) -> dict:
    from datetime import timedelta

    from torch.distributed.fsdp import fully_shard

    from etc_agent.layout import ParallelConfig
    from etc_agent.worker.context import make_context

    config = ParallelConfig.parse(config_text)
    ctx = make_context(config, rank, 0, torch.device("cpu"), timeout=timedelta(seconds=30))
    block = Block()
    fully_shard(block, mesh=ctx.fsdp_mesh)
    return {
        "dims": list(ctx.mesh.mesh_dim_names),
        "fsdp_ranks": ctx.fsdp_mesh.mesh.flatten().tolist(),
        "dp_group_size": dist.get_world_size(ctx.dp_group),
        "tp_group_size": dist.get_world_size(ctx.tp_group),
        "dp_rank": ctx.dp_rank,
        "placements": [type(p).__name__ for p in block.up.weight.placements],
    }


@pytest.mark.parametrize(
    "config, fsdp_ranks, placements",
    [
        ("tp=2,dp_replicate=2,dp_shard=2", {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}, ["Replicate", "Shard"]),
        ("tp=2,dp_shard=4", {0: [0, 2, 4, 6], 1: [1, 3, 5, 7]}, ["Shard"]),
    ],
)
def test_the_context_mesh_has_torchtitans_dims_and_the_mesh_fully_shard_takes(config, fsdp_ranks, placements):
    """8 processes: ``ctx.mesh`` is ``(pp, dp_replicate, dp_shard, tp)`` with ``dp`` flattened from
    the two, ``ctx.fsdp_mesh`` the ranks of one TP column, and ``fully_shard`` on it gives HSDP's
    ``(Replicate, Shard(0))`` or FSDP's ``Shard(0)``."""
    results = run_workers(8, context_worker, config, timeout_s=240)
    for rank, r in enumerate(results):
        assert r["dims"] == ["pp", "dp_replicate", "dp_shard", "tp"]
        assert r["fsdp_ranks"] == fsdp_ranks[rank % 2]
        assert r["dp_group_size"] == 4 and r["tp_group_size"] == 2
        assert r["dp_rank"] == rank // 2
        assert r["placements"] == placements
