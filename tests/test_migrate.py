"""Executor on real processes (gloo): the gathered state after a migration is bitwise the state before.

Every element of every tensor gets a distinct value (its global index for fp32; distinct bit patterns
for bf16), each process holds its old shards as Megatron-style boxed tensors, runs the migration
into freshly built new shards (some on ``meta``), and rank 0 assembles the full state from the old
and from the new layout and compares them bit for bit, parameters and Adam state alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
import torch.distributed as dist
from conftest import MODELS
from dist_harness import run_workers

from etc_agent.layout import Device, DeviceSet, ModelSpec, ParallelConfig, Shard, model_layout
from etc_agent.migrate import BoxedTensor, migrate_state
from etc_agent.migrate.executor import TORCH_DTYPES
from etc_agent.planner import PlannerOptions, plan_model_migration


@dataclass(frozen=True)
class Case:
    name: str
    old: str
    old_devices: str
    new: str
    new_devices: str
    model: str = "gpt-tiny"
    meta: bool = False
    mem_cap: int = 1 << 30
    direct_min_bytes: int = 256 << 10
    adopt: bool = False
    """New shards equal to old ones take over the old storage (the worker does this for live state)."""

    @property
    def num_processes(self) -> int:
        return len(set(DeviceSet.parse(self.old_devices)) | set(DeviceSet.parse(self.new_devices)))


CASES = [
    Case("tp-up", "tp=1,dp=2", "n0:2", "tp=2", "n0:2"),
    Case("tp-down", "tp=4", "n0:4", "tp=2,dp=2", "n0:4", meta=True, direct_min_bytes=4096),
    Case("pp-up", "tp=1,dp=4", "n0:4", "pp=4", "n0:4", adopt=True),
    Case("pp-down", "tp=2,pp=2", "n0:4", "tp=2,dp=2", "n0:4"),
    Case("dp-up-join-node", "tp=2", "n0:2", "tp=2,dp=2", "n0:2,n1:2", meta=True),
    Case("dp-down-node-leaves", "tp=2,dp=3", "n0:2,n1:2,n2:2", "tp=2,dp=2", "n0:2,n1:2", adopt=True),
    Case("zero-on", "tp=1,dp=4", "n0:4", "tp=1,dp=4,zero=1", "n0:4", adopt=True),
    Case("zero-off", "tp=2,dp=2,zero=1", "n0:4", "tp=2,dp=2", "n0:4", meta=True),
    Case("device-leaves", "dp=3,zero=1", "n0:3", "dp=2,zero=1", "n0:[0,2]"),
    Case("device-joins", "pp=2", "n0:2", "dp=3,zero=1", "n0:3"),
    Case("whole-node-leaves", "pp=2,dp=2,zero=1", "n0:2,n1:2", "tp=2", "n1:2"),
    Case("combined-tp-pp-dp", "tp=2,pp=2", "n0:4", "tp=1,pp=2,dp=3", "n0:4,n1:2", direct_min_bytes=0),
    Case("combined-one-new-device", "tp=2,pp=2", "n0:4", "dp=5,zero=1", "n0:4,n1:1", meta=True),
    Case(
        "bf16-mixed-dtypes",
        "tp=2,dp=2,zero=1",
        "n0:4",
        "tp=1,pp=2,dp=2",
        "n0:4",
        model="llama-tiny",
        direct_min_bytes=2048,
    ),
    Case("many-rounds", "tp=2,pp=2", "n0:4", "tp=1,dp=4,zero=1", "n0:2,n1:2", mem_cap=48 * 1024, direct_min_bytes=8192),
    Case("all-direct-zero-off", "tp=2,dp=2,zero=1", "n0:4", "tp=4", "n0:4", direct_min_bytes=0),
]


def _values(shard: Shard, base: int) -> torch.Tensor:
    """Distinct values for a shard: global element index (fp32) or distinct bit patterns (bf16)."""
    index = torch.arange(int(np.prod(shard.global_shape)), dtype=torch.int64).reshape(shard.global_shape) + base
    box = index[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.lengths))]
    if shard.flat_range is not None:
        box = box.reshape(-1)[shard.flat_range[0] : shard.flat_range[1]]
    dtype = TORCH_DTYPES[shard.dtype]
    if dtype == torch.float32:
        assert int(index.max()) < 2**24
        return box.to(torch.float32)
    return (box % 65521).to(torch.int16).view(dtype)


def _bases(layout) -> dict[str, int]:
    out, base = {}, 0
    for key in sorted(layout.key_placement):
        out[key] = base
        base += int(np.prod(layout.placements[layout.key_placement[key]].geometry.global_shape))
    return out


def _as_int(t: torch.Tensor) -> np.ndarray:
    t = t.detach().contiguous()
    return (t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)).numpy().copy()


def _assemble(pieces: list[tuple[Shard, np.ndarray]]) -> dict[str, np.ndarray]:
    full: dict[str, np.ndarray] = {}
    seen: dict[str, np.ndarray] = {}
    for shard, data in pieces:
        f = full.setdefault(shard.key, np.zeros(shard.global_shape, dtype=data.dtype))
        s = seen.setdefault(shard.key, np.zeros(shard.global_shape, dtype=bool))
        sl = tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.lengths))
        if shard.flat_range is None:
            f[sl] = data.reshape(shard.lengths)
            s[sl] = True
        else:
            box, cover = f[sl].reshape(-1), s[sl].reshape(-1)
            box[shard.flat_range[0] : shard.flat_range[1]] = data
            cover[shard.flat_range[0] : shard.flat_range[1]] = True
            f[sl] = box.reshape(shard.lengths)
            s[sl] = cover.reshape(shard.lengths)
    for key, s in seen.items():
        assert s.all(), f"{key}: {int((~s).sum())} elements held by no rank"
    return full


def run_case(rank: int, case: Case) -> dict:
    spec = ModelSpec.from_yaml(MODELS / f"{case.model}.yaml")
    old_cfg, new_cfg = ParallelConfig.parse(case.old), ParallelConfig.parse(case.new)
    old_devices, new_devices = DeviceSet.parse(case.old_devices), DeviceSet.parse(case.new_devices)
    options = PlannerOptions(mem_cap_bytes=case.mem_cap)
    # Placement is decided once (the agent's leader does this in the product); processes act on it.
    decision = plan_model_migration(spec, old_cfg, old_devices, new_cfg, new_devices, options=options)
    universe = list(dict.fromkeys(list(old_devices) + list(new_devices)))
    device = universe[rank] if rank < len(universe) else Device("spare", rank)
    old_rank = old_devices.index(device) if device in old_devices else None
    new_rank = decision.assignment.index(device) if device in decision.assignment else None

    old_layout, new_layout = model_layout(spec, old_cfg), model_layout(spec, new_cfg)
    bases = _bases(old_layout)
    old_state = {}
    for s in old_layout.shards_of(old_rank) if old_rank is not None else []:
        old_state[s.key] = BoxedTensor(_values(s, bases[s.key]), s.global_shape, s.offsets, s.lengths, s.flat_range)
    new_state = {}
    for s in new_layout.shards_of(new_rank) if new_rank is not None else []:
        shape = (s.numel,) if s.flat_range else s.lengths
        dtype = TORCH_DTYPES[s.dtype]
        tensor = torch.empty(shape, dtype=dtype, device="meta") if case.meta else torch.full(shape, -7, dtype=dtype)
        new_state[s.key] = BoxedTensor(tensor, s.global_shape, s.offsets, s.lengths, s.flat_range)

    before_wire = [
        (k, b.global_shape, b.offsets, b.lengths, b.flat_range, _as_int(b.tensor)) for k, b in old_state.items()
    ]

    result = migrate_state(
        old_state,
        new_state,
        device=device,
        old_rank=old_rank,
        new_rank=new_rank,
        tp=new_cfg.tp,
        options=options,
        direct_min_bytes=case.direct_min_bytes,
        adopt_old=case.adopt,
    )

    old_storage = {b.tensor.data_ptr() for b in old_state.values()}
    num_adopted = 0
    after_wire = []
    for key, b in new_state.items():
        tensor = result.tensors[key]
        assert not tensor.is_meta
        if not case.meta:
            assert tensor is b.tensor, key  # filled in place: the state's own tensor objects
            num_adopted += tensor.data_ptr() in old_storage
        after_wire.append((key, b.global_shape, b.offsets, b.lengths, b.flat_range, _as_int(tensor)))
    gathered_before = [None] * dist.get_world_size()
    gathered_after = [None] * dist.get_world_size()
    dist.all_gather_object(gathered_before, before_wire)
    dist.all_gather_object(gathered_after, after_wire)
    summary = {
        "plan_hash": result.plan.plan_hash,
        "assignment_matches": [str(d) for d in result.plan.assignment] == [str(d) for d in decision.assignment],
        "bytes_moved": result.plan.bytes_moved,
        "decision_bytes_moved": decision.bytes_moved,
        "num_rounds": result.plan.num_rounds,
        "metrics": result.metrics.to_json(),
        "num_adopted": num_adopted,
    }
    if rank == 0:

        def pieces(gathered):
            return [
                (Shard(key, shape, off, ln, "float32", flat), data)
                for per_rank in gathered
                for key, shape, off, ln, flat, data in per_rank
            ]

        old_full, new_full = _assemble(pieces(gathered_before)), _assemble(pieces(gathered_after))
        assert sorted(old_full) == sorted(new_full)
        for key in old_full:
            np.testing.assert_array_equal(new_full[key], old_full[key], err_msg=key)
        summary["keys_checked"] = len(old_full)
        summary["param_keys"] = sum(not k.startswith("optimizer.") for k in old_full)
        summary["adam_keys"] = sum(k.endswith((".exp_avg", ".exp_avg_sq")) for k in old_full)
    return summary


def cases_worker(rank: int, world: int, cases: list[Case]) -> list[dict]:
    out = []
    for case in cases:
        out.append(run_case(rank, case))
        dist.barrier()
    return out


def _by_size():
    sizes: dict[int, list[Case]] = {}
    for case in CASES:
        sizes.setdefault(case.num_processes, []).append(case)
    return sorted(sizes.items())


def test_case_matrix_covers_the_required_transitions():
    assert len(CASES) >= 12
    assert {c.num_processes for c in CASES} <= set(range(2, 7))


@pytest.mark.parametrize(
    "world, cases", _by_size(), ids=lambda v: str(v) if isinstance(v, int) else "+".join(c.name for c in v)
)
def test_migration_is_bitwise_exact(world, cases):
    results = run_workers(world, cases_worker, cases, timeout_s=240)
    for i, case in enumerate(cases):
        per_rank = [r[i] for r in results]
        assert len({r["plan_hash"] for r in per_rank}) == 1, case.name
        assert all(r["assignment_matches"] for r in per_rank), case.name
        assert per_rank[0]["bytes_moved"] == per_rank[0]["decision_bytes_moved"], case.name
        assert per_rank[0]["keys_checked"] > 0 and per_rank[0]["adam_keys"] > 0
        m = per_rank[0]["metrics"]
        assert m["bytes_moved_total"] == per_rank[0]["bytes_moved"]
        assert sum(r["metrics"]["bytes_sent"] for r in per_rank) == m["bytes_moved_total"]
        assert sum(r["metrics"]["bytes_received"] for r in per_rank) == m["bytes_moved_total"]
        if case.name == "many-rounds":
            assert per_rank[0]["num_rounds"] > 1
            assert max(r["metrics"]["peak_buffer_bytes"] for r in per_rank) <= 2 * case.mem_cap + 4096
        if case.meta or case.adopt:
            assert sum(r["metrics"]["bytes_reused"] for r in per_rank) > 0, case.name
        # Without adopt_old an allocated new shard is filled by copies and never shares old storage.
        assert (sum(r["num_adopted"] for r in per_rank) > 0) == case.adopt, case.name


def adopt_worker(rank: int, world: int) -> dict:
    """Rank 0 holds ``w`` and ``v`` (a replica each); both ranks hold them in the new layout. Rank 0's
    new ``w`` is a detached alias of a parameter (what ``state_dict()`` gives), its new ``v`` a tensor
    of its own: only ``v`` may take the old storage over, and the parameter behind ``w`` is filled."""
    shape = (64, 32)
    old_w, old_v = torch.arange(2048.0).view(shape).clone(), torch.arange(2048.0, 4096.0).view(shape).clone()
    param = torch.nn.Parameter(torch.full(shape, -1.0))
    new_state = {"w": param.detach(), "v": torch.full(shape, -1.0)}
    old_state = {"w": old_w, "v": old_v} if rank == 0 else None
    result = migrate_state(
        old_state,
        new_state,
        device=Device("n0", rank),
        old_rank=0 if rank == 0 else None,
        new_rank=rank,
        tp=1,
        adopt_old=True,
    )
    return {
        "param_filled": bool(torch.equal(param.detach(), old_w if rank == 0 else torch.arange(2048.0).view(shape))),
        "v_filled": bool(torch.equal(new_state["v"], torch.arange(2048.0, 4096.0).view(shape))),
        "v_adopted": rank == 0 and new_state["v"].data_ptr() == old_v.data_ptr(),
        "w_adopted": rank == 0 and param.data_ptr() == old_w.data_ptr(),
        "bytes_reused": result.metrics.bytes_reused,
    }


def test_a_new_tensor_takes_an_old_storage_over_only_when_it_is_its_sole_owner():
    first, second = run_workers(2, adopt_worker, timeout_s=120)
    assert first["param_filled"] and second["param_filled"]
    assert first["v_filled"] and second["v_filled"]
    assert first["v_adopted"] and not first["w_adopted"]
    assert first["bytes_reused"] == 64 * 32 * 4


def test_the_staging_pool_hands_its_resident_arenas_out_again_and_grows_only_for_more():
    from etc_agent.migrate.rounds import ARENA_BYTES, BufferPool

    pool, cpu = BufferPool(), torch.device("cpu")
    assert pool.reserve(ARENA_BYTES, cpu) == ARENA_BYTES
    assert pool.reserve(ARENA_BYTES // 2, cpu) == 0  # already held
    first = pool.get(ARENA_BYTES // 2, cpu)
    second = pool.get(ARENA_BYTES // 2 + 64, cpu)  # does not fit the rest of the first arena
    assert pool.num_bytes(cpu) == 2 * ARENA_BYTES
    assert second.data_ptr() != first.data_ptr() + ARENA_BYTES // 2
    pool.release()
    # The next round gets the same memory in the same order: nothing new is allocated (a fresh
    # allocation would fault its pages in again, inside the stall).
    assert pool.get(ARENA_BYTES // 2, cpu).data_ptr() == first.data_ptr()
    assert pool.get(ARENA_BYTES // 2 + 64, cpu).data_ptr() == second.data_ptr()
    assert pool.num_bytes(cpu) == 2 * ARENA_BYTES
    big = pool.get(ARENA_BYTES + 16, cpu)  # a piece bigger than an arena gets an arena of its size
    assert big.numel() == ARENA_BYTES + 16 and pool.num_bytes(cpu) == 3 * ARENA_BYTES + 16


def _rows(rank: int, world: int, fill: torch.Tensor) -> dict:
    """Rank ``rank``'s rows of the (12, 4) tensor ``w`` split over ``world`` ranks, as a box."""
    rows = 12 // world
    return {"w": BoxedTensor(fill[rank * rows : (rank + 1) * rows].clone(), (12, 4), (rank * rows, 0), (rows, 4))}


