"""Failure domains of a placement: which shards have every copy inside one node.

A node is the failure domain here (its devices go down together: a preempted VM, a dead host).
For each distinct shard of the new layout the planner knows which ranks hold a copy; with the
placement (rank -> device) that is a set of nodes. A shard whose copies all sit in one node is lost
with that node and only a checkpoint brings it back. Pure: layouts and devices in, figures out.

Two uses:

- :func:`replica_sets` gives the placement search (:mod:`etc_agent.planner.assign`) the sets of TP
  groups that hold the same data, weighted by bytes, so it can prefer placements that spread them;
- :func:`failure_domains` reports, for a finished placement, the shards with a single failure
  domain and what losing each node would cost (bytes from surviving peers vs bytes lost).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from etc_agent.layout.devices import Device
from etc_agent.layout.model import DTYPE_BYTES
from etc_agent.layout.shards import StateLayout


def _holders(layout: StateLayout) -> list[tuple[tuple[int, ...], int, int]]:
    """``(ranks holding it, bytes, number of keys)`` for every distinct shard of every placement."""
    keys_of: dict[int, list[str]] = defaultdict(list)
    for key, p in layout.key_placement.items():
        keys_of[p].append(key)
    out = []
    for p_index, placement in enumerate(layout.placements):
        keys = keys_of.get(p_index)
        if not keys:
            continue
        width = sum(DTYPE_BYTES[layout.key_dtype[k]] for k in keys)
        ranks_of: dict[int, list[int]] = defaultdict(list)
        for r, s in zip(placement.entry_rank.tolist(), placement.entry_shard.tolist()):
            ranks_of[s].append(r)
        for s, ranks in ranks_of.items():
            numel = int(placement.geometry.shard_numel[s])
            if numel:
                out.append((tuple(sorted(set(ranks))), numel * width, len(keys)))
    return out


def replica_sets(layout: StateLayout, tp: int) -> list[tuple[tuple[int, ...], int]]:
    """Sets of TP groups (new rank // tp) that hold copies of the same data, with the bytes at stake.

    Only sets of two or more groups: a shard held by one group (ZeRO ranges, dp=1) sits in one node
    whatever the placement, so it does not steer the search.
    """
    weight: dict[tuple[int, ...], int] = defaultdict(int)
    for ranks, nbytes, _ in _holders(layout):
        groups = tuple(sorted({r // tp for r in ranks}))
        if len(groups) > 1:
            weight[groups] += nbytes
    return sorted(weight.items())


@dataclass
class NodeLoss:
    """What losing one node's devices would cost under a placement."""

    node: str
    bytes_lost: int
    """Bytes whose every copy is on this node (only a checkpoint has them)."""
    bytes_from_peers: int
    """Bytes this node held that surviving nodes still have (what a new generation moves from peers)."""


@dataclass
class FailureDomainReport:
    single_domain_shards: int
    """Tensor shards (key x distinct shard) whose every copy sits in one node."""
    single_domain_bytes: int
    unavoidable_single_domain_bytes: int
    """Part of ``single_domain_bytes`` held by a single rank's group (ZeRO ranges, dp=1): no
    placement spreads it."""
    num_nodes: int
    per_node: list[NodeLoss] = field(default_factory=list)

    @property
    def worst(self) -> NodeLoss | None:
        return max(self.per_node, key=lambda n: (n.bytes_lost, n.bytes_from_peers, n.node), default=None)

    def to_json(self) -> dict[str, object]:
        worst = self.worst
        return {
            "single_domain_shards": self.single_domain_shards,
            "single_domain_bytes": self.single_domain_bytes,
            "unavoidable_single_domain_bytes": self.unavoidable_single_domain_bytes,
            "num_nodes": self.num_nodes,
            "worst_node_loss": None
            if worst is None
            else {"node": worst.node, "bytes_lost": worst.bytes_lost, "bytes_from_peers": worst.bytes_from_peers},
            "node_loss": [
                {"node": n.node, "bytes_lost": n.bytes_lost, "bytes_from_peers": n.bytes_from_peers}
                for n in self.per_node
            ],
        }


def failure_domains(layout: StateLayout, assignment: Sequence[Device], tp: int) -> FailureDomainReport:
    """Single-domain shards and per-node loss of ``layout`` with new rank ``r`` on ``assignment[r]``."""
    node_of_rank = [d.node for d in assignment]
    nodes = sorted(set(node_of_rank))
    lost = dict.fromkeys(nodes, 0)
    from_peers = dict.fromkeys(nodes, 0)
    single_shards = single_bytes = unavoidable = 0
    for ranks, nbytes, num_keys in _holders(layout):
        holder_nodes = {node_of_rank[r] for r in ranks}
        if len(holder_nodes) == 1:
            single_shards += num_keys
            single_bytes += nbytes
            if len({r // tp for r in ranks}) == 1:
                unavoidable += nbytes
            lost[next(iter(holder_nodes))] += nbytes
        else:
            for node in holder_nodes:
                from_peers[node] += nbytes
    per_node = [NodeLoss(n, lost[n], from_peers[n]) for n in nodes]
    return FailureDomainReport(single_shards, single_bytes, unavoidable, len(nodes), per_node)


def single_domain_weight(group_node: np.ndarray, sets: Sequence[tuple[tuple[int, ...], int]]) -> int:
    """Bytes of ``sets`` (from :func:`replica_sets`) whose groups all sit on one node."""
    total = 0
    for groups, nbytes in sets:
        first = group_node[groups[0]]
        if all(group_node[g] == first for g in groups[1:]):
            total += nbytes
    return total
