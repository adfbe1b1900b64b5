"""Keep-alive connections to one worker, pooled: at most so many, reused warmest first.

This module owns the pool on the worker side: connecting (TCP or Unix), the idle
stack a connection returns to after a complete exchange, the bound on connections per
worker and the queue of requests waiting for one, and the close of connections idle for
`KEEPALIVE_S`. It never reads or writes a connection's bytes (`router.relay.connection`
does), never decides whether a connection may be reused (the exchange does, from the
parsed reply) and never builds or reads HTTP itself. It also keeps the count of places
held at a client's pace (a streamed upload, a reply streamed to a slow reader), bounded
to a share of the pool so that one client's slowness cannot hold every connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import deque

from router.relay.connection import ConnectionOwner, WorkerConnection
from router.relay.wire import WorkerAddress

__all__ = ["KEEPALIVE_S", "PoolBusy", "PoolClosed", "WorkerPool", "paced_limit"]

log = logging.getLogger("episode_router.forward")

# Idle keep-alive connections are closed by the router after 4 s: below the 5 s default of
# uvicorn and hypercorn, so it is the router, not the worker, that closes an idle
# connection, and a request is not sent into a connection the worker is closing.
KEEPALIVE_S = 4.0


class PoolClosed(Exception):
    """The pool closed (the worker was forgotten, or the router is stopping)."""


class PoolBusy(Exception):
    """Every connection of the pool stayed busy until the deadline: the router's own
    crowding, not a failure of the worker (which was never asked)."""


def paced_limit(limit: int, share: float) -> int:
    """How many of a pool's `limit` places may be held at a client's pace: `share` of
    them (0 < share <= 1), rounded down, at least one (a pool of one may still stream)."""
    return max(1, int(limit * share))


class WorkerPool(ConnectionOwner):
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
        "_paced_waiters",
        "_sweeper",
        "_taken",
        "_time",
        "_waiters",
        "address",
        "closed",
        "keep_alive",
        "limit",
        "paced",
        "paced_limit",
        "url",
    )

    def __init__(
        self,
        url: str,
        address: WorkerAddress,
        limit: int,
        loop: asyncio.AbstractEventLoop,
        paced_share: float = 1.0,
    ) -> None:
        self.url = url
        self.address = address
        self.limit = limit
        # Places held at a client's pace, and how many may be (`take_paced`).
        self.paced = 0
        self.paced_limit = paced_limit(limit, paced_share)
        self.closed = False
        # False once the worker sent bytes nobody asked for (`stray`): from then on each
        # of its connections carries one exchange and closes.
        self.keep_alive = True
        self._loop = loop
        self._taken = 0  # places held: open connections, connects under way, places handed on
        self._connections: set[WorkerConnection] = set()
        # Oldest first, warmest last. A list, not a deque: the compiled build appends to
        # and pops from a list directly, and calls a deque's methods by name (see
        # router.edge.serving.ServingConnection).
        self._idle: list[WorkerConnection] = []
        self._time = loop.time  # kept bound, as the connections' transport methods
        self._waiters: deque[asyncio.Future[WorkerConnection | None]] = deque()
        # Exchanges waiting for a paced place (`wait_paced`): True, handed one; False, not.
        self._paced_waiters: deque[asyncio.Future[bool]] = deque()
        self._sweeper: asyncio.TimerHandle | None = None

    async def acquire(self, deadline: float) -> WorkerConnection:
        """A connection for one exchange, idle or new, by `deadline` (loop time).

        Raises PoolBusy (every place stayed taken until the deadline), TimeoutError (the
        connect did not finish in time), OSError (connect failed) or PoolClosed.
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

    def take_paced(self) -> bool:
        """Counts one more exchange held at a client's pace; False (nothing counted) when
        the pool's share for them is full. `give_paced` gives it back."""
        if self.paced >= self.paced_limit:
            return False
        self.paced += 1
        return True

    def give_paced(self) -> None:
        """An exchange counted by `take_paced` let go of its connection: its place goes
        straight to the first exchange waiting for one (`wait_paced`), if any."""
        waiters = self._paced_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(True)  # the place is handed on: still counted
                return
        self.paced -= 1

    async def wait_paced(self, deadline: float) -> bool:
        """`take_paced`, waiting until `deadline` (loop time) for a place to free; False
        (nothing counted) when none did. A place freed goes to the first in line."""
        if self.take_paced():
            return True
        loop = self._loop
        waiter: asyncio.Future[bool] = loop.create_future()
        self._paced_waiters.append(waiter)
        timer = loop.call_at(deadline, _no_paced_place, waiter)
        try:
            return await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.result():
                self.give_paced()  # handed a place as it gave up: the next one's
            raise
        finally:
            timer.cancel()
            if waiter in self._paced_waiters:  # timed out, or given up: out of the line
                self._paced_waiters.remove(waiter)

    def take_idle(self) -> WorkerConnection | None:
        """The warmest usable idle connection, at once; None when there is none (the
        pool is closed, or every connection is busy)."""
        idle = self._idle
        if not idle or self.closed:
            return None
        now = self._time()
        while idle:
            conn = idle.pop()
            if conn.usable() and now - conn.released_at < KEEPALIVE_S:
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

    async def connects(self, deadline: float) -> bool:
        """Whether the worker takes a new connection by `deadline` (loop time): a probe
        outside the pool's places, closed at once with nothing written on it."""
        probe = asyncio.Protocol()
        try:
            async with asyncio.timeout_at(deadline):
                transport = await self._connect(probe)
        except (OSError, TimeoutError):
            return False
        transport.close()
        return True

    def release(self, conn: WorkerConnection) -> None:
        """Takes back `conn` after a complete exchange: to a waiting request, else idle.
        A connection that cannot carry another exchange is closed instead."""
        if self.closed or conn.closed or not conn.reply.reusable or not self.keep_alive:
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

    def stray(self, conn: WorkerConnection) -> None:
        """The worker sent bytes after a complete reply on `conn`: an idle `conn` closes
        now (as nginx closes a cached upstream connection that becomes readable), a busy
        one when its exchange lets it go (it is no longer reusable). HTTP/1.1 cannot tell
        such bytes from a reply once the next request was written, so the pool stops
        reusing this worker's connections for as long as it lives (the worker's life)."""
        if self.keep_alive:
            self.keep_alive = False
            log.warning(
                "a worker sent bytes after a complete reply: its connections are no longer reused",
                extra={"worker_url": self.url},
            )
        if conn in self._idle:
            conn.close()

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
        paced_waiters = self._paced_waiters
        while paced_waiters:
            paced_waiter = paced_waiters.popleft()
            if not paced_waiter.done():
                paced_waiter.set_result(False)
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

    async def _connect(self, conn: asyncio.Protocol) -> asyncio.BaseTransport:
        address, loop = self.address, self._loop
        if address.unix_path is not None:
            transport, _ = await loop.create_unix_connection(lambda: conn, address.unix_path)
            return transport
        host = address.tcp_host
        assert host is not None
        if address.tcp_literal:
            transport, _ = await loop.create_connection(lambda: conn, host, address.tcp_port)
            return transport
        # A name: each address in turn, so the error kept is a real connect error with its
        # errno (asyncio folds several failures into one errno-less OSError).
        infos = await loop.getaddrinfo(host, address.tcp_port, type=socket.SOCK_STREAM)
        error: OSError = OSError(f"no address for {host}")
        for family, _, _, _, sockaddr in infos:
            try:
                transport, _ = await loop.create_connection(
                    lambda: conn, str(sockaddr[0]), int(sockaddr[1]), family=family
                )
                return transport
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
        if not conn.usable():
            # The worker closed it, or sent bytes on it, after it was handed over, before
            # this turn came: nothing was written on it, so any request may go on a
            # fresh one.
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


def _no_paced_place(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


def _expire(waiter: asyncio.Future[WorkerConnection | None]) -> None:
    if not waiter.done():
        # Its turn never came: the pool was full, the worker was not asked anything.
        waiter.set_exception(PoolBusy())
