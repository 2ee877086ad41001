"""The migration planner: old layout on old devices + new layout + new devices -> ``MigrationPlan``.

Pure: takes descriptions, returns data. Steps (docs/planner.md, "How the planner decides"):

1. Key groups: keys whose shards sit in the same places in both layouts are planned together.
2. Cost matrix over (device, new rank): ``U`` = bytes of the rank's new shards not resident on the
   device, ``V`` = bytes of them not resident anywhere on the device's node.
3. Assignment minimising ``U + eps * V`` with every TP group inside one node. ``eps`` is small
   enough that the ``V`` term (inter-node bytes) only breaks ties between placements moving the same
   number of bytes: bytes moved come first, inter-node bytes second.
4. Routing: each region a device needs and does not hold comes from one live holder, preferring the
   same node, then the holder that has sent the fewest bytes so far (spreads sends over replicas).
5. Coalescing: one message per (src, dst) pair per round, regions packed back to back; rounds keep
   every device's send and receive buffers under ``mem_cap_bytes``.
6. Validation (``validate.py``) and figures.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from math import prod
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from etc_agent.layout.boxes import Box, box_intersection, box_subtract
from etc_agent.layout.config import ParallelConfig
from etc_agent.layout.devices import Device, DeviceSet
from etc_agent.layout.megatron import model_layout
from etc_agent.layout.model import ModelSpec
from etc_agent.layout.shards import Geometry, StateLayout
from etc_agent.planner.assign import assign_ranks, lsa
from etc_agent.planner.bandwidth import BandwidthModel
from etc_agent.planner.domains import failure_domains, replica_sets, single_domain_weight
from etc_agent.planner.plan import KeyGroup, LocalCopy, MigrationPlan, Region, Restore, Transfer

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


class _Planner:
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
        # Device universe: new devices first (their ids index the cost matrix), then old-only ones.
        new_set = set(new_devices)
        self.universe: list[Device] = list(new_devices) + [d for d in self.old_devices if d not in new_set]
        self.dev_id = {d: i for i, d in enumerate(self.universe)}
        self.nodes = list(dict.fromkeys(d.node for d in self.universe))
        node_id = {n: i for i, n in enumerate(self.nodes)}
        self.node_of = np.array([node_id[d.node] for d in self.universe], dtype=np.int64)
        self.num_dev = len(new_devices)
        self.num_new_nodes = len({d.node for d in new_devices})
        self.old_rank_dev = np.array([self.dev_id[d] for d in old_assignment], dtype=np.int64)
        self.old_rank_alive = np.array([d not in failed for d in old_assignment], dtype=bool)
        self._overlaps: dict[tuple[str, str], np.ndarray] = {}

    # ---- step 1: groups ------------------------------------------------------------
    def _groups(self) -> tuple[list[KeyGroup], list[str]]:
        missing = sorted(k for k in self.new.key_placement if k not in self.old.key_placement)
        if missing:
            message = f"the new layout needs {len(missing)} tensors no old rank holds, e.g. {missing[:3]}"
            if self.old_rank_alive.all():
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

    def _overlap(self, a: Geometry, b: Geometry) -> np.ndarray:
        """Elements shared by every (old distinct shard, new distinct shard) pair."""
        key = (a.fingerprint, b.fingerprint)
        if key not in self._overlaps:
            out = np.zeros((a.num_shards, b.num_shards), dtype=np.int64)
            if len(a.piece_shard) and len(b.piece_shard):
                lo = np.maximum(a.piece_off[:, None, :], b.piece_off[None, :, :])
                hi = np.minimum((a.piece_off + a.piece_len)[:, None, :], (b.piece_off + b.piece_len)[None, :, :])
                ov = np.clip(hi - lo, 0, None).prod(axis=-1, dtype=np.int64)
                rows = _reduce_sorted(ov, a.piece_shard, a.num_shards, axis=0)
                out = _reduce_sorted(rows, b.piece_shard, b.num_shards, axis=1)
            self._overlaps[key] = out
        return self._overlaps[key]

    # ---- step 2: cost matrix ------------------------------------------------------
    def _cost(self, groups: list[KeyGroup]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n_dev, n_rank = self.num_dev, self.new.num_ranks
        need = np.zeros(n_rank, dtype=np.int64)
        res_dev = np.zeros((n_dev, n_rank), dtype=np.int64)
        res_node = np.zeros((self.num_new_nodes, n_rank), dtype=np.int64)
        for g in groups:
            pn = self.new.placements[g.new_placement]
            w = g.bytes_per_element
            new_rank, new_shard = pn.entry_rank, pn.entry_shard
            np.add.at(need, new_rank, pn.geometry.shard_numel[new_shard] * w)
            if g.old_placement < 0:
                continue  # held nowhere: the same cost on every device
            po = self.old.placements[g.old_placement]
            overlap = self._overlap(po.geometry, pn.geometry)
            dev = self.old_rank_dev[po.entry_rank]
            here = dev < n_dev
            if here.any():
                vals = overlap[np.ix_(po.entry_shard[here], new_shard)] * w
                _add_block(res_dev, dev[here], new_rank, vals)
            alive = self.old_rank_alive[po.entry_rank]
            node = self.node_of[dev[alive]]
            shard = po.entry_shard[alive]
            keep = node < self.num_new_nodes
            pairs = np.unique(np.stack([node[keep], shard[keep]], axis=1), axis=0)
            if len(pairs):
                vals = overlap[np.ix_(pairs[:, 1], new_shard)] * w
                if po.geometry.disjoint:
                    _add_block(res_node, pairs[:, 0], new_rank, vals)
                else:
                    # Overlapping old shards would be counted twice; the node term only breaks ties,
                    # so an upper bound per group (never above the rank's need) is good enough.
                    part = np.zeros_like(res_node)
                    np.add.at(part, (pairs[:, 0][:, None], new_rank[None, :]), vals)
                    group_need = np.zeros(n_rank, dtype=np.int64)
                    np.add.at(group_need, new_rank, pn.geometry.shard_numel[new_shard] * w)
                    res_node += np.minimum(part, group_need[None, :])
        not_on_device = need[None, :] - res_dev
        node_of_new = self.node_of[:n_dev]
        not_on_node = need[None, :] - res_node[node_of_new, :]
        return need, not_on_device, not_on_node

    # ---- step 4: routing -------------------------------------------------------------
    def _route(
        self, groups: list[KeyGroup], assignment: np.ndarray
    ) -> tuple[
        dict[tuple[int, int], list[tuple[Region, int]]],
        dict[int, list[Region]],
        np.ndarray,
        dict[str, int],
        dict[int, list[Region]],
    ]:
        dev_of_old_rank = self.old_rank_dev
        rank_at_dev = {int(d): r for r, d in enumerate(dev_of_old_rank.tolist())}
        load = np.zeros(len(self.universe), dtype=np.int64)
        pair_regions: dict[tuple[int, int], list[tuple[Region, int]]] = defaultdict(list)
        local: dict[int, list[Region]] = defaultdict(list)
        local_bytes = np.zeros(self.num_dev, dtype=np.int64)
        lost: dict[str, int] = {}
        restores: dict[int, list[Region]] = defaultdict(list)
        partitions: dict[tuple[object, ...], tuple[list[Box], list[tuple[int, Box]], list[Box]]] = {}
        for gi, g in enumerate(groups):
            pn = self.new.placements[g.new_placement]
            if g.old_placement < 0:
                for j, b in zip(pn.entry_rank.tolist(), pn.entry_shard.tolist()):
                    restores[int(assignment[j])] += [Region(gi, off, ln) for off, ln in pn.geometry.pieces_of(b)]
                continue
            po = self.old.placements[g.old_placement]
            geo_old, geo_new = po.geometry, pn.geometry
            w = g.bytes_per_element
            overlap = self._overlap(geo_old, geo_new)
            held: dict[int, list[int]] = defaultdict(list)
            holders: dict[int, list[int]] = defaultdict(list)
            for r, a in zip(po.entry_rank.tolist(), po.entry_shard.tolist()):
                held[r].append(a)
                if self.old_rank_alive[r]:
                    holders[a].append(int(dev_of_old_rank[r]))
            available = tuple(sorted(holders))
            for j, b in zip(pn.entry_rank.tolist(), pn.entry_shard.tolist()):
                d = int(assignment[j])
                old_rank = rank_at_dev.get(d)
                resident = tuple(held.get(old_rank, ())) if old_rank is not None else ()
                if geo_old.disjoint:
                    key = (geo_old.fingerprint, geo_new.fingerprint, b, resident, available)
                    part = partitions.get(key)
                    if part is None:
                        part = partitions[key] = self._partition(geo_old, geo_new, overlap, b, resident, available)
                else:
                    order = sorted(available, key=lambda a: (min(self._distance(h, d) for h in holders[a]), a))
                    part = self._partition(geo_old, geo_new, overlap, b, resident, tuple(order))
                local_boxes, remote, missing = part
                for off, ln in local_boxes:
                    local[d].append(Region(gi, off, ln))
                    local_bytes[d] += prod(ln) * w
                for a, (off, ln) in remote:
                    nbytes = prod(ln) * w
                    src = min(holders[a], key=lambda h: (self._distance(h, d), load[h], h))
                    load[src] += nbytes
                    pair_regions[(src, d)].append((Region(gi, off, ln), nbytes))
                for off, ln in missing:
                    if self.options.restore_lost:
                        restores[d].append(Region(gi, off, ln))
                        continue
                    for key_name in g.keys:
                        lost[key_name] = lost.get(key_name, 0) + prod(ln)
        return pair_regions, local, local_bytes, lost, restores

    def _distance(self, src: int, dst: int) -> int:
        if src == dst:
            return 0
        return 1 if self.node_of[src] == self.node_of[dst] else 2

    def _partition(
        self,
        geo_old: Geometry,
        geo_new: Geometry,
        overlap: np.ndarray,
        b: int,
        resident: tuple[int, ...],
        candidates: tuple[int, ...],
    ) -> tuple[list[Box], list[tuple[int, Box]], list[Box]]:
        """Split new shard ``b`` into resident boxes, ``(old shard, box)`` to fetch, and boxes nobody has."""
        local: list[Box] = []
        remaining: list[Box] = []
        for piece in geo_new.pieces_of(b):
            rest = [piece]
            for a in resident:
                if not overlap[a, b]:
                    continue
                for held in geo_old.pieces_of(a):
                    rest = _carve(rest, held, lambda box: local.append(box))
            remaining += rest
        remote: list[tuple[int, Box]] = []
        resident_set = set(resident)
        for a in candidates:
            if not remaining:
                break
            if a in resident_set or not overlap[a, b]:
                continue

            def take(box: Box, a: int = a) -> None:
                remote.append((a, box))

            for held in geo_old.pieces_of(a):
                remaining = _carve(remaining, held, take)
        return local, remote, remaining

    # ---- step 5: coalescing and rounds --------------------------------------------
    def _schedule(
        self, groups: list[KeyGroup], pair_regions: dict[tuple[int, int], list[tuple[Region, int]]]
    ) -> list[tuple[int, int, int, list[Region], int]]:
        cap = self.options.mem_cap_bytes
        messages: list[tuple[int, int, list[Region], int]] = []
        for src, dst in sorted(pair_regions):
            chunk: list[Region] = []
            chunk_bytes = 0
            for region, nbytes in pair_regions[(src, dst)]:
                w = groups[region.group].bytes_per_element
                for piece in _split_region(region, w, cap) if nbytes > cap else [region]:
                    pbytes = piece.numel * w
                    if chunk and chunk_bytes + pbytes > cap:
                        messages.append((src, dst, chunk, chunk_bytes))
                        chunk, chunk_bytes = [], 0
                    chunk.append(piece)
                    chunk_bytes += pbytes
            if chunk:
                messages.append((src, dst, chunk, chunk_bytes))
        # First fit decreasing: biggest messages first, each into the earliest round with room at
        # both ends (bytes and message count), at most one message per (src, dst) pair per round.
        order = sorted(range(len(messages)), key=lambda i: (-messages[i][3], messages[i][0], messages[i][1]))
        send_bytes: dict[int, list[int]] = defaultdict(list)
        recv_bytes: dict[int, list[int]] = defaultdict(list)
        send_count: dict[int, list[int]] = defaultdict(list)
        recv_count: dict[int, list[int]] = defaultdict(list)
        pair_rounds: dict[tuple[int, int], set[int]] = defaultdict(set)
        max_msgs = self.options.max_messages_per_round
        out = []
        for i in order:
            src, dst, regions, nbytes = messages[i]
            rnd = 0
            while True:
                for table in (send_bytes[src], recv_bytes[dst], send_count[src], recv_count[dst]):
                    while len(table) <= rnd:
                        table.append(0)
                if (
                    send_bytes[src][rnd] + nbytes <= cap
                    and recv_bytes[dst][rnd] + nbytes <= cap
                    and send_count[src][rnd] < max_msgs
                    and recv_count[dst][rnd] < max_msgs
                    and rnd not in pair_rounds[(src, dst)]
                ):
                    break
                rnd += 1
            send_bytes[src][rnd] += nbytes
            recv_bytes[dst][rnd] += nbytes
            send_count[src][rnd] += 1
            recv_count[dst][rnd] += 1
            pair_rounds[(src, dst)].add(rnd)
            out.append((src, dst, rnd, regions, nbytes))
        out.sort(key=lambda m: (m[2], m[0], m[1]))
        return out

    # ---- everything --------------------------------------------------------------
    def run(
        self,
        old_config: ParallelConfig | None,
        new_config: ParallelConfig | None,
        fixed_assignment: Sequence[Device] | None = None,
    ) -> MigrationPlan:
        from etc_agent.planner.validate import validate_plan

        groups, dropped = self._groups()
        need, not_on_device, not_on_node = self._cost(groups)
        eps = 0.5 / (float(need.sum()) + 1.0)
        cost = not_on_device.astype(np.float64) + eps * not_on_node.astype(np.float64)
        n_rank = self.new.num_ranks
        ranks = np.arange(n_rank)
        if fixed_assignment is not None:
            if len(fixed_assignment) != n_rank or len(set(fixed_assignment)) != n_rank:
                raise ValueError(f"a fixed assignment needs {n_rank} distinct devices, got {len(fixed_assignment)}")
            unknown = [str(d) for d in fixed_assignment if d not in self.dev_id or self.dev_id[d] >= self.num_dev]
            if unknown:
                raise ValueError(f"fixed assignment uses devices outside the new set: {', '.join(unknown)}")
            assignment = np.array([self.dev_id[d] for d in fixed_assignment], dtype=np.int64)
        else:
            sets = replica_sets(self.new, self.tp)
            prefer = "resilience" if self.options.placement == "resilient" else "cost"
            assignment = assign_ranks(cost, self.node_of[: self.num_dev], self.tp, sets, prefer)

            def key(candidate: np.ndarray) -> tuple[float, ...]:
                total = float(cost[candidate, ranks].sum())
                single = single_domain_weight(self.node_of[candidate[:: self.tp]], sets)
                return (single, total) if prefer == "resilience" else (int(total + 1e-9), single, total)

            # The constrained search is exact for small cases and a heuristic at scale; never do
            # worse than the naive placement when that one keeps TP groups inside nodes.
            naive_nodes = self.node_of[:n_rank].reshape(-1, self.tp)
            if (naive_nodes == naive_nodes[:, :1]).all() and key(ranks) < key(assignment):
                assignment = ranks.copy()
        predicted_moved = int(not_on_device[assignment, ranks].sum())
        naive_moved = int(not_on_device[ranks, ranks].sum())
        # Only where this planner chose the placement: workers plan with the leader's fixed one, and the
        # bound would cost them scipy's import (~0.6 s of a replacement's start).
        lower_bound = None if fixed_assignment is not None else int(round(lsa(not_on_device.T.astype(np.float64))[1]))

        pair_regions, local, local_bytes, lost, restore_regions = self._route(groups, assignment)
        if lost:
            total = sum(lost.values())
            names = sorted(lost)
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise StateLostError(
                f"state lost: {total} elements of {len(names)} tensors have no copy on a live device ({shown})", lost
            )
        messages = self._schedule(groups, pair_regions)
        universe = self.universe
        transfers = [
            Transfer(universe[s], universe[d], rnd, tuple(regions), nbytes) for s, d, rnd, regions, nbytes in messages
        ]
        local_copies = [LocalCopy(universe[d], tuple(local[d]), int(local_bytes[d])) for d in sorted(local) if local[d]]
        restores = [
            Restore(universe[d], tuple(regions), sum(r.numel * groups[r.group].bytes_per_element for r in regions))
            for d, regions in sorted(restore_regions.items())
            if regions
        ]
        bytes_restored = sum(r.num_bytes for r in restores)
        bytes_moved = sum(t.num_bytes for t in transfers)
        inter = sum(t.num_bytes for t in transfers if t.src.node != t.dst.node)
        assert bytes_moved + bytes_restored == predicted_moved, (bytes_moved, bytes_restored, predicted_moved)

        need_by_dev = {d: 0 for d in self.new_devices}
        resident_by_dev = {d: 0 for d in self.new_devices}
        for j in range(n_rank):
            need_by_dev[universe[int(assignment[j])]] = int(need[j])
        for d in range(self.num_dev):
            resident_by_dev[universe[d]] = int(local_bytes[d])
        write_bytes = self.old.state_bytes()
        read_bytes = int(need.sum())
        bw = self.options.bandwidth
        plan = MigrationPlan(
            old_config=old_config,
            new_config=new_config,
            devices_old=self.old_devices,
            devices_new=self.new_devices,
            old_assignment=self.old_assignment,
            assignment=[universe[int(d)] for d in assignment],
            groups=groups,
            transfers=transfers,
            local_copies=local_copies,
            restores=restores,
            bytes_restored=bytes_restored,
            failed=sorted(self.failed),
            dropped_keys=dropped,
            state_bytes=self.new.state_bytes(),
            need_bytes=need_by_dev,
            resident_bytes=resident_by_dev,
            bytes_moved=bytes_moved,
            bytes_moved_inter_node=inter,
            # What no live device holds is read from the checkpoint under every placement alike.
            lower_bound_bytes=None if lower_bound is None else lower_bound - bytes_restored,
            naive_bytes_moved=naive_moved - bytes_restored,
            checkpoint_bytes=write_bytes + read_bytes,
            num_rounds=1 + max((t.round for t in transfers), default=-1),
            mem_cap_bytes=self.options.mem_cap_bytes,
            max_messages_per_round=self.options.max_messages_per_round,
            estimated_seconds=bw.etc_seconds((t.src, t.dst, t.round, t.num_bytes) for t in transfers),
            checkpoint_estimated_seconds=bw.checkpoint_seconds(
                write_bytes,
                len({d.node for d in self.old_assignment}),
                read_bytes,
                len({universe[int(d)].node for d in assignment}),
            ),
        )
        plan.failure_domains = failure_domains(self.new, plan.assignment, self.tp).to_json()
        validate_plan(plan, self.old, self.new)
        plan.plan_hash = plan.compute_hash()
        return plan


def _carve(boxes: list[Box], cutter: Box, take: Callable[[Box], None]) -> list[Box]:
    """Remove ``cutter`` from ``boxes``; every removed intersection is passed to ``take``."""
    out: list[Box] = []
    for box in boxes:
        inter = box_intersection(box, cutter)
        if inter is None:
            out.append(box)
            continue
        take(inter)
        out += box_subtract(box, inter)
    return out


def _split_region(region: Region, bytes_per_element: int, cap: int) -> list[Region]:
    """Cut a region into boxes of at most ``cap`` bytes (along its outermost splittable dims)."""
    if region.numel * bytes_per_element <= cap:
        return [region]
    dims = [i for i, n in enumerate(region.lengths) if n > 1]
    if not dims:
        raise ValueError(
            f"memory cap of {cap} bytes is below one element of key group {region.group} ({bytes_per_element} bytes)"
        )
    dim = dims[0]
    unit = region.numel // region.lengths[dim] * bytes_per_element
    step = max(1, cap // unit)
    out: list[Region] = []
    for start in range(0, region.lengths[dim], step):
        length = min(step, region.lengths[dim] - start)
        offsets = tuple(o + start if i == dim else o for i, o in enumerate(region.offsets))
        lengths = tuple(length if i == dim else n for i, n in enumerate(region.lengths))
        out += _split_region(Region(region.group, offsets, lengths), bytes_per_element, cap)
    return out


def _add_block(target: np.ndarray, rows: np.ndarray, cols: np.ndarray, vals: np.ndarray) -> None:
    """``target[rows[i], cols[j]] += vals[i, j]``, also when indices repeat."""
    if len(np.unique(rows)) == len(rows) and len(np.unique(cols)) == len(cols):
        target[np.ix_(rows, cols)] += vals
    else:
        np.add.at(target, (rows[:, None], cols[None, :]), vals)


def _reduce_sorted(values: np.ndarray, owner: np.ndarray, num: int, axis: int) -> np.ndarray:
    """Sum ``values`` along ``axis`` by ``owner`` (sorted ascending) into ``num`` buckets."""
    starts = np.flatnonzero(np.r_[True, owner[1:] != owner[:-1]])
    summed = np.add.reduceat(values, starts, axis=axis)
    shape = list(values.shape)
    shape[axis] = num
    out = np.zeros(shape, dtype=np.int64)
    index: list[slice | np.ndarray] = [slice(None)] * values.ndim
    index[axis] = owner[starts]
    out[tuple(index)] = summed
    return out
