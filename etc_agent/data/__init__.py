"""Exactly-once data through every change of layout: the global order, the position, the shares
(:mod:`order`), a memory-mapped token dataset (:mod:`tokens`) and a prefetching loader for any
map-style dataset (:mod:`loader`). ``docs/data.md`` has the whole picture."""

from etc_agent.data.loader import ElasticData, StepSampler
from etc_agent.data.order import DataPosition, SampleOrder, Share, dp_share, share_weight
from etc_agent.data.tokens import DataError, TokenDataset

__all__ = [
    "DataError",
    "DataPosition",
    "ElasticData",
    "SampleOrder",
    "Share",
    "StepSampler",
    "TokenDataset",
    "dp_share",
    "share_weight",
]
