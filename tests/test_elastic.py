"""End to end through ``etcrun`` over a real etcd: the example GPT trained through a join, a planned
leave (SIGTERM) and a crash (SIGKILL of a worker), with no checkpoint; compared with an
uninterrupted single-process run of the same global batch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import uuid

import pytest
from conftest import LEAVE_SPREAD_S, ROOT, etcd_rdzv

sys.path.insert(0, str(ROOT / "scripts"))
from elastic_demo import compare_states, reference_losses, run_scenario

CASES = {
    # name: (parallel, workers per agent, steps, step delay, events, elementwise)
    "tp2-torch-adamw-loss": ("tp=2,pp=1,dp=auto", 2, 40, 0.1, ("join", "leave", "kill"), False),
    # 60 steps: the joining agent warms up its workers (interpreter, torch) before it enters, and on 2
    # busy cores that took longer than the 32 steps left of a 40-step run once.
    "tp2-bitwise": ("tp=2,pp=1,dp=auto", 2, 60, 0.15, ("join", "leave", "kill"), True),
    # etc-agent sidecar per node, workers started (and the killed one restarted) by etc-agent workers.
    "tp2-sidecar-bitwise": ("tp=2,pp=1,dp=auto", 2, 60, 0.15, ("join", "leave", "kill"), True),
    # A joining agent starts its 4 workers before it enters (10+ s on 2 loaded cores); the run's last
    # steps are held back (run_scenario's slow_during_events) until both events are through.
    "tp2pp2-zero1-bitwise": ("tp=2,pp=2,dp=auto,zero=1", 4, 60, 0.2, ("join", "leave"), True),
    # hang: SIGSTOP of a worker, killed by its agent after --worker-heartbeat-timeout (AGENT_ARGS).
    "tp2pp2-loss": ("tp=2,pp=2,dp=auto", 4, 44, 0.2, ("join", "leave", "kill", "hang"), False),
}
MODEL_ARGS = {"tp2pp2-loss": ["--layers", "2"]}  # one layer per stage: 8 workers on 2 cores train slowly
AGENT_ARGS = {
    "tp2pp2-loss": ["--worker-heartbeat-timeout", "3"],
    # Every switch arrives and forms its migration group inside the stall, as memory-tight jobs ask.
    "tp2-torch-adamw-loss": ["--prepare", "off"],
}


@pytest.mark.parametrize("name", list(CASES))
def test_elastic_training_through_join_leave_and_crash(name, etcd_server, tmp_path):
    parallel, nproc, steps, delay, events, elementwise = CASES[name]
    run_id = f"{name}-{uuid.uuid4().hex[:6]}"
    rdzv = ["--rdzv-backend", "etcd-v3", "--rdzv-endpoint", etcd_server.endpoint, "--rdzv-id", run_id]
    extra = (["--elementwise"] if elementwise else []) + MODEL_ARGS.get(name, [])
    if "torch-adamw" in name:
        extra += ["--optimizer", "torch"]
    work = tmp_path / "elastic"
    work.mkdir()
    sidecar = "sidecar" in name
    result = run_scenario(
        parallel,
        nproc,
        steps,
        delay,
        work,
        echo=False,
        rdzv=rdzv,
        events=events,
        extra_script_args=extra,
        sidecar=sidecar,
        agent_args=AGENT_ARGS.get(name),
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0] * len(result["codes"]), f"agents exited {result['codes']}\n{logs}"
    if sidecar:
        assert result["cluster"].launcher_codes() == [0] * len(result["codes"]), logs
        text = "".join("".join(lines) for lines in result["cluster"].outputs)
        assert '"worker_attached"' in text and "starting it again" in text, (
            logs
        )  # the killed worker came back through its launcher
        # The leave signalled the workers' launcher first, as a terminating pod does: it asked its
        # sidecar to leave instead of stopping the workers, who handed their state over.
        assert '"departure_requested"' in text and "the sidecar leaves the job" in text, logs

    # Every step trained once to completion, in order, across every event.
    losses = result["losses"]
    assert sorted(losses) == list(range(steps)), f"steps missing: {sorted(set(range(steps)) - set(losses))}\n{logs}"

    # One migration record per event, in order, with the layout each event implies; a crash has the
    # job go on without the crashed worker's node, and a second one when that node rejoins.
    records = sorted(result["migrations"], key=lambda m: m["generation"])
    per_event = [[records[i] for i in done["migrations"]] for done in result["events"]]
    crashes = ("kill", "hang")
    in_place = [e in crashes and "in place" in r[0]["reason"] for e, r in zip(events, per_event)]
    assert [len(r) for r in per_event] == [2 if e in crashes and not p else 1 for e, p in zip(events, in_place)], [
        r["reason"] for r in records
    ]
    unit = 4 if "pp=2" in parallel else 2
    world = 2 * nproc
    for event, (record, *rejoin), restarted_in_place in zip(events, per_event, in_place):
        old_world = world
        shrinks = event == "leave" or (event in crashes and not restarted_in_place)
        world = world + nproc if event == "join" else (world - nproc if shrinks else world)
        assert (record["old_world_size"], record["new_world_size"]) == (old_world, world), record
        assert f"dp={world // unit}" in record["new_config"], record
        # A checkpoint writes every element once and every new rank reads its shards back.
        assert record["state_bytes"] > 0 and record["checkpoint_bytes"] >= 2 * record["state_bytes"], record
        assert record["bytes_moved"] < record["checkpoint_bytes"], record
        assert record["total_stall_s"] > 0 and record["transfer_s"] >= 0, record
        # The slowest rank's stall in named parts that add up to it, none of it unaccounted.
        parts = record["stall_parts"]
        assert parts is not None and sum(parts.values()) == pytest.approx(record["total_stall_s"], abs=2e-3), record
        assert parts["unaccounted_s"] < 0.1 and parts["transfer_s"] <= record["transfer_s"] + 1e-3, record
        if event in ("join", "leave"):
            # The old world's processes heard of the generation before the boundary that took it over:
            # they had arrived and formed its migration group while training.
            prepared = "--prepare" not in AGENT_ARGS.get(name, [])
            assert (record["num_prepared"] > 0) == prepared, record
            # Every process published its description while training and planned from everyone's:
            # the stall neither planned nor compared plan hashes (the example builds ahead).
            assert record["planned_ahead"] == prepared, record
        if event == "join":
            assert record["bytes_moved"] > 0, record  # the new replicas receive their state
        if event == "leave":
            assert len(record["senders"]) == nproc, record
        if event in crashes:
            assert "worker failure" in record["reason"] and len(record["lost"]) >= 1, record
            assert record["leave_spread_s"] <= LEAVE_SPREAD_S, record  # every survivor left its collective at once
            # Below --nnodes MIN the others wait for the restart in place; else they go on at once
            # and the node rejoins once its restarted worker runs.
            if not restarted_in_place:
                [back] = rejoin
                assert "joined" in back["reason"] and back["new_world_size"] == old_world, back
                assert back["bytes_moved"] > 0, back  # the restarted node's workers received their state
                world = old_world
            else:
                assert record["bytes_moved"] > 0, record  # the restarted worker's shards came from a replica

    if "hang" in events:
        hung = [json.loads(line) for line in result["cluster"].outputs[1] if '"worker_hung"' in line]
        assert len(hung) == 1 and hung[0]["silent_s"] >= 3, logs  # its agent found it silent and killed it

    # No checkpoint was written or read: the run directory holds only the loss log and the final dump.
    assert sorted(p.name for p in work.iterdir() if not p.name.startswith("agent-")) == ["loss.jsonl", "state.pt"]

    reference, reference_state = reference_losses(steps, tmp_path, extra)
    if elementwise:
        assert compare_states(result["state_file"], reference_state) == []
    else:
        worst = max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in range(steps))
        assert worst <= 1e-4, f"loss differs from the uninterrupted run by {worst:.2e} (relative)"

    # `etc-agent status` shows the last migration.
    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "etc_agent.cli.main",
            "status",
            "--rdzv-endpoint",
            etcd_server.endpoint,
            "--rdzv-id",
            run_id,
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    shown = json.loads(status.stdout)["last_migration"]
    assert shown is not None and shown["generation"] == records[-1]["generation"]
    assert shown["new_config"] == records[-1]["new_config"]


def test_a_crash_that_takes_the_only_copy_fails_the_job_naming_the_lost_state(etcd_server, tmp_path):
    """zero=1 splits the optimizer state over dp: a killed rank's range has no replica. The job must
    stop with the lost tensors named (not restart from scratch, not hang)."""
    rdzv = etcd_rdzv(etcd_server, "lost")
    started = time.monotonic()
    result = run_scenario(
        "tp=1,pp=1,dp=auto,zero=1",
        2,
        60,
        0.1,
        tmp_path,
        echo=False,
        rdzv=rdzv,
        events=("kill",),
        wait_migrations=False,
        extra_script_args=["--micro-batch", "1"],
        event_steps=[4],
    )
    assert result["codes"] == [1, 1], result["codes"]
    # 7 s here; it took 90 s while a group that saw a failed collective outlived its destruction (the
    # survivors waited out the dead peer's sockets). 30 s leaves room for a slower machine.
    assert time.monotonic() - started < 30
    text = "".join("".join(lines) for lines in result["cluster"].outputs)
    assert "state lost" in text and "optim.state.model." in text
    assert "job_failed" in text and max(result["losses"]) < 59  # stopped, not trained on from scratch


@pytest.mark.parametrize(
    "parallel,nproc", [("tp=1,pp=1,dp=auto,zero=1", 2), ("tp=1,pp=2,dp=auto", 1)], ids=["zero1-range", "pp-stage"]
)
def test_a_crash_that_takes_the_only_copy_restores_just_that_from_the_periodic_checkpoint(
    etcd_server, tmp_path, parallel, nproc
):
    """The same crash with --checkpoint-interval: what only the killed rank held (its ZeRO range, or
    a whole pipeline stage) comes from the last checkpoint, and only that: the rest comes from the
    survivors' snapshots of the same step. The steps since are trained again, and the result is
    bitwise the uninterrupted run's."""
    rdzv = etcd_rdzv(etcd_server, "restore")
    checkpoints, work = tmp_path / "checkpoints", tmp_path / "run"
    work.mkdir()
    extra = ["--micro-batch", "1", "--elementwise"]
    steps = 40
    result = run_scenario(
        parallel,
        nproc,
        steps,
        0.15,
        work,
        echo=False,
        rdzv=rdzv,
        events=("kill",),
        agent_args=["--checkpoint-dir", str(checkpoints), "--checkpoint-interval", "5"],
        extra_script_args=extra,
        event_steps=[17],
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0, 0], f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    [record] = result["migrations"]
    assert "worker failure" in record["reason"], record
    # Only the lost optimizer range was read: some bytes, far less than the state (params, the other
    # ranks' ranges and the replicated state came from the survivors' snapshots).
    assert 0 < record["bytes_restored"] < record["state_bytes"] * (0.5 if "zero=1" in parallel else 0.8), record
    assert record["bytes_moved"] + record["bytes_reused"] > 0, record
    assert record["restored_from"] and "step000000" in record["restored_from"], record
    assert record["redone_steps"] >= 1 and record["step"] % 5 == 0, record
    text = "".join("".join(lines) for lines in result["cluster"].outputs)
    assert "have no live copy" in text and f"resuming at step {record['step']}" in text
    assert '"etc_checkpoint"' in text
    _, reference_state = reference_losses(steps, tmp_path, extra)
    assert compare_states(result["state_file"], reference_state) == []


