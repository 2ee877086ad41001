"""The warm spare worker (etc_agent/agent/spares.py, etc_agent/worker/spare.py): a process of the
script waiting in ``etc_agent.init()`` that takes a crashed worker's place without a process start."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, etcd_rdzv
from elastic_demo import compare_states, reference_losses, run_scenario
from test_etcrun import Job, finish, launch

from etc_agent.agent.workers import WorkerGroup, WorkerSpec

SCRIPTS = ROOT / "tests" / "scripts"


def _env(local_rank: int, rank: int) -> dict[str, str]:
    return {
        "ETC_AGENT_LOCAL_RANK": str(local_rank),
        "LOCAL_RANK": str(local_rank),
        "RANK": str(rank),
        "ETC_AGENT_TOKEN": f"w{local_rank}:" + "ab" * 16,
    }


def _wait_ready(group: WorkerGroup, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    assert group.spare is not None
    while not group.spare.poll_ready():
        assert group.spare_exit_code() is None, f"the spare exited with {group.spare_exit_code()}"
        assert time.monotonic() < deadline, "the spare never said it waits"
        time.sleep(0.05)


def _adopted_worker_log(group: WorkerGroup, local_rank: int, attempt_dir: Path) -> str:
    """The adopted spare's stdout log, once it exited with the probe's code (3)."""
    group.workers[local_rank].proc.wait(timeout=90)
    assert group.poll()[local_rank] == 3
    for t in group.workers[local_rank].pumps:
        t.join(timeout=5)
    return (attempt_dir / str(local_rank) / "stdout.log").read_text()


@pytest.fixture
def probe_group(tmp_path: Path):
    spec = WorkerSpec(
        entrypoint=[str(SCRIPTS / "spare_probe.py"), "3"],
        start_method="spawn",
        log_dir=tmp_path,
        redirects={0: 3, 1: 3},
    )
    group = WorkerGroup(spec, [_env(0, 4), _env(1, 5)], tmp_path / "attempt_0")
    yield group
    group.stop(5.0)


def test_a_spare_becomes_the_crashed_local_rank_s_worker_with_its_environment_and_log(probe_group, tmp_path, capfd):
    """The spare runs the script's top without a rank, waits in become_worker(), and, adopted for
    local rank 1, runs on with exactly that rank's environment (its key, no spare descriptor), under
    that rank's pid entry, its output in that rank's log of the new attempt."""
    group = probe_group
    for worker in group.workers:
        worker.proc.wait(timeout=90)
    assert group.poll() == {0: 3, 1: 3}
    group.start_spare({})
    _wait_ready(group)
    assert group.spare is not None
    spare_pid = group.spare.proc.pid
    assert group.adopt_spare(1, _env(1, 7), tmp_path / "restart_1")
    assert group.spare is None
    assert group.pids()[1] == spare_pid
    log = _adopted_worker_log(group, 1, tmp_path / "restart_1")
    assert "worker LOCAL_RANK=1 RANK=7 token=set spare_fd=None" in log, log
    assert "top LOCAL_RANK" not in log  # said before its adoption: on the console, as the spare
    assert "[spare]:top LOCAL_RANK=None" in capfd.readouterr().out


def test_a_spare_adopted_before_it_is_ready_still_becomes_the_worker(probe_group, tmp_path):
    """A crash right after the spare started: the adoption waits in the socket (the agent has closed
    its end by the time the spare says ready) and the spare goes on as the worker."""
    group = probe_group
    for worker in group.workers:
        worker.proc.wait(timeout=90)
    group.start_spare({})
    assert group.adopt_spare(0, _env(0, 9), tmp_path / "restart_1")
    log = _adopted_worker_log(group, 0, tmp_path / "restart_1")
    assert "worker LOCAL_RANK=0 RANK=9 token=set spare_fd=None" in log, log


def test_a_spare_let_go_exits_0_at_once_and_none_is_adopted_twice(probe_group, tmp_path):
    group = probe_group
    group.start_spare({})
    _wait_ready(group)
    assert group.spare is not None
    proc = group.spare.proc
    started = time.monotonic()
    group.stop_spare(10.0)
    assert proc.returncode == 0 and time.monotonic() - started < 5.0
    for worker in group.workers:
        worker.proc.wait(timeout=90)
    assert not group.adopt_spare(1, _env(1, 5), tmp_path / "restart_1")  # nothing left to adopt


def test_a_killed_worker_s_place_goes_to_its_node_s_spare_and_the_state_stays_exact(etcd_server, tmp_path):
    """SIGKILL of a worker where the survivors may not shrink (--nnodes 2:2, tp=2): its node hands
    the rank to its warm spare (no process start), the job goes on from the replica, every step is
    trained once, the final state is bitwise the uninterrupted run's, and a new spare follows."""
    extra, steps = ["--elementwise"], 40
    result = run_scenario(
        "tp=2,pp=1,dp=auto",
        2,
        steps,
        0.15,
        tmp_path,
        echo=False,
        rdzv=etcd_rdzv(etcd_server, "spare"),
        events=("kill",),
        extra_script_args=extra,
        event_steps=[8],
        event_after_every_agent='"spare_worker_ready"',
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0, 0], f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    [record] = [result["migrations"][i] for e in result["events"] for i in e["migrations"]]
    # In place: the same four ranks (the spare said hello so soon that the leader may not have had
    # to wait for it: the reason then does not say "in place").
    assert "worker failure" in record["reason"] and record["new_world_size"] == 4, record
    assert record["total_stall_s"] < 5.0, record
    # The survivors' layout is the one they held: what they built ahead inside the stall is taken over
    # from the held shards and not written ahead; the adopted spare, which holds nothing, made the
    # pages of everything it receives resident while the plan was made.
    assert record["num_built_ahead"] >= 1 and record["bytes_touched_ahead"] == record["bytes_moved"], record
    killed_node = "".join(result["cluster"].outputs[1])
    assert '"event": "spare_worker_adopted"' in killed_node and '"from_spare": [' in killed_node, logs
    adopted_at = killed_node.index('"event": "spare_worker_adopted"')
    assert '"event": "spare_worker_started"' in killed_node[adopted_at:], "no new spare after the adoption"
    _, reference_state = reference_losses(steps, tmp_path, extra)
    assert compare_states(result["state_file"], reference_state) == []


def test_a_script_that_needs_its_rank_before_init_runs_without_spares_and_says_why(etcd_server, tmp_path):
    j = Job(etcd_server, tmp_path, nnodes="1:1")
    try:
        j.agents.append(launch(*j.args, str(SCRIPTS / "rank_before_init.py"), "40", "0.15"))
        [(code, text)] = finish(j.agents, timeout=180)
    finally:
        j.close()
    assert code == 0, text[-3000:]
    assert "step 39 local_rank 0" in text
    assert "spare_worker_off" in text and "before it was needed" in text, text[-3000:]
    assert "LOCAL_RANK" in text  # the spare's traceback names what it lacked
    assert subprocess.run(["pgrep", "-f", "rank_before_init.py"], capture_output=True).stdout == b""
