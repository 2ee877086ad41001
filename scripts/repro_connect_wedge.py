"""Reproduce the wait on a peer that dies while a gloo group forms (issue: crash recovery).

Three processes form a gloo group through a generation store; rank 2 publishes its address and
exits before it connects (it dies at its first wait in the store, which comes right after it
published). Ranks 0 and 1 report how long their constructor took to fail; the JSON line has the
slowest of the two per mode:

    python scripts/repro_connect_wedge.py               # both ways side by side, timeout 10 s
    python scripts/repro_connect_wedge.py --timeout 60  # torch's way waits 5 x 60 s

``plain`` forms ``ProcessGroupGloo(store, rank, 3, timeout)`` as torch does (gloo's passive side
of a pair waits 5 x timeout for the connection); ``bounded`` forms it with
:func:`etc_agent.worker.connect.gloo_group` (with ``timeout``, given up 5 x
``ETC_AGENT_CONNECT_TIMEOUT`` after its store calls are over). Prints a table (each survivor's exit code
too: the abandoned constructor must not break its exit) and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import time
from datetime import timedelta

WORLD = 3
DYING_RANK = 2


def _form(rank: int, port: int, mode: str, timeout_s: float, results) -> None:
    import torch.distributed as dist

    from etc_agent.worker.connect import gloo_group
    from etc_agent.worker.genstore import GenerationStore

    class DiesAfterPublishing(GenerationStore):
        def wait(self, keys, timeout=None):
            if rank == DYING_RANK:
                os._exit(9)
            super().wait(keys, timeout)

    tcp = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=600), wait_for_workers=False)
    # Kept in a name: a Python store that only C++ refers to is collected, and its methods go with it.
    generation_store = DiesAfterPublishing(tcp, 1, lambda: None, 600)
    store = dist.PrefixStore(f"{mode}/", generation_store)
    timeout = timedelta(seconds=timeout_s)
    started = time.monotonic()
    try:
        if mode == "plain":
            dist.ProcessGroupGloo(store, rank, WORLD, timeout)
        else:
            gloo_group(store, rank, WORLD, timeout)
        outcome = "formed"
    except RuntimeError as error:
        outcome = str(error).splitlines()[0][-60:]
    results.put((rank, time.monotonic() - started, outcome))
    time.sleep(0.5)  # rank 0 hosts the store


def measure(mode: str, timeout_s: float) -> list[tuple[int, float, str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    processes = [ctx.Process(target=_form, args=(r, port, mode, timeout_s, results)) for r in range(WORLD)]
    for p in processes:
        p.start()
    got = sorted(results.get(timeout=6 * timeout_s + 60) for _ in range(WORLD - 1))
    for p in processes:
        p.join()
    codes = [p.exitcode for r, p in enumerate(processes) if r != DYING_RANK]
    return [(rank, seconds, f"{outcome} (exit code {codes[rank]})") for rank, seconds, outcome in got]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=10.0, help="the group's (collective) timeout, seconds")
    parser.add_argument("--modes", default="plain,bounded")
    args = parser.parse_args()
    summary = {"timeout_s": args.timeout, "connect_timeout_s": float(os.environ.get("ETC_AGENT_CONNECT_TIMEOUT", 1.0))}
    print(f"{'mode':<8} {'rank':>4} {'failed after s':>14}  outcome")
    for mode in args.modes.split(","):
        got = measure(mode, args.timeout)
        for rank, seconds, outcome in got:
            print(f"{mode:<8} {rank:>4} {seconds:>14.2f}  {outcome}")
        summary[f"{mode}_slowest_s"] = round(max(s for _, s, _ in got), 3)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