def test_a_worker_crash_with_default_flags_lets_the_others_go_on_and_its_node_rejoins_warm(etcd_server, tmp_path):
    """SIGKILL of one worker under tp=2,dp=auto on 2 agents x 2, --nnodes 1:3 and no --max-restarts:
    the other node trains on alone at once (its replica holds everything), the crashed worker's node
    restarts it, sends what its survivor holds, and rejoins once it runs; every step trained once,
    the final state bitwise the uninterrupted run's."""
    rdzv = etcd_rdzv(etcd_server, "goon")
    extra, steps = ["--elementwise"], 40
    result = run_scenario(
        "tp=2,pp=1,dp=auto",
        2,
        steps,
        0.15,
        tmp_path,
        echo=False,
        rdzv=rdzv,
        events=("kill",),
        min_nodes=1,
        extra_script_args=extra,
        event_steps=[8],
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0, 0], f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    [[failure, back]] = [[result["migrations"][i] for i in e["migrations"]] for e in result["events"]]
    assert "worker failure" in failure["reason"] and "in place" not in failure["reason"], failure
    assert (failure["old_world_size"], failure["new_world_size"]) == (4, 2), failure
    assert failure["bytes_moved"] == 0, failure  # the survivors' replica held every shard
    assert failure["leave_spread_s"] <= LEAVE_SPREAD_S and failure["total_stall_s"] < 5.0, failure
    assert "joined" in back["reason"] and (back["old_world_size"], back["new_world_size"]) == (2, 4), back
    text = "".join("".join(lines) for lines in result["cluster"].outputs)
    assert "the others go on, this node rejoins once they run" in text and "waiting as a standby" in text
    _, reference_state = reference_losses(steps, tmp_path, extra)
    assert compare_states(result["state_file"], reference_state) == []


