"""What a generation switch sees of its job, and the calls through which it changes the job.

The job (:mod:`etc_agent.worker.job`) builds a :class:`JobView` for every switch; the switch
(:mod:`etc_agent.worker.switch` and its rooms) reads the job's settings from it and changes the
job's state only through its calls (:attr:`JobView.take_state`, :attr:`JobView.leave`,
:attr:`JobView.use_store`, :attr:`JobView.resume`), never by naming the job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from etc_agent.layout.config import ParallelConfig
from etc_agent.protocol.phases import PhaseTracker
from etc_agent.rendezvous.records import MigrationRecord
from etc_agent.worker.context import ParallelContext
from etc_agent.worker.errors import JobError
from etc_agent.worker.link import AgentLink

if TYPE_CHECKING:
    from etc_agent.worker.checkpoint import PeriodicCheckpointer
    from etc_agent.worker.member import BuiltState
    from etc_agent.worker.prepare import Preparations


@dataclass(frozen=True)
class Resumed:
    """The generation a switch brought this process into, as a member: what the job trains on next."""

    state: dict
    ctx: ParallelContext
    next_step: int
    generation: int
    tensors: dict
    """The state's tensors by flattened key (its boxes: what a build ahead compares new shards with)."""


@dataclass(frozen=True)
class JobView:
    """One elastic job as its switch sees it: settings, services, and the calls that change the job."""

    link: AgentLink
    phase: PhaseTracker
    checkpointer: PeriodicCheckpointer | None
    timeout_s: float
    backend: str
    device: torch.device
    node_id: str
    local_rank: int
    migration: str
    """live, or checkpoint (the baseline)."""
    checkpoint_dir: str | None
    fresh_start: bool
    """``etcrun --fresh-start``: never resume from the checkpoints in ``checkpoint_dir``."""
    config_for: Callable[[str | None, int], ParallelConfig]
    build: Callable[[ParallelContext], BuiltState]
    """Run the script's ``build(ctx)`` and ready its state (changes nothing of the job: may run ahead)."""
    take_built: Callable[[BuiltState], None]
    """The job takes over what a built state decides (its commit-barrier answer)."""
    build_ahead: bool
    """``job.start(build, build_ahead=True)``: the build may run beside training (:mod:`etc_agent.worker.member`)."""
    training_ctx: Callable[[], ParallelContext | None]
    """The context training now (None inside a switch, after the teardown)."""
    held_tensors: Callable[[], dict | None]
    """The tensors of the state training now, by flattened key, as the switch that resumed it had
    them, or inside a switch of the state it brings (None when it holds none); safe to describe
    beside the training thread, unlike the app objects (a state dict of an FSDP2 module reshards it)."""
    publish: Callable[[MigrationRecord], None]
    fatal: Callable[[JobError], None]
    """Tell the agent the job cannot go on, then raise the error."""
    mark_trained: Callable[[], None]
    next_step: Callable[[], int]
    """Steps the job completed: its held state's step, or the step it resumed at."""
    take_state: Callable[[], tuple[dict | None, ParallelContext | None]]
    """The job's state and context; the job lets go of the state (the context goes with :attr:`teardown`)."""
    teardown: Callable[[], None]
    """Destroy the old groups (and the job's context)."""
    leave: Callable[[], None]
    """The job lets go of its state and context, then tears its groups down."""
    use_store: Callable[[dist.Store], None]
    """The store of the generation being entered becomes the job's (its checkpoints coordinate on it)."""
    resume: Callable[[Resumed], None]
    """The job now holds the state of the generation it entered."""
    preparations: Preparations
    """What is prepared of the next generation while training (:meth:`~etc_agent.worker.prepare.Preparations.take`)."""
