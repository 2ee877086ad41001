"""The worker API: ``job = etc_agent.init(); job.start(build); for step in job.steps(n): ...``."""

from etc_agent.worker.context import ParallelContext
from etc_agent.worker.job import Job, JobError, init

__all__ = ["Job", "JobError", "ParallelContext", "init"]