@pytest.mark.alone  # wall-clock bounds
def test_ten_worker_kills_in_a_row_never_stall_the_survivors_over_2_s(etcd_server, tmp_path):
    """Ten SIGKILLs of a worker in one job (tp=2,dp=auto, 2 agents x 2, --nnodes 1:3, --max-restarts 10:
    the default, 3 crash restarts per node, would have the node leave at the fourth),
    each once the job is back at full strength after the previous one: every time the other node
    goes on at once from its replica and the killed worker's node rejoins once its restarted worker
    (forked in milliseconds) runs; no switch stalls anyone over 2 s, every step is trained once and
    the final state is bitwise the uninterrupted run's."""
    kills, steps = 10, 110
    extra = ["--elementwise"]
    result = run_scenario(
        "tp=2,pp=1,dp=auto",
        2,
        steps,
        0.1,
        tmp_path,
        echo=False,
        rdzv=etcd_rdzv(etcd_server, "tenkills"),
        events=("kill",) * kills,
        agent_args=["--max-restarts", str(kills)],
        min_nodes=1,
        extra_script_args=extra,
        event_steps=list(range(6, 6 + 8 * kills, 8)),
        gap_before={"kill": 2},
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0, 0], f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    per_kill = [[result["migrations"][i] for i in e["migrations"]] for e in result["events"]]
    assert len(per_kill) == kills
    for failure, *back in per_kill:
        assert "worker failure" in failure["reason"] and failure["old_world_size"] == 4, failure
        assert failure["leave_spread_s"] <= 2.0 and failure["total_stall_s"] <= 2.0, failure
        # Mostly the others go on alone (4 -> 2) and the node rejoins (2 -> 4); a restart quicker
        # than the leader's decision has the node in the failure's generation already.
        assert [r["new_world_size"] for r in [failure, *back]][-1] == 4, [failure, *back]
        assert all("joined" in r["reason"] and r["total_stall_s"] <= 2.0 for r in back), back
    _, reference_state = reference_losses(steps, tmp_path, extra)
    assert compare_states(result["state_file"], reference_state) == []


