"""The Megatron integration on a CUDA machine, in one call: what the CPU tests cannot reach.

    python scripts/megatron_gpu_check.py            # needs CUDA, megatron-core; Transformer Engine if installed

1. One process on ``cuda:0``: the example GPT (``etc_agent.examples.megatron_gpt``) with bf16
   parameters, Megatron DDP and the distributed optimizer, with Transformer Engine's layer specs when
   TE imports (its fused layer-norm linears and ``_extra_state``), trains 3 steps; the adapter
   describes the model and optimizer (every parameter has a box, every optimizer range a flat range).
2. With 2+ GPUs, ``etcrun --nproc-per-node N`` on NCCL: the same job, reconfigured live
   (``tp=2,pp=1`` -> ``tp=1,pp=2``) by ``etc-agent reconfigure``: the state entering the step after
   the switch must equal (digest) the state the step before left; losses are reported.

Prints one line per check and a JSON summary; exits 1 when a check fails. Not run on a GPU yet (the
machine this was written on has none): expect to adapt the first run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

MODEL = [
    "--layers",
    "4",
    "--hidden",
    "256",
    "--heads",
    "8",
    "--query-groups",
    "4",
    "--ffn",
    "704",
    "--vocab",
    "4096",
    "--seq",
    "64",
    "--global-batch",
    "8",
    "--bf16",
]


def single_gpu() -> dict:
    """Check 1 in a subprocess (a world of 1 on cuda:0)."""
    code = r"""
import json, sys, torch
import etc_agent
from etc_agent.examples import megatron_gpt
from etc_agent.integrations import megatron
from etc_agent.worker.appstate import split_state
args = megatron_gpt.parse_args(sys.argv[1:])
job = etc_agent.init(parallel="tp=1,pp=1,dp=1")
job.start(megatron_gpt.make_build(args))
losses = [megatron_gpt.train_step(args, job, s) for s in job.steps(3)]
tensors, plain = split_state(job.state)
params = {k: b for k, b in tensors.items() if k.startswith("model.")}
ranged = {k: b for k, b in tensors.items() if b.flat_range is not None}
try:
    import transformer_engine  # noqa: F401
    te = True
except Exception:
    te = False
print(json.dumps({"losses": losses, "tensors": len(tensors), "params": len(params), "ranged": len(ranged),
                  "bytes": sum(b.tensor.numel() * b.tensor.element_size() for b in tensors.values()),
                  "devices": sorted({str(b.tensor.device) for b in tensors.values()}), "transformer_engine": te,
                  "dtypes": sorted({str(b.tensor.dtype) for b in tensors.values()})}))
job.finish()
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETC_AGENT")}
    p = subprocess.run(
        [sys.executable, "-c", code, *MODEL], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600
    )
    if p.returncode != 0:
        return {"ok": False, "error": p.stderr[-3000:]}
    result = json.loads(p.stdout.strip().splitlines()[-1])
    ok = (
        result["params"] > 0
        and result["ranged"] > 0
        and all(d.startswith("cuda") for d in result["devices"])
        and "torch.bfloat16" in result["dtypes"]
        and all(x is not None for x in result["losses"])
    )
    return {"ok": ok, **result}


def multi_gpu(num_gpus: int) -> dict:
    """Check 2: a live tp/pp reconfiguration on NCCL through etcrun."""
    from elastic_demo import run_scenario

    nproc = 4 if num_gpus >= 4 else 2
    with tempfile.TemporaryDirectory(prefix="etc-gpu-") as tmp:
        work = Path(tmp)
        digests = work / "digests.jsonl"
        result = run_scenario(
            "tp=2,pp=1,dp=auto",
            nproc,
            30,
            0.0,
            work,
            echo=False,
            initial_agents=1,
            events=("reconfigure:tp=1,pp=2,dp=auto",),
            extra_script_args=[*MODEL, "--digest-log", str(digests)],
            module="etc_agent.examples.megatron_gpt",
            min_nodes=1,
        )
        if result["codes"] != [0]:
            return {"ok": False, "error": result["cluster"].tail(80)}
        from etc_agent.examples.megatron_gpt import compare_digests

        crossings, mismatches = compare_digests(digests)
        records = result["migrations"]
        return {
            "ok": len(crossings) == 1 and not mismatches and len(records) == 1,
            "crossings": crossings,
            "mismatches": mismatches,
            "migration": {k: records[0].get(k) for k in ("old_config", "new_config", "bytes_moved", "total_stall_s")}
            if records
            else None,
            "steps": len(result["losses"]),
        }


def main() -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("megatron_gpu_check: no CUDA device here (the CPU path is covered by tests/test_megatron.py)")
    started = time.monotonic()
    summary = {"gpus": torch.cuda.device_count(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    checks = {"single_gpu": single_gpu()}
    print(
        f"single GPU (bf16, distributed optimizer, TE specs if installed): {'ok' if checks['single_gpu']['ok'] else 'FAILED'}",
        flush=True,
    )
    if summary["gpus"] >= 2:
        checks["nccl_reconfigure"] = multi_gpu(summary["gpus"])
        print(
            f"NCCL live reconfigure tp=2 -> pp=2: {'ok' if checks['nccl_reconfigure']['ok'] else 'FAILED'}", flush=True
        )
    else:
        print("NCCL live reconfigure: skipped (one GPU; NCCL needs one device per rank)", flush=True)
    summary.update(checks=checks, wall_s=round(time.monotonic() - started, 1))
    print(json.dumps(summary))
    raise SystemExit(0 if all(c["ok"] for c in checks.values()) else 1)


if __name__ == "__main__":
    main()
