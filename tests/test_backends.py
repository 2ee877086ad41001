"""The default group's backends: gloo beside NCCL for the step boundary's CPU tensors, and the data
backend read back from a device map (etc_agent.utils.backends, worker.connect, worker.context)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
from conftest import ROOT

from etc_agent.utils.backends import data_backend, default_group_backend
from etc_agent.worker import connect


@pytest.mark.parametrize(
    "backend, default, data",
    [
        ("nccl", "cpu:gloo,cuda:nccl", "nccl"),
        ("gloo", "gloo", "gloo"),
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl", "nccl"),
        ("cpu:gloo", "cpu:gloo", "gloo"),
    ],
)
def test_nccl_jobs_get_gloo_beside_it_and_their_data_stays_on_nccl(backend, default, data):
    assert default_group_backend(backend) == default
    assert data_backend(default_group_backend(backend)) == data


def test_an_nccl_default_group_is_made_with_a_cpu_backend(monkeypatch):
    made = {}
    monkeypatch.setattr(connect.dist, "init_process_group", lambda backend, **kw: made.update(backend=backend, **kw))
    monkeypatch.setattr(connect.dist.distributed_c10d, "_set_pg_timeout", lambda timeout: None)
    connect.init_default_group("nccl", store=None, rank=0, world_size=2, timeout=timedelta(seconds=30))  # type: ignore[arg-type]
    assert made["backend"] == "cpu:gloo,cuda:nccl" and made["rank"] == 0 and made["world_size"] == 2


SCRIPT = textwrap.dedent(
    """
    from datetime import timedelta
    import torch.distributed as dist
    from etc_agent.layout import ParallelConfig
    from etc_agent.worker.boundary import boundary_vote
    from etc_agent.worker.context import _bounded_groups, make_context
    # A device map as an NCCL job's, with gloo standing in for NCCL on this CPU-only machine.
    dist.init_process_group("cpu:gloo,cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    vote = boundary_vote(seen=7, checkpointer=None, step=3)
    assert vote.pending == 7 and not vote.checkpoint_due, vote
    groups = _bounded_groups(timedelta(seconds=30))
    assert groups is not None and {backend for backend, _ in groups.values()} == {"gloo"}, groups
    ctx = make_context(ParallelConfig(tp=1, pp=1, dp=1), 0, 0, __import__("torch").device("cpu"), timeout=timedelta(seconds=30))
    print("ok", dist.get_backend(), ctx.config.short())
    """
)


def test_the_step_boundary_vote_and_the_mesh_run_on_a_device_mapped_default_group():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok cpu:gloo,cuda:gloo"), out.stdout
