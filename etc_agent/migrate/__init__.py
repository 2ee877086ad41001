"""Execute a ``MigrationPlan`` inside live worker processes with torch.distributed point-to-point."""

from etc_agent.migrate.describe import BoxedTensor, LocalShard, describe_state, flatten_state
from etc_agent.migrate.executor import MigrationMetrics, MigrationResult, migrate_state
from etc_agent.migrate.transport import MigrationError, TorchTransport, Transport

__all__ = [
    "BoxedTensor",
    "LocalShard",
    "MigrationError",
    "MigrationMetrics",
    "MigrationResult",
    "TorchTransport",
    "Transport",
    "describe_state",
    "flatten_state",
    "migrate_state",
]
