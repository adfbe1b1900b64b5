"""Prometheus metrics for the admin listener's `GET /metrics` (DESIGN §6).

This module owns every metric name, label set and help text the router
exposes, and the registry they live in. It has two halves:

- event metrics (counters and histograms), updated as things happen by the
  request path and the control server through cheap methods;
- a collector that reads the live state (claims, tombstones, workers and their
  requests in flight, control connections, recovery) at scrape time through
  callables, so nothing on the hot path counts what the core already knows.

It must never put a session key, a token, a boot id or any other string a
client or worker chose into a label. Every label value comes from a fixed set
named here, from the configured session kinds, or is a worker id (the event
metrics take at most `max_worker_labels` of them; the state collector's follow
the known workers); anything outside those sets is counted as "other", so a
hostile peer cannot grow the series count. It never touches
prometheus_client's global registry, opens no socket and reads no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from router.answers import STATUS_BY_CODE
from router.workers import WorkerState

__all__ = [
    "CONTROL_OPS",
    "CONTROL_RESULTS",
    "OTHER",
    "SESSIONLESS",
    "UPSTREAM_FAILURE_KINDS",
    "RouterMetrics",
    "status_class",
]

SESSIONLESS: Final = "none"  # the `kind` label of a request that names no session
OTHER: Final = "other"  # any label value outside its fixed set
FORWARDED: Final = "forwarded"
CLIENT_CLOSED: Final = "client_closed"  # the client left before its reply (status 499)
STATUS_CLASSES: Final = ("1xx", "2xx", "3xx", "4xx", "5xx")
# The control protocol's ops (DESIGN §3); any other op string is counted as "invalid".
CONTROL_OPS: Final = ("hello", "claim", "release", "sync", "drain", "bye", "ping")
INVALID_OP: Final = "invalid"
# "ok" and every error code a control reply can carry (DESIGN §3). This tuple and the
# buckets' are not Final: mypyc (setup.py) leaves a Final tuple built with * unset.
CONTROL_RESULTS: tuple[str, ...] = (
    *("ok", "bad_request", "unknown_op", "no_hello", "unsupported_version", "forbidden"),
    *("worker_busy", "conflict", "ended", "worker_exited", "unknown_kind", "not_holder"),
)
UPSTREAM_FAILURE_KINDS: Final = ("refused", "error", "timeout")
WORKER_STATES: Final = tuple(state.value for state in WorkerState)

# A proxied call ranges from a millisecond (a cached tool) to minutes (an
# LLM-backed tool; timeouts.first_byte_s defaults to 300 s).
REQUEST_BUCKETS: tuple[float, ...] = (
    *(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
    *(1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
)
# The router's own decision (read the session, look up the claim) takes microseconds.
DECISION_BUCKETS: tuple[float, ...] = (
    *(1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4),
    *(2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2),
)
# Worker ids are chosen by workers; this bounds the series even if a pool
# restarts with a fresh id each time. Ids past it are counted as "other".
MAX_WORKER_LABELS: Final = 1024

_NAMESPACE: Final = "episode_router"
# prometheus_client's own formatting of a bucket bound ("0.001", "1e-06", "+Inf"),
# untyped there.
_go_float: Callable[[float], str] = floatToGoString


def status_class(status: int) -> str:
    """The class of `status`: "2xx" for 200..299 and so on; "other" outside 100..599."""
    return CLASS_LABELS[_class_index(status)]


CLASS_LABELS: Final = (*STATUS_CLASSES, OTHER)


def _class_index(status: int) -> int:
    """Where `status_class(status)` is in CLASS_LABELS."""
    return status // 100 - 1 if 100 <= status <= 599 else len(STATUS_CLASSES)


def _seconds(value: float) -> float:
    # Durations come from a monotonic clock and are never negative or NaN, but a
    # bad one must not corrupt a histogram's sum: count it as zero.
    return value if value >= 0.0 else 0.0


class RouterMetrics:
    """Every metric of one router process, in a registry of its own.

    The callables are read at scrape time only:
    `claims_by_worker_kind()` gives (worker, kind) → held claims;
    `tombstones()` the number of tombstones; `workers()` (id, state, draining)
    for every known worker; `in_flight()` (id, requests being forwarded to it) for
    every known worker; `control_connections()` the open control
    connections; `recovery_remaining()` the seconds left in the recovery
    window (None or 0 once it is over); `journal_write_errors()` failed
    journal appends (None when there is no journal). `kinds` are the
    configured session kind names: the only values the `kind` label takes
    besides "none" and "other".

    The event methods never raise on an unexpected value: it is counted under
    "other" (or "invalid" for a control op).
    """

    def __init__(
        self,
        *,
        claims_by_worker_kind: Callable[[], dict[tuple[str, str], int]],
        tombstones: Callable[[], int],
        workers: Callable[[], Iterable[tuple[str, str, bool]]],
        control_connections: Callable[[], int],
        recovery_remaining: Callable[[], float | None],
        journal_write_errors: Callable[[], int] | None = None,
        in_flight: Callable[[], Iterable[tuple[str, int]]] = lambda: (),
        kinds: Iterable[str] = ("episode",),
        max_worker_labels: int = MAX_WORKER_LABELS,
    ) -> None:
        self.registry = CollectorRegistry()
        self._kind_labels: dict[str | None, str] = {kind: kind for kind in kinds}
        self._kind_labels[None] = SESSIONLESS
        self._max_worker_labels = max_worker_labels
        self._workers_seen: set[str] = set()
        self._define_event_metrics()
        self._prebind()
        self.registry.register(
            _StateCollector(
                claims_by_worker_kind,
                tombstones,
                workers,
                control_connections,
                recovery_remaining,
                journal_write_errors,
                in_flight,
            )
        )

    def _define_event_metrics(self) -> None:
        reg = self.registry
        # The per-request and per-control-op metrics are plain counts exposed by
        # _HotCollector at scrape time (see _Histogram for what that bought).
        self._hot = _HotCollector()
        reg.register(self._hot)
        self._upstream_failures = Counter(
            f"{_NAMESPACE}_upstream_failures",
            "Forwards that failed before the worker's reply head: connect refused, "
            "another error, or a timeout.",
            ("worker", "kind"),
            registry=reg,
        )
        self._claim_conflicts = Counter(
            f"{_NAMESPACE}_claim_conflicts",
            "Claims refused because another live worker holds the key.",
            registry=reg,
        )
        self._learned = Counter(
            f"{_NAMESPACE}_learned_claims",
            "Claims learned from workers' replies, by session kind.",
            ("kind",),
            registry=reg,
        )
        self._learn_conflicts = Counter(
            f"{_NAMESPACE}_learn_conflicts",
            "Keys not learned from a reply because another worker already holds them.",
            ("kind",),
            registry=reg,
        )
        self._worker_transitions = Counter(
            f"{_NAMESPACE}_worker_transitions",
            "Workers entering each state (live, unhealthy, lost, exited).",
            ("state",),
            registry=reg,
        )

    def _prebind(self) -> None:
        """Create every series whose labels are known now, at zero, so rate() sees
        its first increase. prometheus_client's `labels()` costs about 1.3 µs (label
        checks, a lock, a dict), so the children the colder paths use are found in
        plain dicts; the hot counts are plain dict entries of _HotCollector."""
        for kind in self._kind_labels.values():
            self._prebind_kind(kind)
        # Successes are pre-bound; errors (at most 8 ops x 13 results) appear when first seen.
        for op in CONTROL_OPS:
            self._hot.control_ops[op, "ok"] = 0
        kinds = [kind for kind in self._kind_labels if kind is not None]
        self._learned_children = {k: self._learned.labels(k) for k in kinds}
        self._learn_conflict_children = {k: self._learn_conflicts.labels(k) for k in kinds}
        self._transition_children = {s: self._worker_transitions.labels(s) for s in WORKER_STATES}
        self._failure_children: dict[tuple[str, str], Counter] = {}

    def _prebind_kind(self, kind: str) -> None:
        self._hot.forwarded[kind] = [0] * len(CLASS_LABELS)
        self._hot.prebound_kinds.add(kind)
        requests = self._hot.requests
        for code, status in STATUS_BY_CODE.items():
            requests[kind, code, status_class(status)] = 0

    def add_kinds(self, kinds: Iterable[str]) -> None:
        """Session kinds a config reload added get their own label from now on (not
        `other`). A kind removed keeps its series: the labels stay the configs' kinds."""
        for kind in kinds:
            if kind in self._kind_labels:
                continue
            self._kind_labels[kind] = kind
            self._prebind_kind(kind)
            self._learned_children[kind] = self._learned.labels(kind)
            self._learn_conflict_children[kind] = self._learn_conflicts.labels(kind)

    # -- the hot path ----------------------------------------------------------

    def request_done(self, kind: str | None, outcome: str, status: int, seconds: float) -> None:
        """A request finished: `outcome` is "forwarded" or the router's answer code,
        `status` the reply's status, `seconds` the whole request's duration."""
        kind_label = self._kind_labels.get(kind, OTHER)
        hot = self._hot
        if outcome == FORWARDED:
            # The usual outcome: counted in a list per kind, by status class, where a
            # tuple key was built, hashed and looked up twice. request_done went 2,490
            # -> 1,050 instructions, and instructions per routed request 81,100 ->
            # 80,600 (callgrind on bench.hotpath, compiled).
            counts = hot.forwarded.get(kind_label)
            if counts is None:
                counts = hot.forwarded[kind_label] = [0] * len(CLASS_LABELS)
            counts[_class_index(status)] += 1
            hot.forwarded_seconds.observe(_seconds(seconds))
            return
        if outcome not in STATUS_BY_CODE and outcome != CLIENT_CLOSED:
            outcome = OTHER
        # The labels come from fixed sets (kinds, outcomes, status classes): bounded.
        key = (kind_label, outcome, status_class(status))
        requests = hot.requests
        requests[key] = requests.get(key, 0) + 1
        hot.answered_seconds.observe(_seconds(seconds))

    def decision_seconds(self, seconds: float) -> None:
        """How long the router took to decide a request's route."""
        self._hot.decision_seconds.observe(_seconds(seconds))

    def upstream_failure(self, worker: str, kind: str) -> None:
        """A forward to `worker` failed before its reply head: `kind` is refused,
        error or timeout."""
        key = (self._worker_label(worker), kind if kind in UPSTREAM_FAILURE_KINDS else OTHER)
        child = self._failure_children.get(key)
        if child is None:
            child = self._failure_children[key] = self._upstream_failures.labels(*key)
        child.inc()

    def _worker_label(self, worker: str) -> str:
        if worker in self._workers_seen:
            return worker
        if len(self._workers_seen) >= self._max_worker_labels:
            return OTHER
        self._workers_seen.add(worker)
        return worker

    # -- the control plane -------------------------------------------------------

    def control_op(self, op: str, result: str) -> None:
        """One control request answered: `result` is "ok" or the reply's error code.
        An op outside the protocol (a typo, a hostile peer) counts as "invalid"."""
        op_label = op if op in CONTROL_OPS else INVALID_OP
        key = (op_label, result if result in CONTROL_RESULTS else OTHER)
        ops = self._hot.control_ops
        ops[key] = ops.get(key, 0) + 1

    def claim_conflict(self) -> None:
        """A claim (or a synced key) was refused: another live worker holds it."""
        self._claim_conflicts.inc()

    def learned(self, kind: str) -> None:
        """A claim of `kind` was learned from a worker's reply."""
        self._learned_child(self._learned_children, self._learned, kind).inc()

    def learn_conflict(self, kind: str) -> None:
        """A key of `kind` in a reply was not learned: another worker holds it."""
        self._learned_child(self._learn_conflict_children, self._learn_conflicts, kind).inc()

    def _learned_child(self, children: dict[str, Counter], parent: Counter, kind: str) -> Counter:
        label = kind if kind in children else OTHER
        child = children.get(label)
        if child is None:
            child = children[label] = parent.labels(label)
        return child

    def worker_transition(self, state: str) -> None:
        """A worker entered `state` (a WorkerState value)."""
        child = self._transition_children.get(state)
        if child is None:
            child = self._transition_children[OTHER] = self._worker_transitions.labels(OTHER)
        child.inc()

    # -- exposition ----------------------------------------------------------------

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition body and its Content-Type. The Prometheus text format,
        or OpenMetrics when `accept` (the scraper's Accept header) asks for it."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


class _Histogram:
    """Bucket counts as plain ints, turned into a histogram family at scrape time.

    `observe` is a short scan and two additions. Moving the request counter, both
    histograms, the in-flight gauge (since read at scrape time) and the control-op counter here from
    prometheus_client's objects (a lock and a value object per update, seven updates
    per forwarded request) took the router's cost per forwarded request from 339,000
    to 310,000 instructions (valgrind --tool=callgrind on bench.hotpath).
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
        # calls out and compares objects. With the in-flight gauge read at scrape time,
        # instructions per routed request (callgrind on bench.hotpath, compiled):
        # 107,800 -> 105,300.
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


class _HotCollector(Collector):
    """The metrics updated on every request and control op, kept as plain numbers."""

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str], int] = {}  # the router's own answers
        # The forwarded requests: per kind, counts in CLASS_LABELS' order. The kinds
        # known at start show every class from zero; another only the classes it counted.
        self.forwarded: dict[str, list[int]] = {}
        self.prebound_kinds: set[str] = set()
        self.forwarded_seconds = _Histogram(REQUEST_BUCKETS)
        self.answered_seconds = _Histogram(REQUEST_BUCKETS)
        self.decision_seconds = _Histogram(DECISION_BUCKETS)
        self.control_ops: dict[tuple[str, str], int] = {}

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            f"{_NAMESPACE}_requests",
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
            f"{_NAMESPACE}_request_duration_seconds",
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
            f"{_NAMESPACE}_decision_duration_seconds",
            "Time the router spends deciding where a request goes (session read, claim lookup).",
        )
        decision.add_metric((), self.decision_seconds.buckets(), self.decision_seconds.total)
        yield decision
        ops = CounterMetricFamily(
            f"{_NAMESPACE}_control_ops",
            "Control socket requests, by op and result (ok, or the error code).",
            labels=("op", "result"),
        )
        for op_result, count in list(self.control_ops.items()):
            ops.add_metric(op_result, count)
        yield ops


class _StateCollector(Collector):
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
        # a request): see _Histogram.observe for the figure.
        requests = GaugeMetricFamily(
            f"{_NAMESPACE}_in_flight_requests",
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
            f"{_NAMESPACE}_journal_write_errors",
            "Journal appends that failed (the state survives a restart only up to the first).",
            value=journal_errors,
        )


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{_NAMESPACE}_{name}", documentation, value=value)


def _claims_family(claims: dict[tuple[str, str], int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(
        f"{_NAMESPACE}_claims",
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
        f"{_NAMESPACE}_worker_state",
        "Each worker's lease state: 1 for its current state, 0 for the others.",
        labels=("worker", "state"),
    )
    per_worker_draining = GaugeMetricFamily(
        f"{_NAMESPACE}_worker_draining",
        "Whether a worker is draining: 1 while it gets no new sessions, else 0.",
        labels=("worker",),
    )
    for worker_id, state, is_draining in sorted(workers):
        label = state if state in by_state else OTHER
        by_state[label] = by_state.get(label, 0) + 1
        draining += is_draining
        for candidate in WORKER_STATES:
            per_worker.add_metric((worker_id, candidate), 1.0 if candidate == state else 0.0)
        per_worker_draining.add_metric((worker_id,), 1.0 if is_draining else 0.0)
    totals = GaugeMetricFamily(
        f"{_NAMESPACE}_workers", "Known workers, by lease state.", labels=("state",)
    )
    for state, count in by_state.items():
        totals.add_metric((state,), count)
    yield totals
    yield _gauge("workers_draining", "Workers draining: no new sessions.", draining)
    yield per_worker
    yield per_worker_draining
