"""A circuit breaker for directory calls: closed, open, half-open (design §10).

After `failures` calls in a row fail (timeouts, refused connections), the breaker
opens: calls are refused at once, without waiting for a deadline, for `open_s`.
Then it is half-open: one trial call goes through; its success closes the breaker,
its failure opens it again. Pure: the clock is passed in (`now`, in seconds, from
one monotonic clock), so every transition is tested without an event loop.
"""

from __future__ import annotations

import enum

# Five in a row: one slow answer under load is not an outage, five deadlines are.
DEFAULT_FAILURES = 5
# One second: a request's 503 `recovering` asks for a retry after about that long.
DEFAULT_OPEN_S = 1.0


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Whether a directory call may go out now, from how the last ones went."""

    __slots__ = ("_failures", "_open_s", "_opened_at", "_trial_out", "failures_in_a_row")

    def __init__(self, failures: int = DEFAULT_FAILURES, open_s: float = DEFAULT_OPEN_S) -> None:
        if failures < 1 or open_s <= 0:
            raise ValueError("a breaker needs failures >= 1 and open_s > 0")
        self._failures = failures
        self._open_s = open_s
        self._opened_at: float | None = None
        self._trial_out = False
        self.failures_in_a_row = 0

    def state(self, now: float) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if now - self._opened_at < self._open_s:
            return BreakerState.OPEN
        return BreakerState.HALF_OPEN

    def allow(self, now: float) -> bool:
        """Whether a call may go out at `now`; in half-open, only one at a time."""
        state = self.state(now)
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.OPEN or self._trial_out:
            return False
        self._trial_out = True
        return True

    def succeeded(self) -> None:
        self._opened_at = None
        self._trial_out = False
        self.failures_in_a_row = 0

    def abandoned(self) -> None:
        """A call that went out was cancelled before it ended: it proves nothing, and
        frees the half-open trial for the next caller."""
        self._trial_out = False

    def failed(self, now: float) -> None:
        self.failures_in_a_row += 1
        if self._trial_out or self.failures_in_a_row >= self._failures:
            self._opened_at = now
        self._trial_out = False