@pytest.mark.parametrize(
    "parallel,agents,nproc,event",
    [
        ("tp=2,pp=2,dp=auto", 4, 2, "kill-agent"),
        ("tp=2,pp=2,dp=auto", 2, 4, "kill-leader"),
        ("tp=2,pp=1,dp=auto", 3, 2, "kill-agent"),
    ],
    ids=["4x2", "2x4-leader", "tp2-3x2"],
)
def test_a_whole_node_killed_loses_no_state_with_the_resilient_placement(
    etcd_server, tmp_path, parallel, agents, nproc, event
):
    """SIGKILL of a whole agent (its workers die with it) under tp=2,pp=2,dp=2 (and under tp=2,dp=3,
    where each node holds one whole replica and the survivors go on with dp=2). The placement keeps
    the two DP replicas of each stage on different nodes (on 2 agents x 4, Megatron's order would put
    a whole stage on one node), so the survivors hold everything: training goes on with the exact
    state and no checkpoint. With 4 agents, the layout after the loss uses 2 of the 3 survivors: the
    third holds a replica too and sends it before going idle as a spare. The dead agent's lease is
    30 s: the survivors go on once the leader found its liveness port closed, not when it expires;
    on 2 agents the node killed is the leader's, and the other agent takes the leadership over the
    same way."""
    rdzv = etcd_rdzv(etcd_server, "node")
    work = tmp_path / "run"
    work.mkdir()
    extra = ["--elementwise", "--micro-batch", "1"]
    steps = 40
    result = run_scenario(
        parallel,
        nproc,
        steps,
        0.15,
        work,
        echo=False,
        rdzv=rdzv,
        events=(event,),
        extra_script_args=extra,
        initial_agents=agents,
        min_nodes=1,
        event_steps=[8],
        agent_args=["--lease-ttl", "30"],
    )
    logs = result["cluster"].tail(60)
    text = "".join("".join(lines) for lines in result["cluster"].outputs)
    assert sorted(result["codes"]) == [-9] + [0] * (agents - 1), f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    [record] = result["migrations"]
    dp_before = agents * nproc // (2 * (2 if "pp=2" in parallel else 1))
    assert record["old_config"].startswith(parallel.replace("dp=auto", f"dp={dp_before}")), record
    assert record["new_config"].startswith(parallel.replace("dp=auto", f"dp={dp_before - 1}")), record
    assert len(record["lost"]) == nproc and record["bytes_restored"] == 0, record
    assert record["leave_spread_s"] <= LEAVE_SPREAD_S, record  # every survivor left its collective at once
    assert '"agent_gone"' in text and record["total_stall_s"] < 15, f"{record}\n{logs}"  # not the 30 s lease
    assert "state lost" not in text
    assert sorted(p.name for p in work.iterdir() if not p.name.startswith("agent-")) == [
        "loss.jsonl",
        "state.pt",
    ]  # no checkpoint
    _, reference_state = reference_losses(steps, tmp_path, extra)
    assert compare_states(result["state_file"], reference_state) == []


