"""Step 3 of the planner at scale: new ranks onto devices by a maximum-weight matching over the
candidate pairs of a :class:`Residency`, every TP group inside one node.

Units are the new TP groups (``tp`` consecutive ranks; a rank alone when ``tp == 1``), bins the nodes
(a device each when ``tp == 1``), a bin holding ``devices // tp`` units. A candidate (unit, bin) pair
is worth the bytes the unit's ranks find in place when placed on the bin's devices at their best
(a small exact assignment per pair, skipped where each rank's best device differs). A sparse
maximum-weight matching of units onto bin slots (``scipy.sparse.csgraph``; each unit may also take
a slot worth nothing) chooses; the units left over fill the free slots in order. Bins that took
several units place their ranks jointly. Work and memory grow with the candidates, not with
devices x ranks; the result is exact where the candidates hold an optimal placement (a class block
offers each rank several devices of the class, see :meth:`Residency.candidates`), and the plan
reports its gap to a bound otherwise (``MigrationPlan.lower_bound_bytes``).

Deterministic: the same input gives the same placement in every process.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from etc_agent.planner.residency import Residency

COMPONENT_CELLS = 1 << 22
"""The largest units x slots matrix one component is solved exactly with; above it, candidates."""
MAX_ROUNDS = 3
"""Matchings after the first, each offering short ranks more devices (see :func:`assign_sparse`)."""
SHORT_RANK_DEVICES = 64
"""Devices of each class block offered to a short rank in the first extra round."""
UNMATCHED_WEIGHT = 1e-3
"""The weight of a unit's own "nothing in place" column: below any byte kept, above no edge at all."""


def assign_sparse(res: Residency, node_of_dev: np.ndarray, tp: int) -> np.ndarray:
    """Device index of every new rank, maximising the bytes kept in place (``ValueError`` when the
    TP groups do not fit in the nodes).

    A rank may end short of a class block it could have had because the few devices of the class
    it was offered went to ranks with pairs of their own: then the short ranks are offered many
    more devices of their classes (:data:`SHORT_RANK_DEVICES`, doubling each round) and the
    matching runs again (kept only if it keeps more bytes), up to :data:`MAX_ROUNDS` times."""
    num_dev, num_ranks = len(node_of_dev), res.num_ranks
    if num_ranks > num_dev:
        raise ValueError(f"{num_ranks} ranks do not fit on {num_dev} devices")
    by_components = _solve_by_components(res, node_of_dev, tp)
    if by_components is not None:
        return by_components
    ranks = np.arange(num_ranks)
    dev, rank = res.candidates()
    assignment = _solve(res, dev, rank, node_of_dev, tp)
    kept = res.resident(assignment, ranks)
    best_block = res.best_block_bytes()
    for round_ in range(MAX_ROUNDS):
        short = kept < best_block
        if not short.any():
            break
        more_dev, more_rank = res.candidates(per_block=SHORT_RANK_DEVICES << round_, ranks=short)
        merged = np.unique(np.concatenate([dev * num_ranks + rank, more_dev * num_ranks + more_rank]))
        if len(merged) == len(dev):
            break
        dev, rank = merged // num_ranks, merged % num_ranks
        candidate = _solve(res, dev, rank, node_of_dev, tp)
        candidate_kept = res.resident(candidate, ranks)
        if candidate_kept.sum() <= kept.sum():
            break
        assignment, kept = candidate, candidate_kept
    return assignment


