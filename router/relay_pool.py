"""Keep-alive connections to one worker: the asyncio protocol and the bounded pool.

This module owns the sockets on the worker side: connecting (TCP or Unix), the idle
stack a connection returns to after a complete exchange, the bound on connections per
worker and the queue of requests waiting for one, the close of connections idle for
`KEEPALIVE_S`, and flow control in both directions (reading pauses while a reply's
unread body is large; writing waits while the worker's buffer is full). It never
decides whether a connection may be reused (the exchange does, from the parsed reply)
and never builds or reads HTTP itself: `ReplyParser` reads the bytes.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from collections.abc import Callable
from typing import Final, cast

from router.relay_parser import ReplyParser
from router.relay_wire import WorkerAddress

__all__ = ["INTERRUPTED", "KEEPALIVE_S", "TIMED_OUT", "WOKE", "PoolClosed", "WorkerConnection"]
__all__ += ["ReplyWatcher", "WorkerPool"]

# Idle keep-alive connections are closed by the router after 4 s: below the 5 s default of
# uvicorn and hypercorn, so it is the router, not the worker, that closes an idle
# connection, and a request is not sent into a connection the worker is closing.
KEEPALIVE_S = 4.0
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


class PoolClosed(Exception):
    """The pool closed (the worker was forgotten, or the router is stopping)."""


class ReplyWatcher:
    """What `WorkerConnection.listen` wakes when the reply moves: an object whose
    `woke(outcome)` is called, not a callable, so the compiled build calls it
    directly and no bound method is made per request (see `relay.LaneDone`)."""

    __slots__ = ()

    def woke(self, outcome: int) -> None:
        """The reply moved (WOKE), the deadline passed (TIMED_OUT) or `interrupt()` was
        called (INTERRUPTED)."""
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

    def __init__(self, pool: WorkerPool, loop: asyncio.AbstractEventLoop) -> None:
        self._pool = pool
        self._loop = loop
        self._waiter: asyncio.Future[int] | None = None
        self._listener: ReplyWatcher | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._read_paused = False
        # One timer per connection, moved lazily (see wait()).
        self._deadline: float | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0
        self.transport: asyncio.Transport | None = None
        # The transport's methods called per request, kept bound (see
        # router.edge.EdgeConnection: a call by name looks the method up each time).
        self._transport_write: Callable[[bytes], object] | None = None
        self._transport_closing: Callable[[], bool] = _not_open
        self.reply = ReplyParser()
        self.closed = False
        self.holds_place = False  # it counts against the pool's limit
        self.reused = False  # it carried an exchange before this one
        self.released_at = 0.0
        self.write_paused = False

    # --- protocol callbacks --------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self._transport_write = self.transport.write
        self._transport_closing = self.transport.is_closing

    def data_received(self, data: bytes) -> None:
        reply = self.reply
        reply.feed(data)
        if reply.buffered > _READ_HIGH_WATER and not self._read_paused and self.transport:
            self._read_paused = True
            self.transport.pause_reading()
        self._wake(WOKE)

    def eof_received(self) -> bool | None:
        self.reply.feed_eof()
        self._wake(WOKE)
        return None  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.reply.feed_eof()
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
        # 3.3 µs against 5.9 µs for a wait woken at once), and one per connection moved
        # lazily: a later deadline is only stored (the timer, firing early, re-arms), so
        # the waits of a kept-alive connection make no timer call at all. Instructions
        # per routed request (callgrind on bench.hotpath): 311,600 -> 303,900.
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

    def usable(self, now: float) -> bool:
        """True when idle, open, in step (the worker sent nothing since its last reply)
        and younger than the keep-alive bound."""
        transport = self.transport
        return (
            not self.closed
            and self.reply.reusable
            and transport is not None
            and not self._transport_closing()
            and now - self.released_at < KEEPALIVE_S
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


class WorkerPool:
    """The keep-alive connections to one worker, at most `limit` of them.

    `acquire()` hands out the most recently idle connection (the warmest), else opens
    one while under the limit, else waits in line. `release()` takes back a connection
    whose exchange ended cleanly. A connection that closes frees its place, which goes
    straight to the first request waiting in line, so the limit is never exceeded.
    """

    __slots__ = (
        "_connections",
        "_idle",
        "_loop",
        "_sweeper",
        "_taken",
        "_time",
        "_waiters",
        "address",
        "closed",
        "limit",
        "url",
    )

    def __init__(
        self, url: str, address: WorkerAddress, limit: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.url = url
        self.address = address
        self.limit = limit
        self.closed = False
        self._loop = loop
        self._taken = 0  # places held: open connections, connects under way, places handed on
        self._connections: set[WorkerConnection] = set()
        # Oldest first, warmest last. A list, not a deque: the compiled build appends to
        # and pops from a list directly, and calls a deque's methods by name (see
        # router.edge.EdgeConnection).
        self._idle: list[WorkerConnection] = []
        self._time = loop.time  # kept bound, as the connections' transport methods
        self._waiters: deque[asyncio.Future[WorkerConnection | None]] = deque()
        self._sweeper: asyncio.TimerHandle | None = None

    async def acquire(self, deadline: float) -> WorkerConnection:
        """A connection for one exchange, idle or new, by `deadline` (loop time).

        Raises TimeoutError (none in time), OSError (connect failed) or PoolClosed.
        """
        if self.closed:
            raise PoolClosed
        conn = self.take_idle()
        if conn is not None:
            return conn
        if self._taken < self.limit:
            self._taken += 1
            return await self._open(deadline)
        return await self._wait_turn(deadline)

    def take_idle(self) -> WorkerConnection | None:
        """The warmest usable idle connection, at once; None when there is none (the
        pool is closed, or every connection is busy)."""
        idle = self._idle
        if not idle or self.closed:
            return None
        now = self._time()
        while idle:
            conn = idle.pop()
            if conn.usable(now):
                conn.reused = True
                return conn
            conn.close()
        return None

    async def reopen(self, stale: WorkerConnection, deadline: float) -> WorkerConnection:
        """Drops `stale` (held by the caller) and opens a fresh connection in its place,
        never an idle one."""
        held = stale.holds_place
        stale.holds_place = False  # its place passes to the new connection
        stale.abort()
        if not held or self.closed:  # the pool closed under it
            if held:
                self._free_place()
            raise PoolClosed
        return await self._open(deadline)

    def release(self, conn: WorkerConnection) -> None:
        """Takes back `conn` after a complete exchange: to a waiting request, else idle.
        A connection that cannot carry another exchange is closed instead."""
        if self.closed or conn.closed or not conn.reply.reusable:
            conn.close()
            return
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                conn.reused = True
                waiter.set_result(conn)
                return
        conn.released_at = self._time()
        self._idle.append(conn)
        if self._sweeper is None:
            self._sweeper = self._loop.call_at(conn.released_at + KEEPALIVE_S, self._sweep)

    def lost(self, conn: WorkerConnection) -> None:
        """`conn` was closed by its holder: frees its place (for a waiting request)."""
        self._connections.discard(conn)
        if conn.holds_place:
            conn.holds_place = False
            self._free_place()
        if self._idle and conn in self._idle:
            self._idle.remove(conn)

    def dropped(self, conn: WorkerConnection) -> None:
        """The worker closed `conn`: an idle connection leaves the pool now; a busy one
        stays its exchange's until that exchange closes it."""
        if self._idle and conn in self._idle:
            self.lost(conn)

    def close(self) -> None:
        """Closes every connection, idle or busy, and fails every waiting request."""
        self.closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_exception(PoolClosed())
        for conn in list(self._connections):
            conn.close()
        self._idle.clear()

    # --- internals ----------------------------------------------------------------------

    async def _open(self, deadline: float) -> WorkerConnection:
        """Connects a new connection in a place already taken for it; gives the place
        back if the connect fails."""
        conn = WorkerConnection(self, self._loop)
        conn.holds_place = True
        try:
            async with asyncio.timeout_at(deadline):
                await self._connect(conn)
        except BaseException:
            conn.closed = True
            if conn.transport is not None:
                conn.transport.abort()  # connected just as the deadline or a cancel hit
            conn.holds_place = False
            self._free_place()
            raise
        if self.closed:
            conn.close()
            raise PoolClosed
        self._connections.add(conn)
        return conn

    async def _connect(self, conn: WorkerConnection) -> None:
        address, loop = self.address, self._loop
        if address.unix_path is not None:
            await loop.create_unix_connection(lambda: conn, address.unix_path)
            return
        host = address.tcp_host
        assert host is not None
        if address.tcp_literal:
            await loop.create_connection(lambda: conn, host, address.tcp_port)
            return
        # A name: each address in turn, so the error kept is a real connect error with its
        # errno (asyncio folds several failures into one errno-less OSError).
        infos = await loop.getaddrinfo(host, address.tcp_port, type=socket.SOCK_STREAM)
        error: OSError = OSError(f"no address for {host}")
        for family, _, _, _, sockaddr in infos:
            try:
                await loop.create_connection(
                    lambda: conn, str(sockaddr[0]), int(sockaddr[1]), family=family
                )
                return
            except OSError as exc:
                error = exc
        raise error

    async def _wait_turn(self, deadline: float) -> WorkerConnection:
        """Waits in line for a released connection or a freed place."""
        loop = self._loop
        waiter: asyncio.Future[WorkerConnection | None] = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_at(deadline, _expire, waiter)
        try:
            conn = await waiter
        except BaseException:
            self._give_back(waiter)
            raise
        finally:
            timer.cancel()
        if conn is None:  # a place freed up and is ours: connect in it
            return await self._open(deadline)
        if conn.closed or conn.closing:
            # The worker closed it after it was handed over, before this turn came:
            # nothing was written on it, so any request may go on a fresh one.
            return await self.reopen(conn, deadline)
        return conn

    def _give_back(self, waiter: asyncio.Future[WorkerConnection | None]) -> None:
        """A waiter gave up (timeout, cancel): what it was handed goes to the next one."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        if not waiter.done() or waiter.cancelled() or waiter.exception() is not None:
            return
        conn = waiter.result()
        if conn is None:
            self._free_place()
        else:
            self.release(conn)

    def _free_place(self) -> None:
        """A place in the pool is free: the first live waiter gets it, to connect in."""
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._taken -= 1

    def _sweep(self) -> None:
        """Closes the connections idle for KEEPALIVE_S (the oldest are on the left)."""
        self._sweeper = None
        idle = self._idle
        now = self._time()
        stale = 0
        while stale < len(idle) and now - idle[stale].released_at >= KEEPALIVE_S:
            stale += 1
        expired = idle[:stale]
        del idle[:stale]
        for conn in expired:
            conn.close()
        if idle:
            self._sweeper = self._loop.call_at(idle[0].released_at + KEEPALIVE_S, self._sweep)


def _expire(waiter: asyncio.Future[WorkerConnection | None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
