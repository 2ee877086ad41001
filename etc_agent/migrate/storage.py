"""Shard boxes to and from ``torch.distributed.checkpoint`` (DCP) storage.

State is given as :class:`~etc_agent.migrate.describe.LocalShard` lists (the same description the
executor uses), so DTensors, Megatron-style boxed tensors and ZeRO flat ranges all go through DCP:
every shard is written as its pieces (boxes contiguous in local storage) and read back piece by
piece, DCP computing the overlaps with what was saved (its own resharding). Replicas are written
once (DCP's dedup of identical write items across ranks).

Call sequences:

- :func:`save_shards` / :func:`load_shards`: every rank of the default group, together (DCP's own
  collectives);
- :func:`save_shards_on`: every rank of a :class:`~etc_agent.migrate.transport.GroupTransport`
  together, from any thread; the coordination (write plans, write results) travels as JSON on that
  transport, so a background writer never touches the training group and nothing is unpickled;
- :func:`read_regions`: any process alone, any time (no collective): it reads only the boxes asked for.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import WriteResult

from etc_agent.migrate.describe import LocalShard
from etc_agent.migrate.transport import GroupTransport

Entry = tuple[str, tuple[int, ...], torch.Tensor, tuple[int, ...]]
"""(key, global offsets of the box, a view holding it, the key's global shape)."""


class _Pieces:
    def __init__(self, entries: Iterable[Entry]):
        self.views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.by_key: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        self.global_shape: dict[str, tuple[int, ...]] = {}
        for key, offsets, view, global_shape in entries:
            if not view.numel():
                continue
            self.views[(key, offsets)] = view
            self.by_key.setdefault(key, []).append((offsets, view))
            self.global_shape[key] = global_shape

    @classmethod
    def of(cls, shards: Sequence[LocalShard]) -> _Pieces:
        return cls(
            (s.shard.key, offsets, view, s.shard.global_shape) for s in shards for offsets, view in s.piece_views()
        )

    def lookup(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset is not None  # every item this module plans names its chunk's offset
        return self.views[(index.fqn, tuple(index.offset))]

    def describe(self) -> list[list]:
        """JSON form of this rank's write items (what :func:`_write_items` turns back)."""
        return [
            [key, list(offsets), list(view.shape), str(view.dtype).removeprefix("torch."), list(self.global_shape[key])]
            for key, views in self.by_key.items()
            for offsets, view in views
        ]


def _write_items(described: list[list]) -> list[WriteItem]:
    return [
        WriteItem(
            index=MetadataIndex(key, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=TensorProperties(dtype=getattr(torch, dtype)),
                size=torch.Size(global_shape),
            ),
        )
        for key, offsets, sizes, dtype, global_shape in described
    ]


class _BoxSavePlanner(DefaultSavePlanner):
    def __init__(self, pieces: _Pieces):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(_write_items(self.pieces.describe()))
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.pieces.lookup(index)


class _BoxLoadPlanner(DefaultLoadPlanner):
    def __init__(self, pieces: _Pieces):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> LoadPlan:
        items = []
        assert self.metadata is not None  # set_up_planner() came first
        for key, views in self.pieces.by_key.items():
            md = self.metadata.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"checkpoint has no tensor {key!r}")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in views]
            items += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces.lookup(index)


def save_shards(shards: Sequence[LocalShard], path: str | Path, process_group=None) -> None:
    """Write every shard (replicas once) to ``path`` with DCP's file system writer (files synced)."""
    pieces = _Pieces.of(shards)
    dcp.save(
        {},
        storage_writer=dcp.FileSystemWriter(str(path), sync_files=True),
        planner=_BoxSavePlanner(pieces),
        process_group=process_group,
    )


def load_shards(shards: Sequence[LocalShard], path: str | Path, process_group=None) -> None:
    """Fill every shard's storage from the checkpoint at ``path``, resharding as needed."""
    pieces = _Pieces.of(shards)
    dcp.load(
        {}, storage_reader=dcp.FileSystemReader(str(path)), planner=_BoxLoadPlanner(pieces), process_group=process_group
    )


def save_shards_on(shards: Sequence[LocalShard], path: str | Path, transport: GroupTransport) -> int:
    """:func:`save_shards` coordinated over ``transport`` instead of the default group.

    The steps of DCP's own save, with its two gathers done as JSON: every rank computes the global
    plan (dedup of replicas, file prefixes) from everyone's write items, writes its part, and rank 0
    writes the metadata from everyone's write results. Returns the bytes this rank wrote.
    """
    pieces = _Pieces.of(shards)
    rank, is_coordinator = transport.rank, transport.rank == 0
    writer = dcp.FileSystemWriter(str(path), sync_files=True)
    planner = _BoxSavePlanner(pieces)
    planner.set_up_planner(state_dict={}, storage_meta=writer.storage_meta(), is_coordinator=is_coordinator)
    writer.set_up_storage_writer(is_coordinator, rank=rank, use_collectives=True)
    writer.prepare_local_plan(planner.create_local_plan())  # creates the directory
    everyone = transport.all_gather_object(pieces.describe())
    plans, metadata = planner.create_global_plan([SavePlan(_write_items(items)) for items in everyone])
    plans = writer.prepare_global_plan(plans)
    pending = writer.write_data(planner.finish_plan(plans[rank]), planner)
    pending.wait()
    results: list[WriteResult] = pending.value()
    written = [
        [
            r.index.fqn,
            list(r.index.offset or ()),
            r.index.index,
            r.size_in_bytes,
            r.storage_data.relative_path,
            r.storage_data.offset,
            r.storage_data.length,
            r.storage_data.transform_descriptors,
        ]
        for r in results
    ]
    all_written = transport.all_gather_object(written)
    if is_coordinator:
        writer.finish(
            metadata,
            [
                [
                    WriteResult(
                        MetadataIndex(fqn, torch.Size(offset), index), size, _StorageInfo(rel, off, length, transforms)
                    )
                    for fqn, offset, index, size, rel, off, length, transforms in rank_results
                ]
                for rank_results in all_written
            ],
        )
    return sum(r.size_in_bytes for r in results)


def read_regions(path: str | Path, regions: Sequence[tuple[str, tuple[int, ...], torch.Tensor]]) -> None:
    """Fill each ``(key, global offsets, out)`` with the box of that key starting at the offsets and
    shaped like ``out`` (contiguous), reading only those boxes from the checkpoint at ``path``."""
    if not regions:
        return
    pieces = _Pieces((key, tuple(offsets), out, ()) for key, offsets, out in regions)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled"
        )  # one process reading alone is the point
        dcp.load({}, storage_reader=dcp.FileSystemReader(str(path)), planner=_BoxLoadPlanner(pieces), no_dist=True)
