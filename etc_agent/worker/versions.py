"""Which versions of the training state every process holds (steps 1 and 4 of the switch,
:mod:`etc_agent.worker.switch`): what this process brings from the generation it leaves, the
statuses all processes exchange, and the candidate states a migration may start from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from etc_agent.migrate.describe import BoxedTensor, describe_state
from etc_agent.protocol.control import Assignment
from etc_agent.utils.plainstate import to_json
from etc_agent.worker.appstate import split_state
from etc_agent.worker.context import ParallelContext
from etc_agent.worker.entry import Entry
from etc_agent.worker.switch_view import JobView


@dataclass
class Held:
    """What this process brings from the generation it leaves (nothing, for a new process)."""

    rank: int | None = None
    config: str | None = None
    boxed: dict[str, BoxedTensor] | None = None
    plain: dict | None = None


@dataclass
class Exchanged:
    """Every process's versions of the state (index = transport rank) and this process's snapshots."""

    statuses: list[dict]
    snapshots: dict[int, Any]

    @property
    def holders(self) -> list[int]:
        return [i for i, s in enumerate(self.statuses) if any(v["kind"] == "live" for v in s["versions"])]

    @property
    def live_step(self) -> int | None:
        return max((self.statuses[i]["versions"][0]["step"] for i in self.holders), default=None)


def hold(state: dict, ctx: ParallelContext) -> Held:
    """Describe ``state`` (of layout ``ctx``): the boxes keep its tensors, not its app objects."""
    tensors, plain = split_state(state)
    boxed = {
        s.shard.key: BoxedTensor(s.tensor, s.shard.global_shape, s.shard.offsets, s.shard.lengths, s.shard.flat_range)
        for s in describe_state(tensors)
    }
    return Held(
        rank=ctx.rank,
        config=ctx.config.short(),
        boxed=boxed,
        plain={"app": plain, "rng": to_json(torch.get_rng_state(), "rng")},
    )


def exchange(job: JobView, entry: Entry, held: Held) -> Exchanged:
    """Which versions of the state every process holds, and the checkpoints it sees (collective)."""
    assignment = entry.assignment
    versions = []
    if held.boxed is not None:
        versions.append(
            {
                "kind": "live",
                "step": job.next_step(),
                "old_rank": held.rank,
                "config": held.config,
                "plain": held.plain,
            }
        )
    checkpointer = job.checkpointer if assignment.started else None
    snapshots = {s.step: s for s in checkpointer.snapshots} if checkpointer is not None else {}
    for snapshot in sorted(snapshots.values(), key=lambda s: -s.step):
        versions.append(
            {
                "kind": "snapshot",
                "step": snapshot.step,
                "old_rank": snapshot.rank,
                "config": snapshot.config,
                "plain": snapshot.plain,
            }
        )
    storage = checkpointer.storage_steps() if checkpointer is not None else {}
    if resumes_from_storage(job, assignment):
        from etc_agent.worker.checkpoint import resumable_checkpoints

        assert job.checkpoint_dir is not None  # resumes_from_storage() asks for it
        storage = resumable_checkpoints(job.checkpoint_dir)
    statuses = entry.transport.all_gather_object(
        {"device": str(entry.device), "new_rank": entry.new_rank, "versions": versions, "storage": storage}
    )
    return Exchanged(statuses, snapshots)


def resumes_from_storage(job: JobView, assignment: Assignment) -> bool:
    """The job's first generation with ``--checkpoint-dir``: a full restart resumes from its newest
    complete checkpoint (``--fresh-start``: from scratch)."""
    return not assignment.started and job.checkpoint_dir is not None and job.migration == "live" and not job.fresh_start


def candidate_states(
    statuses: list[dict],
) -> tuple[list[tuple[tuple[int, str | None], dict[int, dict]]], dict[int, str]]:
    """The states a migration may start from, newest step first, and the checkpoints every new member sees.

    A candidate is ``(step, old layout) -> {transport rank: version}``, one version per process (its
    live state before its snapshot of the same step). A step that only a complete checkpoint has is a
    candidate with no sources (layout None: read from the checkpoint). Every process computes the
    same list from the same statuses.
    """
    readers = [s for s in statuses if s["new_rank"] is not None]
    # JSON object keys are strings: the steps come back as "12".
    stored = {int(k): v for k, v in readers[0]["storage"].items()} if readers else {}
    for s in readers[1:]:
        stored = {step: path for step, path in stored.items() if str(step) in s["storage"]}
    by_id: dict[tuple[int, str | None], dict[int, dict]] = {}
    for i, s in enumerate(statuses):
        for v in s["versions"]:
            sources = by_id.setdefault((v["step"], v["config"]), {})
            if i not in sources:
                sources[i] = v
    for step in stored:
        if not any(k[0] == step for k in by_id):
            by_id[(step, None)] = {}
    order = sorted(by_id, key=lambda k: (-k[0], k[1] or ""))
    return [(k, by_id[k]) for k in order], stored
