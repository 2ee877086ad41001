"""Placement of new ranks on devices: minimum-cost assignment with every TP group inside one node.

Without the node constraint (``tp == 1`` or one node) this is a plain linear assignment problem,
solved exactly by ``scipy.optimize.linear_sum_assignment``. With it, the problem splits in two:
which node hosts each TP group (the combinatorial part), then, per node, which device takes each
rank of its groups (a linear assignment, exact). When the number of ways to spread groups over
nodes is small the planner enumerates them all and is exact. Otherwise it solves groups -> node
slots with the cost of each group placed alone on a node (exact when no node can host two groups,
the common case of ``tp`` = devices per node), then improves by swapping and moving groups between
nodes while that lowers the total.

Failure domains (``replica_sets``): TP groups that hold copies of the same data should not all
sit in one node, or losing that node loses the data. ``prefer="resilience"`` minimises the bytes
with a single failure domain first and the migration cost second; ``prefer="cost"`` minimises the
bytes moved first and uses failure domains to break ties (then inter-node bytes, as before).
Exact when the distributions are enumerated; at scale, a repair pass moves the groups of
single-domain sets to other nodes while that improves the objective.

Ties: ``linear_sum_assignment`` is deterministic for identical input, enumeration runs in a fixed
order and keeps the first minimum, so every process computes the same placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import comb, floor

import numpy as np

from etc_agent.planner.domains import single_domain_weight

MAX_EXACT_DISTRIBUTIONS = 5000
MAX_IMPROVE_PASSES = 4
MAX_REPAIR_MOVES = 256


def lsa(cost: np.ndarray) -> tuple[np.ndarray, float]:
    """Rows -> columns (rows <= columns); returns the column of each row and the total cost."""
    from scipy.optimize import linear_sum_assignment  # 0.6 s: only the processes that choose placements pay it

    rows, cols = linear_sum_assignment(cost)
    assert len(rows) == cost.shape[0]
    out = np.empty(cost.shape[0], dtype=np.int64)
    out[rows] = cols
    return out, float(cost[rows, cols].sum())


def assign_ranks(
    cost: np.ndarray,
    node_of_device: np.ndarray,
    tp: int,
    replica_sets: Sequence[tuple[tuple[int, ...], int]] = (),
    prefer: str = "cost",
) -> np.ndarray:
    """Device index of every new rank minimising ``sum(cost[device, rank])``.

    ``cost`` is ``(num_devices, num_ranks)``; consecutive blocks of ``tp`` ranks form a TP group and
    must land on one node. ``replica_sets``: sets of TP groups holding copies of the same data, with
    their bytes (:func:`etc_agent.planner.domains.replica_sets`); ``prefer``: ``"cost"`` or
    ``"resilience"`` (see the module docstring). Raises ValueError when no such placement exists.
    """
    if prefer not in ("cost", "resilience"):
        raise ValueError(f"prefer must be cost or resilience, not {prefer!r}")
    num_devices, num_ranks = cost.shape
    if num_ranks > num_devices:
        raise ValueError(f"{num_ranks} ranks do not fit on {num_devices} devices")
    nodes = list(dict.fromkeys(node_of_device.tolist()))
    sets = list(replica_sets) if len(nodes) > 1 else []
    if tp == 1 or len(nodes) == 1:
        if tp > 1 and num_devices < num_ranks:
            raise ValueError(f"{num_ranks} ranks do not fit on {num_devices} devices")
        assignment = lsa(cost.T)[0]
        if not sets:
            return assignment
        # Single ranks as groups: start from the optimal unconstrained placement, then spread.
        node_devices = [np.flatnonzero(node_of_device == n) for n in nodes]
        solver = _NodeSolver(cost, node_devices, 1, sets, prefer)
        node_index = {n: i for i, n in enumerate(nodes)}
        distribution: list[list[int]] = [[] for _ in nodes]
        for rank, device in enumerate(assignment.tolist()):
            distribution[node_index[node_of_device[device]]].append(rank)
        return solver.placement(solver.repair(distribution, [len(d) for d in node_devices]))
    assert num_ranks % tp == 0
    node_devices = [np.flatnonzero(node_of_device == n) for n in nodes]
    capacity = [len(devs) // tp for devs in node_devices]
    num_groups = num_ranks // tp
    if sum(capacity) < num_groups:
        sizes = ", ".join(f"{len(d)}" for d in node_devices)
        raise ValueError(
            f"{num_groups} TP groups of {tp} devices do not fit in nodes of {sizes} devices (a TP group must stay in one node)"
        )
    solver = _NodeSolver(cost, node_devices, tp, sets, prefer)
    if _num_distributions(num_groups, capacity) <= MAX_EXACT_DISTRIBUTIONS:
        best = solver.enumerate(num_groups, capacity)
    else:
        best = solver.heuristic(num_groups, capacity)
        if sets:
            best = solver.repair(best, capacity)
    return solver.placement(best)


def _num_distributions(num_groups: int, capacity: list[int]) -> int:
    """Ways to put ``num_groups`` labelled groups on nodes with these capacities (capped count)."""
    # ways[k] = number of ways to place k labelled groups on the nodes seen so far.
    ways = [1] + [0] * num_groups
    for cap in capacity:
        new = [0] * (num_groups + 1)
        for placed, count in enumerate(ways):
            if not count:
                continue
            for here in range(0, min(cap, num_groups - placed) + 1):
                new[placed + here] += count * comb(num_groups - placed, here)
        ways = [min(w, MAX_EXACT_DISTRIBUTIONS + 1) for w in new]
    return ways[num_groups]


class _NodeSolver:
    def __init__(
        self,
        cost: np.ndarray,
        node_devices: list[np.ndarray],
        tp: int,
        sets: Sequence[tuple[tuple[int, ...], int]] = (),
        prefer: str = "cost",
    ):
        self.cost = cost
        self.node_devices = node_devices
        self.tp = tp
        self.sets = list(sets)
        self.prefer = prefer
        self.num_groups = cost.shape[1] // tp
        self._cache: dict[tuple[int, tuple[int, ...]], tuple[float, np.ndarray]] = {}
        self._lsa_cache: dict[tuple[object, ...], tuple[np.ndarray, float]] = {}

    def ranks(self, groups: tuple[int, ...]) -> np.ndarray:
        return np.concatenate([np.arange(g * self.tp, (g + 1) * self.tp) for g in groups])

    def node_cost(self, node: int, groups: tuple[int, ...]) -> tuple[float, np.ndarray]:
        """Best cost of hosting ``groups`` on ``node`` and the device of each of their ranks."""
        groups = tuple(sorted(groups))
        key = (node, groups)
        if key not in self._cache:
            if not groups:
                self._cache[key] = (0.0, np.empty(0, dtype=np.int64))
            else:
                devs = self.node_devices[node]
                sub = self.cost[np.ix_(devs, self.ranks(groups))]
                # Many (node, group) blocks are identical (e.g. nodes holding nothing of the group).
                content = (sub.shape, sub.tobytes())
                if content not in self._lsa_cache:
                    self._lsa_cache[content] = lsa(sub.T)
                cols, total = self._lsa_cache[content]
                self._cache[key] = (total, devs[cols])
        return self._cache[key]

    def total(self, distribution: list[list[int]]) -> float:
        return sum(self.node_cost(n, tuple(gs))[0] for n, gs in enumerate(distribution))

    def key(self, distribution: list[list[int]], total: float | None = None) -> tuple[float, ...]:
        """What is minimised, compared as a tuple (see the module docstring)."""
        total = self.total(distribution) if total is None else total
        if not self.sets:
            return (total,)
        group_node = np.empty(self.num_groups, dtype=np.int64)
        for node, groups in enumerate(distribution):
            group_node[groups] = node
        single = single_domain_weight(group_node, self.sets)
        if self.prefer == "resilience":
            return (single, total)
        # Whole bytes moved first (the cost's fractional part is the inter-node tie-break).
        return (floor(total + 1e-9), single, total)

    def repair(self, distribution: list[list[int]], capacity: list[int]) -> list[list[int]]:
        """Move groups of sets that sit in one node to other nodes (swapping, or into a free slot)
        while that lowers :meth:`key`; best move first, bounded."""
        distribution = [sorted(gs) for gs in distribution]
        node_cost = [self.node_cost(n, tuple(gs))[0] for n, gs in enumerate(distribution)]
        current = self.key(distribution, sum(node_cost))
        for _ in range(MAX_REPAIR_MOVES):
            where = {g: n for n, gs in enumerate(distribution) for g in gs}
            crowded = [
                groups
                for groups, _ in sorted(self.sets, key=lambda item: -item[1])
                if len({where[g] for g in groups}) == 1
            ]
            best = None
            for groups in crowded:
                for g in groups:
                    a = where[g]
                    for b in range(len(distribution)):
                        if b == a:
                            continue
                        for h in distribution[b] + ([None] if len(distribution[b]) < capacity[b] else []):
                            new_a = sorted([x for x in distribution[a] if x != g] + ([h] if h is not None else []))
                            new_b = sorted([x for x in distribution[b] if x != h] + [g])
                            cost_a, cost_b = self.node_cost(a, tuple(new_a))[0], self.node_cost(b, tuple(new_b))[0]
                            candidate = list(distribution)
                            candidate[a], candidate[b] = new_a, new_b
                            key = self.key(candidate, sum(node_cost) - node_cost[a] - node_cost[b] + cost_a + cost_b)
                            if key < current and (best is None or key < best[0]):
                                best = (key, a, b, new_a, new_b, cost_a, cost_b)
            if best is None:
                break
            current, a, b, new_a, new_b, node_cost[a], node_cost[b] = best
            distribution[a], distribution[b] = new_a, new_b
        return distribution

    def placement(self, distribution: list[list[int]]) -> np.ndarray:
        num_ranks = self.cost.shape[1]
        out = np.full(num_ranks, -1, dtype=np.int64)
        for node, groups in enumerate(distribution):
            if groups:
                out[self.ranks(tuple(sorted(groups)))] = self.node_cost(node, tuple(groups))[1]
        assert (out >= 0).all()
        return out

    def enumerate(self, num_groups: int, capacity: list[int]) -> list[list[int]]:
        num_nodes = len(capacity)
        best: list[list[int]] | None = None
        best_cost: tuple[float, ...] = (np.inf,)
        distribution: list[list[int]] = [[] for _ in range(num_nodes)]

        def place(group: int) -> None:
            nonlocal best, best_cost
            if group == num_groups:
                key = self.key(distribution)
                if key < best_cost:
                    best, best_cost = [list(gs) for gs in distribution], key
                return
            for node in range(num_nodes):
                if len(distribution[node]) < capacity[node]:
                    distribution[node].append(group)
                    place(group + 1)
                    distribution[node].pop()

        place(0)
        assert best is not None
        return best

    def heuristic(self, num_groups: int, capacity: list[int]) -> list[list[int]]:
        num_nodes = len(capacity)
        slots = [n for n in range(num_nodes) for _ in range(capacity[n])]
        alone = np.empty((num_groups, num_nodes))
        for g in range(num_groups):
            for n in range(num_nodes):
                alone[g, n] = self.node_cost(n, (g,))[0]
        chosen, _ = lsa(alone[:, slots])
        distribution: list[list[int]] = [[] for _ in range(num_nodes)]
        for g, slot in enumerate(chosen):
            distribution[slots[slot]].append(g)
        if max(capacity) > 1:
            distribution = self._improve(distribution, capacity)
        return distribution

    def _improve(self, distribution: list[list[int]], capacity: list[int]) -> list[list[int]]:
        """Pairwise swaps and moves between nodes while they lower the total (first improvement)."""
        num_nodes = len(distribution)
        for _ in range(MAX_IMPROVE_PASSES):
            improved = False
            for a in range(num_nodes):
                for b in range(a + 1, num_nodes):
                    before = self.node_cost(a, tuple(distribution[a]))[0] + self.node_cost(b, tuple(distribution[b]))[0]
                    best = None
                    for ga in distribution[a] + [None]:
                        for gb in distribution[b] + [None]:
                            if ga is None and gb is None:
                                continue
                            new_a = [g for g in distribution[a] if g != ga] + ([gb] if gb is not None else [])
                            new_b = [g for g in distribution[b] if g != gb] + ([ga] if ga is not None else [])
                            if len(new_a) > capacity[a] or len(new_b) > capacity[b]:
                                continue
                            after = self.node_cost(a, tuple(new_a))[0] + self.node_cost(b, tuple(new_b))[0]
                            if after < before - 1e-9 and (best is None or after < best[0]):
                                best = (after, new_a, new_b)
                    if best is not None:
                        distribution[a], distribution[b] = sorted(best[1]), sorted(best[2])
                        improved = True
            if not improved:
                break
        return distribution
