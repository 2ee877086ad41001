"""What exactly-once data costs: loader throughput against a plain DataLoader, and a switch's share.

    python scripts/bench_data.py                       # the default pydoc dataset, medians of 5
    python scripts/bench_data.py --data PATH --repeat 7

Throughput: batches of one data-parallel rank's share (``--global-batch`` / ``--dp``) read from the
token dataset for ``--steps`` steps, by :class:`etc_agent.data.ElasticData` (torchdata's
StatefulDataLoader over the step sampler, ``--workers`` processes prefetching) and by a plain
``torch.utils.data.DataLoader`` over the same dataset with a shuffling sampler, the same batch size
and workers, run alternately. A switch: what the data position adds to it, the old loader's
shutdown and the time from a new layout's ``ElasticData`` (built, position loaded from the old
one's ``state_dict``) to its first batch in hand (read in the process while the loader's workers
start), against a plain DataLoader's first batch (what any loader costs at a restart); and how long
the second batch is waited for after a ``--step-s`` training step. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from torch.utils.data import DataLoader, RandomSampler

from etc_agent.data import ElasticData, TokenDataset


def _plain(dataset: TokenDataset, batch: int, workers: int) -> DataLoader:
    sampler = RandomSampler(dataset, replacement=True, num_samples=10**9, generator=torch.Generator().manual_seed(0))
    return DataLoader(dataset, batch_size=batch, sampler=sampler, num_workers=workers, prefetch_factor=2)


def throughput(dataset: TokenDataset, args: argparse.Namespace) -> tuple[float, float]:
    """(ElasticData, plain DataLoader) batches per second over ``args.steps`` steps (first batch excluded)."""
    share = args.global_batch // args.dp
    elastic = ElasticData(dataset, args.global_batch, args.dp, 0, num_workers=args.workers)
    elastic.batch(0)
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        elastic.batch(step)
    elastic_rate = args.steps / (time.perf_counter() - started)
    elastic.close()
    plain = iter(_plain(dataset, share, args.workers))
    next(plain)
    started = time.perf_counter()
    for _ in range(args.steps):
        next(plain)
    plain_rate = args.steps / (time.perf_counter() - started)
    del plain
    return elastic_rate, plain_rate


def switch(dataset: TokenDataset, args: argparse.Namespace) -> dict[str, float]:
    """One switch from dp to dp+1 after 10 steps: the new ElasticData's first batch, the old one's
    shutdown, and a plain DataLoader's first batch (seconds)."""
    old = ElasticData(dataset, args.global_batch, args.dp, 0, num_workers=args.workers)
    for step in range(10):
        old.batch(step)
    state = {**old.state_dict(), "step": 10, "consumed": old.position.at(10)}
    started = time.perf_counter()
    old.close()
    closed = time.perf_counter()
    new = ElasticData(dataset, args.global_batch, args.dp + 1, 0, num_workers=args.workers)
    new.load_state_dict(state)
    new.batch(10)
    first = time.perf_counter()
    time.sleep(args.step_s)  # the first step after the switch trains meanwhile
    waited = time.perf_counter()
    new.batch(11)
    second = time.perf_counter()
    new.close()
    plain_started = time.perf_counter()
    next(iter(_plain(dataset, args.global_batch // (args.dp + 1), args.workers)))
    plain_first = time.perf_counter()
    return {
        "close_s": closed - started,
        "elastic_first_batch_s": first - closed,
        "elastic_switch_s": first - started,
        "elastic_second_batch_wait_s": second - waited,
        "plain_first_batch_s": plain_first - plain_started,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=None, help="A token dataset (default: prepare the pydoc one).")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--global-batch", type=int, default=48)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--step-s", type=float, default=0.1, help="A training step's time after a switch.")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        path = args.data
        if path is None:
            from prepare_data import main as prepare

            path = Path(tmp) / "pydoc"
            prepare(["--out", str(path), "--seq-len", str(args.seq)])
        dataset = TokenDataset(path, seq_len=args.seq)
        rates = [throughput(dataset, args) for _ in range(args.repeat)]
        switches = [switch(dataset, args) for _ in range(args.repeat)]
    elastic_rate = statistics.median(r[0] for r in rates)
    plain_rate = statistics.median(r[1] for r in rates)
    switch_median = {k: statistics.median(s[k] for s in switches) for k in switches[0]}
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"data loading: share of {args.global_batch // args.dp} x {args.seq} tokens, "
        f"{args.workers} workers, medians of {args.repeat}"
    )
    table.add_column("what")
    table.add_column("ElasticData")
    table.add_column("plain DataLoader")
    table.add_row("batches/s", f"{elastic_rate:.0f}", f"{plain_rate:.0f}")
    table.add_row(
        "first batch after a switch (ms)",
        f"{switch_median['elastic_first_batch_s'] * 1e3:.1f}",
        f"{switch_median['plain_first_batch_s'] * 1e3:.1f}",
    )
    table.add_row("old loader shut down (ms)", f"{switch_median['close_s'] * 1e3:.1f}", "")
    table.add_row("switch total (ms)", f"{switch_median['elastic_switch_s'] * 1e3:.1f}", "")
    table.add_row(
        f"wait for the 2nd batch after a {args.step_s:g} s step (ms)",
        f"{switch_median['elastic_second_batch_wait_s'] * 1e3:.1f}",
        "",
    )
    Console(width=120).print(table)
    print(
        json.dumps(
            {
                "bench": "data",
                "samples": len(dataset),
                "seq": args.seq,
                "share": args.global_batch // args.dp,
                "workers": args.workers,
                "repeat": args.repeat,
                "elastic_batches_per_s": round(elastic_rate, 1),
                "plain_batches_per_s": round(plain_rate, 1),
                "throughput_ratio": round(elastic_rate / plain_rate, 3),
                **{k: round(v, 4) for k, v in switch_median.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
