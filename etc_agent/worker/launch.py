"""Run a training script the way ``python script.py`` (or ``python -m module``) would, and re-enter
it after a recovered peer failure.

``etcrun`` starts Python workers as ``python -m etc_agent.worker.launch script.py args...``. For a
script that does not use the worker API nothing changes: its exceptions and exit code are its own.
For a worker-API script, an error from a failed peer inside a training step does not end the
process: :meth:`Job.recover <etc_agent.worker.job.Job.recover>` keeps the state in memory, switches
to the next generation with the surviving replicas, and the script runs again from the top, where
``etc_agent.init()`` and ``job.start()`` return the live job and ``job.steps()`` continues from the
recovered step. Code before the loop therefore runs again and should not redo one-time side effects.
"""

from __future__ import annotations

import os
import runpy
import sys


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m etc_agent.worker.launch (script.py | -m module) [args...]")
    module = argv[0] == "-m"
    target = argv[1] if module else argv[0]
    args = argv[2:] if module else argv[1:]
    sys.argv = [target, *args]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))  # as `python script.py` does
    while True:
        try:
            if module:
                # Imported already where a fork server preloaded it (ETC_AGENT_PRELOAD): runpy runs
                # it again as __main__ either way, but warns about the copy in sys.modules.
                sys.modules.pop(target, None)
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
            return
        except SystemExit:
            raise
        except BaseException as err:
            # Only a script that used the worker API has imported it; a plain script keeps its own
            # start-up cost (importing it here would import torch into every worker).
            job_module = sys.modules.get("etc_agent.worker.job")
            job = job_module.current() if job_module is not None else None
            if job is None or not job.recover(err):
                raise


if __name__ == "__main__":
    main(sys.argv[1:])
