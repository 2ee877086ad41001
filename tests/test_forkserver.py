"""The fork server (``--start-method forkserver``, the default): a forked worker is what ``python -u
script`` would be, it dies with the server and the server with its agent, and etcrun's workers come
from it (or, with ``--start-method spawn``, are new interpreters)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from etc_agent.agent.forkserver import ForkServer

SCRIPTS = ROOT / "tests" / "scripts"
PROBE = str(SCRIPTS / "forked_probe.py")


@pytest.fixture(scope="module")
def server():
    fork_server = ForkServer(env={**os.environ, "SERVER_ONLY": "1"})
    assert fork_server.ready.wait(120) and fork_server.available
    yield fork_server
    fork_server.close()


def run(server: ForkServer, argv: list[str], end: str = "exit0", cwd: Path = ROOT, **env: str):
    process = server.spawn(
        argv, {**os.environ, "PROBE_END": end, **env}, str(cwd), pipe_stdout=True, pipe_stderr=True, name="probe"
    )
    code = process.wait(timeout=60)
    return code, process.stdout.read().decode(), process.stderr.read().decode()


def probe_line(out: str) -> dict:
    return json.loads(out.splitlines()[0])


def test_a_forked_worker_has_the_scripts_argv_path_cwd_environment_and_streams(server, tmp_path):
    code, out, err = run(server, [PROBE, "--lr", "3e-4"], cwd=tmp_path, PROBE_VAR="mine")
    assert code == 0, err
    seen = probe_line(out)
    assert seen["argv"] == [PROBE, "--lr", "3e-4"] and seen["path0"] == str(SCRIPTS)
    assert seen["cwd"] == str(tmp_path) and seen["probe"] == "mine"
    assert seen["server_only"] is None  # the environment is the request's, not the server's
    assert seen["pgid_is_pid"] and seen["comm"] == "probe"
    assert seen["torch_imported"]  # imported once, in the server
    assert out.splitlines()[-1] == "atexit ran" and err == "to stderr\n"


def test_a_forked_module_runs_as_main_with_the_working_directory_on_its_path(server):
    code, out, err = run(server, ["-m", "fork_mod", "x"], cwd=SCRIPTS)
    assert code == 0, err
    seen = json.loads(out)
    assert seen["name"] == "__main__" and seen["argv"][1:] == ["x"] and seen["path0"] == str(SCRIPTS)
    assert seen["argv"][0].endswith(os.path.join("fork_mod", "__main__.py"))


def test_forked_workers_do_not_share_random_seeds(server):
    first, second = (probe_line(run(server, [PROBE])[1]) for _ in range(2))
    assert first["random"] != second["random"] and first["numpy"] != second["numpy"]


@pytest.mark.parametrize(
    ("end", "code", "in_out", "in_err"),
    [
        ("exit3", 3, "atexit ran", ""),
        ("message", 1, "atexit ran", "a message for stderr"),
        ("raise", 1, "atexit ran", "RuntimeError: raised on purpose"),
        ("thread", 0, "thread done", ""),
    ],
)
def test_a_forked_worker_exits_as_the_interpreter_would(server, end, code, in_out, in_err):
    got, out, err = run(server, [PROBE], end=end)
    assert got == code and in_out in out and in_err in err, (got, out, err)
    if end == "raise":
        assert "Traceback (most recent call last)" in err


@pytest.mark.alone  # wall-clock bounds
def test_a_killed_worker_reports_the_signal_and_a_fork_takes_milliseconds(server):
    started = time.monotonic()
    process = server.spawn([PROBE], {**os.environ, "PROBE_END": "sleep"}, str(ROOT), True, True, "probe")
    pid = process.pid
    assert time.monotonic() - started < 2.0  # a fresh interpreter takes seconds to import torch here
    assert process.stdout.readline()  # it runs
    os.killpg(pid, signal.SIGKILL)
    assert process.wait(timeout=10) == -signal.SIGKILL


def test_workers_die_with_the_server_and_are_reported_killed():
    fork_server = ForkServer()
    process = fork_server.spawn([PROBE], {**os.environ, "PROBE_END": "sleep"}, str(ROOT), True, True, "probe")
    assert process.stdout.readline()
    fork_server.process.kill()  # the server dies: PR_SET_PDEATHSIG takes its workers along
    assert process.wait(timeout=10) == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while Path(f"/proc/{process.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{process.pid}").exists() or "Z" in Path(f"/proc/{process.pid}/stat").read_text().split()[2]
    assert not fork_server.available
    later = fork_server.spawn([PROBE], dict(os.environ), str(ROOT), True, True, "probe")
    assert later.wait(timeout=1) == 1 and later.pid == -1  # never forked: the agent starts a new interpreter
    fork_server.close()


@pytest.mark.alone  # wall-clock bounds
def test_a_worker_stopped_while_the_server_imports_is_cancelled_without_waiting_for_the_imports():
    """A generation superseded while the server still imports: stopping its queued workers must not
    wait seconds for a fork only to kill it, and a cancelled worker never runs."""
    fork_server = ForkServer()
    try:
        queued = fork_server.spawn([PROBE], {**os.environ, "PROBE_END": "sleep"}, str(ROOT), True, True, "probe")
        assert not fork_server.ready.is_set()  # the imports take seconds: the fork is still queued
        started = time.monotonic()
        queued.send_signal(signal.SIGTERM)
        assert queued.wait(timeout=1) == -signal.SIGTERM and time.monotonic() - started < 0.5
        later = fork_server.spawn([PROBE], {**os.environ, "PROBE_END": "exit0"}, str(ROOT), True, True, "probe")
        assert later.wait(timeout=120) == 0 and probe_line(later.stdout.read().decode())["torch_imported"]
        assert queued.stdout.read() == b""  # it never ran: nothing printed, its pipe closed
        assert queued.known_pid is None
    finally:
        fork_server.close()


def test_a_forked_worker_counts_as_a_worker_and_its_fork_server_does_not(server):
    """What an agent checks before it kills a hung attached worker by pid (sidecar mode)."""
    from etc_agent.agent.attached import _is_worker

    process = server.spawn([PROBE], {**os.environ, "PROBE_END": "sleep"}, str(ROOT), True, True, "probe")
    try:
        assert process.stdout.readline()
        assert _is_worker(process.pid, 0)
        assert not _is_worker(server.process.pid, 0)  # the server: every worker of the node would die with it
        assert not _is_worker(os.getpid(), 0)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_the_server_and_its_workers_die_with_their_agent():
    """SIGKILL of the process that started the server (an agent killed with -9)."""
    client = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, sys\n"
            "from etc_agent.agent.forkserver import ForkServer\n"
            "s = ForkServer()\n"
            f"p = s.spawn([{PROBE!r}], {{**os.environ, 'PROBE_END': 'sleep'}}, '.', True, False, 'probe')\n"
            "p.stdout.readline()\n"
            "print(s.process.pid, p.pid, flush=True)\n"
            "import time; time.sleep(60)\n",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    server_pid, worker_pid = map(int, client.stdout.readline().split())
    client.kill()
    client.wait()
    deadline = time.monotonic() + 5
    while not (_gone(server_pid) and _gone(worker_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(server_pid) and _gone(worker_pid)


def _etcrun(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "env"
    out.mkdir()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "etc_agent.cli.etcrun",
            "--standalone",
            "--nproc-per-node",
            "2",
            *flags,
            str(SCRIPTS / "env_dump.py"),
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {p.name: json.loads(p.read_text()) for p in sorted(out.iterdir())}


def _parent_command(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_etcrun_forks_its_workers_from_the_fork_server_by_default(tmp_path):
    dumps = _etcrun(tmp_path)
    assert sorted(dumps) == ["0.json", "1.json"]
    for rank, env in enumerate(dumps.values()):
        assert "etc_agent.worker.forkserver" in env["parent_command"], env
        assert env["dist_rank"] == rank and env["dist_world_size"] == 2 and env["LOCAL_RANK"] == str(rank)
        # torchrun's OMP_NUM_THREADS=1 for several workers per node holds in a forked worker too.
        assert env["OMP_NUM_THREADS"] == "1" and env["num_threads"] == 1


def test_etcrun_start_method_spawn_starts_new_interpreters(tmp_path):
    dumps = _etcrun(tmp_path, "--start-method", "spawn")
    assert sorted(dumps) == ["0.json", "1.json"]
    for env in dumps.values():
        assert "etc_agent.cli.etcrun" in env["parent_command"] and "forkserver" not in env["parent_command"]
        assert env["num_threads"] == 1
