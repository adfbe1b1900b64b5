"""Pure tests for router.metrics.registry: every method, read back through the exposition text.

Each test renders the registry, parses it with prometheus_client's own parser and
asserts the exact samples, so what is checked is what Prometheus would scrape.
No event loop: RouterMetrics is synchronous.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from router.core.answers import STATUS_BY_CODE
from router.metrics.labels import CONTROL_OPS
from router.metrics.registry import RouterMetrics


@dataclass
class FakeState:
    """What the collector's callables read; tests change it between scrapes."""

    claims: dict[tuple[str, str], int] = field(default_factory=dict)
    tombstones: int = 0
    workers: list[tuple[str, str, bool]] = field(default_factory=list)
    in_flight: dict[str, int] = field(default_factory=dict)
    connections: int = 0
    recovery: float | None = None
    journal_errors: int = 0
    reads: int = 0

    def read_claims(self) -> dict[tuple[str, str], int]:
        self.reads += 1
        return dict(self.claims)


def new_metrics(
    state: FakeState | None = None,
    *,
    kinds: tuple[str, ...] = ("episode", "mcp_session"),
    max_worker_labels: int = 1024,
    journal: bool = True,
) -> RouterMetrics:
    s = state if state is not None else FakeState()
    return RouterMetrics(
        claims_by_worker_kind=s.read_claims,
        tombstones=lambda: s.tombstones,
        workers=lambda: s.workers,
        in_flight=lambda: s.in_flight.items(),
        control_connections=lambda: s.connections,
        recovery_remaining=lambda: s.recovery,
        journal_write_errors=(lambda: s.journal_errors) if journal else None,
        kinds=kinds,
        max_worker_labels=max_worker_labels,
    )


Samples = dict[tuple[str, str], float]


def scrape(metrics: RouterMetrics) -> Samples:
    """(sample name, "label=value,..." sorted) → value; `_created` samples left out."""
    body, _ = metrics.render()
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[sample.name, labels] = sample.value
    return samples


def series(samples: Samples, name: str, *, nonzero: bool = True) -> dict[str, float]:
    """The samples called `name`, by label string (only the non-zero ones by default)."""
    return {
        labels: value
        for (sample, labels), value in samples.items()
        if sample == name and (value != 0 or not nonzero)
    }


REQ = "episode_router_requests_total"


# ---------------------------------------------------------------------------- requests


def test_a_fresh_registry_has_the_known_request_series_at_zero_and_nothing_counted() -> None:
    samples = scrape(new_metrics())
    assert series(samples, REQ) == {}
    every = series(samples, REQ, nonzero=False)
    # kinds x (forwarded x 6 status classes + one series per answer code)
    assert len(every) == 3 * (6 + len(STATUS_BY_CODE))
    assert every["kind=episode,outcome=forwarded,status_class=2xx"] == 0
    assert every["kind=none,outcome=no_worker,status_class=5xx"] == 0
    assert every["kind=mcp_session,outcome=unknown_session,status_class=4xx"] == 0
    assert {labels.split(",")[0] for labels in every} == {
        "kind=episode",
        "kind=mcp_session",
        "kind=none",
    }


def test_a_forward_outside_the_known_statuses_and_kinds_counts_as_other() -> None:
    metrics = new_metrics()
    metrics.request_done("episode", "forwarded", 600, 0.01)  # outside 100..599
    metrics.request_done("episode", "forwarded", 99, 0.01)
    metrics.request_done("renamed_kind", "forwarded", 100, 0.01)  # a kind not configured
    samples = scrape(metrics)
    assert series(samples, REQ) == {
        "kind=episode,outcome=forwarded,status_class=other": 2,
        "kind=other,outcome=forwarded,status_class=1xx": 1,
    }
    # A kind first seen shows only the classes it counted, no zero series beside them.
    every = series(samples, REQ, nonzero=False)
    assert [labels for labels in every if labels.startswith("kind=other,")] == [
        "kind=other,outcome=forwarded,status_class=1xx"
    ]


def test_a_kind_a_reload_adds_gets_its_own_label() -> None:
    metrics = new_metrics(kinds=("episode",))
    metrics.add_kinds(["episode", "rollout"])
    metrics.request_done("rollout", "forwarded", 200, 0.01)
    metrics.learned("rollout")
    samples = scrape(metrics)
    assert series(samples, REQ) == {"kind=rollout,outcome=forwarded,status_class=2xx": 1}
    assert series(samples, "episode_router_learned_claims_total") == {"kind=rollout": 1}


