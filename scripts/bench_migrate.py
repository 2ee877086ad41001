#!/usr/bin/env python
"""ETC migration vs the checkpoint data path vs raw gloo, side by side in one run.

Four gloo processes on 127.0.0.1 hold a ~1.15 GB fp32 state (gpt-100m: parameters + Adam moments)
in an old layout and move it into a new one, for several transitions, alternating:

- ETC: ``migrate_state`` (describe, exchange, plan, local copies, packed point-to-point rounds);
- checkpoint: DCP ``save`` of the old shards to a directory (files synced) + DCP ``load`` into the
  new shards with resharding, each process reading its own new shards (no process restart here;
  ``scripts/bench_migration.py`` adds that);
- raw: the same messages as ETC's plan (same peers, same bytes, same rounds) sent with
  ``batch_isend_irecv`` from preallocated buffers, no packing: what the wire gives;
- raw pieces: the wire messages exactly as ETC cuts them (one per piece sent on its own, one per
  packed buffer, same tags and posting order), from preallocated contiguous buffers: ETC's message
  structure without its packing and unpacking copies.

Prints a table and one JSON line with medians over ``--repeat`` runs.

    python scripts/bench_migrate.py [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TRANSITIONS = [
    ("tp-down", "tp=4", "tp=2,dp=2"),
    ("zero-reshard", "dp=4,zero=1", "tp=2,dp=2,zero=1"),
    ("pp-to-dp", "tp=2,pp=2", "tp=1,pp=2,dp=2,zero=1"),
    ("zero-off-pp-up", "tp=2,dp=2,zero=1", "pp=4"),
    ("tp-up", "tp=2,dp=2", "tp=4"),
]
DEVICES = "n0:4"
WORLD = 4


def _state(layout, rank, fill):
    import torch

    from etc_agent.migrate import BoxedTensor
    from etc_agent.migrate.executor import TORCH_DTYPES

    out = {}
    for s in layout.shards_of(rank):
        shape = (s.numel,) if s.flat_range else s.lengths
        out[s.key] = BoxedTensor(
            torch.full(shape, fill, dtype=TORCH_DTYPES[s.dtype]), s.global_shape, s.offsets, s.lengths, s.flat_range
        )
    return out


def _raw_replay(plan, device, peer_of, names):
    """Send exactly the plan's messages from preallocated buffers; returns seconds."""
    import torch
    import torch.distributed as dist

    from etc_agent.migrate import TorchTransport

    transport = TorchTransport()
    rounds = {}
    for t in plan.transfers:
        if device in (t.src, t.dst):
            rounds.setdefault(t.round, []).append(t)
    # Pre-touched buffers: the wire alone, no page faults (ETC receives into already-touched tensors too).
    buffers = {id(t): torch.ones(t.num_bytes, dtype=torch.uint8) for ts in rounds.values() for t in ts}
    dist.barrier()
    started = time.perf_counter()
    for r in range(plan.num_rounds):
        ts = rounds.get(r, [])
        sends = [(peer_of[t.dst], buffers[id(t)], 0) for t in ts if t.src == device]
        recvs = [(peer_of[t.src], buffers[id(t)], 0) for t in ts if t.dst == device]
        transport.exchange(r, sends, recvs, 600.0, names)
    dist.barrier()
    return time.perf_counter() - started


def _pieces_replay(plan, device, peer_of, names):
    """Send the plan's messages cut into ETC's wire pieces (:func:`etc_agent.migrate.rounds._chunks`)
    from preallocated contiguous buffers, receives posted first; returns seconds."""
    import torch
    import torch.distributed as dist

    from etc_agent.migrate import TorchTransport
    from etc_agent.migrate.rounds import DIRECT_MIN_BYTES, _chunks

    transport = TorchTransport()
    sends: dict[int, list] = {}
    recvs: dict[int, list] = {}
    for t in plan.transfers:
        if device not in (t.src, t.dst):
            continue
        chunks, packed_size = _chunks(t, plan, DIRECT_MIN_BYTES)
        pieces = [(0, packed_size)] if packed_size else []
        pieces += [(i + 1, c.nbytes) for i, c in enumerate(chunks) if c.offset < 0]
        for tag, num_bytes in pieces:
            side = sends if t.src == device else recvs
            peer = peer_of[t.dst] if t.src == device else peer_of[t.src]
            side.setdefault(t.round, []).append((peer, torch.ones(num_bytes, dtype=torch.uint8), tag))
    dist.barrier()
    started = time.perf_counter()
    for r in range(plan.num_rounds):
        receiving = transport.post(r, [], recvs.get(r, []), 600.0, names)
        sending = transport.post(r, sends.get(r, []), [], 600.0, names)
        receiving.wait()
        sending.wait()
    dist.barrier()
    return time.perf_counter() - started


