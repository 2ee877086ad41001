"""Old layout + new layout + devices -> ``MigrationPlan``. Pure: no process groups, no tensors.

Names are loaded on first use, so that importing the bandwidth model (command-line flags) does not
pull in numpy and scipy.
"""

from importlib import import_module

_EXPORTS = {
    "BandwidthModel": "etc_agent.planner.bandwidth",
    "KeyGroup": "etc_agent.planner.plan",
    "LocalCopy": "etc_agent.planner.plan",
    "MigrationPlan": "etc_agent.planner.plan",
    "PlanValidationError": "etc_agent.planner.validate",
    "PlannerOptions": "etc_agent.planner.core",
    "Region": "etc_agent.planner.plan",
    "StateLostError": "etc_agent.planner.core",
    "Transfer": "etc_agent.planner.plan",
    "plan_migration": "etc_agent.planner.core",
    "plan_model_migration": "etc_agent.planner.core",
    "validate_plan": "etc_agent.planner.validate",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'etc_agent.planner' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
