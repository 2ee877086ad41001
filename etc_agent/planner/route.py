"""Step 4 of the planner: where each region a placed new rank needs comes from.

Each new shard is split into boxes its device already holds (local copies), boxes fetched from one
live holder each (same device, then same node, then the holder that has sent the fewest bytes so far,
which spreads sends over replicas), and boxes no live device holds (restores, or lost state).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable
from math import prod

import numpy as np

from etc_agent.layout.boxes import Box, box_intersection, box_subtract
from etc_agent.layout.shards import Geometry, StateLayout
from etc_agent.planner.plan import KeyGroup, Region
from etc_agent.planner.universe import ShardOverlaps, Universe

Partition = tuple[list[Box], list[tuple[int, Box]], list[Box]]
"""A new shard's boxes: resident on its device, ``(old shard, box)`` to fetch, held by no live device."""


@dataclasses.dataclass
class Routes:
    """What routing decided, by device id of the :class:`Universe`."""

    pair_regions: dict[tuple[int, int], list[tuple[Region, int]]]
    """``(src, dst)`` -> ``(region, bytes)`` to send, in routing order."""
    local: dict[int, list[Region]]
    """Device -> regions it copies from its own old shards."""
    local_bytes: np.ndarray
    """Per new device, the bytes of its local copies."""
    lost: dict[str, int]
    """Key -> elements no live device holds (empty when lost regions are restored)."""
    restores: dict[int, list[Region]]
    """Device -> regions it reads from the checkpoint."""


def route(
    old: StateLayout,
    new: StateLayout,
    groups: list[KeyGroup],
    assignment: np.ndarray,
    universe: Universe,
    overlaps: ShardOverlaps,
    *,
    restore_lost: bool,
) -> Routes:
    """Route every region of ``new`` with new rank ``r`` on device ``assignment[r]``."""
    router = _Router(old, new, assignment, universe, overlaps, restore_lost)
    for gi, g in enumerate(groups):
        router.route_group(gi, g)
    return router.routes