def _ring(num_bytes):
    """Every process sends ``num_bytes`` to the next and receives from the previous at once."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    send, recv = torch.ones(num_bytes, dtype=torch.uint8), torch.zeros(num_bytes, dtype=torch.uint8)
    dist.barrier()
    started = time.perf_counter()
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % world), dist.P2POp(dist.irecv, recv, (rank - 1) % world)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    dist.barrier()
    return world * num_bytes / (time.perf_counter() - started) / 1e9


def _chosen(args):
    if args.only:
        unknown = set(args.only) - {name for name, _, _ in TRANSITIONS}
        if unknown:
            sys.exit(f"unknown transitions {sorted(unknown)}; known: {[name for name, _, _ in TRANSITIONS]}")
        return [t for t in TRANSITIONS if t[0] in args.only]
    return TRANSITIONS[: args.transitions]


def worker(rank, port, args, queue):
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from etc_agent.layout import DeviceSet, ModelSpec, ParallelConfig, model_layout
    from etc_agent.migrate import describe_state, migrate_state
    from etc_agent.planner import plan_model_migration
    from etc_agent.worker.baseline import load_shards, save_shards

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600)
    )
    spec = ModelSpec.from_yaml(args.model)
    devices = DeviceSet.parse(DEVICES)
    device = devices[rank]
    transitions = _chosen(args)
    results = {name: {"etc": [], "ckpt": [], "raw": [], "pieces": [], "transfer": []} for name, _, _ in transitions}
    info = {}
    ring = [_ring(args.ring_mb << 20) for _ in range(args.repeat)]
    for rep in range(args.repeat):
        for name, old_text, new_text in transitions:
            old_cfg, new_cfg = ParallelConfig.parse(old_text), ParallelConfig.parse(new_text)
            decision = plan_model_migration(spec, old_cfg, devices, new_cfg, devices)
            new_rank = decision.assignment.index(device)
            old_layout, new_layout = model_layout(spec, old_cfg), model_layout(spec, new_cfg)

            # ETC
            old_state, new_state = _state(old_layout, rank, 1.0), _state(new_layout, new_rank, 0.0)
            dist.barrier()
            started = time.perf_counter()
            result = migrate_state(old_state, new_state, device=device, old_rank=rank, new_rank=new_rank, tp=new_cfg.tp)
            dist.barrier()
            results[name]["etc"].append(time.perf_counter() - started)
            results[name]["transfer"].append(result.metrics.transfer_phase_s)
            if args.verbose:
                m = result.metrics
                print(
                    f"  rank {rank} {name}: describe {m.describe_s:.3f} exchange {m.exchange_s:.3f} plan {m.plan_s:.3f} "
                    f"local {m.local_s:.3f} pack {m.pack_s:.3f} wire {m.transfer_s:.3f} unpack {m.unpack_s:.3f} "
                    f"sent {m.bytes_sent >> 20} MiB recv {m.bytes_received >> 20} MiB local {m.bytes_copied_locally >> 20} MiB "
                    f"staged {m.peak_buffer_bytes >> 20} MiB",
                    file=sys.stderr,
                    flush=True,
                )
            bad = sum(int((b.tensor != 1.0).sum()) for b in new_state.values())
            assert bad == 0, f"{name}: {bad} elements not migrated"
            plan = result.plan
            peer_of = {devices[r]: r for r in range(WORLD)}
            names = {r: str(devices[r]) for r in range(WORLD)}
            results[name]["raw"].append(_raw_replay(plan, device, peer_of, names))
            results[name]["pieces"].append(_pieces_replay(plan, device, peer_of, names))
            del old_state, new_state, result

            # checkpoint: save the old layout, load into the new one
            old_state, new_state = _state(old_layout, rank, 1.0), _state(new_layout, new_rank, 0.0)
            path = None
            if rank == 0:
                path = tempfile.mkdtemp(prefix="etc-bench-ckpt-", dir=args.dir)
            holder = [path]
            dist.broadcast_object_list(holder, src=0)
            path = holder[0]
            dist.barrier()
            started = time.perf_counter()
            save_shards(describe_state(old_state), path)
            dist.barrier()
            load_shards(describe_state(new_state), path)
            dist.barrier()
            results[name]["ckpt"].append(time.perf_counter() - started)
            bad = sum(int((b.tensor != 1.0).sum()) for b in new_state.values())
            assert bad == 0, f"{name}: checkpoint left {bad} elements unset"
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            del old_state, new_state
            info[name] = {
                "from": old_cfg.short(),
                "to": new_cfg.short(),
                "bytes_moved": plan.bytes_moved,
                "state_bytes": plan.state_bytes,
                "num_messages": plan.num_messages,
                "num_rounds": plan.num_rounds,
            }
            if rank == 0:
                print(
                    f"rep {rep} {name}: etc {results[name]['etc'][-1]:.3f} s (data {results[name]['transfer'][-1]:.3f} s), "
                    f"ckpt {results[name]['ckpt'][-1]:.3f} s, raw {results[name]['raw'][-1]:.3f} s, "
                    f"raw pieces {results[name]['pieces'][-1]:.3f} s",
                    file=sys.stderr,
                    flush=True,
                )
    dist.destroy_process_group()
    if rank == 0:
        queue.put((results, info, ring))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "configs/models/gpt-100m.yaml"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--transitions", type=int, default=len(TRANSITIONS))
    parser.add_argument("--only", action="append", help="Run only this transition (repeatable).")
    parser.add_argument("--ring-mb", type=int, default=256)
    parser.add_argument("--dir", default=None, help="Where checkpoints are written (default: the temp dir).")
    parser.add_argument("--quick", action="store_true", help="One repetition of three transitions.")
    parser.add_argument("--verbose", action="store_true", help="Per-process phase times of every ETC run.")
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.transitions = 1, 3
    import multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    import queue as queue_mod

    deadline = time.monotonic() + 3600
    while True:
        try:
            results, info, ring = queue.get(timeout=1.0)
            break
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in procs:
                    p.kill()
                sys.exit(
                    f"benchmark workers {dead} failed (exit codes {[procs[r].exitcode for r in dead]})"
                    if dead
                    else "benchmark timed out"
                )
    for p in procs:
        p.join(timeout=60)
    rows = []
    for name, _, _ in _chosen(args):
        r, i = results[name], info[name]
        etc, ckpt, raw, pieces, transfer = (
            statistics.median(r[k]) for k in ("etc", "ckpt", "raw", "pieces", "transfer")
        )
        moved = i["bytes_moved"]
        etc_gbps = moved / transfer / 1e9 if moved and transfer else None
        raw_gbps = moved / raw / 1e9 if moved and raw else None
        rows.append(
            {
                "name": name,
                **i,
                "etc_s": etc,
                "ckpt_s": ckpt,
                "ratio": ckpt / etc,
                "etc_transfer_s": transfer,
                "raw_s": raw,
                "etc_gbps": etc_gbps,
                "raw_gbps": raw_gbps,
                "raw_fraction": etc_gbps / raw_gbps if etc_gbps and raw_gbps else None,
                "raw_pieces_s": pieces,
                "pieces_fraction": pieces / transfer if moved and transfer else None,
                "etc_runs": r["etc"],
                "ckpt_runs": r["ckpt"],
            }
        )
    from rich.console import Console
    from rich.table import Table

    from etc_agent.cli.report import fmt_bytes

    table = Table(
        title=f"migration of a {fmt_bytes(rows[0]['state_bytes'])} state over {WORLD} gloo processes (median of {args.repeat})",
        header_style="bold",
    )
    for col in (
        "transition",
        "moved",
        "ETC s",
        "checkpoint s",
        "ckpt/ETC",
        "ETC data GB/s",
        "raw GB/s",
        "ETC/raw",
        "raw pieces s",
        "ETC/raw pieces",
    ):
        table.add_column(col, justify="left" if col == "transition" else "right")
    for r in rows:
        table.add_row(
            f"{r['name']}: {r['from']} -> {r['to']}",
            fmt_bytes(r["bytes_moved"]),
            f"{r['etc_s']:.3f}",
            f"{r['ckpt_s']:.3f}",
            f"{r['ratio']:.1f}x",
            "-" if r["etc_gbps"] is None else f"{r['etc_gbps']:.2f}",
            "-" if r["raw_gbps"] is None else f"{r['raw_gbps']:.2f}",
            "-" if r["raw_fraction"] is None else f"{r['raw_fraction']:.0%}",
            f"{r['raw_pieces_s']:.3f}",
            "-" if r["pieces_fraction"] is None else f"{r['pieces_fraction']:.0%}",
        )
    table.caption = f"raw ring (all {WORLD} sending at once): {statistics.median(ring):.2f} GB/s aggregate"
    Console(width=170).print(table)
    print(
        json.dumps(
            {
                "bench": "migrate",
                "world": WORLD,
                "repeat": args.repeat,
                "raw_ring_gbps": statistics.median(ring),
                "median_ratio": statistics.median(r["ratio"] for r in rows),
                "transitions": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