def _solve(res: Residency, dev: np.ndarray, rank: np.ndarray, node_of_dev: np.ndarray, tp: int) -> np.ndarray:
    """One matching over the candidate pairs ``(dev, rank)``."""
    num_dev, num_ranks = len(node_of_dev), res.num_ranks
    gain = res.resident(dev, rank)
    keep = gain > 0
    dev, rank, gain = dev[keep], rank[keep], gain[keep]
    if tp == 1:
        slot_of_unit = _match(rank, dev, gain.astype(np.float64), num_ranks, num_dev)
        return _fill(slot_of_unit, np.arange(num_dev), num_dev)
    nodes, node_index = np.unique(node_of_dev, return_inverse=True)
    node_devices = [np.flatnonzero(node_index == n) for n in range(len(nodes))]
    capacity = np.array([len(d) // tp for d in node_devices], dtype=np.int64)
    num_units = num_ranks // tp
    if capacity.sum() < num_units:
        sizes = ", ".join(str(len(d)) for d in node_devices)
        raise ValueError(
            f"{num_units} TP groups of {tp} devices do not fit in nodes of {sizes} devices (a TP group must stay in one node)"
        )
    pairs = np.unique((rank // tp) * len(nodes) + node_index[dev])
    unit, node = pairs // len(nodes), pairs % len(nodes)
    pair_gain = _pair_gains(res, unit, node, node_devices, tp)
    slot_start = np.cumsum(capacity) - capacity
    # Each (unit, node) pair may take any of the node's slots.
    per = capacity[node]
    row = np.repeat(np.arange(len(unit)), per)
    slot = slot_start[node[row]] + (np.arange(len(row)) - np.repeat(np.cumsum(per) - per, per))
    slot_of_unit = _match(unit[row], slot, pair_gain[row], num_units, int(capacity.sum()))
    slot_node = np.repeat(np.arange(len(nodes)), capacity)
    node_of_unit = slot_node[_fill(slot_of_unit, np.arange(len(slot_node)), len(slot_node))]
    assignment = np.full(num_ranks, -1, dtype=np.int64)
    for n in np.unique(node_of_unit).tolist():
        units = np.flatnonzero(node_of_unit == n)
        ranks = (units[:, None] * tp + np.arange(tp)[None, :]).ravel()
        assignment[ranks] = _place_in_node(res, ranks, node_devices[n])
    assert (assignment >= 0).all() and len(np.unique(assignment)) == num_ranks
    return assignment


def _bins(node_of_dev: np.ndarray, tp: int) -> tuple[list[np.ndarray], np.ndarray]:
    """The devices of each bin and the node of each bin: a node's devices in order, cut into runs of
    ``tp`` (a device each when ``tp == 1``; what is left over in a node takes no unit). A bin takes
    one unit, so the units on one node never count the same device twice; the ranks of a node's
    units are then placed on all its devices together (:func:`_place_in_node`)."""
    _, node_index = np.unique(node_of_dev, return_inverse=True)
    bins: list[np.ndarray] = []
    node_of_bin: list[int] = []
    for n in range(int(node_index.max()) + 1 if len(node_index) else 0):
        devices = np.flatnonzero(node_index == n)
        for start in range(0, len(devices) - tp + 1, tp):
            bins.append(devices[start : start + tp])
            node_of_bin.append(n)
    return bins, np.array(node_of_bin, dtype=np.int64)


def _solve_by_components(res: Residency, node_of_dev: np.ndarray, tp: int) -> np.ndarray | None:
    """The exact placement of the units onto the bins, one connected component at a time.

    Units (bins) whose ranks (devices) have the same classes in the same order (as a multiset) are
    worth the same to each other wherever no sparse pair touches them, so a component's matrix is
    filled from a small matrix of class values (each an exact in-node assignment of one
    representative pair) and the cells sparse pairs touch are worked out alone. Components link
    the classes that share bytes. None when a component's matrix would exceed
    :data:`COMPONENT_CELLS` (the candidate matching takes over)."""
    num_ranks = res.num_ranks
    bin_devices, node_of_bin = _bins(node_of_dev, tp)
    num_units = num_ranks // tp
    if len(bin_devices) < num_units:
        _, per_node = np.unique(node_of_dev, return_counts=True)
        sizes = ", ".join(str(n) for n in per_node.tolist())
        raise ValueError(
            f"{num_units} TP groups of {tp} devices do not fit in nodes of {sizes} devices (a TP group must stay in one node)"
        )
    unit_ranks = np.arange(num_ranks).reshape(num_units, tp)
    classes = _UnitBinClasses.of(res, bin_devices, unit_ranks)
    value = classes.values(res, bin_devices, tp)
    touched = _touched(res, node_of_dev, bin_devices, tp)
    bin_of_unit = _assign_components(classes, value, touched, num_units, len(bin_devices))
    if bin_of_unit is None:
        return None
    node_of_unit = node_of_bin[bin_of_unit]
    _, node_index = np.unique(node_of_dev, return_inverse=True)
    assignment = np.full(num_ranks, -1, dtype=np.int64)
    for n in np.unique(node_of_unit).tolist():
        ranks = unit_ranks[np.flatnonzero(node_of_unit == n)].ravel()
        assignment[ranks] = _place_in_node(res, ranks, np.flatnonzero(node_index == n))
    assert (assignment >= 0).all() and len(np.unique(assignment)) == num_ranks
    return assignment


@dataclass(frozen=True)
class _UnitBinClasses:
    """Units with the same rank classes in order, bins with the same device classes (a multiset)."""

    unit_classes: np.ndarray
    """(unit classes, tp): the rank classes of each unit class."""
    unit_class: np.ndarray
    bin_classes: np.ndarray
    """(bin classes, width + 1): sorted device classes (-2 padding), then the bin's size."""
    bin_class: np.ndarray
    width: int

    @classmethod
    def of(cls, res: Residency, bin_devices: list[np.ndarray], unit_ranks: np.ndarray) -> _UnitBinClasses:
        width = max(len(d) for d in bin_devices)
        signature = np.full((len(bin_devices), width + 1), -2, dtype=np.int64)
        for b, devices in enumerate(bin_devices):
            signature[b, : len(devices)] = np.sort(res.dev_class[devices])
            signature[b, width] = len(devices)
        bin_classes, bin_class = np.unique(signature, axis=0, return_inverse=True)
        unit_classes, unit_class = np.unique(res.rank_class[unit_ranks], axis=0, return_inverse=True)
        return cls(unit_classes, unit_class.ravel(), bin_classes, bin_class.ravel(), width)

    def values(self, res: Residency, bin_devices: list[np.ndarray], tp: int) -> np.ndarray:
        """(unit classes, bin classes): the class blocks' bytes a unit keeps on a bin, for the class
        pairs that share a block (one representative pair each; 0 elsewhere)."""
        num_k = max(1, res.num_rank_classes)
        blocks = set(zip((res.block_key // num_k).tolist(), (res.block_key % num_k).tolist()))
        bins_of: dict[int, set[int]] = {}
        for bc in range(len(self.bin_classes)):
            for c in set(self.bin_classes[bc, : self.width].tolist()) - {-1, -2}:
                bins_of.setdefault(c, set()).add(bc)
        units_of: dict[int, set[int]] = {}
        for uc in range(len(self.unit_classes)):
            for k in set(self.unit_classes[uc].tolist()):
                units_of.setdefault(k, set()).add(uc)
        pairs = sorted({(uc, bc) for c, k in blocks for bc in bins_of.get(c, ()) for uc in units_of.get(k, ())})
        first_bin = np.unique(self.bin_class, return_index=True)[1]
        value = np.zeros((len(self.unit_classes), len(self.bin_classes)), dtype=np.float64)
        for uc, bc in pairs:
            devices = bin_devices[int(first_bin[bc])]
            block = res.block_resident(
                np.tile(res.dev_class[devices], tp), np.repeat(self.unit_classes[uc], len(devices))
            )
            value[uc, bc] = _best_in_node(block.reshape(tp, len(devices)))
        return value


@dataclass(frozen=True)
class _Touched:
    """The (unit, bin) cells sparse pairs touch, with their exact values."""

    unit: np.ndarray
    bin: np.ndarray
    gain: np.ndarray


def _touched(res: Residency, node_of_dev: np.ndarray, bin_devices: list[np.ndarray], tp: int) -> _Touched:
    num_ranks = max(1, res.num_ranks)
    pair_dev, pair_rank = res.pair_key // num_ranks, res.pair_key % num_ranks
    bin_of_dev = np.full(len(node_of_dev), -1, dtype=np.int64)
    for b, devices in enumerate(bin_devices):
        bin_of_dev[devices] = b
    keep = bin_of_dev[pair_dev] >= 0  # devices left over in a node host no unit
    cells = np.unique((pair_rank[keep] // tp) * len(bin_devices) + bin_of_dev[pair_dev[keep]])
    unit, where = cells // len(bin_devices), cells % len(bin_devices)
    return _Touched(unit, where, _pair_gains(res, unit, where, bin_devices, tp))


def _assign_components(
    classes: _UnitBinClasses, value: np.ndarray, touched: _Touched, num_units: int, num_bins: int
) -> np.ndarray | None:
    """The bin of each unit: an exact assignment per connected component of the classes, the units
    worth nothing anywhere on the free bins in order; None if a component is too large."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    num_uc = len(classes.unit_classes)
    size = num_uc + len(classes.bin_classes)
    uc, bc = np.nonzero(value > 0)
    rows = np.concatenate([uc, classes.unit_class[touched.unit]])
    cols = np.concatenate([num_uc + bc, num_uc + classes.bin_class[touched.bin]])
    graph = coo_matrix((np.ones(len(rows)), (rows, cols)), shape=(size, size))
    _, component = connected_components(graph, directed=False)
    unit_comp, bin_comp = component[classes.unit_class], component[num_uc + classes.bin_class]
    touched_comp = unit_comp[touched.unit]
    bin_of_unit = np.full(num_units, -1, dtype=np.int64)
    for comp in np.unique(unit_comp).tolist():
        units = np.flatnonzero(unit_comp == comp)
        bins = np.flatnonzero(bin_comp == comp)
        if not len(bins):
            continue
        if len(units) * len(bins) > COMPONENT_CELLS:
            return None
        matrix = value[classes.unit_class[units]][:, classes.bin_class[bins]]
        mine = np.flatnonzero(touched_comp == comp)
        matrix[np.searchsorted(units, touched.unit[mine]), np.searchsorted(bins, touched.bin[mine])] = touched.gain[
            mine
        ]
        if not matrix.any():
            continue
        rows_chosen, cols_chosen = _assign(matrix)
        good = matrix[rows_chosen, cols_chosen] > 0
        bin_of_unit[units[rows_chosen[good]]] = bins[cols_chosen[good]]
    return _fill(bin_of_unit, np.arange(num_bins), num_bins)


def _block(res: Residency, ranks: np.ndarray, devices: np.ndarray) -> np.ndarray:
    return res.resident(np.tile(devices, len(ranks)), np.repeat(ranks, len(devices))).reshape(len(ranks), len(devices))


def _best_in_node(block: np.ndarray) -> float:
    """The most bytes the rows (ranks) keep on distinct columns (devices)."""
    best = block.argmax(axis=1)
    if len(np.unique(best)) == block.shape[0]:
        return float(block.max(axis=1).sum())
    return _lsa(block)[1]


def _assign(matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The maximum-weight assignment of a dense matrix's rows to columns (the smaller side whole),
    as ``(rows, cols)`` ordered by row; by ``scipy.sparse.csgraph`` (scipy.optimize's import is
    a tenth of a second of a fresh leader's plan)."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching

    transposed = matrix.shape[0] > matrix.shape[1]
    side = matrix.T if transposed else matrix
    # Every cell an edge (a constant added to all of them leaves the best full matching as it is).
    rows, cols = min_weight_full_bipartite_matching(csr_matrix(side + 1.0), maximize=True)
    if transposed:
        rows, cols = cols, rows
    order = np.argsort(rows)
    return np.asarray(rows[order], dtype=np.int64), np.asarray(cols[order], dtype=np.int64)


def _match(unit: np.ndarray, slot: np.ndarray, weight: np.ndarray, num_units: int, num_slots: int) -> np.ndarray:
    """The slot of each unit (-1: none worth anything) maximising the total weight; each unit also
    has a column of its own worth :data:`UNMATCHED_WEIGHT`, so a full matching always exists."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import min_weight_full_bipartite_matching

    if not len(unit):
        return np.full(num_units, -1, dtype=np.int64)
    rows = np.concatenate([unit, np.arange(num_units)])
    cols = np.concatenate([slot, num_slots + np.arange(num_units)])
    data = np.concatenate([weight, np.full(num_units, UNMATCHED_WEIGHT)])
    graph = csr_matrix((data, (rows, cols)), shape=(num_units, num_slots + num_units))
    matched_rows, matched_cols = min_weight_full_bipartite_matching(graph, maximize=True)
    out = np.full(num_units, -1, dtype=np.int64)
    out[matched_rows] = np.where(matched_cols < num_slots, matched_cols, -1)
    return out


def _fill(slot_of_unit: np.ndarray, slots: np.ndarray, num_slots: int) -> np.ndarray:
    """The matched slots, and the free slots in order for the units left over (in order)."""
    out = slot_of_unit.copy()
    taken = np.zeros(num_slots, dtype=bool)
    taken[out[out >= 0]] = True
    free = slots[~taken[slots]]
    left = np.flatnonzero(out < 0)
    out[left] = free[: len(left)]
    return out


def _pair_gains(
    res: Residency, unit: np.ndarray, node: np.ndarray, node_devices: list[np.ndarray], tp: int
) -> np.ndarray:
    """Bytes in place for each (unit, node) pair, the unit's ranks on the node's devices at their best."""
    gains = np.zeros(len(unit), dtype=np.float64)
    sizes = np.array([len(d) for d in node_devices], dtype=np.int64)
    for size in np.unique(sizes[node]).tolist():
        which = np.flatnonzero(sizes[node] == size)
        devices = np.stack([node_devices[n] for n in node[which].tolist()])  # (pairs, size)
        ranks = unit[which][:, None] * tp + np.arange(tp)[None, :]  # (pairs, tp)
        block = res.resident(
            np.broadcast_to(devices[:, None, :], (len(which), tp, size)).ravel(),
            np.broadcast_to(ranks[:, :, None], (len(which), tp, size)).ravel(),
        ).reshape(len(which), tp, size)
        best = block.argmax(axis=2)
        distinct = (np.sort(best, axis=1)[:, 1:] != np.sort(best, axis=1)[:, :-1]).all(axis=1)
        # Where each rank's best device is its own, that is the best assignment.
        gains[which[distinct]] = block[distinct].max(axis=2).sum(axis=1)
        for k in np.flatnonzero(~distinct).tolist():
            gains[which[k]] = _lsa(block[k])[1]
    return gains


def _place_in_node(res: Residency, ranks: np.ndarray, devices: np.ndarray) -> np.ndarray:
    """The device of each of ``ranks`` among ``devices`` keeping the most bytes in place."""
    block = res.resident(np.tile(devices, len(ranks)), np.repeat(ranks, len(devices))).reshape(len(ranks), len(devices))
    best = block.argmax(axis=1)
    if not block.any():
        chosen = np.arange(len(ranks))
    elif len(np.unique(best)) == len(ranks):
        chosen = best
    else:
        chosen = _lsa(block)[0]
    return np.asarray(devices[chosen], dtype=np.int64)


def _lsa(gain: np.ndarray) -> tuple[np.ndarray, float]:
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(gain, maximize=True)
    out = np.empty(gain.shape[0], dtype=np.int64)
    out[rows] = cols
    return out, float(gain[rows, cols].sum())
