"""The metrics read from the router's live state when Prometheus scrapes (design §6).

This module owns the gauges and counters that show what the core already knows:
claims by worker and kind, tombstones, workers by lease state and draining, requests
in flight to each worker, control connections, the recovery window and failed
journal appends. `StateCollector` reads them through callables at scrape time, so
nothing on the request path counts them.

It must never read the state before a scrape (registration only describes), nor
keep a count of its own; it opens no socket and reads no clock. Its label values
are the workers' ids and kinds the state holds and the fixed sets of
`router.metrics.labels`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.metrics.labels import NAMESPACE, OTHER, WORKER_STATES

__all__ = ["StateCollector"]


class StateCollector(Collector):
    """Reads the router's live state when Prometheus scrapes, never before."""

    def __init__(
        self,
        claims_by_worker_kind: Callable[[], dict[tuple[str, str], int]],
        tombstones: Callable[[], int],
        workers: Callable[[], Iterable[tuple[str, str, bool]]],
        control_connections: Callable[[], int],
        recovery_remaining: Callable[[], float | None],
        journal_write_errors: Callable[[], int] | None,
        in_flight: Callable[[], Iterable[tuple[str, int]]],
    ) -> None:
        self._claims = claims_by_worker_kind
        self._in_flight = in_flight
        self._tombstones = tombstones
        self._workers = workers
        self._connections = control_connections
        self._recovery_remaining = recovery_remaining
        self._journal_write_errors = journal_write_errors

    def describe(self) -> Iterator[Metric]:
        """The families without samples: registration checks names without reading state."""
        return self._families(
            claims={},
            tombstones=0,
            workers=(),
            in_flight=(),
            connections=0,
            remaining=None,
            journal_errors=0,
        )

    def collect(self) -> Iterator[Metric]:
        return self._families(
            claims=self._claims(),
            tombstones=self._tombstones(),
            workers=list(self._workers()),
            in_flight=list(self._in_flight()),
            connections=self._connections(),
            remaining=self._recovery_remaining(),
            journal_errors=self._journal_write_errors() if self._journal_write_errors else 0,
        )

    def _families(
        self,
        *,
        claims: dict[tuple[str, str], int],
        tombstones: int,
        workers: Iterable[tuple[str, str, bool]],
        in_flight: Iterable[tuple[str, int]],
        connections: int,
        remaining: float | None,
        journal_errors: int,
    ) -> Iterator[Metric]:
        yield _claims_family(claims)
        yield _gauge("tombstones", "Ended session keys remembered as tombstones.", tombstones)
        yield from _worker_families(workers)
        # Read from the workers at scrape time instead of counted per request (two calls
        # a request): measured with router.metrics.counts.Histogram.observe's scan
        # (docs/performance.md).
        requests = GaugeMetricFamily(
            f"{NAMESPACE}_in_flight_requests",
            "Requests being forwarded to each worker now.",
            labels=("worker",),
        )
        for worker, count in sorted(in_flight):
            requests.add_metric((worker,), count)
        yield requests
        yield _gauge("control_connections", "Open control socket connections.", connections)
        left = remaining if remaining is not None and remaining > 0.0 else 0.0
        recovering = (
            "Whether the router is recovering after a start (unknown keys get 503): 1 or 0."
        )
        yield _gauge("recovering", recovering, 1.0 if left > 0.0 else 0.0)
        yield _gauge(
            "recovery_remaining_seconds", "Seconds left in the recovery window (0 when over).", left
        )
        yield CounterMetricFamily(
            f"{NAMESPACE}_journal_write_errors",
            "Journal appends that failed (the state survives a restart only up to the first).",
            value=journal_errors,
        )


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NAMESPACE}_{name}", documentation, value=value)


def _claims_family(claims: dict[tuple[str, str], int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        f"{NAMESPACE}_claims",
        "Session claims held, by worker and kind.",
        labels=("worker", "kind"),
    )
    for (worker, kind), count in sorted(claims.items()):
        family.add_metric((worker, kind), count)
    return family


def _worker_families(workers: Iterable[tuple[str, str, bool]]) -> Iterator[GaugeMetricFamily]:
    """Workers per state (every state, zeros included), draining workers, and a
    one-hot state per worker (as kube-state-metrics shows a pod's phase)."""
    by_state = dict.fromkeys(WORKER_STATES, 0)
    draining = 0
    per_worker = GaugeMetricFamily(
        f"{NAMESPACE}_worker_state",
        "Each worker's lease state: 1 for its current state, 0 for the others.",
        labels=("worker", "state"),
    )
    per_worker_draining = GaugeMetricFamily(
        f"{NAMESPACE}_worker_draining",
        "Whether a worker is draining: 1 while it gets no new sessions, else 0.",
        labels=("worker",),
    )
    for worker_id, state, drain_flag in sorted(workers):
        # An exited worker takes no session at all: not counted as draining (a worker
        # that drained itself, then left, kept the gauge up for as long as it was known).
        is_draining = drain_flag and state != "exited"
        label = state if state in by_state else OTHER
        by_state[label] = by_state.get(label, 0) + 1
        draining += is_draining
        for candidate in WORKER_STATES:
            per_worker.add_metric((worker_id, candidate), 1.0 if candidate == state else 0.0)
        per_worker_draining.add_metric((worker_id,), 1.0 if is_draining else 0.0)
    totals = GaugeMetricFamily(
        f"{NAMESPACE}_workers", "Known workers, by lease state.", labels=("state",)
    )
    for state, count in by_state.items():
        totals.add_metric((state,), count)
    yield totals
    yield _gauge("workers_draining", "Workers draining: no new sessions.", draining)
    yield per_worker
    yield per_worker_draining
