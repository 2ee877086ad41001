"""Old layout + new layout + devices -> ``MigrationPlan``. Pure: no process groups, no tensors.

Names are loaded on first use, so that importing the bandwidth model (command-line flags) does not
pull in numpy and scipy.
"""

from etc_agent.utils.lazy import lazy_exports

_EXPORTS = {
    "BandwidthModel": "etc_agent.planner.bandwidth",
    "KeyGroup": "etc_agent.planner.plan",
    "LocalCopy": "etc_agent.planner.plan",
    "Restore": "etc_agent.planner.plan",
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

__getattr__ = lazy_exports("etc_agent.planner", _EXPORTS)


__all__ = sorted(_EXPORTS)
