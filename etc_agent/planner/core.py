"""The migration planner: old layout on old devices + new layout + new devices -> ``MigrationPlan``.

Pure: takes descriptions, returns data. Steps (docs/planner.md, "How the planner decides"):

1. Key groups: keys whose shards sit in the same places in both layouts are planned together.
2. Cost matrix over (device, new rank) (``cost.py``): ``U`` = bytes of the rank's new shards not
   resident on the device, ``V`` = bytes of them not resident anywhere on the device's node.
3. Assignment minimising ``U + eps * V`` with every TP group inside one node. ``eps`` is small
   enough that the ``V`` term (inter-node bytes) only breaks ties between placements moving the same
   number of bytes: bytes moved come first, inter-node bytes second.
4. Routing (``route.py``): each region a device needs and does not hold comes from one live holder,
   preferring the same node, then the holder that has sent the fewest bytes so far (spreads sends
   over replicas).
5. Coalescing (``schedule.py``): one message per (src, dst) pair per round, regions packed back to
   back; rounds keep every device's send and receive buffers under ``mem_cap_bytes``.
6. Validation (``validate.py``) and figures.

This module is the entry: it checks the input, drives the steps and assembles the plan. The device
ids and shard overlaps the steps share are in ``universe.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from math import prod
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from etc_agent.layout.config import ParallelConfig
from etc_agent.layout.devices import Device, DeviceSet
from etc_agent.layout.megatron import model_layout
from etc_agent.layout.model import ModelSpec
from etc_agent.layout.shards import StateLayout
from etc_agent.planner.assign import assign_ranks, lsa
from etc_agent.planner.bandwidth import BandwidthModel
from etc_agent.planner.cost import cost_matrices
from etc_agent.planner.domains import failure_domains, replica_sets, single_domain_weight
from etc_agent.planner.matching import assign_sparse
from etc_agent.planner.plan import KeyGroup, LocalCopy, MigrationPlan, Restore, Transfer
from etc_agent.planner.residency import Residency, residency
from etc_agent.planner.route import Routes, route
from etc_agent.planner.schedule import ScheduledMessage, schedule
from etc_agent.planner.universe import ShardOverlaps, Universe

GiB = 1 << 30


class PlannerOptions(BaseModel):
    """Knobs of the planner."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mem_cap_bytes: int = Field(
        2 * GiB,
        gt=0,
        description="Per device and round, the most bytes of send buffers and of receive buffers in flight "
        "(each); larger transfers are split over rounds.",
    )
    max_messages_per_round: int = Field(
        64, ge=1, description="Per device and round, the most messages it sends (and receives)."
    )
    bandwidth: BandwidthModel = Field(
        default_factory=BandwidthModel, description="Link and storage speeds for the estimates."
    )
    placement: Literal["fast", "resilient"] = Field(
        "fast",
        description="fast: fewest bytes moved first, failure domains (bytes whose every copy sits in one node) only break "
        "ties (the default of etcrun and `etc-agent plan`); resilient: fewest single-domain bytes first, then fewest bytes "
        "moved (--placement resilient).",
    )
    exact_placement_max_cells: int = Field(
        1 << 22,
        ge=0,
        description="Where new devices x new ranks is at most this, placement builds the dense cost matrices and "
        "solves exactly (steps 2-3); above it, it works on the sparse residency and a matching over candidate pairs "
        "(residency.py, matching.py: near-linear in the devices), and the plan's lower_bound_bytes shows the gap.",
    )
    restore_lost: bool = Field(
        False,
        description="Regions that no live device holds are planned as reads from a checkpoint "
        "(MigrationPlan.restores) instead of raising StateLostError. Only set it when such a checkpoint exists.",
    )


class StateLostError(ValueError):
    """Some of the new layout's state is held only by failed devices."""

    def __init__(self, message: str, lost: dict[str, int]):
        super().__init__(message)
        self.lost = lost
        """Key -> number of elements with no live copy."""


