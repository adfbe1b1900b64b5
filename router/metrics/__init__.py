"""Prometheus exposition (design §6): counts per request and the state read
at scrape time.
"""

from __future__ import annotations

from router.metrics.edge import EdgeCounts
from router.metrics.fleet import FleetFigures
from router.metrics.labels import CLIENT_CLOSED
from router.metrics.registry import RouterMetrics

__all__ = [
    "CLIENT_CLOSED",
    "EdgeCounts",
    "FleetFigures",
    "RouterMetrics",
]
