"""Run a function in N new processes on a gloo process group (127.0.0.1, random port).

One scenario helper for every multi-process test: ``run_workers(n, fn, *args)`` returns each rank's
return value and re-raises the first worker failure with its traceback. Every wait is bounded.

The processes are forked from multiprocessing's fork server, which imports torch (and
``torch.distributed``, DTensor, dynamo) once per test session: a new interpreter would spend 2-3 s
of CPU on those imports for every rank of every test. Nothing of this package is preloaded (its
modules read fault-injection variables at import), and each process gets the test's environment
as it is when ``run_workers`` is called, not the server's.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(
    rank: int, world: int, port: int, fn: Callable, args: tuple, queue, pg_timeout_s: float, env: dict[str, str]
) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - every failure goes back to the test
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_workers(
    world: int,
    fn: Callable,
    *args: Any,
    timeout_s: float = 180.0,
    pg_timeout_s: float = 60.0,
    may_exit: frozenset[int] = frozenset(),
) -> list[Any]:
    """Each rank's return value; a rank in ``may_exit`` may also die without reporting (its value: None)."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(r, world, port, fn, args, queue, pg_timeout_s, env), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        import queue as queue_mod
        import time

        deadline = time.monotonic() + timeout_s
        while len(results) < world and not errors:
            try:
                rank, status, value = queue.get(timeout=0.5)
            except queue_mod.Empty:
                for r in may_exit - set(results):
                    if procs[r].exitcode is not None:
                        results[r] = None
                dead = [r for r, p in enumerate(procs) if r not in results and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # a report may still be in the pipe
                    if queue.empty():
                        codes = ", ".join(f"{r} (exit code {procs[r].exitcode})" for r in dead)
                        raise AssertionError(f"workers {codes} exited without reporting") from None
                    continue
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world)) - set(results))
                    raise TimeoutError(f"workers {missing} did not finish within {timeout_s:.0f} s") from None
                continue
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    if errors:
        raise AssertionError("worker failed:\n" + errors[0])
    return [results[r] for r in range(world)]
