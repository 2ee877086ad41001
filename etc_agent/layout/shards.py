"""Where every byte of state lives: shards, and the columnar ``StateLayout`` the planner reads.

A :class:`Shard` is one tensor piece on one rank: ``(key, global_shape, offsets, lengths, dtype)`` and,
for ZeRO-split optimizer state, a flat element range inside that box. Shards with the same key and box
on different ranks are replicas.

A :class:`StateLayout` stores the same information grouped for speed at thousands of ranks: keys
whose shards sit in exactly the same places share one :class:`Placement`, and placements whose boxes
are the same (only the holding ranks differ, e.g. the same layer kind on another pipeline stage) share
one :class:`Geometry`. The planner works per placement, never per rank x key.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from math import prod

import numpy as np

from etc_agent.layout.boxes import Box, flat_range_pieces, overlap_volumes, overlapping_pairs
from etc_agent.layout.model import DTYPE_BYTES, canonical_dtype


@dataclass(frozen=True, slots=True)
class Shard:
    """One piece of one tensor held by one rank."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    dtype: str
    flat_range: tuple[int, int] | None = None
    """``[start, stop)`` in the row-major flattening of the box, for ZeRO-split state; None = whole box."""

    @property
    def numel(self) -> int:
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return prod(self.lengths)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def boxes(self) -> list[Box]:
        """The shard as global boxes (one, or the pieces of its flat range)."""
        if self.flat_range is None:
            return [(self.offsets, self.lengths)] if prod(self.lengths) else []
        return [
            (tuple(o + p for o, p in zip(self.offsets, piece.offsets)), piece.lengths)
            for piece in flat_range_pieces(self.lengths, *self.flat_range)
        ]

    def validate(self) -> None:
        if not (len(self.global_shape) == len(self.offsets) == len(self.lengths)):
            raise ValueError(
                f"shard of {self.key}: shape {self.global_shape}, offsets {self.offsets}, lengths {self.lengths} differ in rank"
            )
        for dim, (size, off, length) in enumerate(zip(self.global_shape, self.offsets, self.lengths)):
            if off < 0 or length < 0 or off + length > size:
                raise ValueError(f"shard of {self.key}: dim {dim} range [{off}, {off + length}) outside size {size}")
        if self.flat_range is not None:
            start, stop = self.flat_range
            if not 0 <= start <= stop <= prod(self.lengths):
                raise ValueError(
                    f"shard of {self.key}: flat range [{start}, {stop}) outside box of {prod(self.lengths)} elements"
                )
        canonical_dtype(self.dtype)


ShardBox = tuple[tuple[int, ...], tuple[int, ...], tuple[int, int] | None]


class Geometry:
    """The distinct shards of one tensor shape, as boxes split into contiguous pieces.

    ``shard_boxes[s]`` is ``(offsets, lengths, flat_range)``; ``piece_*`` arrays list every piece with
    the distinct shard it belongs to. Distinct shards are usually disjoint (a partition of the tensor);
    ``disjoint`` says whether they are.
    """

    def __init__(self, global_shape: tuple[int, ...], shard_boxes: Sequence[ShardBox]):
        self.global_shape = tuple(global_shape)
        self.shard_boxes: tuple[ShardBox, ...] = tuple(shard_boxes)
        ndim = len(self.global_shape)
        offs, lens, owner, flat_starts = [], [], [], []
        self.shard_numel = np.zeros(len(self.shard_boxes), dtype=np.int64)
        for s, (offsets, lengths, flat) in enumerate(self.shard_boxes):
            if flat is None:
                if prod(lengths):
                    offs.append(offsets)
                    lens.append(lengths)
                    owner.append(s)
                    flat_starts.append(0)
                self.shard_numel[s] = prod(lengths)
            else:
                for piece in flat_range_pieces(lengths, *flat):
                    offs.append(tuple(o + p for o, p in zip(offsets, piece.offsets)))
                    lens.append(piece.lengths)
                    owner.append(s)
                    flat_starts.append(piece.flat_start - flat[0])
                self.shard_numel[s] = flat[1] - flat[0]
        self.piece_off = np.array(offs, dtype=np.int64).reshape(-1, ndim)
        self.piece_len = np.array(lens, dtype=np.int64).reshape(-1, ndim)
        self.piece_shard = np.array(owner, dtype=np.int64)
        self.piece_flat_start = np.array(flat_starts, dtype=np.int64)
        """Element index of each piece inside its shard's local (flat) storage."""
        self.fingerprint = hashlib.sha256(repr((self.global_shape, self.shard_boxes)).encode()).hexdigest()
        self._disjoint: bool | None = None
        self._pieces: list[list[Box]] | None = None

    @property
    def num_shards(self) -> int:
        return len(self.shard_boxes)

    @property
    def numel(self) -> int:
        return prod(self.global_shape)

    @property
    def disjoint(self) -> bool:
        if self._disjoint is None:
            i, j, _ = overlapping_pairs(self.piece_off, self.piece_len, self.piece_off, self.piece_len)
            self._disjoint = bool((i == j).all())
        return self._disjoint

    def pieces_of(self, shard: int) -> list[Box]:
        """The boxes of distinct shard ``shard`` (cached; do not modify)."""
        if self._pieces is None:
            pieces: list[list[Box]] = [[] for _ in range(self.num_shards)]
            for s, off, ln in zip(self.piece_shard.tolist(), self.piece_off.tolist(), self.piece_len.tolist()):
                pieces[s].append((tuple(off), tuple(ln)))
            self._pieces = pieces
        return self._pieces[shard]

    def covered_numel(self) -> int:
        """Elements covered by at least one distinct shard (exact; assumes disjoint for speed)."""
        if self.disjoint:
            return int(self.shard_numel.sum())
        from etc_agent.layout.boxes import box_subtract

        covered: list[Box] = []
        total = 0
        for i in range(len(self.piece_shard)):
            todo = [(tuple(self.piece_off[i].tolist()), tuple(self.piece_len[i].tolist()))]
            for c in covered:
                todo = [r for t in todo for r in box_subtract(t, c)]
            total += sum(prod(b[1]) for b in todo)
            covered.append((tuple(self.piece_off[i].tolist()), tuple(self.piece_len[i].tolist())))
        return total


