"""``etcrun`` keeps torchrun's contract: what a script, a scheduler or an operator relies on.

torch's own argument parser is the reference for the options; the scripts are plain torchrun
scripts (no worker API). Run against the code before the changes they cover, 17 of these 18 tests
failed; the etcd-v3 backend's state contract passed (it had no test before).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from datetime import timedelta

import pytest
import typer
from conftest import ROOT, _free_port
from test_etcrun import LOOPBACK, SCRIPTS, finish, launch

from etc_agent.cli.etcrun import app, parse_filters


def _etcrun_params() -> dict[str, object]:
    return {param.name: param for param in typer.main.get_command(app).params}


def test_every_torchrun_option_is_an_etcrun_option_read_from_its_PET_variable():
    from torch.distributed.run import get_args_parser

    params = _etcrun_params()
    missing, no_env = [], []
    for action in get_args_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        param = params.get(action.dest)
        if param is None or not set(action.option_strings) <= set(param.opts):
            missing.append(f"{action.dest} {action.option_strings}")
        elif param.envvar != f"PET_{action.dest.upper()}":
            no_env.append(f"{action.dest}: {param.envvar}")
    assert missing == [] and no_env == []


def test_options_come_from_PET_variables_and_a_flag_wins(tmp_path):
    """The Kubeflow training operator configures torchrun with PET_* variables only."""
    out = tmp_path / "env"
    out.mkdir()
    env = {"PET_NPROC_PER_NODE": "2", "PET_NO_PYTHON": "1", "PET_STANDALONE": "1"}
    ((code, text),) = finish([launch(str(SCRIPTS / "touch_rank.sh"), str(out), env=env)], timeout=60)
    assert code == 0, text[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["0", "1"]

    flagged = tmp_path / "flagged"
    flagged.mkdir()
    ((code, text),) = finish(
        [launch("--nproc-per-node", "3", str(SCRIPTS / "touch_rank.sh"), str(flagged), env=env)], timeout=60
    )
    assert code == 0, text[-3000:]
    assert sorted(p.name for p in flagged.iterdir()) == ["0", "1", "2"]


@pytest.mark.parametrize("scheme", ["tcp", "env"])
def test_init_on_master_addr_and_port_reaches_the_agents_store(scheme, tmp_path):
    """Static rendezvous: ``tcp://MASTER:PORT`` (and ``env://``) reach the TCPStore on --master-port."""
    port = _free_port()
    init = f"tcp://localhost:{port}" if scheme == "tcp" else "env://"
    p = launch(
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "localhost",
        "--master-port",
        str(port),
        str(SCRIPTS / "init_method.py"),
        "--init-method",
        init,
        "--out",
        str(tmp_path),
    )
    ((code, text),) = finish([p], timeout=90)
    assert code == 0, text[-3000:]
    assert {f.read_text().strip() for f in tmp_path.glob("*.txt")} == {f"localhost:{port}"}
    assert sorted(f.name for f in tmp_path.glob("*.txt")) == ["0.txt", "1.txt"]