def plan_model_migration(
    spec: ModelSpec,
    old_config: ParallelConfig,
    old_devices: DeviceSet,
    new_config: ParallelConfig,
    new_devices: DeviceSet,
    *,
    failed: Iterable[Device] = (),
    options: PlannerOptions | None = None,
    ordered: bool = False,
) -> MigrationPlan:
    """Plan a Megatron-layout model moving from ``old_config`` on ``old_devices`` (old rank ``r`` on
    the ``r``-th device) to ``new_config`` on ``new_devices``. ``ordered``: new rank ``r`` on the
    ``r``-th new device (as live workers are placed today) instead of the planner's placement."""
    old_config.check_world_size(len(old_devices))
    if new_config.world_size > len(new_devices):
        raise ValueError(
            f"{new_config.short()} needs {new_config.world_size} devices, the new set has only {len(new_devices)}"
        )
    started = time.perf_counter()
    old_layout = model_layout(spec, old_config)
    new_layout = model_layout(spec, new_config)
    plan = plan_migration(
        old_layout,
        list(old_devices)[: old_config.world_size],
        new_layout,
        new_devices,
        tp=new_config.tp,
        old_devices=old_devices,
        old_config=old_config,
        new_config=new_config,
        failed=failed,
        options=options,
        assignment=list(new_devices)[: new_config.world_size] if ordered else None,
    )
    plan.plan_seconds = time.perf_counter() - started
    return plan


def resilience_advice(fast: MigrationPlan, resilient: MigrationPlan) -> dict[str, Any] | None:
    """What the resilient placement would change over the fast one: None when the fast plan already
    leaves nothing avoidable in a single node (or the resilient plan spreads no more)."""
    fast_domains, resilient_domains = fast.failure_domains, resilient.failure_domains
    if fast_domains is None or resilient_domains is None:
        return None
    avoidable = fast_domains["single_domain_bytes"] - fast_domains["unavoidable_single_domain_bytes"]
    if avoidable <= 0 or resilient_domains["single_domain_bytes"] >= fast_domains["single_domain_bytes"]:
        return None
    return {
        "bytes_moved": resilient.bytes_moved,
        "extra_bytes_moved": resilient.bytes_moved - fast.bytes_moved,
        "single_domain_bytes": resilient_domains["single_domain_bytes"],
        "worst_node_loss": resilient_domains["worst_node_loss"],
        "estimated_seconds": resilient.estimated_seconds,
    }


def plan_migration(
    old: StateLayout,
    old_assignment: Sequence[Device],
    new: StateLayout,
    new_devices: Sequence[Device] | DeviceSet,
    *,
    tp: int = 1,
    old_devices: Sequence[Device] | DeviceSet | None = None,
    old_config: ParallelConfig | None = None,
    new_config: ParallelConfig | None = None,
    failed: Iterable[Device] = (),
    options: PlannerOptions | None = None,
    assignment: Sequence[Device] | None = None,
) -> MigrationPlan:
    """Plan moving ``old`` (old rank ``r`` on ``old_assignment[r]``) into ``new`` on ``new_devices``.

    ``tp``: size of the new layout's TP groups (consecutive new ranks), each kept inside one node.
    ``failed``: old devices whose state is gone. ``assignment``: new rank -> device when placement is
    already decided (live processes that know their new rank); otherwise the planner chooses it.
    Raises ``ValueError`` for inconsistent input and :class:`StateLostError` when some needed state
    has no live copy.
    """
    started = time.perf_counter()
    options = options or PlannerOptions()
    planner = _Planner(
        old, list(old_assignment), new, list(new_devices), tp, list(old_devices or old_assignment), set(failed), options
    )
    plan = planner.run(old_config, new_config, fixed_assignment=assignment)
    plan.plan_seconds = time.perf_counter() - started
    return plan


@dataclasses.dataclass(frozen=True)
class _Placement:
    """New rank -> device id, with the bytes it moves and what the alternatives would move."""

    assignment: np.ndarray
    predicted_moved: int
    naive_moved: int
    lower_bound: int | None
    """No placement moves less; None where the placement was given."""


