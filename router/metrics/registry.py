"""Prometheus metrics for the admin listener's `GET /metrics` (design §6).

This module owns the router's metrics registry and the event metrics in it:
counters and histograms updated as things happen, by the request path and the
control server, through cheap methods of `RouterMetrics`. It chooses every label
value they take and registers the two collectors that show the rest:

- `router.metrics.counts`: the per-request and per-control-op counts, kept as
  plain numbers and turned into families at scrape time;
- `router.metrics.state`: a collector that reads the live state (claims,
  tombstones, workers and their requests in flight, control connections,
  recovery) at scrape time through callables, so nothing on the hot path counts
  what the core already knows.

The fixed label sets are in `router.metrics.labels`. This module must never put a
session key, a token, a boot id or any other string a client or worker chose
into a label. Every label value comes from a fixed set, from the configured
session kinds, or is a worker id (the event metrics take at most
`max_worker_labels` of them; the state collector's follow the known workers);
anything outside those sets is counted as "other", so a hostile peer cannot grow
the series count. It never touches prometheus_client's global registry, opens no
socket and reads no clock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Final

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import choose_encoder

from router.core import STATUS_BY_CODE
from router.metrics.buffers import BufferCollector, BufferFigures
from router.metrics.counts import HotCollector
from router.metrics.edge import EdgeCollector, EdgeCounts
from router.metrics.fleet import FleetCollector, FleetFigures
from router.metrics.labels import (
    CLASS_LABELS,
    CLIENT_CLOSED,
    CONTROL_OPS,
    CONTROL_RESULTS,
    FORWARDED,
    INVALID_OP,
    NAMESPACE,
    OTHER,
    SESSIONLESS,
    UPSTREAM_FAILURE_KINDS,
    WORKER_STATES,
    class_index,
    status_class,
)
from router.metrics.state import StateCollector

__all__ = ["MAX_WORKER_LABELS", "RouterMetrics"]

# Worker ids are chosen by workers; this bounds the series even if a pool
# restarts with a fresh id each time. Ids past it are counted as "other".
MAX_WORKER_LABELS: Final = 1024


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
    journal appends (None when there is no journal); `buffering()` the forwarder's
    buffer figures (`router.metrics.buffers`; None: not shown). `kinds` are the
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
        buffering: Callable[[], BufferFigures] | None = None,
        kinds: Iterable[str] = ("episode",),
        max_worker_labels: int = MAX_WORKER_LABELS,
    ) -> None:
        self.registry = CollectorRegistry()
        self._kind_labels: dict[str | None, str] = {kind: kind for kind in kinds}
        self._kind_labels[None] = SESSIONLESS
        self._max_worker_labels = max_worker_labels
        self._workers_seen: set[str] = set()
        self._known_workers = workers
        self._edge_collector: EdgeCollector | None = None  # once the edge is up (watch_edge)
        self._fleet_collector: FleetCollector | None = None  # with a directory (watch_fleet)
        self._define_event_metrics()
        self._prebind()
        self.registry.register(
            StateCollector(
                claims_by_worker_kind,
                tombstones,
                workers,
                control_connections,
                recovery_remaining,
                journal_write_errors,
                in_flight,
            )
        )
        if buffering is not None:
            self.registry.register(BufferCollector(buffering))

    def _define_event_metrics(self) -> None:
        reg = self.registry
        # The per-request and per-control-op metrics are plain counts exposed by
        # HotCollector at scrape time (see router.metrics.counts.Histogram for what that bought).
        self._hot = HotCollector()
        reg.register(self._hot)
        self._upstream_failures = Counter(
            f"{NAMESPACE}_upstream_failures",
            "Forwards that failed before the worker's reply head: connect refused, "
            "another error, or a timeout.",
            ("worker", "kind"),
            registry=reg,
        )
        self._claim_conflicts = Counter(
            f"{NAMESPACE}_claim_conflicts",
            "Claims refused because another live worker holds the key.",
            registry=reg,
        )
        self._learned = Counter(
            f"{NAMESPACE}_learned_claims",
            "Claims learned from workers' replies, by session kind.",
            ("kind",),
            registry=reg,
        )
        self._learn_conflicts = Counter(
            f"{NAMESPACE}_learn_conflicts",
            "Keys not learned from a reply because another worker already holds them.",
            ("kind",),
            registry=reg,
        )
        self._learn_misses = Counter(
            f"{NAMESPACE}_learn_misses",
            "Seed replies that named no session where the kind looks for one: a kind whose "
            "config cannot learn its sessions.",
            ("kind",),
            registry=reg,
        )
        self._worker_transitions = Counter(
            f"{NAMESPACE}_worker_transitions",
            "Workers entering each state (live, unhealthy, lost, exited).",
            ("state",),
            registry=reg,
        )

    def _prebind(self) -> None:
        """Create every series whose labels are known now, at zero, so rate() sees
        its first increase. prometheus_client's `labels()` does real work per call (label
        checks, a lock, a dict), so the children the colder paths use are found in
        plain dicts; the hot counts are plain dict entries of HotCollector."""
        for kind in self._kind_labels.values():
            self._prebind_kind(kind)
        # Successes are pre-bound; errors (at most 8 ops x 13 results) appear when first seen.
        for op in CONTROL_OPS:
            self._hot.control_ops[op, "ok"] = 0
        kinds = [kind for kind in self._kind_labels if kind is not None]
        self._learned_children = {k: self._learned.labels(k) for k in kinds}
        self._learn_conflict_children = {k: self._learn_conflicts.labels(k) for k in kinds}
        self._learn_miss_children = {k: self._learn_misses.labels(k) for k in kinds}
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
            self._learn_miss_children[kind] = self._learn_misses.labels(kind)

    # -- the hot path ----------------------------------------------------------

    def request_done(self, kind: str | None, outcome: str, status: int, seconds: float) -> None:
        """A request finished: `outcome` is "forwarded" or the router's answer code,
        `status` the reply's status, `seconds` the whole request's duration."""
        kind_label = self._kind_labels.get(kind, OTHER)
        hot = self._hot
        if outcome == FORWARDED:
            # The usual outcome: counted in a list per kind, by status class, where a
            # tuple key was built, hashed and looked up twice.
            counts = hot.forwarded.get(kind_label)
            if counts is None:
                counts = hot.forwarded[kind_label] = [0] * len(CLASS_LABELS)
            counts[class_index(status)] += 1
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
        seen = self._workers_seen
        if worker in seen:
            return worker
        if len(seen) >= self._max_worker_labels:
            self._forget_unknown_workers()
            if len(seen) >= self._max_worker_labels:
                return OTHER
        seen.add(worker)
        return worker

    def _forget_unknown_workers(self) -> None:
        """Drops the series of workers the router no longer knows (it keeps the live
        ones and the 1,024 that exited last): the first ids ever seen kept their labels
        for ever, and a pool that restarts with fresh ids counted its live workers'
        failures as "other". Runs only at the cap, on a failure: rare."""
        known = {worker_id for worker_id, _, _ in self._known_workers()}
        for worker in self._workers_seen - known:
            self._workers_seen.discard(worker)
            for key in [key for key in self._failure_children if key[0] == worker]:
                del self._failure_children[key]
                self._upstream_failures.remove(*key)

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

    def learn_missed(self, kind: str) -> None:
        """A seed reply of `kind` named no session where the kind looks for one."""
        self._learned_child(self._learn_miss_children, self._learn_misses, kind).inc()

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

    def watch_edge(self, counts: Callable[[], EdgeCounts]) -> None:
        """Shows the public server's connection and head counts (`counts()`, read at
        scrape time) from now on, instead of any shown before (a service started again)."""
        if self._edge_collector is not None:
            self.registry.unregister(self._edge_collector)
        self._edge_collector = EdgeCollector(counts)
        self.registry.register(self._edge_collector)

    def watch_fleet(self, figures: Callable[[], FleetFigures]) -> None:
        """Shows the fleet's directory and peer-hop figures (`figures()`, read at scrape
        time) from now on: a router with a `directory:` section."""
        if self._fleet_collector is not None:
            self.registry.unregister(self._fleet_collector)
        self._fleet_collector = FleetCollector(figures)
        self.registry.register(self._fleet_collector)

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition body and its Content-Type. The Prometheus text format,
        or OpenMetrics when `accept` (the scraper's Accept header) asks for it."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type
