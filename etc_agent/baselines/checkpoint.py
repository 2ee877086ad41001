"""The checkpoint way: ``torch.distributed.checkpoint`` save, then load with resharding.

State is given as :class:`~etc_agent.migrate.describe.LocalShard` lists (the same description the
executor uses), so DTensors, Megatron-style boxed tensors and ZeRO flat ranges all go through DCP:
every shard is written as its pieces (boxes contiguous in local storage) and every new shard is read
back piece by piece, DCP computing the overlaps with what was saved (its own resharding). Replicas
are written once (DCP's dedup of identical write items across ranks).

Call sequence: every rank of the old layout calls :func:`save_shards` (collective over the default
group), the job restarts, every rank of the new layout calls :func:`load_shards`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from etc_agent.migrate.describe import LocalShard


class _Pieces:
    def __init__(self, shards: Sequence[LocalShard]):
        self.views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
        self.by_key: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
        self.global_shape: dict[str, tuple[int, ...]] = {}
        for local in shards:
            for offsets, view in local.piece_views():
                if not view.numel():
                    continue
                self.views[(local.shard.key, offsets)] = view
                self.by_key.setdefault(local.shard.key, []).append((offsets, view))
            self.global_shape[local.shard.key] = local.shard.global_shape

    def lookup(self, index: MetadataIndex) -> torch.Tensor:
        return self.views[(index.fqn, tuple(index.offset))]


class _BoxSavePlanner(DefaultSavePlanner):
    def __init__(self, pieces: _Pieces):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> SavePlan:
        items = []
        for key, views in self.pieces.by_key.items():
            for offsets, view in views:
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, torch.Size(offsets)),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape),
                            properties=TensorProperties.create_from_tensor(view),
                            size=torch.Size(self.pieces.global_shape[key]),
                        ),
                    )
                )
        self.plan = SavePlan(items)
        return self.plan

    def lookup_object(self, index: MetadataIndex):
        return self.pieces.lookup(index)


class _BoxLoadPlanner(DefaultLoadPlanner):
    def __init__(self, pieces: _Pieces):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, views in self.pieces.by_key.items():
            if key not in self.metadata.state_dict_metadata:
                raise ValueError(f"checkpoint has no tensor {key!r}")
            md = self.metadata.state_dict_metadata[key]
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in views]
            items += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces.lookup(index)


def save_shards(shards: Sequence[LocalShard], path: str | Path, process_group=None) -> None:
    """Write every shard (replicas once) to ``path`` with DCP's file system writer (files synced)."""
    pieces = _Pieces(shards)
    dcp.save({}, storage_writer=dcp.FileSystemWriter(str(path), sync_files=True), planner=_BoxSavePlanner(pieces), process_group=process_group)


def load_shards(shards: Sequence[LocalShard], path: str | Path, process_group=None) -> None:
    """Fill every shard's storage from the checkpoint at ``path``, resharding as needed."""
    pieces = _Pieces(shards)
    dcp.load({}, storage_reader=dcp.FileSystemReader(str(path)), planner=_BoxLoadPlanner(pieces), process_group=process_group)
