"""ETC agent: elastic hybrid-parallel training with live device-to-device state migration.

The worker API (``etc_agent.init``, ``Job``, ``ParallelContext``) is loaded on first use, so the
command-line tools start without importing torch.
"""

__version__ = "0.1.0"

_WORKER_API = {"init", "Job", "JobError", "ParallelContext"}


def __getattr__(name: str):
    if name in _WORKER_API:
        from etc_agent import worker

        return getattr(worker, name)
    raise AttributeError(f"module 'etc_agent' has no attribute {name!r}")


__all__ = sorted(_WORKER_API)
