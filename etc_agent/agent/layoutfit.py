"""Which of the members a layout uses, and where its ranks go: the layout half of the leader's
decision (:mod:`etc_agent.agent.decision`), pure. The planner is imported when first needed (the
agent starts without numpy's import time), in the background by :func:`warm` as an agent starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from etc_agent.layout.config import ParallelSpec
from etc_agent.rendezvous.records import GenerationRecord

if TYPE_CHECKING:
    from etc_agent.layout.model import ModelSpec


def warm() -> None:
    """Import the planner and the solvers it loads on first use now. Every agent calls it in the
    background as it starts: the first generation's decision, and a takeover's from a leader gone
    silent, would otherwise spend the imports (0.4-0.9 s here, numpy's and scipy's), the latter
    inside the survivors' stall."""
    import scipy.optimize
    import scipy.sparse.csgraph  # noqa: F401

    import etc_agent.planner.placement
    import etc_agent.planner.policy  # noqa: F401


def fits(spec: ParallelSpec | None, model: ModelSpec | None, sizes: list[int], min_nodes: int) -> bool:
    """Whether nodes with these numbers of devices (in member order) can run a generation: enough of
    them, and a layout that uses the devices of some prefix of at least ``min_nodes`` of them."""
    if len(sizes) < min_nodes:
        return False
    if spec is None:
        return True
    from etc_agent.planner.policy import resolve_parallel

    return any(
        resolve_parallel(spec, sizes[:count], model) is not None
        for count in range(len(sizes), max(min_nodes, 1) - 1, -1)
    )


def fit(
    spec: ParallelSpec | None, model: ModelSpec | None, ordered: list[str], devices: dict[str, int], min_nodes: int
) -> tuple[list[str], str | None] | str:
    """The longest prefix of the members whose devices the layout uses exactly, and that layout
    (nodes after it wait as spares); why not, when it fits no group (a waiting generation says so)."""
    if spec is None or len(ordered) < min_nodes:
        return ordered, None
    from etc_agent.planner.policy import resolve_parallel

    for count in range(len(ordered), min_nodes - 1, -1):
        config = resolve_parallel(spec, [devices[n] for n in ordered[:count]], model) if count else None
        if config is not None:
            return ordered[:count], config.short()
    total = sum(devices[n] for n in ordered)
    return f"--parallel {spec.short()} fits no group of the {len(ordered)} nodes ({total} devices)"


def place(
    parallel: str, ordered: list[str], devices: dict[str, int], current: GenerationRecord | None, resilient: bool
) -> tuple[list[str], list[str]]:
    """Training rank -> device for a new generation (``--placement``), from the previous placement,
    and why one node's loss would lose state no survivor holds (empty: it would not)."""
    from etc_agent.layout.config import ParallelConfig
    from etc_agent.planner.placement import live_placement, resilience_gaps

    previous, previous_config = None, None
    if current is not None and current.parallel and current.status == "running":
        previous_config = ParallelConfig.parse(current.parallel)
        order = current.placement or current.member_devices()
        previous = {device: rank for rank, device in enumerate(order)}
    names = [f"{n}:{d}" for n in ordered for d in range(devices[n])]
    config = ParallelConfig.parse(parallel)
    placement = live_placement(config, names, previous, previous_config, "resilience" if resilient else "cost")
    return placement, resilience_gaps(config, placement)
