"""Migration-time simulator: the real planner on real model specs, priced under a cost model.

Names are loaded on first use (the cost model alone backs command-line flags)."""

from importlib import import_module

_EXPORTS = {
    "CostModel": "etc_agent.sim.costs",
    "Scenario": "etc_agent.sim.estimate",
    "SimResult": "etc_agent.sim.estimate",
    "simulate": "etc_agent.sim.estimate",
    "bench_suite": "etc_agent.sim.suites",
    "paper_suite": "etc_agent.sim.suites",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'etc_agent.sim' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
