"""A simple bandwidth model for estimating migration time, ETC's and the checkpoint way's."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from etc_agent.layout.devices import Device

GB = 1e9


class BandwidthModel(BaseModel):
    """Link and storage speeds. Defaults describe an H100/H200-class cluster.

    Every figure is per direction. A device sends and receives at the same time; what a device sends
    inside its node and across nodes in one round shares its time (one copy engine / NIC queue).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    intra_node_gbps: float = Field(
        150.0, gt=0, description="GB/s one device achieves point-to-point inside a node (NVLink-class, effective)."
    )
    inter_node_gbps: float = Field(
        25.0, gt=0, description="GB/s one device achieves to another node (one 200 Gb/s NIC per GPU)."
    )
    message_latency_s: float = Field(2e-5, ge=0, description="Fixed cost of one message (launch + handshake).")
    stream_gbps: float | None = Field(
        None,
        gt=0,
        description="GB/s one point-to-point stream reaches, when below the link's: a device then needs several "
        "peers at once to reach intra/inter_node_gbps (e.g. TCP over loopback). None: one stream reaches the link's speed.",
    )
    storage_write_gbps_per_node: float = Field(
        5.0, gt=0, description="GB/s one node writes a checkpoint to shared storage."
    )
    storage_read_gbps_per_node: float = Field(
        10.0, gt=0, description="GB/s one node reads a checkpoint from shared storage."
    )
    storage_aggregate_gbps: float = Field(
        100.0, gt=0, description="GB/s the parallel file system absorbs from all nodes together (writes)."
    )
    storage_aggregate_read_gbps: float = Field(
        200.0, gt=0, description="GB/s the parallel file system serves to all nodes together (reads)."
    )
    restart_seconds: float = Field(
        20.0,
        ge=0,
        description="Checkpoint way only: stop every worker, start new processes, import torch, create the CUDA context.",
    )

    def etc_seconds(self, messages: Iterable[tuple[Device, Device, int, int]]) -> float:
        """Time of the rounds of ``(src, dst, round, bytes)`` messages: per round, the busiest device.

        A device's time in a round, for its sends and (separately) its receives: its bytes over each link
        summed (one NIC / copy engine), but no less than its largest message over one stream."""
        link: dict[tuple[int, Device, str], float] = defaultdict(float)
        stream: dict[tuple[int, Device, str], float] = defaultdict(float)
        for src, dst, rnd, nbytes in messages:
            bw = self.intra_node_gbps if src.node == dst.node else self.inter_node_gbps
            one = min(bw, self.stream_gbps) if self.stream_gbps else bw
            for key in ((rnd, src, "send"), (rnd, dst, "recv")):
                link[key] += nbytes / (bw * GB) + self.message_latency_s
                stream[key] = max(stream[key], nbytes / (one * GB) + self.message_latency_s)
        per_round: dict[int, float] = defaultdict(float)
        for key, seconds in link.items():
            per_round[key[0]] = max(per_round[key[0]], seconds, stream[key])
        return sum(per_round.values())

    def checkpoint_seconds(self, write_bytes: int, num_old_nodes: int, read_bytes: int, num_new_nodes: int) -> float:
        """Save everything, restart, load every new shard: storage-bound phases plus the restart."""
        write_bw = min(num_old_nodes * self.storage_write_gbps_per_node, self.storage_aggregate_gbps) * GB
        read_bw = min(num_new_nodes * self.storage_read_gbps_per_node, self.storage_aggregate_read_gbps) * GB
        return write_bytes / write_bw + self.restart_seconds + read_bytes / read_bw
