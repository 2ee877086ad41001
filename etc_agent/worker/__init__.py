"""The worker API: ``job = etc_agent.init(); job.start(build); for step in job.steps(n): ...``.

Loaded on first use: ``etcrun`` starts every Python worker through ``etc_agent.worker.launch``, and
a plain script (no worker API) must not pay for importing torch there.
"""

from etc_agent.utils.lazy import lazy_exports

_EXPORTS = {
    "ParallelContext": "etc_agent.worker.context",
    "Job": "etc_agent.worker.job",
    "JobError": "etc_agent.worker.errors",
    "init": "etc_agent.worker.job",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