class _Planner:
    """One planning run: checks the input, drives the steps over a shared :class:`Universe` and
    assembles the ``MigrationPlan``."""

    def __init__(
        self,
        old: StateLayout,
        old_assignment: list[Device],
        new: StateLayout,
        new_devices: list[Device],
        tp: int,
        old_devices: list[Device],
        failed: set[Device],
        options: PlannerOptions,
    ):
        if len(old_assignment) != old.num_ranks:
            raise ValueError(f"old layout has {old.num_ranks} ranks but {len(old_assignment)} old devices were given")
        if len(set(old_assignment)) != len(old_assignment):
            raise ValueError("two old ranks on one device")
        if len(set(new_devices)) != len(new_devices):
            raise ValueError("new device list repeats a device")
        if new.num_ranks > len(new_devices):
            raise ValueError(f"new layout has {new.num_ranks} ranks but only {len(new_devices)} new devices")
        if new.num_ranks % tp:
            raise ValueError(f"{new.num_ranks} new ranks are not a whole number of TP groups of {tp}")
        both = failed & set(new_devices)
        if both:
            raise ValueError(f"{', '.join(sorted(map(str, both)))} listed as failed and as a new device")
        self.old, self.new, self.tp, self.options = old, new, tp, options
        self.old_assignment, self.new_devices, self.failed = old_assignment, new_devices, failed
        self.old_devices = list(dict.fromkeys(list(old_devices) + old_assignment))
        self.universe = Universe(new_devices, self.old_devices, old_assignment, failed)
        self.overlaps = ShardOverlaps()

    def run(
        self,
        old_config: ParallelConfig | None,
        new_config: ParallelConfig | None,
        fixed_assignment: Sequence[Device] | None = None,
    ) -> MigrationPlan:
        from etc_agent.planner.validate import validate_plan

        groups, dropped = self._groups()
        if self._exact():
            need, not_on_device, not_on_node = cost_matrices(self.old, self.new, groups, self.universe, self.overlaps)
            placement = self._place(need, not_on_device, not_on_node, fixed_assignment)
        else:
            res = residency(self.old, self.new, groups, self.universe, self.overlaps)
            need = res.need
            placement = self._place_at_scale(res, fixed_assignment)
        routes = route(
            self.old,
            self.new,
            groups,
            placement.assignment,
            self.universe,
            self.overlaps,
            restore_lost=self.options.restore_lost,
        )
        if routes.lost:
            raise _state_lost(routes.lost)
        options = self.options
        messages = schedule(groups, routes.pair_regions, options.mem_cap_bytes, options.max_messages_per_round)
        plan = self._assemble(old_config, new_config, groups, dropped, need, placement, routes, messages)
        plan.failure_domains = failure_domains(self.new, plan.assignment, self.tp).to_json()
        validate_plan(plan, self.old, self.new)
        plan.plan_hash = plan.compute_hash()
        return plan

    # ---- step 1: groups ------------------------------------------------------------
    def _groups(self) -> tuple[list[KeyGroup], list[str]]:
        missing = sorted(k for k in self.new.key_placement if k not in self.old.key_placement)
        if missing:
            message = f"the new layout needs {len(missing)} tensors no old rank holds, e.g. {missing[:3]}"
            if self.universe.old_rank_alive.all():
                raise ValueError(message)
            if not self.options.restore_lost:
                # Failed ranks may have been their only holders.
                lost = {k: prod(self.new.placements[self.new.key_placement[k]].geometry.global_shape) for k in missing}
                raise StateLostError(f"state lost: {message}", lost)
        by_pair: dict[tuple[int, int], list[str]] = defaultdict(list)
        for key in missing:
            by_pair[(-1, self.new.key_placement[key])].append(key)  # every element comes from the checkpoint
        for key in sorted(k for k in self.new.key_placement if k in self.old.key_placement):
            op, np_ = self.old.key_placement[key], self.new.key_placement[key]
            old_shape = self.old.placements[op].geometry.global_shape
            new_shape = self.new.placements[np_].geometry.global_shape
            if old_shape != new_shape:
                raise ValueError(f"{key}: global shape {old_shape} in the old layout but {new_shape} in the new one")
            if self.old.key_dtype[key] != self.new.key_dtype[key]:
                raise ValueError(
                    f"{key}: dtype {self.old.key_dtype[key]} in the old layout but {self.new.key_dtype[key]} in the new one"
                )
            by_pair[(op, np_)].append(key)
        groups = [
            KeyGroup(
                keys=tuple(keys),
                dtypes=tuple(self.new.key_dtype[k] for k in keys),
                global_shape=self.new.placements[np_].geometry.global_shape,
                old_placement=op,
                new_placement=np_,
            )
            for (op, np_), keys in sorted(by_pair.items(), key=lambda item: (item[0][0] < 0, item[1][0]))
        ]
        dropped = sorted(set(self.old.key_placement) - set(self.new.key_placement))
        return groups, dropped

    # ---- step 3: placement -----------------------------------------------------------
    def _exact(self) -> bool:
        """Dense and exact, or sparse (see :class:`PlannerOptions`); the resilient placement is dense only."""
        cells = self.universe.num_dev * self.new.num_ranks
        return cells <= self.options.exact_placement_max_cells or self.options.placement == "resilient"

    def _place_at_scale(self, res: Residency, fixed_assignment: Sequence[Device] | None) -> _Placement:
        if fixed_assignment is not None:
            assignment = self._fixed_placement(fixed_assignment)
        else:
            assignment = assign_sparse(res, self.universe.node_of[: self.universe.num_dev], self.tp)
        ranks = np.arange(self.new.num_ranks)
        need_total = int(res.need.sum())
        moved = need_total - int(res.resident(assignment, ranks).sum())
        naive = need_total - int(res.resident(ranks, ranks).sum())
        naive_nodes = self.universe.node_of[: self.new.num_ranks].reshape(-1, self.tp)
        if fixed_assignment is None and naive < moved and (naive_nodes == naive_nodes[:, :1]).all():
            assignment, moved = ranks.copy(), naive
        return _Placement(
            assignment=assignment,
            predicted_moved=moved,
            naive_moved=naive,
            lower_bound=None if fixed_assignment is not None else need_total - res.best_bytes_bound(),
        )

    def _place(
        self,
        need: np.ndarray,
        not_on_device: np.ndarray,
        not_on_node: np.ndarray,
        fixed_assignment: Sequence[Device] | None,
    ) -> _Placement:
        if fixed_assignment is not None:
            assignment = self._fixed_placement(fixed_assignment)
        else:
            eps = 0.5 / (float(need.sum()) + 1.0)
            assignment = self._chosen_placement(not_on_device.astype(np.float64) + eps * not_on_node.astype(np.float64))
        ranks = np.arange(self.new.num_ranks)
        # Only where this planner chose the placement: workers plan with the leader's fixed one, and the
        # bound would cost them scipy's import (~0.6 s of a replacement's start).
        lower_bound = None if fixed_assignment is not None else int(round(lsa(not_on_device.T.astype(np.float64))[1]))
        return _Placement(
            assignment=assignment,
            predicted_moved=int(not_on_device[assignment, ranks].sum()),
            naive_moved=int(not_on_device[ranks, ranks].sum()),
            lower_bound=lower_bound,
        )

    def _fixed_placement(self, fixed_assignment: Sequence[Device]) -> np.ndarray:
        n_rank, dev_id = self.new.num_ranks, self.universe.dev_id
        if len(fixed_assignment) != n_rank or len(set(fixed_assignment)) != n_rank:
            raise ValueError(f"a fixed assignment needs {n_rank} distinct devices, got {len(fixed_assignment)}")
        unknown = [str(d) for d in fixed_assignment if d not in dev_id or dev_id[d] >= self.universe.num_dev]
        if unknown:
            raise ValueError(f"fixed assignment uses devices outside the new set: {', '.join(unknown)}")
        return np.array([dev_id[d] for d in fixed_assignment], dtype=np.int64)

    def _chosen_placement(self, cost: np.ndarray) -> np.ndarray:
        node_of = self.universe.node_of
        ranks = np.arange(self.new.num_ranks)
        sets = replica_sets(self.new, self.tp)
        prefer = "resilience" if self.options.placement == "resilient" else "cost"
        assignment = assign_ranks(cost, node_of[: self.universe.num_dev], self.tp, sets, prefer)

        def key(candidate: np.ndarray) -> tuple[float, ...]:
            total = float(cost[candidate, ranks].sum())
            single = single_domain_weight(node_of[candidate[:: self.tp]], sets)
            return (single, total) if prefer == "resilience" else (int(total + 1e-9), single, total)

        # The constrained search is exact for small cases and a heuristic at scale; never do
        # worse than the naive placement when that one keeps TP groups inside nodes.
        naive_nodes = node_of[: self.new.num_ranks].reshape(-1, self.tp)
        if (naive_nodes == naive_nodes[:, :1]).all() and key(ranks) < key(assignment):
            assignment = ranks.copy()
        return assignment

    # ---- step 6: the plan and its figures ---------------------------------------------
    def _assemble(
        self,
        old_config: ParallelConfig | None,
        new_config: ParallelConfig | None,
        groups: list[KeyGroup],
        dropped: list[str],
        need: np.ndarray,
        placement: _Placement,
        routes: Routes,
        messages: list[ScheduledMessage],
    ) -> MigrationPlan:
        transfers, local_copies, restores = self._actions(groups, routes, messages)
        bytes_restored = sum(r.num_bytes for r in restores)
        bytes_moved = sum(t.num_bytes for t in transfers)
        assert bytes_moved + bytes_restored == placement.predicted_moved, (
            bytes_moved,
            bytes_restored,
            placement.predicted_moved,
        )
        assignment = [self.universe.devices[int(d)] for d in placement.assignment]
        write_bytes, read_bytes = self.old.state_bytes(), int(need.sum())
        return MigrationPlan(
            old_config=old_config,
            new_config=new_config,
            devices_old=self.old_devices,
            devices_new=self.new_devices,
            old_assignment=self.old_assignment,
            assignment=assignment,
            groups=groups,
            transfers=transfers,
            local_copies=local_copies,
            restores=restores,
            bytes_restored=bytes_restored,
            failed=sorted(self.failed),
            dropped_keys=dropped,
            state_bytes=self.new.state_bytes(),
            need_bytes=self._need_by_device(need, placement.assignment),
            resident_bytes=self._resident_by_device(routes.local_bytes),
            bytes_moved=bytes_moved,
            bytes_moved_inter_node=sum(t.num_bytes for t in transfers if t.src.node != t.dst.node),
            # What no live device holds is read from the checkpoint under every placement alike.
            lower_bound_bytes=None if placement.lower_bound is None else placement.lower_bound - bytes_restored,
            naive_bytes_moved=placement.naive_moved - bytes_restored,
            checkpoint_bytes=write_bytes + read_bytes,
            num_rounds=1 + max((t.round for t in transfers), default=-1),
            mem_cap_bytes=self.options.mem_cap_bytes,
            max_messages_per_round=self.options.max_messages_per_round,
            estimated_seconds=self.options.bandwidth.etc_seconds(
                (t.src, t.dst, t.round, t.num_bytes) for t in transfers
            ),
            checkpoint_estimated_seconds=self.options.bandwidth.checkpoint_seconds(
                write_bytes, len({d.node for d in self.old_assignment}), read_bytes, len({d.node for d in assignment})
            ),
        )

    def _actions(
        self, groups: list[KeyGroup], routes: Routes, messages: list[ScheduledMessage]
    ) -> tuple[list[Transfer], list[LocalCopy], list[Restore]]:
        """The routed and scheduled regions as the plan's transfers, local copies and restores."""
        devices, local = self.universe.devices, routes.local
        transfers = [
            Transfer(devices[s], devices[d], rnd, tuple(regions), nbytes) for s, d, rnd, regions, nbytes in messages
        ]
        local_copies = [
            LocalCopy(devices[d], tuple(local[d]), int(routes.local_bytes[d])) for d in sorted(local) if local[d]
        ]
        restores = [
            Restore(devices[d], tuple(regions), sum(r.numel * groups[r.group].bytes_per_element for r in regions))
            for d, regions in sorted(routes.restores.items())
            if regions
        ]
        return transfers, local_copies, restores

    def _need_by_device(self, need: np.ndarray, assignment: np.ndarray) -> dict[Device, int]:
        need_by_dev = {d: 0 for d in self.new_devices}
        for j in range(self.new.num_ranks):
            need_by_dev[self.universe.devices[int(assignment[j])]] = int(need[j])
        return need_by_dev

    def _resident_by_device(self, local_bytes: np.ndarray) -> dict[Device, int]:
        resident_by_dev = {d: 0 for d in self.new_devices}
        for d in range(self.universe.num_dev):
            resident_by_dev[self.universe.devices[d]] = int(local_bytes[d])
        return resident_by_dev


def _state_lost(lost: dict[str, int]) -> StateLostError:
    total = sum(lost.values())
    names = sorted(lost)
    shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return StateLostError(
        f"state lost: {total} elements of {len(names)} tensors have no copy on a live device ({shown})", lost
    )
