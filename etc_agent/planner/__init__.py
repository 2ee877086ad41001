"""Old layout + new layout + devices -> ``MigrationPlan``. Pure: no process groups, no tensors."""

from etc_agent.planner.bandwidth import BandwidthModel
from etc_agent.planner.core import PlannerOptions, StateLostError, plan_migration, plan_model_migration
from etc_agent.planner.plan import KeyGroup, LocalCopy, MigrationPlan, Region, Transfer
from etc_agent.planner.validate import PlanValidationError, validate_plan

__all__ = [
    "BandwidthModel",
    "KeyGroup",
    "LocalCopy",
    "MigrationPlan",
    "PlanValidationError",
    "PlannerOptions",
    "Region",
    "StateLostError",
    "Transfer",
    "plan_migration",
    "plan_model_migration",
    "validate_plan",
]
