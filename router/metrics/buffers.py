"""The metrics of the memory that keeps slow clients off worker connections (design §8).

This module owns three figures read from the forwarder when Prometheus scrapes: the
bytes of request bodies and replies held in memory now, the bodies and replies that
streamed because the budget for them was spent, and the replies relayed at a client's
pace with the pool's share for such replies already full. It reads them through one
callable at scrape time, never before, and keeps no count of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.metrics.labels import NAMESPACE

__all__ = ["BufferCollector", "BufferFigures"]

# (bytes held now, budget refusals so far, replies paced past the share so far, and of
# those, cut for a client that took nothing)
BufferFigures = tuple[int, int, int, int]


class BufferCollector(Collector):
    """Reads the forwarder's buffer figures when Prometheus scrapes."""

    def __init__(self, figures: Callable[[], BufferFigures]) -> None:
        self._figures = figures

    def describe(self) -> Iterator[Metric]:
        return _families((0, 0, 0, 0))

    def collect(self) -> Iterator[Metric]:
        return _families(self._figures())


def _families(figures: BufferFigures) -> Iterator[Metric]:
    held, refused, over_share, over_share_cut = figures
    yield GaugeMetricFamily(
        f"{NAMESPACE}_buffered_bytes",
        "Request bodies and replies held in memory now (bounded by limits.buffer_budget_bytes).",
        value=held,
    )
    yield CounterMetricFamily(
        f"{NAMESPACE}_buffer_budget_refusals",
        "Bodies and replies that streamed because the buffer budget was spent.",
        value=refused,
    )
    yield CounterMetricFamily(
        f"{NAMESPACE}_paced_over_share",
        "Replies relayed at a client's pace while the pool's share for them was full.",
        value=over_share,
    )
    yield CounterMetricFamily(
        f"{NAMESPACE}_paced_over_share_cut",
        "Replies past the pool's share cut because their client took nothing of them.",
        value=over_share_cut,
    )
