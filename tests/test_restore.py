"""Lost state restored from a checkpoint, region by region, inside a live migration (gloo).

Four processes write a checkpoint of a ZeRO layout with :func:`save_shards_on` (coordinated over a
group transport, as the periodic writer does from its thread), the checkpoint holding every element
with one bit flipped. Two processes then vanish; the other two migrate into a new layout with the
checkpoint as the source of last resort. Every element must come from a live peer where one holds
it (unflipped) and from storage exactly where none does (flipped): bitwise, element by element.
"""

from __future__ import annotations

from math import prod

import pytest
import torch
import torch.distributed as dist
from conftest import MODELS
from dist_harness import run_workers
from test_migrate import _bases, _values

from etc_agent.layout import Device, ModelSpec, ParallelConfig, Shard, model_layout
from etc_agent.migrate import BoxedTensor, migrate_state
from etc_agent.migrate.describe import describe_state
from etc_agent.migrate.executor import TORCH_DTYPES
from etc_agent.migrate.storage import read_regions, save_shards_on
from etc_agent.migrate.transport import GroupTransport, TorchTransport
from etc_agent.planner import StateLostError

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT_VIEW[t.element_size()])


def _flipped(t: torch.Tensor) -> torch.Tensor:
    return (_bits(t) ^ 1).view(t.dtype)


def _global_index(shard: Shard) -> torch.Tensor:
    index = torch.arange(prod(shard.global_shape), dtype=torch.int64).reshape(shard.global_shape)
    box = index[tuple(slice(o, o + n) for o, n in zip(shard.offsets, shard.lengths))]
    return box.reshape(-1)[shard.flat_range[0] : shard.flat_range[1]] if shard.flat_range else box


def _boxed(shards, make) -> dict[str, BoxedTensor]:
    return {s.key: BoxedTensor(make(s), s.global_shape, s.offsets, s.lengths, s.flat_range) for s in shards}


def worker(
    rank: int, world: int, path: str, model: str, old: str, new: str, num_alive: int, with_checkpoint: bool
) -> dict:
    spec = ModelSpec.from_yaml(MODELS / f"{model}.yaml")
    old_layout, new_layout = (
        model_layout(spec, ParallelConfig.parse(old)),
        model_layout(spec, ParallelConfig.parse(new)),
    )
    bases = _bases(old_layout)
    old_shards = old_layout.shards_of(rank)
    live = _boxed(old_shards, lambda s: _values(s, bases[s.key]))
    stored = _boxed(old_shards, lambda s: _flipped(_values(s, bases[s.key])))
    written = save_shards_on(
        describe_state(stored), path, GroupTransport(dist.distributed_c10d._get_default_group(), "gloo")
    )
    survivors = dist.new_group(list(range(num_alive)))  # every rank takes part in creating it
    if rank >= num_alive:
        return {"written": written}

    new_shards = new_layout.shards_of(rank)
    new_state = _boxed(
        new_shards, lambda s: torch.zeros((s.numel,) if s.flat_range else s.lengths, dtype=TORCH_DTYPES[s.dtype])
    )
    lost = {r: (Device(f"gone{r}", 0), []) for r in range(num_alive, old_layout.num_ranks)}
    planned = []
    try:
        result = migrate_state(
            live,
            new_state,
            device=Device("n0", rank),
            old_rank=rank,
            new_rank=rank,
            transport=TorchTransport(survivors),
            tp=ParallelConfig.parse(new).tp,
            failed=[d for d, _ in lost.values()],
            lost_old_ranks=lost,
            timeout_s=60,
            read_checkpoint=(lambda boxes: read_regions(path, boxes)) if with_checkpoint else None,
            on_plan=planned.append,
        )
    except StateLostError as err:
        return {"lost": sorted(err.lost)}

    # Which elements a live old rank held, from the layout alone.
    held = {
        key: torch.zeros(prod(old_layout.placements[p].geometry.global_shape), dtype=torch.bool)
        for key, p in old_layout.key_placement.items()
    }
    for r in range(num_alive):
        for s in old_layout.shards_of(r):
            held[s.key][_global_index(s).reshape(-1)] = True
    from_peers = from_storage = 0
    for s in new_shards:
        expected_live = _values(s, bases[s.key])
        mask = held[s.key][_global_index(s)]
        expected = torch.where(mask, _bits(expected_live), _bits(_flipped(expected_live)))
        got = _bits(new_state[s.key].tensor)
        assert torch.equal(got, expected), f"{s.key}: {(got != expected).sum()} elements differ"
        from_peers += int(mask.sum()) * expected_live.element_size()
        from_storage += int((~mask).sum()) * expected_live.element_size()
    assert result.metrics.bytes_restored == from_storage, (result.metrics.bytes_restored, from_storage)
    partly_lost = sorted(key for key, mask in held.items() if not mask.all() and key in new_layout.key_placement)
    return {
        "restored": result.metrics.bytes_restored,
        "plan_restored": planned[0].bytes_restored,
        "restored_keys": planned[0].restored_keys,
        "partly_lost": partly_lost,
        "written": written,
        "from_peers": from_peers,
    }


@pytest.mark.parametrize(
    "model,old,new",
    [
        ("llama-tiny", "tp=2,dp=2,zero=1", "tp=2"),  # half of every optimizer range is gone
        ("gpt-tiny", "tp=1,pp=2", "tp=1"),  # a whole pipeline stage is gone
    ],
)
def test_lost_regions_come_from_the_checkpoint_and_nothing_else_does(tmp_path, model, old, new):
    results = run_workers(
        4 if "dp=2" in old else 2,
        worker,
        str(tmp_path / "ckpt"),
        model,
        old,
        new,
        1 if "pp=2" in old else 2,
        True,
        timeout_s=180,
    )
    alive = [r for r in results if "restored" in r]
    assert alive and all(r["plan_restored"] == sum(a["restored"] for a in alive) for r in alive)
    assert 0 < alive[0]["plan_restored"]
    # Storage supplied only what was lost: less than the state, the rest came from live peers.
    assert all(r["from_peers"] > 0 for r in alive)
    assert alive[0]["restored_keys"] == alive[0]["partly_lost"]
    if "pp=2" in old:
        assert any("layers.3." in k for k in alive[0]["restored_keys"]) and not any(
            "layers.0." in k for k in alive[0]["restored_keys"]
        )


def test_without_a_checkpoint_the_lost_tensors_are_named(tmp_path):
    results = run_workers(2, worker, str(tmp_path / "ckpt"), "gpt-tiny", "tp=1,pp=2", "tp=1", 1, False, timeout_s=120)
    assert any("layers.3." in k for k in results[0]["lost"]) and not any(
        "layers.0." in k for k in results[0]["lost"]
    ), results[0]
