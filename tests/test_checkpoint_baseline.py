"""The checkpoint baseline (DCP save + resharding load) reproduces the state exactly too."""

from __future__ import annotations

import torch
import torch.distributed as dist
from conftest import MODELS
from dist_harness import run_workers
from test_migrate import _bases, _values

from etc_agent.layout import ModelSpec, ParallelConfig, model_layout
from etc_agent.migrate import BoxedTensor, describe_state
from etc_agent.migrate.executor import TORCH_DTYPES
from etc_agent.worker.baseline import load_shards, save_shards


def worker(rank: int, world: int, path: str, model: str, old: str, new: str) -> int:
    spec = ModelSpec.from_yaml(MODELS / f"{model}.yaml")
    old_layout, new_layout = (
        model_layout(spec, ParallelConfig.parse(old)),
        model_layout(spec, ParallelConfig.parse(new)),
    )
    bases = _bases(old_layout)
    old_state = {
        s.key: BoxedTensor(_values(s, bases[s.key]), s.global_shape, s.offsets, s.lengths, s.flat_range)
        for s in old_layout.shards_of(rank)
    }
    save_shards(describe_state(old_state), path)
    dist.barrier()
    new_shards = new_layout.shards_of(rank)
    new_state = {
        s.key: BoxedTensor(
            torch.zeros((s.numel,) if s.flat_range else s.lengths, dtype=TORCH_DTYPES[s.dtype]),
            s.global_shape,
            s.offsets,
            s.lengths,
            s.flat_range,
        )
        for s in new_shards
    }
    load_shards(describe_state(new_state), path)
    for s in new_shards:
        expected = _values(s, bases[s.key])
        got = new_state[s.key].tensor
        assert torch.equal(
            got.view(torch.int16) if got.element_size() == 2 else got,
            expected.view(torch.int16) if expected.element_size() == 2 else expected,
        ), s.key
    return len(new_shards)


def test_dcp_reshards_boxes_and_flat_ranges(tmp_path):
    counts = run_workers(
        4, worker, str(tmp_path / "ckpt"), "llama-tiny", "tp=2,dp=2,zero=1", "tp=1,pp=2,dp=2", timeout_s=180
    )
    assert all(c > 0 for c in counts)
    # Replicas are written once: the checkpoint holds about the state's size, not the replicas' sum.
    size = sum(f.stat().st_size for f in (tmp_path / "ckpt").iterdir() if f.suffix == ".distcp")
    spec = ModelSpec.from_yaml(MODELS / "llama-tiny.yaml")
    assert spec.state_bytes() <= size < 1.2 * spec.state_bytes()