def test_request_done_counts_by_kind_outcome_and_status_class() -> None:
    metrics = new_metrics()
    metrics.request_done("episode", "forwarded", 200, 0.02)
    metrics.request_done("episode", "forwarded", 201, 0.03)
    metrics.request_done("episode", "forwarded", 502, 0.5)  # the worker's own 502
    metrics.request_done("episode", "worker_exited", 410, 0.0001)
    metrics.request_done(None, "no_worker", 503, 0.0002)
    metrics.request_done(None, "forwarded", 404, 0.004)
    samples = scrape(metrics)
    assert series(samples, REQ) == {
        "kind=episode,outcome=forwarded,status_class=2xx": 2,
        "kind=episode,outcome=forwarded,status_class=5xx": 1,
        "kind=episode,outcome=worker_exited,status_class=4xx": 1,
        "kind=none,outcome=no_worker,status_class=5xx": 1,
        "kind=none,outcome=forwarded,status_class=4xx": 1,
    }
    counts = series(samples, "episode_router_request_duration_seconds_count")
    assert counts == {"outcome_class=forwarded": 4, "outcome_class=answered": 2}
    sums = series(samples, "episode_router_request_duration_seconds_sum")
    assert math.isclose(sums["outcome_class=forwarded"], 0.554)
    assert math.isclose(sums["outcome_class=answered"], 0.0003)
    buckets = series(samples, "episode_router_request_duration_seconds_bucket", nonzero=False)
    assert buckets["le=0.001,outcome_class=answered"] == 2
    assert buckets["le=0.001,outcome_class=forwarded"] == 0
    assert buckets["le=0.005,outcome_class=forwarded"] == 1
    assert buckets["le=0.025,outcome_class=forwarded"] == 2
    assert buckets["le=0.25,outcome_class=forwarded"] == 3
    assert buckets["le=0.5,outcome_class=forwarded"] == 4
    assert buckets["le=+Inf,outcome_class=forwarded"] == 4


def test_unexpected_kinds_outcomes_and_statuses_are_counted_as_other() -> None:
    metrics = new_metrics()
    metrics.request_done("not_configured", "forwarded", 200, 0.01)
    metrics.request_done("episode", "ep7-a0", 410, 0.01)  # a key passed by mistake: never a label
    metrics.request_done("episode", "forwarded", 99, 0.01)
    metrics.request_done("episode", "forwarded", 600, 0.01)
    samples = scrape(metrics)
    assert series(samples, REQ) == {
        "kind=other,outcome=forwarded,status_class=2xx": 1,
        "kind=episode,outcome=other,status_class=4xx": 1,
        "kind=episode,outcome=forwarded,status_class=other": 2,
    }
    # "other" outcomes are the router's, not a worker's
    assert series(samples, "episode_router_request_duration_seconds_count") == {
        "outcome_class=forwarded": 3,
        "outcome_class=answered": 1,
    }
    body = metrics.render()[0].decode()
    assert "ep7-a0" not in body and "not_configured" not in body


def test_a_negative_or_nan_duration_is_observed_as_zero() -> None:
    metrics = new_metrics()
    metrics.request_done("episode", "forwarded", 200, -1.0)
    metrics.request_done("episode", "forwarded", 200, math.nan)
    metrics.decision_seconds(-0.5)
    samples = scrape(metrics)
    assert series(samples, "episode_router_request_duration_seconds_sum") == {}
    assert (
        series(samples, "episode_router_request_duration_seconds_bucket", nonzero=False)[
            "le=0.001,outcome_class=forwarded"
        ]
        == 2
    )
    assert samples["episode_router_decision_duration_seconds_sum", ""] == 0
    assert samples["episode_router_decision_duration_seconds_bucket", "le=1e-06"] == 1


def test_decision_buckets_span_a_microsecond_to_ten_milliseconds() -> None:
    metrics = new_metrics()
    for seconds in (3e-6, 3e-6, 8e-5, 0.02):
        metrics.decision_seconds(seconds)
    samples = scrape(metrics)
    buckets = series(samples, "episode_router_decision_duration_seconds_bucket", nonzero=False)
    assert buckets == {
        "le=1e-06": 0,
        "le=2.5e-06": 0,
        "le=5e-06": 2,
        "le=1e-05": 2,
        "le=2.5e-05": 2,
        "le=5e-05": 2,
        "le=0.0001": 3,
        "le=0.00025": 3,
        "le=0.0005": 3,
        "le=0.001": 3,
        "le=0.0025": 3,
        "le=0.005": 3,
        "le=0.01": 3,
        "le=+Inf": 4,
    }
    assert samples["episode_router_decision_duration_seconds_count", ""] == 4
    assert math.isclose(samples["episode_router_decision_duration_seconds_sum", ""], 0.020086)


