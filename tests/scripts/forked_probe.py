"""Prints what a worker process is (argv, path, cwd, env, seeds, process group) as one JSON line,
then ends the way ``PROBE_END`` says."""

import atexit
import json
import os
import random
import sys
import threading
import time

import numpy

end = os.environ.get("PROBE_END", "exit0")
print(
    json.dumps(
        {
            "argv": sys.argv,
            "path0": sys.path[0],
            "cwd": os.getcwd(),
            "probe": os.environ.get("PROBE_VAR"),
            "server_only": os.environ.get("SERVER_ONLY"),
            "random": random.random(),
            "numpy": float(numpy.random.random()),
            "pgid_is_pid": os.getpgid(0) == os.getpid(),
            "comm": open("/proc/self/comm").read().strip(),
            "torch_imported": "torch" in sys.modules,
        }
    ),
    flush=True,
)
print("to stderr", file=sys.stderr, flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
if end == "thread":
    # A non-daemon thread is joined before the process exits, as the interpreter does.
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
elif end == "exit3":
    sys.exit(3)
elif end == "message":
    sys.exit("a message for stderr")
elif end == "raise":
    raise RuntimeError("raised on purpose")
elif end == "sleep":
    time.sleep(60)
