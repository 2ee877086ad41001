"""Migration-time simulator: the real planner on real model specs, priced under a cost model.

Names are loaded on first use (the cost model alone backs command-line flags)."""

from etc_agent.utils.lazy import lazy_exports

_EXPORTS = {
    "CostModel": "etc_agent.sim.costs",
    "Scenario": "etc_agent.sim.estimate",
    "SimResult": "etc_agent.sim.estimate",
    "simulate": "etc_agent.sim.estimate",
    "bench_suite": "etc_agent.sim.suites",
    "paper_suite": "etc_agent.sim.suites",
}

__getattr__ = lazy_exports("etc_agent.sim", _EXPORTS)


__all__ = sorted(_EXPORTS)
