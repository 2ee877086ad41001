"""Check that a point-to-point receive on a :func:`~etc_agent.worker.connect.gloo_group` group waits for a late sender.

gloo copies a group's forming timeout into its transport context, and a receive without a timeout
of its own (``dist.recv``, ``work.wait()``: a pipeline stage waiting for the previous stage's
forward) waits that long; ``_set_default_timeout`` and ``set_timeout`` do not reach it. Groups once
formed under ``ETC_AGENT_CONNECT_TIMEOUT`` (1 s) and given the collective timeout afterwards failed
such a receive after 1 s ("Timed out waiting 1000ms for recv operation"); :func:`gloo_group` now
forms them with the collective timeout and bounds the connect another way (docs/faults.md).

Two processes form a group with a 30-s collective timeout; rank 0 sends after ``--delay`` seconds,
rank 1 receives with ``work.wait()``. Each mode reports whether the receive completed and when:

    python scripts/repro_gloo_p2p_timeout.py              # delay 2.5 s
    python scripts/repro_gloo_p2p_timeout.py --delay 0.5

``bounded``: :func:`~etc_agent.worker.connect.gloo_group`; ``plain``: ``ProcessGroupGloo`` formed
with the 30-s timeout. Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from datetime import timedelta

from elastic_demo import free_port
from rich.console import Console
from rich.table import Table

TIMEOUT = timedelta(seconds=30)


def _pair(rank: int, port: int, mode: str, delay_s: float, results) -> None:
    import torch
    import torch.distributed as dist

    from etc_agent.worker.connect import gloo_group

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=TIMEOUT)
    group = gloo_group(store, rank, 2, TIMEOUT) if mode == "bounded" else dist.ProcessGroupGloo(store, rank, 2, TIMEOUT)
    if rank == 0:
        time.sleep(delay_s)
        try:
            group.send([torch.ones(4)], 1, 0).wait()
        except RuntimeError:
            pass  # the receiver gave up and closed the pair
        return
    started = time.monotonic()
    try:
        group.recv([torch.zeros(4)], 0, 0).wait()
        results[mode] = {"completed": True, "after_s": round(time.monotonic() - started, 2), "error": ""}
    except RuntimeError as err:
        first = str(err).strip().splitlines()[0]
        results[mode] = {"completed": False, "after_s": round(time.monotonic() - started, 2), "error": first[-80:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay", type=float, default=2.5, help="seconds before rank 0 sends")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        for mode in ("bounded", "plain"):
            port = free_port()
            procs = [ctx.Process(target=_pair, args=(r, port, mode, args.delay, results)) for r in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=120)
        summary = {"delay_s": args.delay, **{mode: dict(results[mode]) for mode in results.keys()}}
    table = Table(title=f"gloo recv with the sender {args.delay:g} s late (collective timeout 30 s)")
    for column in ("group", "recv completed", "after s", "error"):
        table.add_column(column)
    for mode in ("bounded", "plain"):
        row = summary.get(mode, {"completed": "-", "after_s": "-", "error": "no result"})
        table.add_row(mode, str(row["completed"]), str(row["after_s"]), row["error"])
    Console().print(table)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