def test_checkpoint_baseline_through_etcrun(etcd_server, tmp_path):
    """--migration checkpoint: at each change every worker saves with DCP and exits, fresh workers
    load with resharding. Same training result; its records say what it moved and how long it stalled."""
    rdzv = etcd_rdzv(etcd_server, "ckpt")
    checkpoints = tmp_path / "checkpoints"
    work = tmp_path / "run"
    work.mkdir()
    steps = 40
    result = run_scenario(
        "tp=2,pp=1,dp=auto",
        2,
        steps,
        0.1,
        work,
        echo=False,
        rdzv=rdzv,
        events=("join", "leave"),
        agent_args=["--migration", "checkpoint", "--checkpoint-dir", str(checkpoints)],
    )
    assert result["codes"] == [0, 0, 0], result["cluster"].tail(40)
    assert sorted(result["losses"]) == list(range(steps))
    records = sorted(result["migrations"], key=lambda m: m["generation"])
    assert [r["method"] for r in records] == ["checkpoint", "checkpoint"]
    assert [r["checkpoint_api"] for r in records] == ["boxes", "boxes"]  # no FSDP2 module: the described shards
    assert [(r["old_world_size"], r["new_world_size"]) for r in records] == [(4, 6), (6, 4)]
    for r in records:
        assert r["state_bytes"] > 0 and r["bytes_moved"] > r["state_bytes"] and r["total_stall_s"] > r["transfer_s"] > 0
    # One save per change, named by the generation that loaded it (on a busy machine the two first
    # agents may start apart, so the numbers need not be 1 and 2).
    assert sorted(p.name for p in checkpoints.iterdir()) == [f"gen{r['generation']}" for r in records]
    reference, _ = reference_losses(steps, tmp_path)
    worst = max(abs(result["losses"][s] - reference[s]) / abs(reference[s]) for s in range(steps))
    assert worst <= 1e-4


def test_reconfigure_changes_tp_pp_and_zero_on_the_same_devices(etcd_server, tmp_path):
    """`etc-agent reconfigure`: tp=2 -> tp=1,pp=2 -> tp=2,zero=1 on the same 4 workers, live."""
    rdzv = etcd_rdzv(etcd_server, "reconf")
    steps = 40
    events = ("reconfigure:tp=1,pp=2,dp=auto", "reconfigure:tp=2,pp=1,dp=auto,zero=1")
    result = run_scenario("tp=2,pp=1,dp=auto", 2, steps, 0.1, tmp_path, echo=False, rdzv=rdzv, events=events)
    assert result["codes"] == [0, 0], result["cluster"].tail(40)
    records = sorted(result["migrations"], key=lambda m: m["generation"])
    assert [(r["old_config"], r["new_config"]) for r in records] == [
        ("tp=2,pp=1,dp=2,zero=0", "tp=1,pp=2,dp=2,zero=0"),
        ("tp=1,pp=2,dp=2,zero=0", "tp=2,pp=1,dp=2,zero=1"),
    ]
    assert all(r["bytes_moved"] > 0 and r["reason"].startswith("reconfigured") for r in records)
    reference, _ = reference_losses(steps, tmp_path)
    assert sorted(result["losses"]) == list(range(steps))
    worst = max(abs(result["losses"][s] - reference[s]) / abs(reference[s]) for s in range(steps))
    assert worst <= 1e-4, worst


