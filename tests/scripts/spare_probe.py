"""Run as a worker or as a warm spare: says what it sees of its environment before and after
``become_worker()`` (what ``etc_agent.init()`` calls first), then exits with ``argv[1]``."""

import os
import sys

from etc_agent.worker.spare import become_worker

print(f"top LOCAL_RANK={os.environ.get('LOCAL_RANK')}", flush=True)
become_worker()
token = "set" if os.environ.get("ETC_AGENT_TOKEN") else "unset"
print(
    f"worker LOCAL_RANK={os.environ.get('LOCAL_RANK')} RANK={os.environ.get('RANK')} token={token} "
    f"spare_fd={os.environ.get('ETC_AGENT_SPARE_FD')}",
    flush=True,
)
sys.exit(int(sys.argv[1]))
