"""The agent's failure block is the text torch's own ChildFailedError gives, without importing torch."""

from __future__ import annotations

import json
import subprocess
import sys

from torch.distributed.elastic.multiprocessing import errors as torch_errors

from etc_agent.agent.failures import ProcessFailure, format_failures


def _write(path, message, timestamp=None) -> str:
    data = {"message": message} if timestamp is None else {"message": message, "timestamp": timestamp}
    path.write_text(json.dumps(data))
    return str(path)


def test_the_block_is_torchs_for_signals_tracebacks_and_plain_messages(tmp_path):
    traceback = {
        "message": "RuntimeError: boom",
        "extraInfo": {
            "py_callstack": "Traceback (most recent call last):\n  File x\nRuntimeError: boom",
            "timestamp": "1700000100",
        },
    }
    cases = [
        (0, dict(local_rank=1, pid=4242, exitcode=-9, error_file=str(tmp_path / "missing.json"))),
        (3, dict(local_rank=0, pid=4343, exitcode=1, error_file=_write(tmp_path / "a.json", traceback))),
        (
            2,
            dict(local_rank=1, pid=4444, exitcode=2, error_file=_write(tmp_path / "b.json", "plain words", 1700000050)),
        ),
        (5, dict(local_rank=0, pid=4545, exitcode=7, error_file=str(tmp_path / "none.json"))),
    ]
    ours, theirs = {}, {}
    for rank, fields in cases:
        ours[rank], theirs[rank] = ProcessFailure(**fields), torch_errors.ProcessFailure(**fields)
        theirs[rank].timestamp = ours[rank].timestamp = ours[rank].timestamp  # "now" where no file says
    for subset in ([0], [3, 2], [0, 3, 2, 5]):
        expected = torch_errors.ChildFailedError("train.py", {r: theirs[r] for r in subset}).format_msg()
        assert format_failures("train.py", {r: ours[r] for r in subset}) == expected
    assert "Root Cause" in expected and "Signal 9 (SIGKILL) received by PID 4242" in expected


def test_the_agent_does_not_import_torch():
    """What etcrun imports to run an agent (its fork server and the workers' stores import torch)."""
    code = (
        "import sys; import etc_agent.cli.etcrun, etc_agent.agent.failures, etc_agent.agent.storehost; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
