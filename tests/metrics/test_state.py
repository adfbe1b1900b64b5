"""Pure tests for router.metrics.state: the live state, read back through the exposition text.

The collector is reached through RouterMetrics, which registers it, and each scrape is
parsed with prometheus_client's own parser (test_metrics' helpers), so what is checked is
what Prometheus would scrape. No event loop.
"""

from __future__ import annotations

from tests.metrics.test_registry import FakeState, new_metrics, scrape, series


def test_in_flight_is_read_from_every_worker_at_scrape_time() -> None:
    state = FakeState(in_flight={"w0": 2, "w1": 1})
    metrics = new_metrics(state)
    assert series(scrape(metrics), "episode_router_in_flight_requests") == {
        "worker=w0": 2,
        "worker=w1": 1,
    }
    state.in_flight.update(w0=1, w1=0)
    assert series(scrape(metrics), "episode_router_in_flight_requests", nonzero=False) == {
        "worker=w0": 1,
        "worker=w1": 0,
    }


def test_the_collector_reads_the_state_at_scrape_time_only() -> None:
    state = FakeState()
    metrics = new_metrics(state)
    assert state.reads == 0  # registration describes, it does not read
    samples = scrape(metrics)
    assert state.reads == 1
    assert series(samples, "episode_router_claims") == {}
    assert samples["episode_router_tombstones", ""] == 0
    assert series(samples, "episode_router_workers", nonzero=False) == {
        "state=live": 0,
        "state=unhealthy": 0,
        "state=lost": 0,
        "state=exited": 0,
    }
    assert samples["episode_router_workers_draining", ""] == 0
    assert samples["episode_router_control_connections", ""] == 0
    assert samples["episode_router_recovering", ""] == 0
    assert samples["episode_router_recovery_remaining_seconds", ""] == 0
    assert samples["episode_router_journal_write_errors_total", ""] == 0

    state.claims = {("w0", "episode"): 3, ("w1", "episode"): 1, ("w1", "mcp_session"): 2}
    state.tombstones = 7
    # w2 drained itself, then left: an exited worker is not draining.
    state.workers = [("w1", "lost", False), ("w0", "live", True), ("w2", "exited", True)]
    state.connections = 2
    state.recovery = 12.5
    state.journal_errors = 4
    samples = scrape(metrics)
    assert state.reads == 2
    assert series(samples, "episode_router_claims") == {
        "kind=episode,worker=w0": 3,
        "kind=episode,worker=w1": 1,
        "kind=mcp_session,worker=w1": 2,
    }
    assert samples["episode_router_tombstones", ""] == 7
    assert series(samples, "episode_router_workers", nonzero=False) == {
        "state=live": 1,
        "state=unhealthy": 0,
        "state=lost": 1,
        "state=exited": 1,
    }
    assert samples["episode_router_workers_draining", ""] == 1
    assert series(samples, "episode_router_worker_state") == {
        "state=live,worker=w0": 1,
        "state=lost,worker=w1": 1,
        "state=exited,worker=w2": 1,
    }
    assert len(series(samples, "episode_router_worker_state", nonzero=False)) == 3 * 4
    assert series(samples, "episode_router_worker_draining", nonzero=False) == {
        "worker=w0": 1,
        "worker=w1": 0,
        "worker=w2": 0,
    }
    assert samples["episode_router_control_connections", ""] == 2
    assert samples["episode_router_recovering", ""] == 1
    assert samples["episode_router_recovery_remaining_seconds", ""] == 12.5
    assert samples["episode_router_journal_write_errors_total", ""] == 4


def test_recovery_is_over_when_the_remaining_time_is_none_or_zero() -> None:
    state = FakeState(recovery=0.0)
    metrics = new_metrics(state)
    for remaining in (0.0, None, -3.0):
        state.recovery = remaining
        samples = scrape(metrics)
        assert samples["episode_router_recovering", ""] == 0
        assert samples["episode_router_recovery_remaining_seconds", ""] == 0


def test_without_a_journal_the_write_error_counter_stays_at_zero() -> None:
    state = FakeState(journal_errors=9)
    samples = scrape(new_metrics(state, journal=False))
    assert samples["episode_router_journal_write_errors_total", ""] == 0
