"""Where every byte of training state lives for a parallel configuration. Pure; no processes."""

from etc_agent.layout.boxes import Box, Piece, balanced_range, chunk_range, flat_range_pieces
from etc_agent.layout.config import ParallelConfig, RankCoord
from etc_agent.layout.devices import Device, DeviceSet
from etc_agent.layout.megatron import model_layout, model_tensors, optimizer_key, stage_layers
from etc_agent.layout.model import DTYPE_BYTES, ModelSpec, canonical_dtype
from etc_agent.layout.shards import Geometry, Placement, Shard, StateLayout

__all__ = [
    "Box",
    "DTYPE_BYTES",
    "Device",
    "DeviceSet",
    "Geometry",
    "ModelSpec",
    "ParallelConfig",
    "Piece",
    "Placement",
    "RankCoord",
    "Shard",
    "StateLayout",
    "balanced_range",
    "canonical_dtype",
    "chunk_range",
    "flat_range_pieces",
    "model_layout",
    "model_tensors",
    "optimizer_key",
    "stage_layers",
]
