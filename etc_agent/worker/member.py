"""A member's groups, context and state for the generation it enters: made inside the switch or,
ahead, while the previous generation still trains.

Call sequence, on every member of the generation: :func:`form_member` (in a preparation's thread,
:func:`prepare_member`, or in :func:`~etc_agent.worker.entry.form`), then in the switch, once the
old groups are destroyed, :meth:`Member.install` and :meth:`Member.take_state`.

Ahead, :func:`prepare_member` also runs ``build(ctx)`` when the job allows it
(``job.start(build, build_ahead=True)``: the build only allocates when ``ctx.restoring``, uses
nothing but ``ctx``, no RNG, no collectives and no global state) and the state will be migrated
into (``ctx.restoring``). It does not when the new mesh equals the one training: DTensor caches
sharding decisions by mesh shape and names, so a build beside training on an equal mesh could
hand the training thread results that point at the new groups. The state built ahead costs the
new shards' memory from then on (:func:`touch_new_shards` makes their pages resident on a CPU),
which the migration would hold beside the old shards anyway.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from etc_agent.migrate.describe import describe_state
from etc_agent.protocol.control import Assignment
from etc_agent.worker import boundary
from etc_agent.worker.appstate import holds_only_whole_tensors, hook_optimizers, split_state
from etc_agent.worker.connect import init_default_group
from etc_agent.worker.context import ParallelContext, context_for, make_context
from etc_agent.worker.worldgroups import TrainingWorld, form_world, supports

if TYPE_CHECKING:
    from etc_agent.worker.switch_view import JobView


@dataclass
class BuiltState:
    """What ``build(ctx)`` returned, ready for the job (optimizer hooks, step binding), not yet the job's."""

    state: dict
    tensors: dict
    """The state's tensors by flattened key (what the migration fills)."""
    commit_barrier_wanted: bool
    """This rank's answer to whether the layout needs the commit barrier (the job's vote carries it)."""


def build_state(
    build: Callable[[ParallelContext], Any],
    ctx: ParallelContext,
    next_step: Callable[[], int],
    before_optimizer_step: Callable[..., None] | None,
    on_optimizer_step: Callable[..., None],
    commit_barrier_wanted: bool | None,
) -> BuiltState:
    """``build(ctx)``'s state readied for the job: data entries told the job's step, optimizers
    hooked (``before_optimizer_step``: the commit barrier, None without), and whether the layout
    needs the commit barrier (``commit_barrier_wanted`` when the job fixed it)."""
    state = build(ctx)
    if not isinstance(state, dict):
        raise TypeError(f"build() must return a dict (the app state), got {type(state).__name__}")
    for entry in state.values():
        bind_step = getattr(entry, "bind_step", None)
        if callable(bind_step):
            bind_step(next_step)  # etc_agent.data.ElasticData: its position is this step's
    hook_optimizers(state, not ctx.restoring, before_optimizer_step, on_optimizer_step)
    if commit_barrier_wanted is None:
        commit_barrier_wanted = boundary.needs_commit_barrier(ctx.config, lambda: holds_only_whole_tensors(state))
    tensors, _ = split_state(state, keep_vars=True)
    return BuiltState(state, tensors, commit_barrier_wanted)


@dataclass
class Member:
    """One member's part of a generation: its groups and context, and its state once built."""

    ctx: ParallelContext
    world: TrainingWorld | None
    """The groups formed on the generation's store (gloo), installed by :meth:`install`; None
    where ``init_process_group`` made the default group already (NCCL)."""
    built: BuiltState | None = None
    """Built ahead (:func:`prepare_member`); None: ``build(ctx)`` runs in the switch."""
    bytes_touched: int = 0
    """Of the state built ahead, the bytes whose pages were written ahead (:func:`touch_new_shards`)."""
    build_error: BaseException | None = None
    """What ``build(ctx)`` raised ahead: raised again in the switch, where it would have been."""

    def install(self, timeout: timedelta) -> None:
        if self.world is not None:
            self.world.install(timeout)

    def take_state(self, view: JobView) -> BuiltState:
        """The state built ahead, or built now; the job takes its settings over."""
        if self.build_error is not None:
            raise self.build_error
        built = self.built if self.built is not None else view.build(self.ctx)
        view.take_built(built)
        return built

    def discard(self) -> None:
        """Not entered (superseded): let its groups go."""
        if self.world is not None:
            self.world.discard()


