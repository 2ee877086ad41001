"""``python -u -m etc_agent.worker.forkserver FD``: the fork server of one agent's workers.

Imports what a worker-API process needs (torch, ``torch.distributed``, DTensor, dynamo, which the
first functional collective imports, and this package's worker modules), then forks workers on
request over the socket ``FD`` (:mod:`etc_agent.utils.forkserver` has the protocol and what a forked
worker is). ``ETC_AGENT_PRELOAD``: more modules to import once here, comma-separated (the script's
own heavy imports: ``transformers``, ``megatron.core``); one that fails to import is skipped with a
line on stderr.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys

from etc_agent.protocol.settings import WorkerSettings
from etc_agent.utils.forkserver import serve

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch._dynamo",
    "etc_agent.worker.job",
)


def preload() -> None:
    """Import the modules; raise if CUDA got initialized on the way (a forked process could then
    not use its GPU: the agent falls back to new interpreters)."""
    # An import-time torch.cuda.is_available() would initialize the CUDA driver (cuInit), after
    # which no forked child can use CUDA; NVML answers it without (the workers' own environment,
    # given with each fork, does not carry this).
    saved = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        for name in PRELOAD:
            importlib.import_module(name)
        for name in WorkerSettings.from_env(os.environ).preload:
            try:
                importlib.import_module(name)
            except Exception as err:  # noqa: BLE001 - the worker imports it itself then, and sees the error there
                print(f"etc_agent fork server: ETC_AGENT_PRELOAD {name!r} not imported: {err}", file=sys.stderr)
    finally:
        if saved is None:
            os.environ.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialized while importing (a preloaded module used the GPU): not fork-safe")


def main() -> int:
    # A Ctrl-C in the terminal goes to the agent, which stops the workers in order; the server ends
    # when its agent closes the socket (or dies: PR_SET_PDEATHSIG).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    return serve(sock, preload)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not the interpreter's finalization: with torch, dynamo and DTensor imported it takes seconds,
    # and the agent waits for this process as it exits (nothing here needs cleaning up).
    os._exit(code)
