"""The relay's lane: a forward driven by its worker connection's callback, with no task.

This module owns what happens to a forward `Forwarder.start` put on its lane once the
request is written: the connection's callback relays a reply that came whole, listens
again while the head is still arriving, and hands anything else (a reply to stream, a
stale connection, a timeout, the client leaving) to the coroutine path
(`Forwarder.resume`), as a coroutine for the caller to run. It never starts a forward,
never waits and never raises into the connection's callback: a bug is handed over as a
coroutine that raises it.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from router.relay.connection import WOKE, ReplyWatcher
from router.relay.contract import ReplyObserver
from router.relay.exchange import Exchange, send_whole

__all__ = ["Lane", "LaneDone", "LaneOwner"]


class LaneDone:
    """What `Forwarder.start` tells how a forward on its lane ended: an object whose
    `lane_done(result)` is called, not a callable. The compiled build then calls it
    directly, where a closure made per request and called through the generic call
    protocol cost more; with `router.relay.connection.ReplyWatcher` (the same for the
    connection's callback), no closure and no bound method are made per request (one of
    the trims measured with router.edge.parsing.ParsingConnection's bound methods)."""

    __slots__ = ()

    def lane_done(self, result: int | Coroutine[Any, Any, int]) -> None:
        """The reply went out whole (`result` is its status), or the rest of the
        forward is the coroutine `result`, to run."""
        raise NotImplementedError


class LaneOwner:
    """What a lane hands a forward it cannot finish to: the `Forwarder` that started it.
    A base class rather than a Protocol, as `LaneDone` is, so that the compiled build
    calls it directly."""

    __slots__ = ()

    def handed_over(
        self,
        exchange: Exchange,
        message: bytes,
        public_base: str | None,
        observer: ReplyObserver | None,
    ) -> Coroutine[Any, Any, int]:
        """The rest of the forward, from the wait for the reply head on, to run, its
        reply shown to `observer`."""
        raise NotImplementedError


class Lane(ReplyWatcher):
    """A forward started by `Forwarder.start`, waiting on its connection's callback."""

    __slots__ = (
        "exchange",
        "forwarder",
        "message",
        "observed_status",
        "observer",
        "on_done",
        "public_base",
    )

    def __init__(
        self,
        forwarder: LaneOwner,
        exchange: Exchange,
        message: bytes,
        public_base: str | None,
        on_done: LaneDone,
        observer: ReplyObserver | None = None,
        observed_status: int = 0,
    ) -> None:
        self.forwarder = forwarder
        self.exchange = exchange
        self.message = message
        self.public_base = public_base
        self.on_done = on_done
        # A reply of this status is handed over, to be shown to `observer` (0: none is).
        self.observer = observer
        self.observed_status = observed_status if observer is not None else 0

    def woke(self, outcome: int) -> None:
        """The connection's listener: relays a reply that came whole, listens again while
        the head is still arriving, and hands anything else to `Forwarder.resume`."""
        exchange = self.exchange
        conn = exchange.conn
        status: int | None = None
        try:
            if conn is not None:
                reply = conn.reply
                if reply.complete:
                    if reply.status != self.observed_status:
                        status = send_whole(exchange, self.public_base)
                elif outcome == WOKE and not reply.head_done and reply.broken is None:
                    conn.listen(self, exchange.deadline)
                    return
        except Exception as exc:  # a bug: the caller's task logs it and drops the client
            exchange.settle(clean=False)
            self.on_done.lane_done(_raise(exc))
            return
        if status is not None:
            self.on_done.lane_done(status)
        else:
            self.on_done.lane_done(
                self.forwarder.handed_over(exchange, self.message, self.public_base, self.observer)
            )


async def _raise(exc: Exception) -> int:
    raise exc
