"""The public edge's connection and head metrics, read when Prometheus scrapes (design §6).

This module owns `EdgeCounts`, what the public server counts of its connections and the
request heads they hold, and `EdgeCollector`, which shows them: open connections,
connections refused at the connection limit, idle ones closed to make room, the bytes
unfinished heads hold and the heads refused over their budget. The edge keeps them as
plain numbers; they become families only at scrape time, so nothing on the request path
calls into prometheus_client.

It never reads the edge itself (a callable given at registration does), opens no socket
and reads no clock; its one label takes values from a fixed set.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.metrics.labels import NAMESPACE

__all__ = ["REFUSAL_REASONS", "EdgeCollector", "EdgeCounts"]

# Why a public connection was accepted and closed at once: at limits.max_connections
# with no idle keep-alive connection to close instead.
REFUSAL_REASONS = ("limit",)


class EdgeCounts(NamedTuple):
    """What the public server counted, as of the scrape."""

    open_connections: int = 0
    refused_at_limit: int = 0
    idle_closed_for_room: int = 0
    head_bytes_held: int = 0
    heads_over_budget: int = 0


class EdgeCollector(Collector):
    """Reads the public server's counts when Prometheus scrapes, never before."""

    def __init__(self, counts: Callable[[], EdgeCounts]) -> None:
        self._counts = counts

    def describe(self) -> Iterator[Metric]:
        return _families(EdgeCounts())

    def collect(self) -> Iterator[Metric]:
        return _families(self._counts())


def _families(counts: EdgeCounts) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        f"{NAMESPACE}_public_connections",
        "Open connections on the public listener.",
        value=counts.open_connections,
    )
    refused = CounterMetricFamily(
        f"{NAMESPACE}_connections_refused",
        "Public connections accepted and closed at once, by reason (limit: at "
        "limits.max_connections with no idle keep-alive connection to close instead).",
        labels=("reason",),
    )
    refused.add_metric(REFUSAL_REASONS, counts.refused_at_limit)
    yield refused
    yield CounterMetricFamily(
        f"{NAMESPACE}_idle_connections_closed",
        "Idle keep-alive connections closed to make room at limits.max_connections.",
        value=counts.idle_closed_for_room,
    )
    yield GaugeMetricFamily(
        f"{NAMESPACE}_head_bytes_held",
        "Bytes the unfinished request heads of all public connections hold.",
        value=counts.head_bytes_held,
    )
    yield CounterMetricFamily(
        f"{NAMESPACE}_heads_over_budget",
        "Unfinished heads refused (431) because all of them together held more than "
        "limits.max_held_head_bytes: the largest one each time.",
        value=counts.heads_over_budget,
    )
