"""Exactly-once data: the order, the shares, the position through layout changes, the token
dataset's checks, and the prefetching loader across a switch. Every test name says ``data``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from etc_agent.data import DataError, DataPosition, ElasticData, SampleOrder, TokenDataset, dp_share, share_weight
from etc_agent.data.tokens import write_dataset

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("global_batch", [1, 7, 8, 12, 13, 64])
@pytest.mark.parametrize("dp", range(1, 9))
def test_data_shares_cover_the_global_batch_once_as_evenly_as_can_be(global_batch, dp):
    if dp > global_batch:
        with pytest.raises(ValueError, match="cannot share"):
            dp_share(global_batch, dp, 0)
        return
    shares = [dp_share(global_batch, dp, r) for r in range(dp)]
    covered = [i for s in shares for i in range(s.start, s.start + s.count)]
    assert covered == list(range(global_batch))
    assert max(s.count for s in shares) - min(s.count for s in shares) <= 1
    # The weighted mean of per-rank mean gradients is the global batch's mean gradient.
    grads = torch.arange(global_batch, dtype=torch.float64) ** 2
    mean_of_ranks = (
        sum(share_weight(global_batch, dp, r) * grads[s.start : s.start + s.count].mean() for r, s in enumerate(shares))
        / dp
    )
    assert float(mean_of_ranks) == pytest.approx(float(grads.mean()))


def test_data_share_errors_name_the_mistake():
    with pytest.raises(ValueError, match="rank 4 is not one of 4"):
        dp_share(12, 4, 4)
    with pytest.raises(ValueError, match="at least one sample"):
        dp_share(0, 1, 0)
    with pytest.raises(ValueError, match="nothing to train on"):
        SampleOrder(0)


def test_data_order_depends_on_seed_and_epoch_only_and_each_epoch_is_a_permutation():
    order = SampleOrder(10, seed=3)
    stream = order.span(0, 30)
    for epoch in range(3):
        assert sorted(stream[epoch * 10 : (epoch + 1) * 10]) == list(range(10))
    assert stream[:10] != stream[10:20]  # a new permutation each epoch
    assert SampleOrder(10, seed=3).span(7, 9) == stream[7:16]  # a span straddling an epoch end
    assert SampleOrder(10, seed=4).span(0, 10) != stream[:10]


def _consumed_through(changes: list[tuple[int, int]], num_samples: int, global_batch: int, seed: int) -> list[int]:
    """Every sample the ranks read, step by step, through ``changes`` (steps, dp) of layout, the
    position carried from one layout to the next as a switch carries it."""
    order = SampleOrder(num_samples, seed)
    position = DataPosition(0, 0, seed, global_batch)
    step, seen = 0, []
    for num_steps, dp in changes:
        for _ in range(num_steps):
            for rank in range(dp):
                seen.extend(order.share(position.at(step), global_batch, dp, rank))
            step += 1
        position = DataPosition(position.at(step), step, seed, global_batch)  # the carried state
    return seen


def test_data_position_after_any_sequence_of_layout_changes_reads_every_sample_once_per_epoch():
    rng = random.Random(0)
    for trial in range(50):
        num_samples, global_batch = rng.randint(20, 200), rng.randint(1, 24)
        changes = [(rng.randint(0, 7), rng.randint(1, min(8, global_batch))) for _ in range(rng.randint(1, 9))]
        seen = _consumed_through(changes, num_samples, global_batch, seed=trial)
        reference = _consumed_through([(sum(n for n, _ in changes), 1)], num_samples, global_batch, seed=trial)
        assert sorted(seen) == sorted(reference), (num_samples, global_batch, changes)
        assert seen == reference  # the same stream, whatever the layout (shares are contiguous)
        full_epochs, rest = divmod(len(seen), num_samples)
        for epoch in range(full_epochs):
            assert sorted(seen[epoch * num_samples : (epoch + 1) * num_samples]) == list(range(num_samples))
        assert len(set(seen[full_epochs * num_samples :])) == rest


def test_data_position_refuses_a_step_before_it():
    position = DataPosition(consumed=120, step=10, seed=0, global_batch=12)
    assert position.at(10) == 120 and position.at(13) == 156
    with pytest.raises(ValueError, match="before the position's step 10"):
        position.at(9)


# ---- the token dataset ---------------------------------------------------------------------
@pytest.fixture
def tiny_tokens(tmp_path):
    documents = [[(7 * d + t) % 50 for t in range(40 + d)] for d in range(5)]
    write_dataset(tmp_path / "ds", documents, seq_len=8, vocab_size=50, tokenizer="none", corpus="test")
    return tmp_path / "ds"


def test_data_token_dataset_reads_fixed_length_windows(tiny_tokens):
    dataset = TokenDataset(tiny_tokens)
    flat = np.fromfile(tiny_tokens / "tokens.bin", dtype="<u2").astype(np.int64)
    assert len(dataset) == (len(flat) - 1) // 8
    assert dataset[3].tolist() == flat[24:33].tolist()
    with pytest.raises(IndexError):
        dataset[len(dataset)]


def test_data_bad_files_give_one_clear_line(tiny_tokens, tmp_path):
    tokens = tiny_tokens / "tokens.bin"
    data = tokens.read_bytes()
    tokens.write_bytes(data[:-6])
    with pytest.raises(DataError, match=r"tokens.bin holds \d+ bytes.*truncated or of another token width") as err:
        TokenDataset(tiny_tokens)
    assert "\n" not in str(err.value)
    tokens.write_bytes(np.frombuffer(data, dtype="<u2").astype("<u4").tobytes())  # written as uint32
    with pytest.raises(DataError, match="truncated or of another token width"):
        TokenDataset(tiny_tokens)
    tokens.write_bytes(data)
    with pytest.raises(DataError, match="is longer than its"):
        TokenDataset(tiny_tokens, seq_len=10_000)
    meta = json.loads((tiny_tokens / "meta.json").read_text())
    (tiny_tokens / "meta.json").write_text(json.dumps({**meta, "dtype": "int8"}))
    with pytest.raises(DataError, match="token dtype 'int8' is not one of uint16, uint32"):
        TokenDataset(tiny_tokens)
    (tiny_tokens / "meta.json").write_text(json.dumps({**meta, "vocab_size": 10}))
    with pytest.raises(DataError, match="token id 49 >= vocab_size 10"):
        TokenDataset(tiny_tokens)
    with pytest.raises(DataError, match="no such directory"):
        TokenDataset(tmp_path / "absent")


def test_data_prepare_script_builds_the_default_dataset_from_a_real_corpus(tmp_path):
    out = tmp_path / "pydoc"
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts/prepare_data.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    dataset = TokenDataset(out)
    assert summary["num_samples"] == len(dataset) > 1000 and summary["vocab_size"] == 4096
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(out / "tokenizer.json")).decode(dataset[0].tolist())
    assert len(text) > 50 and text.isprintable() or "\n" in text


def _default_dataset_in(root: str) -> str:
    from etc_agent.data.prepare import default_dataset

    return str(default_dataset(Path(root)))


def test_data_default_dataset_is_built_once_by_concurrent_callers(tmp_path):
    """Three processes ask for the default dataset at once (a node's workers starting): one builds it
    under the lock, the others wait and read it; a directory a killed build left (no meta.json) is
    replaced, and nothing of the builds is left beside it."""
    import multiprocessing

    stale = tmp_path / "pydoc-bpe4096"
    stale.mkdir()
    (stale / "tokens.bin").write_bytes(b"\0" * 10)
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        paths = pool.map(_default_dataset_in, [str(tmp_path)] * 3)
    assert paths == [str(stale)] * 3
    assert len(TokenDataset(stale)) > 1000
    assert sorted(p.name for p in tmp_path.iterdir()) == [".pydoc-bpe4096.lock", "pydoc-bpe4096"]


# ---- the loader ----------------------------------------------------------------------------
class _Indexed(torch.utils.data.Dataset):
    """Sample ``i`` is ``i``: what a batch holds is the indices it was built from."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def test_data_loader_with_prefetching_workers_loses_and_repeats_nothing_through_a_switch():
    """Two loader worker processes prefetch ahead; a switch from dp=2 to dp=3 after step 4 (the
    prefetched batches of steps 5-6 are dropped with the old loaders) and back to dp=1 after step 9:
    every step's samples, from every rank, are the global order's, each once per epoch."""
    dataset, global_batch, steps = _Indexed(60), 6, 20
    step_now = [0]

    def ranks(dp: int, state: dict | None) -> list[ElasticData]:
        out = []
        for rank in range(dp):
            data = ElasticData(dataset, global_batch, dp, rank, seed=5, num_workers=2, prefetch_factor=2)
            data.bind_step(lambda: step_now[0])
            if state is not None:
                data.load_state_dict(state)
            out.append(data)
        return out

    seen: list[int] = []
    layout = ranks(2, None)
    for step in range(steps):
        if step in (5, 10):
            state = layout[0].state_dict()
            for old in layout:
                old.close()
            layout = ranks(3 if step == 5 else 1, state)
        for data in layout:
            batch = data.batch(step).tolist()
            assert batch == data.samples(step)
            seen.extend(batch)
        step_now[0] = step + 1
    assert [d.num_loader_starts for d in layout] == [1]  # one start per switch, not per step
    assert seen == SampleOrder(60, 5).span(0, global_batch * steps)
    assert sorted(seen[:60]) == list(range(60)) and sorted(seen[60:120]) == list(range(60))


def test_data_loader_reads_a_step_again_after_a_failure_as_it_was_first_read():
    dataset = _Indexed(30)
    data = ElasticData(dataset, 4, 2, 1, seed=1, num_workers=2)
    first = [data.batch(s).tolist() for s in range(3)]
    again = data.batch(1).tolist()  # the step that failed is trained again: the loader restarts there
    assert again == first[1] and data.num_loader_starts == 2
    with pytest.raises(ValueError, match="for 30 samples with seed 1; this dataset has 31"):
        ElasticData(_Indexed(31), 4, 2, 1, seed=1).load_state_dict(data.state_dict())


def test_data_position_rides_the_app_state_as_switches_and_checkpoints_carry_it():
    """What a live switch carries and a periodic checkpoint stores (``etc_state.json``'s ``app``):
    the plain part of the app state, as JSON. Loaded into the new layout's ElasticData (another dp),
    the next step's samples are the global order's from the saved step on."""
    from etc_agent.worker.appstate import load_state, split_state

    dataset, global_batch = _Indexed(50), 8
    step_now = [0]
    old = ElasticData(dataset, global_batch, 4, 1, seed=2, num_workers=0)
    old.bind_step(lambda: step_now[0])
    for step in range(7):
        old.batch(step)
    step_now[0] = 7
    tensors, plain = split_state({"data": old})
    assert tensors == {}
    carried = json.loads(json.dumps(plain))  # what travels: JSON, never pickled
    new_layout = [ElasticData(dataset, global_batch, 3, r, seed=2, num_workers=0) for r in range(3)]
    for data in new_layout:
        load_state({"data": data}, carried, {})
    seen = [i for data in new_layout for i in data.batch(7).tolist()]
    assert seen == SampleOrder(50, 2).span(7 * global_batch, global_batch)
