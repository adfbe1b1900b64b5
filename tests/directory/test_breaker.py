"""The circuit breaker, step by step with a clock passed in, and the batcher's pure half."""

from __future__ import annotations

import pytest

from router.directory import BreakerState, CircuitBreaker
from router.directory.batching import PendingBatch


def test_the_breaker_opens_after_failures_in_a_row_and_refuses_until_open_s() -> None:
    breaker = CircuitBreaker(failures=3, open_s=1.0)
    assert breaker.state(0.0) is BreakerState.CLOSED
    breaker.failed(0.0)
    breaker.failed(0.1)
    breaker.succeeded()  # a success breaks the row
    breaker.failed(0.2)
    breaker.failed(0.3)
    assert breaker.allow(0.3) and breaker.state(0.3) is BreakerState.CLOSED
    breaker.failed(0.4)
    assert breaker.state(0.4) is BreakerState.OPEN
    assert not breaker.allow(0.5)
    assert not breaker.allow(1.39)
    assert breaker.state(1.41) is BreakerState.HALF_OPEN


def test_half_open_lets_one_trial_through_and_its_outcome_decides() -> None:
    breaker = CircuitBreaker(failures=1, open_s=1.0)
    breaker.failed(0.0)
    assert breaker.allow(1.0)  # the trial
    assert not breaker.allow(1.0)  # one at a time
    breaker.failed(1.1)  # the trial failed: open again, for a whole open_s
    assert breaker.state(1.5) is BreakerState.OPEN
    assert not breaker.allow(2.0)
    assert breaker.allow(2.1)
    breaker.succeeded()
    assert breaker.state(2.1) is BreakerState.CLOSED
    assert breaker.allow(2.1) and breaker.allow(2.1)


def test_a_cancelled_trial_frees_half_open_for_the_next_caller() -> None:
    breaker = CircuitBreaker(failures=1, open_s=1.0)
    breaker.failed(0.0)
    assert breaker.allow(1.0)
    breaker.abandoned()
    assert breaker.state(1.0) is BreakerState.HALF_OPEN
    assert breaker.allow(1.0)


def test_a_breaker_needs_sane_bounds() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failures=0)
    with pytest.raises(ValueError):
        CircuitBreaker(open_s=0)


def test_a_pending_batch_keeps_each_key_once_in_order_with_all_its_waiters() -> None:
    batch: PendingBatch[str, int] = PendingBatch()
    assert batch.add("a", 1) is True  # the first: the caller schedules the flush
    assert batch.add("b", 2) is False
    assert batch.add("a", 3) is False
    assert len(batch) == 2
    assert list(batch.take()) == [(["a", "b"], [[1, 3], [2]])]
    assert len(batch) == 0
    assert batch.add("c", 4) is True  # a new batch after the flush


def test_a_pending_batch_is_cut_into_slices_of_the_limit() -> None:
    batch: PendingBatch[int, int] = PendingBatch()
    for key in range(7):
        batch.add(key, key * 10)
    slices = list(batch.take(limit=3))
    assert [keys for keys, _ in slices] == [[0, 1, 2], [3, 4, 5], [6]]
    assert slices[2][1] == [[60]]
    with pytest.raises(ValueError):
        list(PendingBatch[int, int]().take(limit=0))
