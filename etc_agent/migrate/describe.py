"""Describe live state as the planner's shard boxes, with a handle on each shard's local storage.

Accepted leaves of a (possibly nested) state dict, flattened to dotted keys:

- ``DTensor`` with any ``Shard``/``Replicate`` placements on a ``DeviceMesh`` (TP, FSDP2, HSDP),
  and FSDP2's ``_StridedShard`` over tensor parallel (2-D FSDP + TP on one dim): the box comes from
  ``compute_local_shape_and_global_offset``; the storage is the local tensor (for FSDP2, a view of
  its padded sharded storage, so a migration writes into the module's parameters in place).
- :class:`BoxedTensor`: Megatron-style tensors that carry their own global shape and offsets, and
  optionally a flat element range inside that box (distributed-optimizer shards).
- plain ``torch.Tensor``: a full replica. 0-dim tensors are seen as one-element 1-D tensors.

Everything else (numbers, strings, param-group settings) is not state to move and is skipped.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import torch

from etc_agent.layout.boxes import Piece, flat_range_pieces
from etc_agent.layout.model import canonical_dtype
from etc_agent.layout.shards import Shard


@dataclass
class BoxedTensor:
    """A local tensor that knows where it sits in its global tensor (Megatron ``ShardedTensor`` style).

    ``tensor`` holds the box ``offsets .. offsets+lengths`` of a ``global_shape`` tensor, either with
    shape ``lengths`` or, when ``flat_range`` is given, as the 1-D range ``[start, stop)`` of the box's
    row-major flattening.
    """

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...] | None = None
    flat_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.lengths is None:
            self.lengths = tuple(self.tensor.shape)
        expected = (self.flat_range[1] - self.flat_range[0],) if self.flat_range else tuple(self.lengths)
        if tuple(self.tensor.shape) != expected and self.tensor.numel() != prod(expected):
            raise ValueError(
                f"BoxedTensor: tensor of shape {tuple(self.tensor.shape)} does not hold a box of {expected}"
            )


@dataclass
class LocalShard:
    """A shard and the local tensor holding its elements (shape ``lengths``, or 1-D for a flat range)."""

    shard: Shard
    tensor: torch.Tensor

    def piece_views(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """``(global offsets, view)`` of each piece of the storage: the whole box, or for a flat range
        its pieces, each contiguous in the 1-D storage."""
        s = self.shard
        if s.flat_range is None:
            tensor = self.tensor if tuple(self.tensor.shape) == s.lengths else self.tensor.view(s.lengths)
            return [(s.offsets, tensor)]
        flat = self.tensor.view(-1)
        out = []
        for piece in _pieces(s):
            start = piece.flat_start - s.flat_range[0]
            view = flat[start : start + prod(piece.lengths)].view(piece.lengths)
            out.append((tuple(so + po for so, po in zip(s.offsets, piece.offsets)), view))
        return out

    def region_view(self, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> torch.Tensor:
        """A view of the global box ``offsets/lengths`` inside this shard's storage.

        The region must lie inside one piece (the planner's regions do).
        """
        for p_off, view in self.piece_views():
            if all(po <= o and o + n <= po + pn for po, pn, o, n in zip(p_off, view.shape, offsets, lengths)):
                return view[tuple(slice(o - po, o - po + n) for o, po, n in zip(offsets, p_off, lengths))]
        raise ValueError(
            f"{self.shard.key}: region {offsets}/{lengths} is not inside one piece of {self.shard.flat_range or 'its box'}"
        )


_PIECES: dict[tuple[tuple[int, ...], tuple[int, int]], list[Piece]] = {}


def _pieces(shard: Shard) -> list[Piece]:
    """The boxes of a ZeRO-split shard's flat range (its ``flat_range`` is set)."""
    assert shard.flat_range is not None
    key = (shard.lengths, shard.flat_range)
    if key not in _PIECES:
        _PIECES[key] = flat_range_pieces(shard.lengths, *shard.flat_range)
    return _PIECES[key]


def flatten_state(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``{"model": {"w": t}}`` -> ``("model.w", t)``; lists and tuples are indexed by position."""
    for name, value in state.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            yield from flatten_state(value, key + ".")
        elif (
            isinstance(value, (list, tuple))
            and value
            and all(isinstance(v, (Mapping, torch.Tensor, BoxedTensor)) for v in value)
        ):
            yield from flatten_state({str(i): v for i, v in enumerate(value)}, key + ".")
        else:
            yield key, value


def describe_tensor(key: str, value: Any) -> LocalShard | None:
    """The shard of one state leaf, or None when the leaf is not a tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, BoxedTensor):
        assert value.lengths is not None  # BoxedTensor.__post_init__ fills it in
        shard = Shard(
            key,
            tuple(value.global_shape),
            tuple(value.offsets),
            tuple(value.lengths),
            canonical_dtype(str(value.tensor.dtype)),
            value.flat_range,
        )
        shard.validate()
        return LocalShard(shard, value.tensor)
    if isinstance(value, DTensor):
        return _describe_dtensor(key, value)
    if isinstance(value, torch.Tensor):
        tensor = value.reshape(1) if value.dim() == 0 else value
        shape = tuple(tensor.shape)
        return LocalShard(Shard(key, shape, (0,) * len(shape), shape, canonical_dtype(str(tensor.dtype))), tensor)
    return None


def _describe_dtensor(key: str, value) -> LocalShard:
    local = value._local_tensor
    global_shape = tuple(value.shape)
    lengths, offsets = _dtensor_box(key, value)
    if tuple(local.shape) != lengths:
        raise ValueError(f"{key}: DTensor local shape {tuple(local.shape)} differs from its computed box {lengths}")
    if not global_shape:
        global_shape, offsets, lengths, local = (1,), (0,), (1,), local.reshape(1)
    # Empty local shards (uneven Shard) report offset = dim size; keep them inside bounds.
    offsets = tuple(min(o, s) for o, s in zip(offsets, global_shape))
    return LocalShard(Shard(key, global_shape, offsets, lengths, canonical_dtype(str(local.dtype))), local)


_MESH_BOXES: dict[int, tuple[weakref.ref, dict]] = {}
"""``id(mesh)`` -> (the mesh, ``(global shape, placements)`` -> ``(lengths, offsets)`` of this
process's box). Keyed by the mesh object, not its value: a mesh equal to an old one may put this
process at another coordinate (a rank changes between generations)."""


def _dtensor_box(key: str, value) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(lengths, offsets)`` of this process's box of ``value``, checked once per shape, placements
    and mesh: torch's computation costs ~0.3 ms a tensor, and a model's layers repeat a few shapes."""
    mesh = value.device_mesh
    entry = _MESH_BOXES.get(id(mesh))
    if entry is None or entry[0]() is not mesh:
        mesh_id = id(mesh)
        entry = (weakref.ref(mesh, lambda _ref: _MESH_BOXES.pop(mesh_id, None)), {})
        _MESH_BOXES[mesh_id] = entry
    geometry = (tuple(value.shape), tuple(value.placements))
    box = entry[1].get(geometry)
    if box is None:
        box = entry[1][geometry] = _compute_box(key, value)
    return box


def _compute_box(key: str, value) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as ShardPlacement
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    for mesh_dim, placement in enumerate(value.placements):
        if isinstance(placement, _StridedShard):
            _check_fsdp_over_tp(key, value, mesh_dim, placement)
        elif type(placement) not in (ShardPlacement, Replicate):
            raise ValueError(
                f"{key}: DTensor placement {placement} cannot be migrated (only Shard, Replicate and "
                "FSDP2's strided sharding over tensor parallel; reduce Partial placements before migrating)"
            )
    lengths, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return tuple(lengths), tuple(offsets)


def _check_fsdp_over_tp(key: str, value, mesh_dim: int, placement) -> None:
    """Accept the ``_StridedShard`` FSDP2 gives a parameter that tensor parallel already split on the
    same dim: ``split_factor`` is the product of the later mesh dims that ``Shard`` that dim, so each
    rank holds one contiguous chunk of its TP shard (a box). Other strided layouts are not boxes."""
    from torch.distributed.tensor import Shard as ShardPlacement

    later = [
        value.device_mesh.size(later_dim)
        for later_dim, other in enumerate(value.placements)
        if later_dim > mesh_dim and type(other) is ShardPlacement and other.dim == placement.dim
    ]
    if not later or prod(later) != placement.split_factor:
        raise ValueError(
            f"{key}: DTensor placement {placement} on mesh dim {mesh_dim} is not FSDP2 over tensor parallel "
            f"(split factor {placement.split_factor}, later Shard({placement.dim}) mesh sizes {later}): "
            "its local shard is not one box and cannot be migrated"
        )


def describe_state(state: Mapping[str, Any] | None) -> list[LocalShard]:
    """Every tensor leaf of ``state`` as a :class:`LocalShard`, in key order."""
    if state is None:
        return []
    out: list[LocalShard] = []
    seen: set[str] = set()
    for key, value in flatten_state(state):
        if key in seen:
            raise ValueError(f"state key {key!r} appears twice after flattening")
        seen.add(key)
        local = describe_tensor(key, value)
        if local is not None:
            out.append(local)
    out.sort(key=lambda ls: ls.shard.key)
    return out
