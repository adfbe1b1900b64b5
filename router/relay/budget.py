"""The process's budget for the bytes it holds so that slow clients cost no connection.

This module owns one count: the request bodies read whole before a worker connection is
taken, and the replies read whole before the client takes them, held at once across the
process, against `BufferLimits.budget_bytes`. It is pure: it never allocates the bytes
it counts, never waits and never decides what happens past the budget (the forwarder
streams instead).
"""

from __future__ import annotations

__all__ = ["BufferBudget"]


class BufferBudget:
    """Bytes reserved against a fixed budget; a reservation that does not fit is refused
    whole, never cut down."""

    __slots__ = ("held", "limit", "refused")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0  # bytes reserved now
        self.refused = 0  # reservations that did not fit, since the start

    def reserve(self, size: int) -> bool:
        """Reserves `size` bytes; False (nothing reserved) when they would pass the limit."""
        if self.held + size > self.limit:
            self.refused += 1
            return False
        self.held += size
        return True

    def give_back(self, size: int) -> None:
        """Returns bytes `reserve` took."""
        self.held -= size