def test_a_hung_worker_is_killed_by_its_agent_and_the_job_recovers(etcd_server, tmp_path):
    """SIGSTOP (the process stays, says nothing): its agent kills it after --worker-heartbeat-timeout,
    names it, and the job recovers from the replica like after a crash."""
    rdzv = etcd_rdzv(etcd_server, "hang")
    work = tmp_path / "elastic"
    work.mkdir()
    steps = 40
    result = run_scenario(
        "tp=2,pp=1,dp=auto",
        2,
        steps,
        0.1,
        work,
        echo=False,
        rdzv=rdzv,
        events=("hang",),
        agent_args=["--worker-heartbeat-timeout", "3"],
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0, 0], f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    hung = [json.loads(line) for line in result["cluster"].outputs[1] if '"worker_hung"' in line]
    assert len(hung) == 1 and hung[0]["silent_s"] >= 3 and hung[0]["local_rank"] == 1, logs
    (record,) = result["migrations"]
    assert "worker failure" in record["reason"] and record["bytes_moved"] > 0, record
    assert record["leave_spread_s"] <= LEAVE_SPREAD_S, record  # once it was killed, every survivor left at once
    assert "killed by the agent: no word from it" in "".join(result["cluster"].outputs[1])
    reference, _ = reference_losses(steps, tmp_path)
    worst = max(abs(result["losses"][s] - reference[s]) / abs(reference[s]) for s in range(steps))
    assert worst <= 1e-4, worst


def test_a_sender_killed_mid_migration_abandons_the_generation_and_replicas_take_over(
    etcd_server, tmp_path, monkeypatch
):
    """SIGTERM one agent, then SIGKILL one of its workers while it is about to send: the generation is
    abandoned everywhere, the next one is planned from the survivors' replicas, training goes on exactly."""
    monkeypatch.setenv("ETC_AGENT_FAULT_SENDER_PAUSE_S", "3")
    rdzv = etcd_rdzv(etcd_server, "sender")
    work = tmp_path / "elastic"
    work.mkdir()
    steps = 60
    started = time.monotonic()
    result = run_scenario(
        "tp=2,pp=1,dp=auto",
        2,
        steps,
        0.25,
        work,
        echo=False,
        rdzv=rdzv,
        events=("join", "leave-crash"),
        extra_script_args=["--elementwise"],
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0, 0, 0], f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    join, recovered = sorted(result["migrations"], key=lambda m: m["generation"])
    assert (recovered["old_world_size"], recovered["new_world_size"]) == (6, 4), recovered
    assert "abandoned" in recovered["reason"] and recovered["generation"] == join["generation"] + 2, recovered
    abandoned = [
        json.loads(line) for out in result["cluster"].outputs for line in out if '"generation_abandoned"' in line
    ]
    assert abandoned and all(a["generation"] == join["generation"] + 1 for a in abandoned), abandoned
    assert time.monotonic() - started < 240
    reference, reference_state = reference_losses(steps, tmp_path, ["--elementwise"])
    assert compare_states(result["state_file"], reference_state) == []


def test_a_checkpoint_still_committing_on_one_rank_is_skipped_by_every_rank(etcd_server, tmp_path, monkeypatch):
    """Rank 0's first checkpoint commit stalls past the group timeout: at the next checkpoint every rank
    waits (half the timeout), then all skip it and form a new checkpoint group (a rank that skipped alone
    left the others' write waiting for it in the old group, to be paired with its next one); the later
    checkpoints complete and the run ends bitwise equal to the uninterrupted one."""
    from etc_agent.worker.checkpoint import complete_checkpoints

    monkeypatch.setenv("ETC_AGENT_TIMEOUT", "8")
    monkeypatch.setenv("ETC_AGENT_FAULT_CHECKPOINT_COMMIT_PAUSE_S", "10")
    checkpoints, work = tmp_path / "checkpoints", tmp_path / "run"
    work.mkdir()
    extra, steps = ["--elementwise"], 24
    result = run_scenario(
        "tp=1,pp=1,dp=auto",
        1,
        steps,
        0.2,
        work,
        echo=False,
        rdzv=etcd_rdzv(etcd_server, "commit"),
        events=(),
        agent_args=["--checkpoint-dir", str(checkpoints), "--checkpoint-interval", "2"],
        extra_script_args=extra,
        slow_during_events=None,
    )
    logs = result["cluster"].tail(40)
    assert result["codes"] == [0, 0], logs
    text = "".join("".join(lines) for lines in result["cluster"].outputs)
    assert "fault injection: the commit of checkpoint step 2" in text, logs
    # The checkpoints after the skip complete (a unilateral skip left the checkpoint group broken:
    # every later one failed with "Application timeout caused pair closure").
    complete = [c.step for c in complete_checkpoints(checkpoints)]
    assert complete and complete[-1] >= steps - 4, (complete, logs)
    assert "checkpoint of step 4 skipped on every rank" in text, logs
    assert sorted(result["losses"]) == list(range(steps))
    _, reference_state = reference_losses(steps, tmp_path, extra)
    assert compare_states(result["state_file"], reference_state) == []


