"""The worker's environment as one typed class (etc_agent.protocol.settings), both ways."""

from __future__ import annotations

from pathlib import Path

import pytest

from etc_agent.protocol.settings import WorkerSettings

DOCS = Path(__file__).resolve().parent.parent / "docs" / "cli.md"


def test_what_the_agent_writes_the_worker_reads_back():
    written = WorkerSettings(
        agent_addr="10.0.0.1:4001",
        local_rank=3,
        device_index=0,
        node_id="node-a",
        generation=7,
        migration="checkpoint",
        checkpoint_dir="/ckpt",
        checkpoint_interval=50,
        checkpoint_keep=3,
        fresh_start=True,
        parallel="tp=2,pp=1,dp=2",
    )
    env = written.to_env()
    assert env["ETC_AGENT_LOCAL_RANK"] == "3" and env["LOCAL_RANK"] == "0" and env["ETC_AGENT_FRESH_START"] == "1"
    assert WorkerSettings.from_env(env) == written
    assert WorkerSettings.from_env(env).cuda_index == 0


def test_only_what_was_given_is_written():
    assert WorkerSettings(generation=0, node_id="n").to_env() == {"ETC_AGENT_GENERATION": "0", "ETC_AGENT_NODE_ID": "n"}


def test_the_local_rank_falls_back_to_torchruns_then_slurms():
    assert WorkerSettings.from_env({"SLURM_LOCALID": "5"}).local_rank == 5
    settings = WorkerSettings.from_env({"LOCAL_RANK": "2", "SLURM_LOCALID": "5"})
    assert (settings.local_rank, settings.cuda_index) == (2, 2)
    assert WorkerSettings.from_env({}).local_rank == 0


def test_values_written_by_hand_are_read_as_a_user_means_them():
    settings = WorkerSettings.from_env(
        {
            "ETC_AGENT_CHECKPOINT_INTERVAL": "1e2",
            "ETC_AGENT_PRELOAD": "numpy, torch ,",
            "ETC_AGENT_ELASTIC": "0",
            "ETC_AGENT_TIMEOUT": "8",
            "ETC_AGENT_BACKEND": "",
        }
    )
    assert settings.checkpoint_interval == 100 and settings.preload == ("numpy", "torch")
    assert settings.elastic is False and settings.timeout_s == 8.0 and settings.backend is None


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        (
            "ETC_AGENT_TIMEOUT",
            "soon",
            "ETC_AGENT_TIMEOUT='soon': Input should be a valid number, unable to parse string as a number",
        ),
        ("ETC_AGENT_CONNECT_TIMEOUT", "0", "ETC_AGENT_CONNECT_TIMEOUT='0': Input should be greater than 0"),
        ("ETC_AGENT_MIGRATION", "rsync", "ETC_AGENT_MIGRATION='rsync': Input should be 'live' or 'checkpoint'"),
    ],
)
def test_a_bad_value_fails_at_start_up_naming_its_variable(name, value, says):
    with pytest.raises(ValueError) as caught:
        WorkerSettings.from_env({name: value})
    assert str(caught.value) == says


def test_every_variable_is_described_and_documented():
    docs = DOCS.read_text()
    for name, field in WorkerSettings.model_fields.items():
        assert field.description, f"WorkerSettings.{name} has no description"
        assert field.alias is not None and f"`{field.alias}`" in docs, f"{field.alias} is not in docs/cli.md"


def test_with_log_format_json_the_workers_records_are_json_lines_like_the_agents_events(capsys):
    import json
    import logging

    from etc_agent.worker.logs import configure_worker_logging, say

    package = logging.getLogger("etc_agent")
    saved = (list(package.handlers), package.level, package.propagate)
    try:
        configure_worker_logging(WorkerSettings.from_env({"ETC_AGENT_LOG_FORMAT": "json"}))
        configure_worker_logging(WorkerSettings.from_env({"ETC_AGENT_LOG_FORMAT": "json"}))  # once only
        settings = WorkerSettings.from_env({"ETC_AGENT_LOG_FORMAT": "json", "ETC_AGENT_NODE_ID": "n1"})
        assert settings.log_format == "json"
        logging.getLogger("etc_agent.worker.switch").info("moved %d bytes", 42)
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1
        record = json.loads(lines[0])
        assert {k: record[k] for k in ("event", "level", "logger", "message", "local_rank")} == {
            "event": "worker_log",
            "level": "INFO",
            "logger": "etc_agent.worker.switch",
            "message": "moved 42 bytes",
            "local_rank": 0,
        }
        say("told the user")
        assert json.loads(capsys.readouterr().err)["message"] == "told the user"
    finally:
        package.handlers[:] = saved[0]
        package.setLevel(saved[1])
        package.propagate = saved[2]
    say("told the user")  # the handler gone, the mode is gone with it
    assert capsys.readouterr().err == "[etc_agent] told the user\n"