def test_two_static_nodes_find_each_other_through_master_port_alone(tmp_path):
    port = _free_port()
    common = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--local-addr",
        "127.0.0.1",
    ]
    procs = [
        launch(
            *common,
            "--node-rank",
            str(rank),
            str(SCRIPTS / "init_method.py"),
            "--init-method",
            f"tcp://127.0.0.1:{port}",
            "--out",
            str(tmp_path),
        )
        for rank in (1, 0)
    ]  # the follower first
    outputs = finish(procs, timeout=120)
    for code, text in outputs:
        assert code == 0, text[-3000:]
    assert sorted(f.name for f in tmp_path.glob("*.txt")) == ["0.txt", "1.txt"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_that_ends_an_unfinished_job_exits_non_zero(sig, tmp_path):
    """torchrun exits 1 (SignalException); a scheduler must not record a killed job as a success."""
    p = launch(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-format",
        "json",
        str(SCRIPTS / "sleeper.py"),
        str(tmp_path),
        "60",
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(tmp_path.glob("*.json"))) == 2, "workers did not start"
    p.send_signal(sig)
    ((code, text),) = finish([p], timeout=60)
    assert code == 1, text[-3000:]
    assert '"event": "job_unfinished"' in text and sig.name in text


def test_signals_to_handle_are_forwarded_to_the_workers(tmp_path):
    """--signals-to-handle SIGUSR1 (Slurm's preemption notice): the agent leaves and its workers get
    SIGUSR1 (not SIGTERM), as torchrun forwards the signal it got."""
    p = launch(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--signals-to-handle",
        "SIGTERM,SIGUSR1",
        str(SCRIPTS / "signal_catcher.py"),
        str(tmp_path),
    )
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.up"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    p.send_signal(signal.SIGUSR1)
    ((code, text),) = finish([p], timeout=60)
    assert code == 1, text[-3000:]
    assert sorted(f.read_text() for f in tmp_path.glob("*.sig")) == ["SIGUSR1", "SIGUSR1"]


def test_a_planned_departure_while_others_go_on_exits_0(etcd_server, tmp_path):
    run_id = f"leave-{uuid.uuid4().hex[:6]}"
    args = [
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "etcd-v3",
        "--rdzv-endpoint",
        etcd_server.endpoint,
        "--rdzv-id",
        run_id,
        "--local-addr",
        "127.0.0.1",
        "--reconfig-delay",
        "0.3",
        "--lease-ttl",
        "2",
    ]
    stays, leaves = (launch(*args, str(SCRIPTS / "sleeper.py"), str(tmp_path), "60") for _ in range(2))
    deadline = time.monotonic() + 60
    while (
        not any('"WORLD_SIZE": "2"' in p.read_text() for p in tmp_path.glob("*.json")) and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    time.sleep(0.5)
    leaves.send_signal(signal.SIGTERM)
    assert leaves.wait(timeout=60) == 0
    assert stays.poll() is None  # the job goes on without it
    stays.send_signal(signal.SIGTERM)
    ((code, text),) = finish([stays], timeout=60)
    assert code == 1, text[-3000:]  # now the last node: the job ends unfinished


def test_a_worker_failure_prints_torchruns_root_cause_block(tmp_path):
    p = launch("--standalone", "--nproc-per-node", "3", "--log-dir", str(tmp_path), str(SCRIPTS / "fail_on_rank.py"))
    ((code, text),) = finish([p], timeout=90)
    assert code == 1, text[-3000:]
    block = text[text.index("fail_on_rank.py FAILED") :]
    root = block[block.index("Root Cause (first observed failure):") :]
    assert "rank      : 1 (local_rank: 1)" in root and "exitcode  : 1 (pid:" in root
    assert "error_file: " + str(tmp_path) in root and "RuntimeError: deliberate failure on rank 1" in root
    # The two workers stopped because of it are listed as failures, with their signal.
    failures = block[: block.index("Root Cause")]
    assert failures.count("exitcode  : -15") == 2 and "rank      : 0 (local_rank: 0)" in failures


def test_duplicate_stdout_filters_copy_matching_lines(tmp_path):
    out = tmp_path / "env"
    out.mkdir()
    p = launch(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--log-dir",
        str(tmp_path / "logs"),
        "--duplicate-stdout-filters",
        "rank 1,zz",
        str(SCRIPTS / "env_dump.py"),
        str(out),
        "--no-dist",
    )
    ((code, text),) = finish([p], timeout=60)
    assert code == 0, text[-3000:]
    (filtered,) = (tmp_path / "logs").rglob("filtered_stdout.log")
    assert filtered.read_text() == "[default1]:rank 1 done\n"
    assert parse_filters("a,,b,c") == ["a,b", "c"] and parse_filters("") == []


def test_virtual_local_rank_gives_every_worker_local_rank_0_and_its_own_device(tmp_path):
    p = launch(
        "--standalone",
        "--nproc-per-node",
        "2",
        "--virtual-local-rank",
        str(SCRIPTS / "dump_vars.py"),
        str(tmp_path),
        "LOCAL_RANK",
        "CUDA_VISIBLE_DEVICES",
        "ETC_AGENT_LOCAL_RANK",
        env={"CUDA_VISIBLE_DEVICES": "4,5"},
    )
    ((code, text),) = finish([p], timeout=60)
    assert code == 0, text[-3000:]
    seen = {int(f.stem): json.loads(f.read_text()) for f in tmp_path.glob("*.json")}
    assert seen == {
        0: {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "4", "ETC_AGENT_LOCAL_RANK": "0"},
        1: {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "5", "ETC_AGENT_LOCAL_RANK": "1"},
    }


@pytest.mark.parametrize(
    "args, message",
    [
        (["--numa-binding", "node"], "--numa-binding node: not supported"),
        (["--logs-specs", "custom"], "--logs-specs custom: custom LogsSpecs are not supported"),
        (["--signals-to-handle", "SIGNOPE"], "'SIGNOPE' is not a signal name"),
        (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be handled"),
    ],
)
def test_torchrun_options_etcrun_cannot_honour_are_refused(args, message):
    p = subprocess.run(
        [sys.executable, "-m", "etc_agent.cli.etcrun", "--standalone", *args, str(SCRIPTS / "env_dump.py")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **LOOPBACK},
    )
    assert p.returncode == 2 and message in p.stderr, p.stderr


# ---- the etcd-v3 rendezvous backend for torchrun ---------------------------------------------
@pytest.fixture
def backend(etcd_server):
    from etc_agent.rendezvous.etcd import EtcdOptions, EtcdStore
    from etc_agent.rendezvous.torch_backend import EtcdV3C10dStore, EtcdV3RendezvousBackend

    store = EtcdStore(EtcdOptions(endpoint=etcd_server.endpoint), f"torch-{uuid.uuid4().hex[:6]}")
    yield EtcdV3RendezvousBackend(store), EtcdV3C10dStore(store, timeout_s=1.0), store
    store.close()


def test_rendezvous_backend_state_follows_torchs_backend_contract(backend):
    """The behaviour torch's ``RendezvousBackendTestMixin`` checks of every backend."""
    from torch.distributed.elastic.rendezvous import RendezvousStateError

    rdzv, _, store = backend
    assert rdzv.get_state() is None
    state, token1, has_set = rdzv.set_state(b"x")
    assert (state, has_set) == (b"x", True) and token1 is not None
    assert rdzv.get_state() == (b"x", token1)
    state2, token2, has_set = rdzv.set_state(b"y", token1)  # current token: written
    assert (state2, has_set) == (b"y", True) and token2 != token1
    assert rdzv.set_state(b"z", token1) == (b"y", token2, False)  # old token: the current state back
    assert rdzv.set_state(b"z") == (b"y", token2, False)  # no token while a state exists
    assert rdzv.set_state(b"z", "invalid") == (b"y", token2, False)
    store.put("torch/rendezvous/state", "not base64 !")
    with pytest.raises(RendezvousStateError):
        rdzv.get_state()


@pytest.mark.alone  # wall-clock bounds
def test_c10d_store_waits_end_in_dist_store_error(backend):
    """torch's elastic barrier and store utilities catch ``DistStoreError``, not ``LookupError``."""
    import torch.distributed as dist

    _, c10d, _ = backend
    c10d.set("present", b"1")
    assert c10d.get("present") == b"1" and c10d.add("count", 2) == 2 and c10d.add("count", 3) == 5
    started = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="absent"):
        c10d.wait(["present", "absent"], timedelta(seconds=0.5))
    assert time.monotonic() - started < 5
    with pytest.raises(dist.DistStoreError):
        c10d.get("absent")