# ---------------------------------------------------------------------------- workers


def test_upstream_failures_by_worker_and_kind() -> None:
    metrics = new_metrics()
    assert series(scrape(metrics), "episode_router_upstream_failures_total") == {}
    metrics.upstream_failure("w0", "refused")
    metrics.upstream_failure("w0", "refused")
    metrics.upstream_failure("w0", "timeout")
    metrics.upstream_failure("w1", "error")
    metrics.upstream_failure("w1", "exploded")
    assert series(scrape(metrics), "episode_router_upstream_failures_total") == {
        "kind=refused,worker=w0": 2,
        "kind=timeout,worker=w0": 1,
        "kind=error,worker=w1": 1,
        "kind=other,worker=w1": 1,
    }


def test_worker_labels_stop_growing_at_the_bound() -> None:
    state = FakeState(workers=[("w0", "live", False), ("w1", "exited", False)])
    metrics = new_metrics(state, max_worker_labels=2)
    for worker in ("w0", "w1", "pid-123", "pid-456"):
        metrics.upstream_failure(worker, "refused")
    metrics.upstream_failure("w1", "refused")  # a known id keeps its own label
    samples = scrape(metrics)
    assert series(samples, "episode_router_upstream_failures_total") == {
        "kind=refused,worker=w0": 1,
        "kind=refused,worker=w1": 2,
        "kind=refused,worker=other": 2,
    }


def test_a_worker_the_router_forgot_gives_its_label_to_a_new_one() -> None:
    # It keeps the live workers and the 1,024 that exited last: a pool restarting with
    # fresh ids must not see its live workers' failures counted as "other".
    state = FakeState(workers=[("w0", "exited", False), ("w1", "live", False)])
    metrics = new_metrics(state, max_worker_labels=2)
    metrics.upstream_failure("w0", "refused")
    metrics.upstream_failure("w1", "refused")
    state.workers = [("w1", "live", False), ("w2", "live", False)]  # w0 forgotten
    metrics.upstream_failure("w2", "timeout")
    assert series(scrape(metrics), "episode_router_upstream_failures_total") == {
        "kind=refused,worker=w1": 1,
        "kind=timeout,worker=w2": 1,
    }


def test_worker_transitions_by_state() -> None:
    metrics = new_metrics()
    for state in ("live", "lost", "live", "lost", "exited", "unhealthy", "zombie"):
        metrics.worker_transition(state)
    samples = scrape(metrics)
    assert series(samples, "episode_router_worker_transitions_total", nonzero=False) == {
        "state=live": 2,
        "state=lost": 2,
        "state=exited": 1,
        "state=unhealthy": 1,
        "state=other": 1,
    }


# ---------------------------------------------------------------------------- control plane


def test_control_ops_by_op_and_result_with_hostile_values_bounded() -> None:
    metrics = new_metrics()
    assert series(scrape(metrics), "episode_router_control_ops_total", nonzero=False) == {
        f"op={op},result=ok": 0 for op in CONTROL_OPS
    }
    metrics.control_op("hello", "ok")
    metrics.control_op("claim", "ok")
    metrics.control_op("claim", "ok")
    metrics.control_op("claim", "conflict")
    metrics.control_op("release", "not_holder")
    metrics.control_op("ep7-a0", "unknown_op")  # a peer's op string never becomes a label
    metrics.control_op("", "bad_request")
    metrics.control_op("sync", "secret-token-value")
    assert series(scrape(metrics), "episode_router_control_ops_total") == {
        "op=hello,result=ok": 1,
        "op=claim,result=ok": 2,
        "op=claim,result=conflict": 1,
        "op=release,result=not_holder": 1,
        "op=invalid,result=unknown_op": 1,
        "op=invalid,result=bad_request": 1,
        "op=sync,result=other": 1,
    }
    body = metrics.render()[0].decode()
    assert "ep7-a0" not in body and "secret-token-value" not in body


def test_claim_conflicts_and_learned_claims() -> None:
    metrics = new_metrics()
    metrics.claim_conflict()
    metrics.claim_conflict()
    metrics.learned("mcp_session")
    metrics.learned("mcp_session")
    metrics.learned("made_up")
    metrics.learn_conflict("mcp_session")
    samples = scrape(metrics)
    assert samples["episode_router_claim_conflicts_total", ""] == 2
    assert series(samples, "episode_router_learned_claims_total", nonzero=False) == {
        "kind=episode": 0,
        "kind=mcp_session": 2,
        "kind=other": 1,
    }
    assert series(samples, "episode_router_learn_conflicts_total") == {"kind=mcp_session": 1}


