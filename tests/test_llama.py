"""The Llama example (``etc_agent.examples.llama``) with PyTorch-native parallelism under ``etcrun``
over a real etcd: FSDP2, HSDP and FSDP2 + TP layouts through reconfigurations, joins, a SIGTERM
leave and a worker SIGKILL, losses against an uninterrupted one-process run of the same training."""

from __future__ import annotations

from conftest import etcd_rdzv
from elastic_demo import compare_states, reference_losses, run_scenario

LLAMA = "etc_agent.examples.llama"


def _worst_relative(losses: dict[int, float], reference: dict[int, float]) -> float:
    return max(abs(losses[s] - reference[s]) / abs(reference[s]) for s in reference)


def test_reconfigure_moves_fsdp2_state_and_the_data_position_between_fsdp_tp_and_hsdp_layouts(etcd_server, tmp_path):
    """`etc-agent reconfigure` on the same 4 workers, training on real tokens: FSDP over 4 -> FSDP 2
    x TP 2 (``_StridedShard``, sequence parallel) -> HSDP 2 x 2 -> pipeline 2 x FSDP 2 -> pipeline 2
    x TP 2 (sequence-parallel activations between the stages; both pipelines under
    ``torch.distributed.pipelining``'s 1F1B); every step's samples the global order's, none twice,
    and every step's loss within 1e-4 of the reference."""
    from test_data_elastic import check_samples, prepare_pydoc

    from etc_agent.data import TokenDataset

    steps = 40
    dataset = prepare_pydoc(tmp_path / "pydoc", 32)
    sample_log = tmp_path / "samples.jsonl"
    data = ["--data", str(dataset), "--seq", "32"]
    events = (
        "reconfigure:tp=2,dp_shard=auto",
        "reconfigure:dp_replicate=2,dp_shard=auto",
        "reconfigure:pp=2,dp_shard=auto",
        "reconfigure:tp=2,pp=2",
    )
    result = run_scenario(
        "dp_shard=auto",
        2,
        steps,
        0.1,
        tmp_path,
        echo=False,
        rdzv=etcd_rdzv(etcd_server, "llama-reconf"),
        events=events,
        module=LLAMA,
        extra_script_args=["--pipeline-schedule", "1f1b", *data, "--sample-log", str(sample_log)],
    )
    assert result["codes"] == [0, 0], result["cluster"].tail(40)
    check_samples(sample_log, len(TokenDataset(dataset, seq_len=32)), 12, steps, result["cluster"].tail(40))
    records = sorted(result["migrations"], key=lambda m: m["generation"])
    assert [(r["old_config"], r["new_config"]) for r in records] == [
        ("tp=1,pp=1,dp_replicate=1,dp_shard=4", "tp=2,pp=1,dp_replicate=1,dp_shard=2"),
        ("tp=2,pp=1,dp_replicate=1,dp_shard=2", "tp=1,pp=1,dp_replicate=2,dp_shard=2"),
        ("tp=1,pp=1,dp_replicate=2,dp_shard=2", "tp=1,pp=2,dp_replicate=1,dp_shard=2"),
        ("tp=1,pp=2,dp_replicate=1,dp_shard=2", "tp=2,pp=2,dp=1,zero=0"),
    ], result["cluster"].tail(40)
    # HSDP 2 x 2 -> pp 2 x FSDP 2: every rank's new shards are a subset of what it held (its stage's
    # layers, the same dim-0 chunk): nothing moves. The others reshard.
    assert [r["bytes_moved"] > 0 for r in records] == [True, True, False, True], [r["bytes_moved"] for r in records]
    reference, _ = reference_losses(steps, tmp_path, data, module=LLAMA)
    assert sorted(result["losses"]) == list(range(steps))
    assert _worst_relative(result["losses"], reference) <= 1e-4


