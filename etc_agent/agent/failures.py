"""torchrun's failure report (``ChildFailedError``'s block), written without importing torch.

The agent prints this block when workers fail, as torchrun does; torch's own classes
(``torch.distributed.elastic.multiprocessing.errors``) would cost the agent ~1.5 s of CPU to import
at the first failure, on the path from a crash to the others going on. The text is the same as
torch 2.13's ``ChildFailedError.format_msg`` gives (the conformance tests compare them): the error
file a worker's ``@record`` wrote (its message, timestamp and traceback), or the signal that killed
it, per failed rank; the root cause is the failure with the smallest timestamp (the first of equal
ones, in the order given).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from string import Template
from typing import Any

NOT_AVAILABLE = "<N/A>"

_MSG_FORMAT_TEMPLATE = """
${boarder}
${title}
${section}
Failures:
${other_failures}
${section}
Root Cause (first observed failure):
${root_failure}
${boarder}"""

_FAILURE_FORMAT_TEMPLATE = """[${idx}]:
  time      : ${time}
  host      : ${hostname}
  rank      : ${rank} (local_rank: ${local_rank})
  exitcode  : ${exitcode} (pid: ${pid}) ${signal_name}
  error_file: ${error_file}
  traceback : ${message}"""


@dataclass
class ProcessFailure:
    """One failed worker, as torch's ``ProcessFailure``: its error file is read when it exists
    (``ValueError``/``OSError`` for one that cannot be parsed, as torch raises)."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    message: Any = field(init=False, default="")
    timestamp: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if os.path.isfile(self.error_file):
            with open(self.error_file) as fp:
                data = json.load(fp)
            self.message = data["message"]
            if isinstance(self.message, str):
                self.timestamp = int(data.get("timestamp", 0))
            else:
                self.timestamp = int(self.message["extraInfo"]["timestamp"])
        else:
            self.error_file = NOT_AVAILABLE
            self.timestamp = int(time.time())
        if not self.message:
            if self.exitcode < 0:
                self.message = f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
            else:
                self.message = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"

    def signal_name(self) -> str:
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return NOT_AVAILABLE
        return NOT_AVAILABLE


def format_failures(name: str, failures: dict[int, ProcessFailure]) -> str:
    """The block torchrun prints for ``failures`` (global rank -> failure) of the script ``name``."""
    title = f"{name} FAILED"
    root_rank = min(failures, key=lambda rank: failures[rank].timestamp)
    root, others, width = "", [], len(title)
    for idx, (rank, failure) in enumerate(failures.items()):
        text = _format_failure(idx, rank, failure)
        width = max(width, *(len(line) for line in text.split("\n")))
        if rank == root_rank:
            root = text
        else:
            others.append(text)
    width = min(width, 60)
    return Template(_MSG_FORMAT_TEMPLATE).substitute(
        boarder="=" * width,
        title=title,
        section="-" * width,
        root_failure=root,
        other_failures="\n".join(others or ["  <NO_OTHER_FAILURES>"]),
    )


def _format_failure(idx: int, rank: int, failure: ProcessFailure) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("extraInfo", {}).get("py_callstack", message.get("message", NOT_AVAILABLE))
        message = message.replace("\n", "\n  ")
    name = failure.signal_name()
    return Template(_FAILURE_FORMAT_TEMPLATE).substitute(
        idx=idx,
        time=datetime.fromtimestamp(failure.timestamp).isoformat(sep="_"),
        hostname=socket.getfqdn(),
        rank=rank,
        local_rank=failure.local_rank,
        exitcode=failure.exitcode,
        pid=failure.pid,
        signal_name=f" ({name})" if name != NOT_AVAILABLE else "",
        error_file=failure.error_file,
        message=message,
    )
