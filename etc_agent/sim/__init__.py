"""Migration-time simulator: the real planner on real model specs, priced under a cost model."""

from etc_agent.sim.costs import CostModel
from etc_agent.sim.simulate import Scenario, SimResult, simulate
from etc_agent.sim.suites import bench_suite, paper_suite

__all__ = ["CostModel", "Scenario", "SimResult", "bench_suite", "paper_suite", "simulate"]