@dataclass(eq=False)
class Placement:
    """Which ranks hold which distinct shard of a :class:`Geometry` (one entry per rank x shard)."""

    geometry: Geometry
    entry_rank: np.ndarray
    entry_shard: np.ndarray
    fingerprint: str = field(init=False)
    _by_rank: dict[int, list[int]] | None = field(init=False, default=None)

    def shards_held_by(self, rank: int) -> list[int]:
        """Distinct shard indices ``rank`` holds (empty if none)."""
        if self._by_rank is None:
            by_rank: dict[int, list[int]] = defaultdict(list)
            for r, s in zip(self.entry_rank.tolist(), self.entry_shard.tolist()):
                by_rank[r].append(s)
            self._by_rank = dict(by_rank)
        return self._by_rank.get(rank, [])

    def __post_init__(self) -> None:
        order = np.lexsort((self.entry_shard, self.entry_rank))
        self.entry_rank = np.ascontiguousarray(self.entry_rank[order], dtype=np.int64)
        self.entry_shard = np.ascontiguousarray(self.entry_shard[order], dtype=np.int64)
        h = hashlib.sha256(self.geometry.fingerprint.encode())
        h.update(self.entry_rank.tobytes())
        h.update(self.entry_shard.tobytes())
        self.fingerprint = h.hexdigest()


