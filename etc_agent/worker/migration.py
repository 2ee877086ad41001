"""The migration of a switch (step 6, :mod:`etc_agent.worker.switch`): the newest step some set of
sources covers is tried first; the plan is computed on every process from the same descriptions and
its hash compared before anything moves (:func:`~etc_agent.migrate.executor.migrate_state`); a step
with a gap falls back to an older one."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from etc_agent.layout.config import ParallelConfig
from etc_agent.layout.devices import Device
from etc_agent.migrate.exchange import PlanAhead
from etc_agent.migrate.executor import MigrationResult, migrate_state
from etc_agent.migrate.storage import read_regions
from etc_agent.planner.core import StateLostError
from etc_agent.planner.validate import PlanValidationError
from etc_agent.protocol.settings import WorkerSettings
from etc_agent.worker.entry import Entry
from etc_agent.worker.errors import BuildMismatch, PlannerBug, StateLost
from etc_agent.worker.logs import say
from etc_agent.worker.switch_view import JobView
from etc_agent.worker.versions import Exchanged, Held, candidate_states


def _fault_sender_pause_s() -> float:
    """Tests only (``ETC_AGENT_FAULT_SENDER_PAUSE_S``): read when the fault would happen."""
    return WorkerSettings.from_env(os.environ).fault_sender_pause_s


"""Tests only: a departing sender sleeps this long between the status exchange and sending."""


@dataclass
class Source:
    """What the migration started from, and what it did."""

    resume_step: int
    config: str | None = None
    carried: dict | None = None
    result: MigrationResult | None = None
    restored_from: str | None = None
    lost: list[str] = field(default_factory=list)


class Migration:
    """Move the newest state the sources cover into ``entry``'s layout (collective over the migration group)."""

    def __init__(self, job: JobView, entry: Entry, exchanged: Exchanged, held: Held, ahead: PlanAhead | None = None):
        self.job, self.entry, self.exchanged, self.held = job, entry, exchanged, held
        self.ahead = ahead
        """The plan made ahead (:mod:`etc_agent.worker.ahead`), if any: used when every process votes for it."""

    def run(self) -> Source:
        """Try the candidate states newest first; the first one the sources cover is migrated."""
        job, entry, generation = self.job, self.entry, self.entry.assignment.generation
        candidates, stored = candidate_states(self.exchanged.statuses)
        if not candidates:
            if entry.assignment.trained:
                job.fatal(
                    StateLost(
                        f"generation {generation}: no process holds any training state (all holders are gone) "
                        "and there is no checkpoint to restore from"
                    )
                )
            return Source(resume_step=job.next_step())
        last_error: Exception | None = None
        for (step, config), sources in candidates:
            try:
                return self._migrate_from(step, config, sources, stored.get(step))
            except StateLostError as err:
                # Every process computed the same plan and hit the same gap: try an older step.
                last_error = err
        if not entry.assignment.trained:
            # Nothing trained yet: the state every process built is the initial one, so a part
            # that died with its process is built again (a crash before the first step).
            return Source(resume_step=job.next_step())
        hint = (
            ""
            if job.checkpointer is not None
            else " (etcrun --checkpoint-dir and --checkpoint-interval keep periodic checkpoints to restore from)"
        )
        job.fatal(
            StateLost(
                f"generation {generation}: training state lost, no step has a live copy or a "
                f"checkpoint of every shard: {last_error}{hint}"
            )
        )
        raise AssertionError("unreachable: fatal raises")

    def _migrate_from(
        self, step: int, config: str | None, sources: dict[int, dict], restore_path: str | None
    ) -> Source:
        """Migrate the state of ``step`` (layout ``config``; None: only the checkpoint has it) into the new layout."""
        entry = self.entry
        state_file: dict[str, Any] | None = None
        if config is None:
            from etc_agent.worker.checkpoint import STATE_FILE

            assert restore_path is not None  # candidate_states() gives no layout only to steps a checkpoint has
            state_file = json.loads((Path(restore_path) / STATE_FILE).read_text())
            config = state_file["config"]
        held_ranks = {v["old_rank"] for v in sources.values()}
        lost_ranks: dict[int, tuple[Device, list]] = {
            r: (Device(f"lost{r}", 0), [])
            for r in range(ParallelConfig.parse(config).world_size)
            if r not in held_ranks
        }
        mine = sources.get(entry.transport.rank)
        old_state = None
        if mine is not None:
            old_state = self.held.boxed if mine["kind"] == "live" else self.exchanged.snapshots[mine["step"]].boxed
        if entry.new_rank is None:
            _pause_before_sending(entry)
        plan_hook = _before_moving(entry, _announcer(entry, step, self.exchanged.live_step, restore_path))
        # A live state is dropped after the switch; a snapshot may still be written out in the background.
        adopt = mine is not None and mine["kind"] == "live"
        result = self._execute(
            old_state, mine["old_rank"] if mine else None, lost_ranks, restore_path, plan_hook, adopt
        )
        if sources:
            carried = sources[min(sources)]["plain"]
        else:
            assert state_file is not None  # no process holds this step: it was read above
            carried = {"app": state_file["app"], "rng": state_file["rng"]}
        if mine is not None and mine["kind"] == "snapshot":
            assert self.job.checkpointer is not None  # this process has snapshots only with periodic checkpoints
            self.job.checkpointer.drop(lambda s: s.step == mine["step"])  # the new state may hold its buffers now
        return Source(
            resume_step=step,
            config=config,
            carried=carried,
            result=result,
            restored_from=restore_path if result.plan.bytes_restored else None,
            lost=[str(d) for d, _ in lost_ranks.values()],
        )

    def _execute(
        self,
        old_state: dict | None,
        old_rank: int | None,
        lost_ranks: dict[int, tuple[Device, list]],
        restore_path: str | None,
        plan_hook: Any,
        adopt_old: bool,
    ) -> MigrationResult:
        """Run the executor; its errors become the job's error families (a gap in the state stays
        :class:`StateLostError`, so that the caller tries an older step)."""
        job, entry, generation = self.job, self.entry, self.entry.assignment.generation
        read_checkpoint = None
        if restore_path:
            # Read straight from storage: a full restart with --checkpoint-dir alone has no checkpointer.
            read_checkpoint = partial(read_regions, restore_path)
        try:
            return migrate_state(
                old_state,
                entry.new_tensors,
                device=entry.device,
                old_rank=old_rank,
                new_rank=entry.new_rank,
                transport=entry.transport,
                tp=entry.ctx.config.tp if entry.ctx else 1,
                failed=[d for d, _ in lost_ranks.values()],
                lost_old_ranks=lost_ranks,
                timeout_s=job.timeout_s,
                read_checkpoint=read_checkpoint,
                on_plan=plan_hook,
                same_keys=pipeline_stages(job.config_for(entry.assignment.parallel, entry.assignment.world_size)),
                adopt_old=adopt_old,
                ahead=self.ahead,
            )
        except StateLostError:
            raise
        except PlanValidationError as err:
            job.fatal(
                PlannerBug(
                    f"generation {generation}: the migration plan broke one of the planner's own invariants "
                    f"(a bug in etc_agent; every process computed the same plan): {err}"
                )
            )
        except ValueError as err:
            # The descriptions do not fit together (every process sees the same, before anything
            # moved): what build() returned is wrong somewhere; a restart would repeat it.
            job.fatal(
                BuildMismatch(
                    f"generation {generation}: the state build() returned does not fit the migrating "
                    f"state ({entry.ctx.config.short() if entry.ctx else 'sender'}): {err}"
                )
            )
        raise AssertionError("unreachable: fatal raises")