def form_member(view: JobView, store: dist.Store, assignment: Assignment) -> Member:
    """The groups and context of ``assignment`` (a member's): formed on ``store`` without touching
    torch's groups (gloo), or through ``init_process_group`` and ``init_device_mesh``, which needs
    the old groups gone (other backends)."""
    assert assignment.rank is not None  # members only
    generation, timeout = assignment.generation, timedelta(seconds=view.timeout_s)
    config = view.config_for(assignment.parallel, assignment.world_size)
    # Before the first optimizer step nothing is lost if nobody holds state: build it fresh.
    restoring = assignment.trained
    if supports(view.backend):
        world = form_world(store, generation, config, assignment.rank, view.device, timeout)
        ctx = context_for(config, assignment.rank, generation, view.device, world.mesh, restoring, timeout)
        return Member(ctx=ctx, world=world)
    init_default_group(
        view.backend,
        dist.PrefixStore(f"gen{generation}/train/", store),
        assignment.rank,
        assignment.world_size,
        timeout,
    )
    return Member(ctx=make_context(config, assignment.rank, generation, view.device, restoring, timeout), world=None)


def prepare_member(view: JobView, store: dist.Store, assignment: Assignment) -> Member | None:
    """Ahead of the switch (a preparation's thread): the member's groups and context, and its state
    where the job allows it (see the module docstring); None where it must all wait for the switch."""
    if assignment.rank is None or not supports(view.backend):
        return None
    member = form_member(view, store, assignment)
    if view.build_ahead and member.ctx.restoring and not _same_mesh(member.ctx, view.training_ctx()):
        assert member.world is not None  # formed here (supports(backend))
        try:
            with member.world.as_default():
                member.built = view.build(member.ctx)
        except Exception as err:  # noqa: BLE001 - the switch raises it where the build would have run
            member.build_error = err
        else:
            member.bytes_touched = touch_new_shards(member.built.tensors, view.held_tensors())
    return member


PAGE_BYTES = 4096


def touch_new_shards(new_tensors: dict, held_tensors: dict | None) -> int:
    """Write one element of every memory page of the new shards on the CPU, so that the migration
    writes into resident memory: on a CPU the first write to a page of a fresh allocation faults it
    in, and inside the stall that doubled the cost of the local copies and of receiving. A new shard
    equal to a held one is skipped (the migration takes the old storage over). The values written
    are overwritten by the migration, which fills every element of the new shards. Returns the
    bytes touched."""
    held = {(ls.shard.key, ls.shard) for ls in describe_state(held_tensors)} if held_tensors else set()
    touched = 0
    for local in describe_state(new_tensors):
        tensor = local.tensor
        if (local.shard.key, local.shard) in held or tensor.device.type != "cpu" or tensor.is_meta:
            continue
        if not tensor.is_contiguous():
            continue  # a view into storage described elsewhere (FSDP2's padded shard) or strided: left alone
        with torch.no_grad():
            tensor.view(-1)[:: max(1, PAGE_BYTES // tensor.element_size())].zero_()
        touched += tensor.numel() * tensor.element_size()
    return touched


class ResidentPages:
    """:func:`touch_new_shards` in a thread of its own, for a state built inside the switch: it runs
    while the versions and descriptions are exchanged and the plan made (a joiner: while the others
    still train), and :meth:`wait` ends it before anything is written into the new shards. Torch
    releases the GIL inside each write, so the switch's own work goes on beside it."""

    def __init__(self, new_tensors: dict, held_tensors: dict | None, timeout_s: float):
        self.bytes_touched = 0
        self._timeout_s = timeout_s
        self.error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(new_tensors, held_tensors), name="etc-resident-pages", daemon=True
        )
        self._thread.start()

    def _run(self, new_tensors: dict, held_tensors: dict | None) -> None:
        try:
            self.bytes_touched = touch_new_shards(new_tensors, held_tensors)
        except BaseException as err:  # noqa: BLE001 - only a head start: the data phase faults the rest in
            self.error = err

    def wait(self) -> int:
        """Until every page is written; the bytes touched (0 when it failed: the data phase then
        pays the faults itself, as without it). Nothing may write into the new shards while it
        runs, so a thread still running after the job's timeout is an error, not a reason to go on."""
        self._thread.join(self._timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(f"writing the new shards' pages did not end within {self._timeout_s:.0f} s")
        return self.bytes_touched if self.error is None else 0


def _same_mesh(new: ParallelContext, old: ParallelContext | None) -> bool:
    if old is None:
        return False
    return (new.mesh.shape, new.mesh.mesh_dim_names) == (old.mesh.shape, old.mesh.mesh_dim_names)
