"""Box arithmetic over tensor index space. Pure, no torch.

A box is ``(offsets, lengths)`` in global coordinates of a tensor. A ZeRO shard is a flat element range
``[start, stop)`` inside the row-major flattening of a box; :func:`flat_range_pieces` turns it into a
few boxes ("pieces"), each of which is contiguous in that flattening, so every shard the planner sees
is a list of boxes and every region it routes is one box.
"""

from __future__ import annotations

from math import prod
from typing import NamedTuple

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]


class Piece(NamedTuple):
    """A box inside a flat range; ``flat_start`` is its first element's index in the box's flattening."""

    flat_start: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]


def chunk_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of chunk ``index`` when ``size`` is split in ``parts`` like ``torch.chunk``.

    Chunks are ``ceil(size / parts)`` long and trailing ones may be short or empty; this is the split
    DTensor's ``Shard(dim)`` uses, so boxes described from live DTensors match the planner's.
    """
    assert 0 <= index < parts
    chunk = -(-size // parts)
    start = min(index * chunk, size)
    return start, min(chunk, size - start)


def balanced_range(size: int, parts: int, index: int) -> tuple[int, int]:
    """``(start, length)`` of part ``index`` with the remainder going to the earliest parts."""
    assert 0 <= index < parts
    base, extra = divmod(size, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def flat_range_pieces(lengths: tuple[int, ...], start: int, stop: int) -> list[Piece]:
    """Split the flat range ``[start, stop)`` of a box with ``lengths`` into at most ``2*ndim-1`` boxes.

    Offsets are relative to the box. Pieces come in flat order and each one is contiguous in the
    row-major flattening of the box, so a 1-D buffer holding the range can be viewed piecewise.
    """
    numel = prod(lengths)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat range [{start}, {stop}) outside a box of {numel} elements {lengths}")
    return _split(tuple(lengths), start, stop)


def _split(lengths: tuple[int, ...], a: int, b: int) -> list[Piece]:
    if a >= b:
        return []
    if len(lengths) == 0:
        return [Piece(0, (), ())]
    if len(lengths) == 1:
        return [Piece(a, (a,), (b - a,))]
    rest = lengths[1:]
    row = prod(rest)
    first, last = a // row, (b - 1) // row
    if first == last:
        return _in_row(rest, first, a - first * row, b - first * row)
    out: list[Piece] = []
    if a % row:
        out += _in_row(rest, first, a % row, row)
        first += 1
    tail = b - last * row
    full_end = last if tail < row else last + 1
    if full_end > first:
        out.append(Piece(first * row, (first,) + (0,) * len(rest), (full_end - first,) + rest))
    if tail < row:
        out += _in_row(rest, last, 0, tail)
    return out


def _in_row(rest: tuple[int, ...], row_index: int, a: int, b: int) -> list[Piece]:
    base = row_index * prod(rest)
    if a == 0 and b == prod(rest):
        return [Piece(base, (row_index,) + (0,) * len(rest), (1,) + rest)]
    return [Piece(base + p.flat_start, (row_index,) + p.offsets, (1,) + p.lengths) for p in _split(rest, a, b)]


def box_intersection(a: Box, b: Box) -> Box | None:
    offsets, lengths = [], []
    for ao, al, bo, bl in zip(a[0], a[1], b[0], b[1]):
        lo, hi = max(ao, bo), min(ao + al, bo + bl)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return tuple(offsets), tuple(lengths)


def box_subtract(a: Box, b: Box) -> list[Box]:
    """``a`` minus ``b`` as at most ``2*ndim`` disjoint boxes (``[a]`` when they do not meet)."""
    inter = box_intersection(a, b)
    if inter is None:
        return [a]
    out: list[Box] = []
    cur_off, cur_len = list(a[0]), list(a[1])
    for dim, (io, il) in enumerate(zip(*inter)):
        lo, hi = cur_off[dim], cur_off[dim] + cur_len[dim]
        if io > lo:
            off, ln = list(cur_off), list(cur_len)
            ln[dim] = io - lo
            out.append((tuple(off), tuple(ln)))
        if io + il < hi:
            off, ln = list(cur_off), list(cur_len)
            off[dim] = io + il
            ln[dim] = hi - (io + il)
            out.append((tuple(off), tuple(ln)))
        cur_off[dim], cur_len[dim] = io, il
    return out


def box_contains(outer: Box, inner: Box) -> bool:
    return all(oo <= io and io + il <= oo + ol for oo, ol, io, il in zip(outer[0], outer[1], inner[0], inner[1]))


def overlap_volumes(a_off: np.ndarray, a_len: np.ndarray, b_off: np.ndarray, b_len: np.ndarray) -> np.ndarray:
    """Pairwise intersection volumes of boxes: ``(P, ndim) x (Q, ndim) -> (P, Q)`` int64."""
    lo = np.maximum(a_off[:, None, :], b_off[None, :, :])
    hi = np.minimum((a_off + a_len)[:, None, :], (b_off + b_len)[None, :, :])
    volumes: np.ndarray = np.clip(hi - lo, 0, None).prod(axis=-1, dtype=np.int64)
    return volumes


DENSE_OVERLAP_CELLS = 1 << 16
"""Below this many box pairs, :func:`overlapping_pairs` compares every pair (cheaper than sorting)."""


def overlapping_pairs(
    a_off: np.ndarray, a_len: np.ndarray, b_off: np.ndarray, b_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pairs of boxes that intersect, ``(i, j, volume)`` with ``volume > 0``, ordered by ``(i, j)``.

    Near-linear in the boxes and the pairs found, for the boxes layouts make: along the dimension
    where ``b``'s boxes start at the most distinct offsets, ``b`` sorted by start also ends in order
    (a partition of that dimension, or copies of one), so each box of ``a`` meets a contiguous run
    of ``b``, found by binary search; only those candidates are compared in every dimension. Boxes
    that nest along that dimension fall back to comparing blocks of pairs."""
    num_a, num_b = len(a_off), len(b_off)
    empty = np.empty(0, dtype=np.int64)
    if not num_a or not num_b:
        return empty, empty, empty
    if num_a * num_b <= DENSE_OVERLAP_CELLS or a_off.shape[1] == 0:
        volumes = overlap_volumes(a_off, a_len, b_off, b_len)
        i, j = np.nonzero(volumes)
        return i.astype(np.int64), j.astype(np.int64), volumes[i, j]
    dim = int(np.argmax([len(np.unique(b_off[:, k])) for k in range(b_off.shape[1])]))
    order = np.lexsort((b_off[:, dim] + b_len[:, dim], b_off[:, dim]))
    lo, hi = b_off[order, dim], (b_off + b_len)[order, dim]
    if len(hi) > 1 and (np.diff(hi) < 0).any():
        return _overlapping_pairs_blocked(a_off, a_len, b_off, b_len)
    a_lo, a_hi = a_off[:, dim], a_off[:, dim] + a_len[:, dim]
    first = np.searchsorted(hi, a_lo, side="right")
    stop = np.searchsorted(lo, a_hi, side="left")
    counts = np.clip(stop - first, 0, None)
    i = np.repeat(np.arange(num_a, dtype=np.int64), counts)
    within = np.arange(len(i), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    j = order[np.repeat(first, counts) + within]
    inter_lo = np.maximum(a_off[i], b_off[j])
    inter_hi = np.minimum(a_off[i] + a_len[i], b_off[j] + b_len[j])
    volumes = np.clip(inter_hi - inter_lo, 0, None).prod(axis=1, dtype=np.int64)
    keep = volumes > 0
    i, j, volumes = i[keep], j[keep], volumes[keep]
    by_pair = np.lexsort((j, i))
    return i[by_pair], j[by_pair], volumes[by_pair]


def _overlapping_pairs_blocked(
    a_off: np.ndarray, a_len: np.ndarray, b_off: np.ndarray, b_len: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`overlapping_pairs` by comparing every pair, a block of ``a`` at a time (bounded memory)."""
    step = max(1, DENSE_OVERLAP_CELLS * 16 // max(1, len(b_off)))
    parts_i, parts_j, parts_v = [], [], []
    for start in range(0, len(a_off), step):
        volumes = overlap_volumes(a_off[start : start + step], a_len[start : start + step], b_off, b_len)
        i, j = np.nonzero(volumes)
        parts_i.append(i.astype(np.int64) + start)
        parts_j.append(j.astype(np.int64))
        parts_v.append(volumes[i, j])
    return np.concatenate(parts_i), np.concatenate(parts_j), np.concatenate(parts_v)