# ---------------------------------------------------------------------------- the registry


def test_each_instance_has_its_own_registry_and_the_global_one_is_untouched() -> None:
    first, second = new_metrics(), new_metrics()
    first.claim_conflict()
    assert scrape(first)["episode_router_claim_conflicts_total", ""] == 1
    assert scrape(second)["episode_router_claim_conflicts_total", ""] == 0
    assert not any(name.startswith("episode_router") for name in REGISTRY._names_to_collectors)


def test_render_speaks_the_text_format_or_openmetrics_when_asked() -> None:
    metrics = new_metrics()
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=0.0.4")
    assert body.startswith(b"# HELP ")
    body, content_type = metrics.render("application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert body.endswith(b"# EOF\n")
    assert b"episode_router_requests_total{" in body


# ---------------------------------------------------------------------------- conventions

EXPECTED_FAMILIES = {
    "episode_router_requests": "counter",
    "episode_router_request_duration_seconds": "histogram",
    "episode_router_decision_duration_seconds": "histogram",
    "episode_router_upstream_failures": "counter",
    "episode_router_control_ops": "counter",
    "episode_router_claim_conflicts": "counter",
    "episode_router_learned_claims": "counter",
    "episode_router_learn_conflicts": "counter",
    "episode_router_learn_misses": "counter",
    "episode_router_in_flight_requests": "gauge",
    "episode_router_worker_transitions": "counter",
    "episode_router_claims": "gauge",
    "episode_router_tombstones": "gauge",
    "episode_router_workers": "gauge",
    "episode_router_workers_draining": "gauge",
    "episode_router_worker_state": "gauge",
    "episode_router_worker_draining": "gauge",
    "episode_router_control_connections": "gauge",
    "episode_router_recovering": "gauge",
    "episode_router_recovery_remaining_seconds": "gauge",
    "episode_router_journal_write_errors": "counter",
}
SNAKE = re.compile(r"[a-z][a-z0-9]*(_[a-z0-9]+)*")
NON_BASE_UNITS = (
    *("_ms", "_milliseconds", "_microseconds", "_us", "_ns", "_minutes", "_hours", "_days"),
    *("_kb", "_kilobytes", "_mb", "_megabytes", "_percent"),
)
FORBIDDEN_LABELS = {"key", "session", "token", "boot", "nonce", "url", "ep"}


def populated() -> RouterMetrics:
    """An instance where every family has samples (so label names can be read)."""
    state = FakeState(
        claims={("w0", "episode"): 1},
        workers=[("w0", "live", False)],
        in_flight={"w0": 1},
        recovery=1.0,
    )
    metrics = new_metrics(state)
    metrics.request_done("episode", "forwarded", 200, 0.1)
    metrics.decision_seconds(1e-5)
    metrics.upstream_failure("w0", "timeout")
    metrics.control_op("claim", "ok")
    metrics.claim_conflict()
    metrics.learned("episode")
    metrics.learn_conflict("episode")
    metrics.worker_transition("live")
    return metrics


def test_the_families_are_exactly_the_documented_ones() -> None:
    text = populated().render()[0].decode()
    families = {
        f.name: f.type
        for f in text_string_to_metric_families(text)
        if not f.name.endswith("_created")
    }
    assert families == EXPECTED_FAMILIES


def test_names_labels_and_help_texts_follow_prometheus_conventions() -> None:
    text = populated().render()[0].decode()
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.MULTILINE))
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    assert set(helps) == set(types)
    for name, kind in types.items():
        if name.endswith("_created"):
            continue
        assert SNAKE.fullmatch(name) and name.startswith("episode_router_"), name
        assert not name.endswith(NON_BASE_UNITS) and "_seconds_" not in name, name
        if kind == "counter":
            assert name.endswith("_total"), name
        else:
            assert "_total" not in name, name
            assert not name.endswith(("_count", "_sum", "_bucket", "_created", "_info")), name
        if kind == "histogram":
            assert name.endswith("_seconds"), name
        help_text = helps[name]
        assert len(help_text) >= 20 and help_text[0].isupper() and help_text.endswith("."), name
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for label in sample.labels:
                assert SNAKE.fullmatch(label) and not label.startswith("__"), label
                assert label not in FORBIDDEN_LABELS, (sample.name, label)