def test_hsdp_through_a_join_a_sigterm_leave_and_a_worker_kill_is_bitwise_the_uninterrupted_run(etcd_server, tmp_path):
    """HSDP with shard groups of 2 (``dp_shard=2``, replicas fill the agents): a third agent joins
    (3 replicas), one leaves on SIGTERM, a worker is SIGKILLed (its shards come from the other
    replica); with the layout-independent update the final state is bitwise the reference's."""
    steps, extra = 40, ["--elementwise"]
    result = run_scenario(
        "dp_shard=2",
        2,
        steps,
        0.1,
        tmp_path,
        echo=False,
        rdzv=etcd_rdzv(etcd_server, "llama-hsdp"),
        events=("join", "leave", "kill"),
        module=LLAMA,
        extra_script_args=extra,
    )
    logs = result["cluster"].tail(60)
    assert result["codes"][:2] == [0, 0], logs
    assert sorted(result["losses"]) == list(range(steps)), logs
    configs = {r["new_config"] for r in result["migrations"]}
    assert "tp=1,pp=1,dp_replicate=3,dp_shard=2" in configs, configs
    reasons = [r["reason"] for r in result["migrations"]]
    assert any("failure" in reason for reason in reasons) and any("left" in reason for reason in reasons), reasons
    _, reference_state = reference_losses(steps, tmp_path, extra, module=LLAMA)
    assert compare_states(result["state_file"], reference_state) == []


def test_pure_fsdp_loses_a_shard_to_a_kill_and_restores_just_it_from_the_periodic_checkpoint(etcd_server, tmp_path):
    """FSDP over 4 (no replica): the killed worker's shards come from the last periodic checkpoint
    and only those, the rest from the survivors' snapshots of the same step; the steps since are
    trained again and the final state is bitwise the uninterrupted run's."""
    checkpoints, work = tmp_path / "checkpoints", tmp_path / "run"
    work.mkdir()
    extra, steps = ["--elementwise"], 40
    result = run_scenario(
        "dp_shard=auto",
        2,
        steps,
        0.15,
        work,
        echo=False,
        rdzv=etcd_rdzv(etcd_server, "llama-restore"),
        events=("kill",),
        agent_args=["--checkpoint-dir", str(checkpoints), "--checkpoint-interval", "5"],
        extra_script_args=extra,
        event_steps=[17],
        module=LLAMA,
    )
    logs = result["cluster"].tail(60)
    assert result["codes"] == [0, 0], f"agents exited {result['codes']}\n{logs}"
    assert sorted(result["losses"]) == list(range(steps)), logs
    failures = [m for m in result["migrations"] if "worker failure" in m["reason"]]
    assert failures, result["migrations"]
    record = failures[0]
    assert 0 < record["bytes_restored"] < record["state_bytes"] * 0.5, record
    assert record["redone_steps"] >= 1 and record["step"] % 5 == 0, record
    _, reference_state = reference_losses(steps, tmp_path, extra, module=LLAMA)
    assert compare_states(result["state_file"], reference_state) == []


def test_the_checkpoint_way_saves_fsdp2_state_through_get_state_dict_and_loads_it_resharded(etcd_server, tmp_path):
    """`--migration checkpoint` on an FSDP2 + TP job reconfigured to plain FSDP: the workers save
    with `get_state_dict` + DCP and exit, fresh ones load into the module built for the new mesh;
    the record says which way, and the final state is bitwise the uninterrupted run's."""
    checkpoints, work = tmp_path / "checkpoints", tmp_path / "run"
    work.mkdir()
    extra, steps = ["--elementwise"], 24
    result = run_scenario(
        "tp=2,dp_shard=auto",
        2,
        steps,
        0.1,
        work,
        echo=False,
        rdzv=etcd_rdzv(etcd_server, "llama-ckpt"),
        events=("reconfigure:dp_shard=auto",),
        agent_args=["--migration", "checkpoint", "--checkpoint-dir", str(checkpoints)],
        extra_script_args=extra,
        module=LLAMA,
    )
    assert result["codes"] == [0, 0], result["cluster"].tail(40)
    [record] = result["migrations"]
    assert (record["method"], record["checkpoint_api"]) == ("checkpoint", "state_dict"), record
    assert (record["old_config"], record["new_config"]) == (
        "tp=2,pp=1,dp_replicate=1,dp_shard=2",
        "tp=1,pp=1,dp_replicate=1,dp_shard=4",
    )
    assert record["checkpoint_bytes"] >= 2 * record["state_bytes"] > 0, record
    _, reference_state = reference_losses(steps, tmp_path, extra, module=LLAMA)
    assert compare_states(result["state_file"], reference_state) == []
