"""Run a training script the way ``python script.py`` (or ``python -m module``) would, and re-enter
it after a recovered peer failure.

``etcrun`` starts Python workers as ``python -m etc_agent.worker.launch script.py args...``. For a
script that does not use the worker API nothing changes: ``__file__`` is absolute and ``sys.argv[0]``
is the path as typed (as Python gives them), the working directory is etcrun's, its exit code is its
own, and an uncaught exception's traceback starts at the script's first frame (this launcher's and
``runpy``'s frames are left out, as torchrun's error file leaves them out).

For a worker-API script, an error from a failed peer inside a training step does not end the
process: :meth:`Job.recover <etc_agent.worker.job.Job.recover>` keeps the state in memory, switches
to the next generation with the surviving replicas, and the script runs again from the top, where
``etc_agent.init()`` and ``job.start()`` return the live job and ``job.steps()`` continues from the
recovered step. Code before the loop therefore runs again and should not redo one-time side effects.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import runpy
import sys
import types
from types import TracebackType

LAUNCHER_FILES = frozenset({os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"})
"""Frames of these files before the script's first frame are the launcher's, not the user's."""


def script_path(target: str) -> str:
    """The script's path as Python makes ``__file__`` for ``python TARGET``: absolute, joined to the
    working directory as typed (not normalized)."""
    return target if os.path.isabs(target) else os.path.join(os.getcwd(), target)


def user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the launcher's leading frames (None when every frame is the launcher's: a
    script that does not compile, whose error names its own file and line)."""
    while tb is not None and tb.tb_frame.f_code.co_filename in LAUNCHER_FILES:
        tb = tb.tb_next
    return tb


def run_script(path: str) -> None:
    """Run the file at ``path`` as ``__main__`` the way the interpreter runs ``python path``
    (``runpy.run_path`` would set ``sys.argv[0]`` to the absolute path; Python keeps it as typed)."""
    with io.open_code(path) as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main_module = types.ModuleType("__main__")
    main_module.__dict__.update(
        __file__=path,
        __cached__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path),
        __package__=None,
        __spec__=None,
        __builtins__=builtins,
    )
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main_module
    try:
        exec(code, main_module.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m etc_agent.worker.launch (script.py | -m module) [args...]")
    module = argv[0] == "-m"
    target = argv[1] if module else argv[0]
    args = argv[2:] if module else argv[1:]
    sys.argv = [target, *args]
    path = script_path(target)
    if not module:
        sys.path.insert(0, os.path.dirname(path))  # as `python script.py` does
    while True:
        try:
            if module:
                # Imported already where a fork server preloaded it (ETC_AGENT_PRELOAD): runpy runs
                # it again as __main__ either way, but warns about the copy in sys.modules.
                sys.modules.pop(target, None)
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            elif os.path.isfile(path):
                run_script(path)
            else:
                runpy.run_path(path, run_name="__main__")  # a directory or zip file with __main__.py
            return
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as err:  # noqa: BLE001 - the script's uncaught exception, said as Python would
            # Only a script that used the worker API has imported it; a plain script keeps its own
            # start-up cost (importing it here would import torch into every worker).
            job_module = sys.modules.get("etc_agent.worker.job")
            job = job_module.current() if job_module is not None else None
            if job is not None and job.recover(err):
                continue
            # What the interpreter does with an uncaught exception, from the script's frame on (the
            # default hook prints the exception's own traceback, whatever it is given).
            err.with_traceback(user_traceback(err.__traceback__))
            sys.excepthook(type(err), err, err.__traceback__)
            raise SystemExit(1) from None


if __name__ == "__main__":
    main(sys.argv[1:])
