"""One keep-alive connection to a worker: the asyncio protocol an exchange runs on.

This module owns a worker socket's life as one exchange at a time sees it: the
protocol callbacks that feed the reply parser and wake the one waiter (a task in
`wait()`, or the callback `listen()` set), the deadline of that wait (one timer per
connection, moved lazily), flow control in both directions (reading pauses while a
reply's unread body is large; writing waits while the worker's buffer is full), and
telling its pool when it closes. It never decides whether a connection may be reused
or for how long it may idle (the exchange and `router.relay.pool` do), and never builds
or reads HTTP itself: `ReplyParser` reads the bytes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Final, cast

from router.relay.reply_parser import CONNECTION_BROKE, ReplyParser

__all__ = [
    "INTERRUPTED",
    "TIMED_OUT",
    "WOKE",
    "ConnectionOwner",
    "ReplyWatcher",
    "WorkerConnection",
]

# A reply body not yet relayed may grow to this much before the worker's socket is no
# longer read; reading resumes once the relay takes it (aiohttp's client pauses at 128 KiB).
_READ_HIGH_WATER: Final = 256 * 1024

# What `WorkerConnection.wait` returns.
WOKE: Final = 0  # the reply moved: bytes, its end, or the connection closed
TIMED_OUT: Final = 1  # the deadline passed first
_TIMER_SLACK_S: Final = 0.001
INTERRUPTED: Final = 2  # someone else called `interrupt()` (the client left, the upload broke)


def _not_open() -> bool:
    return True  # no transport yet: nothing can be written


class ReplyWatcher:
    """What `WorkerConnection.listen` wakes when the reply moves: an object whose
    `woke(outcome)` is called, not a callable, so the compiled build calls it
    directly and no bound method is made per request (see `router.relay.lane.LaneDone`)."""

    __slots__ = ()

    def woke(self, outcome: int) -> None:
        """The reply moved (WOKE), the deadline passed (TIMED_OUT) or `interrupt()` was
        called (INTERRUPTED)."""
        raise NotImplementedError


class ConnectionOwner:
    """What a connection tells when it closes: its `WorkerPool`. A base class rather than
    a Protocol, so that the compiled build calls it directly."""

    __slots__ = ()

    def lost(self, conn: WorkerConnection) -> None:
        """`conn` was closed by its holder: its place is free."""
        raise NotImplementedError

    def dropped(self, conn: WorkerConnection) -> None:
        """The worker closed `conn`."""
        raise NotImplementedError

    def stray(self, conn: WorkerConnection) -> None:
        """The worker sent `conn` bytes after a complete reply: bytes nobody asked for."""
        raise NotImplementedError


class WorkerConnection(asyncio.Protocol):
    """One connection to a worker, carrying one exchange at a time.

    The protocol callbacks feed `reply` and wake the one task waiting in `wait()`, or
    call the one callback `listen()` set; they never block.
    """

    __slots__ = (
        "_deadline",
        "_drain_waiter",
        "_listener",
        "_loop",
        "_pool",
        "_read_high_water",
        "_read_paused",
        "_timer",
        "_timer_when",
        "_transport_closing",
        "_transport_write",
        "_waiter",
        "closed",
        "holds_place",
        "released_at",
        "reply",
        "reused",
        "transport",
        "write_paused",
    )

    def __init__(self, pool: ConnectionOwner, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._loop = loop
        self._waiter: asyncio.Future[int] | None = None
        self._listener: ReplyWatcher | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._read_paused = False
        self._read_high_water = _READ_HIGH_WATER  # raised while a reply is buffered whole
        # One timer per connection, moved lazily (see wait()).
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0
        self.transport: asyncio.Transport | None = None
        # The transport's methods called per request, kept bound (see
        # router.edge.parsing.ParsingConnection: a call by name looks the method up each time).
        self._transport_write: Callable[[bytes], object] | None = None
        self._transport_closing: Callable[[], bool] = _not_open
        self.reply = ReplyParser()
        self.closed = False
        self.holds_place = False  # it counts against the pool's limit
        self.reused = False  # it carried an exchange before this one
        self.released_at = 0.0  # when its pool last took it back (loop time)
        self.write_paused = False

    # --- protocol callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self._transport_write = self.transport.write
        self._transport_closing = self.transport.is_closing

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        if reply.complete:
            # Bytes after a complete reply, before the next request was written (the
            # connection idles in its pool, is on its way to the next request, or its
            # exchange still relays the body): nobody asked for them, and on a reused
            # connection they would be read as the next request's reply. The connection
            # is out of step for good (design §8): its pool closes it (`stray`).
            reply.feed(data)  # not parsed; the reply is no longer reusable
            self._pool.stray(self)
            return
        reply.feed(data)
        if reply.buffered > self._read_high_water and not self._read_paused and self.transport:
            self._read_paused = True
            self.transport.pause_reading()
        self._wake(WOKE)

    def eof_received(self) -> bool | None:
        self.reply.feed_eof()
        self._wake(WOKE)
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self.reply.feed_eof()
        else:
            # A reset is no end of a reply, not even of one whose body ends at close.
            self.reply.feed_reset(f"{CONNECTION_BROKE} ({exc})")
        self._wake(WOKE)
        if self._timer is not None:
            self._timer.cancel()  # it holds this connection until it fires
            self._timer = None
        self.write_paused = False
        drain = self._drain_waiter
        if drain is not None and not drain.done():
            drain.set_result(None)
        if not self.closed:
            self.closed = True
            # A busy connection keeps its place until its exchange lets go of it
            # (close or abort); an idle one gives it up now.
            self._pool.dropped(self)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drain = self._drain_waiter
        if drain is not None and not drain.done():
            drain.set_result(None)

    # --- used by the exchange -------------------------------------------------------------

    async def wait(self, deadline: float | None) -> int:
        """Waits until the reply moves, `deadline` (loop time) passes or `interrupt()` is
        called; returns WOKE, TIMED_OUT or INTERRUPTED. The caller checks `reply` first:
        bytes that arrived before the call do not wake it."""
        waiter: asyncio.Future[int] = self._loop.create_future()
        self._waiter = waiter
        self._arm(deadline)
        try:
            return await waiter
        finally:
            self._waiter = None
            self._deadline = None

    def listen(self, listener: ReplyWatcher, deadline: float | None) -> None:
        """Calls `listener.woke` once, with what `wait()` would return, when the reply moves,
        `deadline` passes or `interrupt()` is called: the same wait with no task and no
        future, for an exchange driven by callbacks. The listener may run inside this
        connection's data_received; it may start the next exchange on it."""
        self._listener = listener
        self._arm(deadline)

    def _arm(self, deadline: float | None) -> None:
        self._deadline = deadline
        # A timer handle, not asyncio.timeout (no context manager, no task cancellation:
        # less for a wait woken at once), and one per connection moved lazily: a later
        # deadline is only stored (the timer, firing early, re-arms), so the waits of a
        # kept-alive connection make no timer call at all.
        if deadline is not None:
            timer = self._timer
            if timer is None or self._timer_when > deadline:
                if timer is not None:
                    timer.cancel()
                self._timer = self._loop.call_at(deadline, self._deadline_passed)
                self._timer_when = deadline

    def _deadline_passed(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None or (self._waiter is None and self._listener is None):
            return  # nobody waits with a deadline: the timer lapses
        # A timer may fire up to a millisecond early (the loop's clock resolution).
        if self._loop.time() + _TIMER_SLACK_S < deadline:
            self._timer = self._loop.call_at(deadline, self._deadline_passed)
            self._timer_when = deadline
            return
        self._wake(TIMED_OUT)

    def interrupt(self) -> None:
        """Wakes the task in `wait()` (or the listener) with INTERRUPTED (a no-op when
        none waits)."""
        self._wake(INTERRUPTED)

    def take_body(self) -> bytes:
        """The reply body bytes parsed so far and not yet taken; resumes reading."""
        data = self.reply.take_body()
        if self._read_paused and self.transport is not None:
            self._read_paused = False
            self.transport.resume_reading()
        return data

    def read_up_to(self, limit: int | None) -> None:
        """Lets the reply's unread body grow to `limit` bytes before reading pauses (None:
        back to the usual mark): a reply buffered whole is read on while nobody takes it."""
        limit_now = self._read_high_water = _READ_HIGH_WATER if limit is None else limit
        transport = self.transport
        if self._read_paused and transport is not None and self.reply.buffered <= limit_now:
            self._read_paused = False
            transport.resume_reading()

    async def drain(self) -> None:
        """Returns once the worker's transport takes writes again (or it closed)."""
        if not self.write_paused or self.closed:
            return
        waiter: asyncio.Future[None] = self._loop.create_future()
        self._drain_waiter = waiter
        try:
            await waiter
        finally:
            self._drain_waiter = None

    def expect_reply(self, *, head_request: bool) -> None:
        """Readies the reply for the request about to go (`head_request`: a HEAD). On a
        connection whose loss was already reported (the worker closed it while it was
        being handed over), the reply is broken at once, as `connection_lost` left it:
        the request is not written, and its wait for a reply ends now, not at the
        first-byte timeout."""
        self.reply.begin(head_request=head_request)
        if self.closed:
            self.reply.feed_eof()

    @property
    def closing(self) -> bool:
        """The transport is closing or gone (the worker may have closed it, with its
        `connection_lost` still to come)."""
        return self._transport_closing()

    def write(self, data: bytes) -> None:
        """Writes `data` unless the connection is closing (the reply then says why)."""
        write = self._transport_write
        if write is not None and not self._transport_closing():
            write(data)

    def close(self) -> None:
        """Closes after what was written is flushed; frees its place in the pool."""
        self._end(abort=False)

    def abort(self) -> None:
        """Drops the connection at once (an exchange abandoned mid-way)."""
        self._end(abort=True)

    def usable(self) -> bool:
        """True when open and in step (the worker sent nothing since its last reply):
        it may carry another exchange. How long it may idle is the pool's bound."""
        transport = self.transport
        return (
            not self.closed
            and self.reply.reusable
            and transport is not None
            and not self._transport_closing()
        )

    def _end(self, *, abort: bool) -> None:
        self.closed = True
        self._pool.lost(self)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if abort:
                transport.abort()
            else:
                transport.close()

    def _wake(self, outcome: int) -> None:
        waiter = self._waiter
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(outcome)
            return
        listener = self._listener
        if listener is not None:
            self._listener = None
            self._deadline = None
            listener.woke(outcome)