def _before_moving(entry: Entry, announce: Callable[[Any], None] | None) -> Callable[[Any], None]:
    """The executor's hook once the plan is checked and before anything is written into the new
    shards: their pages made resident (:meth:`~etc_agent.worker.entry.Entry.wait_resident`), then
    the announcement, if any."""

    def hook(plan) -> None:
        entry.wait_resident()
        if announce is not None:
            announce(plan)

    return hook


def _announcer(
    entry: Entry, step: int, live_step: int | None, restore_path: str | None
) -> Callable[[Any], None] | None:
    """What new rank 0 says once the plan is known and before anything moves, when state is lost."""
    assignment = entry.assignment
    if assignment.rank != 0:
        return None

    def announce(plan) -> None:
        if not assignment.started and plan.restores:
            say(
                f"generation {assignment.generation}: resuming the job from {restore_path} at step "
                f"{step} in layout {assignment.parallel or 'the default'}; each rank reads only its regions "
                f"({plan.bytes_restored} bytes in all); etcrun --fresh-start would start from scratch",
            )
            return
        if not plan.restores and (live_step is None or step >= live_step):
            return
        keys = plan.restored_keys
        shown = ", ".join(keys[:4]) + (f" and {len(keys) - 4} more" if len(keys) > 4 else "")
        what = (
            (
                f"{plan.bytes_restored} bytes of {len(keys)} tensors have no live copy ({shown}); reading only those from "
                f"{restore_path}"
            )
            if plan.restores
            else "the survivors' snapshots hold every shard"
        )
        redo = f", training {live_step - step} steps again" if live_step is not None and step < live_step else ""
        say(
            f"generation {assignment.generation}: {what}; resuming at step {step}{redo}",
        )

    return announce


def _pause_before_sending(entry: Entry) -> None:
    """Fault injection for tests: a window in which a sender can be killed mid-migration."""
    pause_s = _fault_sender_pause_s()
    if pause_s > 0:
        say(
            f"{entry.device}: fault injection: pausing {pause_s:g} s before sending",
        )
        time.sleep(pause_s)


def pipeline_stages(config: ParallelConfig) -> dict[str, list[int]]:
    """The new ranks of each pipeline stage: they hold the same tensors (boxes of them), by construction."""
    return {
        f"pipeline stage {pp}": [config.rank(pp, dp, tp) for dp in range(config.dp) for tp in range(config.tp)]
        for pp in range(config.pp)
    }