def test_a_full_restart_resumes_from_the_newest_usable_checkpoint_and_its_data_position_in_the_new_layout(
    etcd_server, tmp_path
):
    """Every agent SIGKILLed mid-run (2 agents x 2, tp=2,dp=2), then the job started again on one agent
    (tp=2,dp=1) with the same --checkpoint-dir and no --checkpoint-interval (the restore reads storage
    without a checkpointer): it resumes from the newest complete checkpoint (the
    newest one made unusable here, so from the one before, with a log line), each rank reading only its
    regions, at the saved step with the carried state (the data position included: every step's
    samples, over both runs, are the global order's); every step from there trained once and the
    final state bitwise the uninterrupted run's."""
    from test_data_elastic import check_samples, prepare_pydoc

    from etc_agent.data import TokenDataset

    dataset = prepare_pydoc(tmp_path / "pydoc", 16)
    checkpoints = tmp_path / "checkpoints"
    data = ["--data", str(dataset), "--seq", "16"]
    extra, steps = ["--micro-batch", "1", "--elementwise", *data], 30
    agent_args = ["--checkpoint-dir", str(checkpoints), "--checkpoint-interval", "4"]

    first_dir, second_dir = tmp_path / "first", tmp_path / "second"
    first_dir.mkdir()
    second_dir.mkdir()
    first = run_scenario(
        "tp=2,pp=1,dp=auto",
        2,
        steps,
        0.15,
        first_dir,
        echo=False,
        rdzv=etcd_rdzv(etcd_server, "resume"),
        events=(),
        agent_args=agent_args,
        extra_script_args=[*extra, "--sample-log", str(first_dir / "samples.jsonl")],
        stop_after=14,
        slow_during_events=None,
    )
    assert first["codes"] == [None, None]  # killed
    from etc_agent.worker.checkpoint import complete_checkpoints

    complete = complete_checkpoints(checkpoints)
    assert len(complete) == 2, [c.path.name for c in complete]  # --checkpoint-keep 2
    older, newest = complete
    (newest.path / ".metadata").unlink()  # the newest is complete but unusable: the one before is used

    second = run_scenario(
        "tp=2,pp=1,dp=auto",
        2,
        steps,
        0.15,
        second_dir,
        echo=False,
        rdzv=etcd_rdzv(etcd_server, "resume"),
        events=(),
        agent_args=["--checkpoint-dir", str(checkpoints)],
        extra_script_args=[*extra, "--sample-log", str(second_dir / "samples.jsonl")],
        initial_agents=1,
    )
    logs = second["cluster"].tail(60)
    assert second["codes"] == [0], logs
    assert sorted(second["losses"]) == list(range(older.step, steps)), logs
    text = "".join("".join(lines) for lines in second["cluster"].outputs)
    assert f"checkpoint {newest.path} is not usable (DCP's .metadata is missing)" in text, logs
    assert f"resuming the job from {older.path} at step {older.step}" in text, logs
    reference, reference_state = reference_losses(steps, tmp_path, extra)
    losses = {**{s: v for s, v in first["losses"].items() if s < older.step}, **second["losses"]}
    assert sorted(losses) == list(range(steps))
    differ = [s for s in range(steps) if not math.isclose(losses[s], reference[s], rel_tol=1e-4, abs_tol=1e-9)]
    assert differ == [], f"losses differ from the uninterrupted run at steps {differ}"
    assert compare_states(second["state_file"], reference_state) == []
    # The steps kept from the first run and those of the second, on another node count, read the order.
    kept = [
        line for line in (first_dir / "samples.jsonl").read_text().splitlines() if json.loads(line)["step"] < older.step
    ]
    (tmp_path / "samples.jsonl").write_text(
        "".join(f"{line}\n" for line in kept) + (second_dir / "samples.jsonl").read_text()
    )
    check_samples(tmp_path / "samples.jsonl", len(TokenDataset(dataset, seq_len=16)), 12, steps, logs)


