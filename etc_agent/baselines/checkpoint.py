"""The checkpoint way: ``torch.distributed.checkpoint`` save, restart the workers, load with resharding.

The shard plumbing is :mod:`etc_agent.migrate.storage` (the same boxes the executor moves); the
baseline is its two collective calls. Call sequence: every rank of the old layout calls
:func:`save_shards` (collective over the default group), the job restarts, every rank of the new
layout calls :func:`load_shards`.
"""

from etc_agent.migrate.storage import load_shards, save_shards

__all__ = ["load_shards", "save_shards"]
