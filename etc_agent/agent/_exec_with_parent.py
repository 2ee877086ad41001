"""``python -m etc_agent.agent._exec_with_parent PARENT_PID CMD...``: exec CMD, dying with PARENT_PID.

Linux's PR_SET_PDEATHSIG survives exec, so the worker gets SIGKILL when its agent dies, even by
kill -9. Done in this shim rather than in a ``preexec_fn``: Python code between fork and exec in an
agent that runs gRPC threads can deadlock the child.
"""

import ctypes
import os
import signal
import sys


def dying_with_this_process(command: list[str]) -> list[str]:
    """``command`` run under this shim with this process as the parent it dies with (on Linux;
    elsewhere ``command`` as it is)."""
    if not sys.platform.startswith("linux"):
        return list(command)
    return [sys.executable, "-m", "etc_agent.agent._exec_with_parent", str(os.getpid()), *command]


def main() -> None:
    parent, cmd = int(sys.argv[1]), sys.argv[2:]
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:  # the agent died before we got here
        sys.exit(1)
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    main()