class StateLayout:
    """All shards of a training state over ``num_ranks`` ranks, grouped by placement."""

    def __init__(
        self, num_ranks: int, placements: Sequence[Placement], key_placement: dict[str, int], key_dtype: dict[str, str]
    ):
        self.num_ranks = num_ranks
        self.placements = list(placements)
        self.key_placement = dict(key_placement)
        self.key_dtype = {k: canonical_dtype(v) for k, v in key_dtype.items()}
        self._by_rank: dict[int, list[tuple[int, int]]] | None = None
        for p in self.placements:
            if len(p.entry_rank) and (p.entry_rank.min() < 0 or p.entry_rank.max() >= num_ranks):
                raise ValueError(f"placement refers to rank {int(p.entry_rank.max())} outside a world of {num_ranks}")

    # ---- construction from plain shard lists ------------------------------------
    @classmethod
    def from_shards(cls, per_rank: Sequence[Iterable[Shard]]) -> StateLayout:
        """Build from every rank's shard list (e.g. all-gathered descriptions of live state)."""
        by_key: dict[str, list[tuple[int, Shard]]] = defaultdict(list)
        for rank, shards in enumerate(per_rank):
            for shard in shards:
                by_key[shard.key].append((rank, shard))
        geometries: dict[str, Geometry] = {}
        # Most keys of a model share their shape and boxes with others (every layer's weights, their
        # optimizer states): each distinct geometry and placement is built and checked once.
        by_boxes: dict[tuple[object, ...], Geometry] = {}
        by_entries: dict[tuple[object, ...], int] = {}
        valid: set[tuple[object, ...]] = set()
        placements: list[Placement] = []
        placement_index: dict[str, int] = {}
        key_placement: dict[str, int] = {}
        key_dtype: dict[str, str] = {}
        for key in sorted(by_key):
            entries = by_key[key]
            first = entries[0][1]
            dtype = canonical_dtype(first.dtype)
            for rank, shard in entries:
                box = (shard.global_shape, shard.offsets, shard.lengths, shard.flat_range, shard.dtype)
                if box not in valid:
                    shard.validate()
                    valid.add(box)
                if shard.global_shape != first.global_shape:
                    raise ValueError(
                        f"{key}: rank {rank} says global shape {shard.global_shape}, rank {entries[0][0]} says {first.global_shape}"
                    )
                if canonical_dtype(shard.dtype) != dtype:
                    raise ValueError(
                        f"{key}: rank {rank} holds {shard.dtype}, rank {entries[0][0]} holds {first.dtype}"
                    )
            boxes = tuple(sorted({(s.offsets, s.lengths, s.flat_range) for _, s in entries}, key=_box_sort_key))
            geometry = by_boxes.get((first.global_shape, boxes))
            if geometry is None:
                geometry = Geometry(first.global_shape, boxes)
                geometry = by_boxes[(first.global_shape, boxes)] = geometries.setdefault(geometry.fingerprint, geometry)
            box_index = {b: i for i, b in enumerate(geometry.shard_boxes)}
            rank_list = tuple(r for r, _ in entries)
            shard_list = tuple(box_index[(s.offsets, s.lengths, s.flat_range)] for _, s in entries)
            idx = by_entries.get((geometry.fingerprint, rank_list, shard_list))
            if idx is None:
                ranks = np.array(rank_list, dtype=np.int64)
                shard_ids = np.array(shard_list, dtype=np.int64)
                _check_rank_disjoint(key, geometry, ranks, shard_ids)
                placement = Placement(geometry, ranks, shard_ids)
                idx = placement_index.get(placement.fingerprint)
                if idx is None:
                    idx = placement_index[placement.fingerprint] = len(placements)
                    placements.append(placement)
                by_entries[(geometry.fingerprint, rank_list, shard_list)] = idx
            key_placement[key] = idx
            key_dtype[key] = dtype
        return cls(len(per_rank), placements, key_placement, key_dtype)

    # ---- queries ----------------------------------------------------------------
    @property
    def keys(self) -> list[str]:
        return list(self.key_placement)

    def keys_by_placement(self) -> list[list[str]]:
        out: list[list[str]] = [[] for _ in self.placements]
        for key, idx in self.key_placement.items():
            out[idx].append(key)
        return out

    def shards_of(self, rank: int) -> list[Shard]:
        """Every shard ``rank`` holds, in key order."""
        if self._by_rank is None:
            by_rank: dict[int, list[tuple[int, int]]] = defaultdict(list)
            for p_idx, p in enumerate(self.placements):
                for r, s in zip(p.entry_rank.tolist(), p.entry_shard.tolist()):
                    by_rank[r].append((p_idx, s))
            self._by_rank = by_rank
        held: dict[int, list[int]] = defaultdict(list)
        for p_idx, s in self._by_rank.get(rank, []):
            held[p_idx].append(s)
        out: list[Shard] = []
        for key in sorted(self.key_placement):
            p_idx = self.key_placement[key]
            geometry = self.placements[p_idx].geometry
            for s in held.get(p_idx, []):
                offsets, lengths, flat = geometry.shard_boxes[s]
                out.append(Shard(key, geometry.global_shape, offsets, lengths, self.key_dtype[key], flat))
        return out

    def rank_bytes(self) -> np.ndarray:
        """Bytes each rank holds."""
        out = np.zeros(self.num_ranks, dtype=np.int64)
        for p_idx, keys in enumerate(self.keys_by_placement()):
            if not keys:
                continue
            p = self.placements[p_idx]
            itemsize = sum(DTYPE_BYTES[self.key_dtype[k]] for k in keys)
            np.add.at(out, p.entry_rank, p.geometry.shard_numel[p.entry_shard] * itemsize)
        return out

    def state_bytes(self) -> int:
        """Bytes of the state with every element counted once (replicas once)."""
        return sum(
            prod(self.placements[p].geometry.global_shape) * DTYPE_BYTES[self.key_dtype[k]]
            for k, p in self.key_placement.items()
        )

    def check_complete(self) -> None:
        """Raise ValueError unless every element of every tensor is held by some rank."""
        for p_idx, keys in enumerate(self.keys_by_placement()):
            if not keys:
                continue
            geometry = self.placements[p_idx].geometry
            covered = geometry.covered_numel()
            if covered != geometry.numel:
                raise ValueError(
                    f"{sorted(keys)[0]} (and {len(keys) - 1} more with the same layout): "
                    f"{geometry.numel - covered} of {geometry.numel} elements held by no rank"
                )


def _box_sort_key(box: ShardBox) -> tuple[object, ...]:
    offsets, lengths, flat = box
    return (offsets, lengths, flat or (-1, -1))


def _check_rank_disjoint(key: str, geometry: Geometry, ranks: np.ndarray, shard_ids: np.ndarray) -> None:
    if len(np.unique(ranks)) == len(ranks):
        return
    for rank in np.unique(ranks):
        mine = shard_ids[ranks == rank]
        if len(mine) < 2:
            continue
        if len(np.unique(mine)) != len(mine):
            raise ValueError(f"{key}: rank {int(rank)} lists the same shard twice")
        sel = np.isin(geometry.piece_shard, mine)
        ov = overlap_volumes(
            geometry.piece_off[sel], geometry.piece_len[sel], geometry.piece_off[sel], geometry.piece_len[sel]
        )
        np.fill_diagonal(ov, 0)
        if ov.any():
            raise ValueError(f"{key}: rank {int(rank)} holds overlapping shards")
