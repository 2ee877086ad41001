"""The periodic checkpoints' directory, as workers write it and agents commit it.

Each checkpoint is ``<dir>/step<S>-g<generation>/``: DCP's files, written by every rank, and the
state file. Rank 0 writes the state file as ``etc_state.json.pending``; it becomes
``etc_state.json`` only once the agent committed the checkpoint in the store, fenced on the
revision of the generation it was made in (:mod:`etc_agent.agent.commits`). A directory without
``etc_state.json`` is incomplete or uncommitted and never read.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "etc_state.json"
"""Marks a checkpoint complete and committed: every rank's data and DCP's metadata are on storage,
and the store accepted the commit."""

PENDING_FILE = f"{STATE_FILE}.pending"
"""The state file of a checkpoint written but not committed yet."""


@dataclass(frozen=True)
class StoredCheckpoint:
    step: int
    generation: int
    path: Path

    def state(self) -> dict[str, Any]:
        return json.loads((self.path / STATE_FILE).read_text())


def checkpoint_path(directory: str | Path, step: int, generation: int) -> Path:
    return Path(directory) / f"step{step:08d}-g{generation}"


def complete_checkpoints(directory: Path) -> list[StoredCheckpoint]:
    """Complete checkpoints under ``directory``, oldest first (by step, then generation)."""
    found = []
    for marker in directory.glob(f"step*-g*/{STATE_FILE}"):
        step, _, generation = marker.parent.name[4:].partition("-g")
        try:
            found.append(StoredCheckpoint(int(step), int(generation), marker.parent))
        except ValueError:
            continue  # not ours
    return sorted(found, key=lambda c: (c.step, c.generation))


def prune_checkpoints(directory: Path, keep: int) -> None:
    """Keep the ``keep`` newest complete checkpoints; delete older ones, and directories older than
    the oldest kept that never completed or were never committed."""
    complete = complete_checkpoints(directory)
    kept = complete[-keep:]
    for old in complete[:-keep]:
        shutil.rmtree(old.path, ignore_errors=True)
    oldest_kept = kept[0].step if kept else 0
    for path in directory.glob("step*-g*"):
        if not (path / STATE_FILE).exists() and path.name[4:12].isdigit() and int(path.name[4:12]) < oldest_kept:
            shutil.rmtree(path, ignore_errors=True)


__all__ = [
    "PENDING_FILE",
    "STATE_FILE",
    "StoredCheckpoint",
    "checkpoint_path",
    "complete_checkpoints",
    "prune_checkpoints",
]