def ahead_worker(rank: int, world: int) -> list[dict]:
    """Three ranks move ``w`` from 3 row blocks to 2 (rank 2 only sends), with a plan made ahead
    from everyone's descriptions (gathered here in place of the worker's store): used when every
    process votes for it, and planned again as without one when any description or input changed."""
    from etc_agent.migrate import TorchTransport, describe_state
    from etc_agent.migrate.exchange import PlanInputs, description, plan_ahead

    full = torch.arange(48.0).view(12, 4)
    device, new_rank = Device("n0", rank), rank if rank < 2 else None
    out = []
    for case in ("all", "rank 1 changed", "rank 0 has none", "other inputs"):
        old = _rows(rank, 3, full)
        new = _rows(rank, 2, torch.full((12, 4), -1.0)) if new_rank is not None else None
        described_new = new
        if case == "rank 1 changed" and rank == 1:
            described_new = {"w": BoxedTensor(torch.zeros(4, 4), (12, 4), (8, 0), (4, 4))}  # not what it brings
        mine = description(device, rank, new_rank, describe_state(old), describe_state(described_new or {}))
        everyone = TorchTransport().all_gather_object(mine)
        ahead = plan_ahead(everyone, rank, PlanInputs(tp=1)) if not (case == "rank 0 has none" and rank == 0) else None
        result = migrate_state(
            old,
            new,
            device=device,
            old_rank=rank,
            new_rank=new_rank,
            tp=2 if case == "other inputs" else 1,
            ahead=ahead,
        )
        exact = new is None or bool(torch.equal(new["w"].tensor, full[rank * 6 : (rank + 1) * 6]))
        out.append({"case": case, "ahead": result.metrics.planned_ahead, "exact": exact, "hash": result.plan.plan_hash})
    return out


def test_a_plan_made_ahead_is_used_only_when_every_process_votes_for_it():
    results = run_workers(3, ahead_worker, timeout_s=120)
    for i, case in enumerate(("all", "rank 1 changed", "rank 0 has none", "other inputs")):
        per_rank = [r[i] for r in results]
        assert all(r["exact"] for r in per_rank), case
        assert len({r["hash"] for r in per_rank}) == 1, case
        # Every process decides the same, from the votes gathered with the descriptions.
        assert {r["ahead"] for r in per_rank} == {case == "all"}, (case, per_rank)
