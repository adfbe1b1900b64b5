"""The metrics counted on every request and control op, kept as plain numbers (design §6).

This module owns the request counter, the request and decision duration histograms
and the control-op counter as plain ints and floats (`HotCollector`, `Histogram`),
their bucket bounds, and the families they become when Prometheus scrapes.
`router.metrics.registry` chooses the label values and updates the counts; this module only
stores them and shows them.

It must never take a lock or call prometheus_client on an update: a forwarded
request updates it, and prometheus_client's objects (see `Histogram`) are what it
replaced. It reads no clock and opens no socket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from router.metrics.labels import CLASS_LABELS, FORWARDED, NAMESPACE

__all__ = ["DECISION_BUCKETS", "REQUEST_BUCKETS", "Histogram", "HotCollector"]

# A proxied call ranges from a millisecond (a cached tool) to minutes (an
# LLM-backed tool; timeouts.first_byte_s defaults to 300 s). The buckets are not
# Final: mypyc (setup.py) leaves a Final tuple built with * unset.
REQUEST_BUCKETS: tuple[float, ...] = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
# The router's own decision (read the session, look up the claim) takes microseconds.
DECISION_BUCKETS: tuple[float, ...] = (
    *(1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4),
    *(2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2),
)

# prometheus_client's own formatting of a bucket bound ("0.001", "1e-06", "+Inf"),
# untyped there.
_go_float: Callable[[float], str] = floatToGoString


class Histogram:
    """Bucket counts as plain ints, turned into a histogram family at scrape time.

    `observe` is a short scan and two additions. Moving the request counter, both
    histograms, the in-flight gauge (since read at scrape time) and the control-op counter here from
    prometheus_client's objects (a lock and a value object per update, seven updates
    per forwarded request) lowered the router's cost per forwarded request
    (docs/performance.md, "The hot path's trims").
    """

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: over every bound (+Inf)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are inclusive (le): the first bound >= value counts it. A
        # scan from the smallest bound, not bisect_left: the usual value is in the first
        # few buckets, and the compiled build compares floats natively where bisect
        # calls out and compares objects (measured with the in-flight gauge read at
        # scrape time: docs/performance.md).
        index = 0
        bounds = self.bounds
        last = len(bounds)
        while index < last and bounds[index] < value:
            index += 1
        self.counts[index] += 1
        self.total += value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative (le, count) pairs, +Inf last."""
        out = []
        running = 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append((_go_float(bound), float(running)))
        return out


class HotCollector(Collector):
    """The metrics updated on every request and control op, kept as plain numbers."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}  # the router's own answers
        # The forwarded requests: per kind, counts in CLASS_LABELS' order. The kinds
        # known at start show every class from zero; another only the classes it counted.
        self.forwarded: dict[str, list[int]] = {}
        self.prebound_kinds: set[str] = set()
        self.forwarded_seconds = Histogram(REQUEST_BUCKETS)
        self.answered_seconds = Histogram(REQUEST_BUCKETS)
        self.decision_seconds = Histogram(DECISION_BUCKETS)
        self.control_ops: dict[tuple[str, str], int] = {}

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            f"{NAMESPACE}_requests",
            "Requests finished, by session kind, outcome (forwarded, or the router's own "
            "answer code) and status class of the reply.",
            labels=("kind", "outcome", "status_class"),
        )
        for kind, counts in list(self.forwarded.items()):
            prebound = kind in self.prebound_kinds
            for cls, count in zip(CLASS_LABELS, counts, strict=True):
                if count or prebound:  # a kind first seen shows only what it counted
                    requests.add_metric((kind, FORWARDED, cls), count)
        for key, count in list(self.requests.items()):
            requests.add_metric(key, count)
        yield requests
        durations = HistogramMetricFamily(
            f"{NAMESPACE}_request_duration_seconds",
            "Time from a request's arrival to the end of its reply, forwarded or answered.",
            labels=("outcome_class",),
        )
        for label, histogram in (
            (FORWARDED, self.forwarded_seconds),
            ("answered", self.answered_seconds),
        ):
            durations.add_metric((label,), histogram.buckets(), histogram.total)
        yield durations
        decision = HistogramMetricFamily(
            f"{NAMESPACE}_decision_duration_seconds",
            "Time the router spends deciding where a request goes (session read, claim lookup).",
        )
        decision.add_metric((), self.decision_seconds.buckets(), self.decision_seconds.total)
        yield decision
        ops = CounterMetricFamily(
            f"{NAMESPACE}_control_ops",
            "Control socket requests, by op and result (ok, or the error code).",
            labels=("op", "result"),
        )
        for op_result, count in list(self.control_ops.items()):
            ops.add_metric(op_result, count)
        yield ops
