"""Writes ``<out>/<RANK>.up`` when running, and on SIGTERM or SIGUSR1 ``<out>/<RANK>.sig`` naming it, then exits 0."""

import os
import signal
import sys
import time

out_dir = sys.argv[1]


def caught(signum, frame) -> None:
    with open(os.path.join(out_dir, f"{os.environ['RANK']}.sig"), "w") as f:
        f.write(signal.Signals(signum).name)
    sys.exit(0)


for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, caught)
with open(os.path.join(out_dir, f"{os.environ['RANK']}.up"), "w") as f:
    f.write("1")
time.sleep(60)