def test_a_replacement_killed_while_it_joins_costs_the_survivor_one_more_switch(etcd_server, tmp_path):
    """2 agents x 1 worker (--nnodes 2: the survivor must wait for the restart): the worker of agent 1
    is SIGKILLed and so is its replacement, as soon as it exists. The survivor, blocked entering the
    generation that waits for the first replacement, moves to the next one as soon as it is published
    (not after ETC_AGENT_TIMEOUT, 30 s); every step trained once, the final state bitwise."""
    rdzv = etcd_rdzv(etcd_server, "twice")
    extra, steps = ["--elementwise"], 30
    result = run_scenario(
        "tp=1,pp=1,dp=auto",
        1,
        steps,
        0.15,
        tmp_path,
        echo=False,
        rdzv=rdzv,
        events=("kill-twice",),
        extra_script_args=extra,
        event_steps=[6],
    )
    logs = result["cluster"].tail(80)
    assert result["codes"] == [0, 0], f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    text = "".join(result["cluster"].outputs[1])
    # The second death is seen as a crash (its own generation), or, when it comes before the agent
    # served the generation that waits for the first replacement, that generation starts it again.
    assert (text.count('"workers_failed"') == 2 and "(2/3)" in text) or (
        text.count('"workers_failed"') == 1 and '"restarted_local_ranks": [0]' in text
    ), logs
    killed = result["events"][0]["wall"]
    records = [json.loads(line) for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    resumed = min(r["wall"] for r in records if r["wall"] > killed)
    assert resumed - killed < 25, f"the survivor trained again {resumed - killed:.1f} s after the first death\n{logs}"
    _, reference_state = reference_losses(steps, tmp_path, extra)
    assert compare_states(result["state_file"], reference_state) == []


def test_a_second_worker_killed_during_the_recovery_costs_the_survivor_one_more_switch(etcd_server, tmp_path):
    """3 agents x 1 worker (dp=3, --nnodes 1:3): the worker of agent 1 is SIGKILLed, and the worker of
    agent 2 as soon as agent 2 reports that it left its collective for the first failure. Agent 0's
    replica holds everything: it trains again after at most two switches (the generation the second
    death breaks, if it was published in time, and the next one), and both nodes rejoin once their
    restarted workers run; every step trained once, the final state bitwise the uninterrupted run's."""
    extra, steps = ["--elementwise"], 40
    result = run_scenario(
        "tp=1,pp=1,dp=auto",
        1,
        steps,
        0.15,
        tmp_path,
        echo=False,
        rdzv=etcd_rdzv(etcd_server, "inrecovery"),
        events=("kill-in-recovery",),
        initial_agents=3,
        min_nodes=1,
        extra_script_args=extra,
        event_steps=[6],
    )
    logs = result["cluster"].tail(80)
    assert result["codes"] == [0, 0, 0], f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    for agent in (1, 2):
        assert '"workers_failed"' in "".join(result["cluster"].outputs[agent]), f"agent {agent}\n{logs}"
    killed = result["events"][0]["wall"]
    records = [json.loads(line) for line in (tmp_path / "loss.jsonl").read_text().splitlines()]
    before = max(r["generation"] for r in records if r["wall"] <= killed)
    resumed = min((r for r in records if r["generation"] > before), key=lambda r: r["wall"])
    assert resumed["generation"] <= before + 2, f"the survivor trained again in generation {resumed['generation']}"
    assert resumed["wall"] - killed < 15, f"the survivor trained again {resumed['wall'] - killed:.1f} s after"
    switches = [m for m in result["migrations"] if before < m["generation"] <= resumed["generation"]]
    assert switches and all(m["leave_spread_s"] is None or m["leave_spread_s"] <= LEAVE_SPREAD_S for m in switches), (
        switches
    )
    assert max(m["new_world_size"] for m in result["migrations"]) == 3  # both nodes came back
    _, reference_state = reference_losses(steps, tmp_path, extra)
    assert compare_states(result["state_file"], reference_state) == []
