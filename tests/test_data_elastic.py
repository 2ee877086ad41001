"""Exactly-once data end to end: the example GPT on a real-token dataset through etcrun over a real
etcd, through eight changes of membership and layout; every step's samples audited from the
``--sample-log`` against the global order, every loss against an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections import defaultdict

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from elastic_demo import reference_losses, run_scenario

from etc_agent.data import SampleOrder, TokenDataset

GLOBAL_BATCH = 24  # 12 micro-batches of 2: dp 2, 3, 4 and 6 all divide them
STEPS = 40  # 960 samples: the whole first epoch (876) and part of the second


@pytest.fixture(scope="module")
def pydoc_dataset(tmp_path_factory):
    out = tmp_path_factory.mktemp("data") / "pydoc"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/prepare_data.py"), "--out", str(out), "--seq-len", "128"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


CASES = {
    # name: (example module, first layout, events, event steps)
    "gpt-eight-changes": (
        "etc_agent.examples.gpt",
        "tp=1,pp=1,dp=auto",
        (
            "join",
            "leave",
            "reconfigure:tp=2,pp=1,dp=auto",
            "reconfigure:tp=1,pp=2,dp=auto",
            "reconfigure:tp=1,pp=1,dp=auto",
            "kill",
            "reconfigure:tp=2,pp=1,dp=auto",
            "join",
        ),
        [2, 5, 8, 11, 14, 17, 20, 23],
    ),
    # FSDP2 over 4, 6 and 4 ranks, HSDP 2x2 and back to FSDP2 over 4.
    "llama-fsdp-hsdp": (
        "etc_agent.examples.llama",
        "dp_shard=auto",
        ("join", "leave", "reconfigure:dp_replicate=2,dp_shard=auto", "reconfigure:dp_shard=auto"),
        [3, 8, 13, 18],
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_data_every_sample_once_through_changes_with_losses_of_the_uninterrupted_run(
    name, pydoc_dataset, etcd_server, tmp_path
):
    """Two agents of two workers, then the case's changes of membership and layout (for the GPT: a
    join, a planned leave, tp=2, pp=2, back to dp=4, a worker SIGKILL restored from a replica, tp=2
    again, a join; for the Llama: FSDP2 through a join and a leave, HSDP 2x2, FSDP2 again). Each
    step's samples, over its data-parallel ranks in the generation that completed it, are the next
    global batch of the (seed, epoch) order; the first epoch's samples are each trained exactly
    once; every loss is within 1e-4 of a one-process run with no changes."""
    module, parallel, events, event_steps = CASES[name]
    num_samples = len(TokenDataset(pydoc_dataset, seq_len=128))
    sample_log = tmp_path / "samples.jsonl"
    model = ["--data", str(pydoc_dataset), "--seq", "128", "--global-batch", str(GLOBAL_BATCH)]
    run_id = f"data-{uuid.uuid4().hex[:6]}"
    rdzv = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id]
    work = tmp_path / "run"
    work.mkdir()
    result = run_scenario(
        parallel,
        2,
        STEPS,
        0.05,
        work,
        echo=False,
        rdzv=rdzv,
        events=events,
        extra_script_args=[*model, "--sample-log", str(sample_log)],
        event_steps=event_steps,
        module=module,
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0] * len(result["codes"]), f"agents exited {result['codes']}\n{logs}"
    assert len(result["migrations"]) >= len(events), [m["new_config"] for m in result["migrations"]]

    entries: dict[int, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for line in sample_log.read_text().splitlines():
        entry = json.loads(line)
        entries[entry["step"]][entry["generation"]].append(entry)
    order = SampleOrder(num_samples, seed=0)
    trained: list[int] = []
    for step in range(STEPS):
        assert entries[step], f"no samples logged for step {step}\n{logs}"
        final = entries[step][max(entries[step])]  # a crash's step is trained again in the next generation
        ranks = sorted(final, key=lambda e: e["dp_rank"])
        assert [e["dp_rank"] for e in ranks] == list(range(len(ranks))), ranks
        samples = [i for e in ranks for i in e["samples"]]
        assert samples == order.span(step * GLOBAL_BATCH, GLOBAL_BATCH), f"step {step}"
        trained.extend(samples)
    assert sorted(trained[:num_samples]) == list(range(num_samples))  # the first epoch: each sample once
    assert len(set(trained[num_samples:])) == len(trained) - num_samples  # the second: none twice so far

    reference, _ = reference_losses(STEPS, work, model, module=module)
    losses = result["losses"]
    assert sorted(losses) == list(range(STEPS)), logs
    worst = max(abs(losses[s] - reference[s]) for s in range(STEPS))
    assert worst <= 1e-4, f"largest loss difference {worst:.2e}"
    assert reference[STEPS - 1] < reference[0] - 0.5, "the loss does not go down on real tokens"