class _Router:
    """Routes key group after key group, remembering how many bytes each holder has sent so far."""

    def __init__(
        self,
        old: StateLayout,
        new: StateLayout,
        assignment: np.ndarray,
        universe: Universe,
        overlaps: ShardOverlaps,
        restore_lost: bool,
    ) -> None:
        self.old, self.new, self.assignment = old, new, assignment
        self.universe, self.overlaps, self.restore_lost = universe, overlaps, restore_lost
        self.rank_at_dev = {int(d): r for r, d in enumerate(universe.old_rank_dev.tolist())}
        self.load = np.zeros(len(universe.devices), dtype=np.int64)
        self.partitions: dict[tuple[object, ...], Partition] = {}
        self.local_regions: dict[tuple[int, int], tuple[list[Region], int, list[Box]]] = {}
        """(group, id of a partition's resident boxes) -> their regions and bytes (the boxes kept
        alive with them, so the id is not reused)."""
        self.routes = Routes(
            pair_regions=defaultdict(list),
            local=defaultdict(list),
            local_bytes=np.zeros(universe.num_dev, dtype=np.int64),
            lost={},
            restores=defaultdict(list),
        )

    def route_group(self, gi: int, g: KeyGroup) -> None:
        pn = self.new.placements[g.new_placement]
        if g.old_placement < 0:
            for j, b in zip(pn.entry_rank.tolist(), pn.entry_shard.tolist()):
                self.routes.restores[int(self.assignment[j])] += [
                    Region(gi, off, ln) for off, ln in pn.geometry.pieces_of(b)
                ]
            return
        po = self.old.placements[g.old_placement]
        geo_old, geo_new = po.geometry, pn.geometry
        overlap = self.overlaps.pairs(geo_old, geo_new).old_of_new
        held: dict[int, list[int]] = defaultdict(list)
        holders: dict[int, list[int]] = defaultdict(list)
        for r, a in zip(po.entry_rank.tolist(), po.entry_shard.tolist()):
            held[r].append(a)
            if self.universe.old_rank_alive[r]:
                holders[a].append(int(self.universe.old_rank_dev[r]))
        available = frozenset(holders)
        for j, b in zip(pn.entry_rank.tolist(), pn.entry_shard.tolist()):
            d = int(self.assignment[j])
            old_rank = self.rank_at_dev.get(d)
            resident = tuple(held.get(old_rank, ())) if old_rank is not None else ()
            part = self._split_shard(geo_old, geo_new, overlap, b, d, resident, available, holders)
            self._record(gi, g, d, part, holders)

    def _split_shard(
        self,
        geo_old: Geometry,
        geo_new: Geometry,
        overlap: list[frozenset[int]],
        b: int,
        d: int,
        resident: tuple[int, ...],
        available: frozenset[int],
        holders: dict[int, list[int]],
    ) -> Partition:
        """New shard ``b`` on device ``d``, split by where its boxes come from. Only the old shards
        that share elements with ``b`` and have a live holder are candidates."""
        candidates = overlap[b] & available
        if geo_old.disjoint:
            # Disjoint old shards: each box has one possible old shard, so the split does not depend
            # on the device and is shared by every device with the same resident shards.
            key = (geo_old.fingerprint, geo_new.fingerprint, b, resident, candidates)
            part = self.partitions.get(key)
            if part is None:
                part = self.partitions[key] = _partition(
                    geo_old, geo_new, overlap, b, resident, tuple(sorted(candidates))
                )
            return part
        order = sorted(candidates, key=lambda a: (min(self.universe.distance(h, d) for h in holders[a]), a))
        return _partition(geo_old, geo_new, overlap, b, resident, tuple(order))

    def _record(self, gi: int, g: KeyGroup, d: int, part: Partition, holders: dict[int, list[int]]) -> None:
        """Book ``part`` of a new shard of group ``gi`` on device ``d``, choosing a sender for each box."""
        local_boxes, remote, missing = part
        w = g.bytes_per_element
        routes = self.routes
        if local_boxes:
            # Many devices keep the same boxes of a group (copies): their regions are made once.
            key = (gi, id(local_boxes))
            made = self.local_regions.get(key)
            if made is None:
                made = self.local_regions[key] = (
                    [Region(gi, off, ln) for off, ln in local_boxes],
                    sum(prod(ln) for _, ln in local_boxes) * w,
                    local_boxes,
                )
            routes.local[d].extend(made[0])
            routes.local_bytes[d] += made[1]
        for a, (off, ln) in remote:
            nbytes = prod(ln) * w
            src = min(holders[a], key=lambda h: (self.universe.distance(h, d), self.load[h], h))
            self.load[src] += nbytes
            routes.pair_regions[(src, d)].append((Region(gi, off, ln), nbytes))
        for off, ln in missing:
            if self.restore_lost:
                routes.restores[d].append(Region(gi, off, ln))
                continue
            for key_name in g.keys:
                routes.lost[key_name] = routes.lost.get(key_name, 0) + prod(ln)


def _partition(
    geo_old: Geometry,
    geo_new: Geometry,
    overlap: list[frozenset[int]],
    b: int,
    resident: tuple[int, ...],
    candidates: tuple[int, ...],
) -> Partition:
    """Split new shard ``b`` into resident boxes, ``(old shard, box)`` to fetch, and boxes nobody has.
    ``overlap[b]``: the old shards that share elements with ``b``."""
    sharing = overlap[b]
    local: list[Box] = []
    remaining: list[Box] = []
    for piece in geo_new.pieces_of(b):
        rest = [piece]
        for a in resident:
            if a not in sharing:
                continue
            for held in geo_old.pieces_of(a):
                rest = _carve(rest, held, lambda box: local.append(box))
        remaining += rest
    remote: list[tuple[int, Box]] = []
    resident_set = set(resident)
    for a in candidates:
        if not remaining:
            break
        if a in resident_set or a not in sharing:
            continue

        def take(box: Box, a: int = a) -> None:
            remote.append((a, box))

        for held in geo_old.pieces_of(a):
            remaining = _carve(remaining, held, take)
    return local, remote, remaining


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
