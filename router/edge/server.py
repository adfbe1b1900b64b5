"""The public listener's HTTP/1.1 server: one asyncio protocol per client connection.

This module owns a client connection from accept to close: `EdgeServer` makes one
`EdgeConnection` per accepted client (up to `max_connections`: at the limit the
longest-idle keep-alive one is closed to make room, else the new one is closed at once),
tracks them for shutdown and counts the bytes their unfinished heads hold (over
`max_held_head_bytes`, the largest head is refused); the connection
answers the transport's events (made, data, EOF, lost), feeding its reads to the parser
and handing the parsed requests on. What it does with them is in its layers, each the
base class of the one after it here, bottom first (native single inheritance: the
compiled build reads their attributes and calls their methods directly, as in one class,
and the layers cost no more than one class did; measured: docs/performance.md):
- `router.edge.clock.ClockedConnection`: the bounds, the clocks (a head must arrive
  complete within `header_timeout_s` of its first byte, of the connection's start for
  the first request; an idle keep-alive connection closes after `idle_timeout_s`; a
  body silent for `body_timeout_s` gets 408), reading stopped while more than
  `MAX_PIPELINED` requests wait or a body holds more than its high-water mark, and the
  end, lingering after an answer to a body still arriving;
- `router.edge.serving.ServingConnection`: pipelined requests handed to the handler one
  at a time, answered in order, and the replies written for them: what a handler sees
  as `PublicRequest.client`, so it sits below the parser that makes the requests;
- `router.edge.parsing.ParsingConnection`: llhttp's callbacks under the router's limits.

A closed connection lets go of everything that points back at it (`_let_go`), so it is
freed by reference counting, not when the collector runs. It replaces aiohttp's server
on the public port: the same rules at about a third of
the CPU (docs/performance.md). It never decides where a request goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Final, cast

from httptools import HttpRequestParser

from router.core import Answer
from router.edge.clock import HEAD_DEADLINE, IDLE_DEADLINE, EdgeLimits
from router.edge.parsing import ParsingConnection
from router.edge.serving import Handler, detach
from router.edge.wire import HeadRefusal

__all__ = ["PARSE_SLICE_BYTES", "EdgeConnection", "EdgeLimits", "EdgeServer", "Handler"]

log = logging.getLogger("episode_router.edge")

# The most bytes of one read parsed before the queue of pipelined requests is looked at
# again: at most ~580 of the tiniest requests fit in one slice.
PARSE_SLICE_BYTES: Final = 16384
# A warning that connections or heads are being refused, at most this often (each one is
# counted in the metrics): an attack is said in the log, never flooded into it.
WARN_EVERY_S: Final = 60.0


class EdgeServer:
    """Makes an `EdgeConnection` per accepted client and tracks them for shutdown."""

    def __init__(
        self, handler: Handler, limits: EdgeLimits, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.loop = loop
        self.time = loop.time  # kept bound for the connections (see router.edge.parsing)
        self.connections: set[EdgeConnection] = set()
        self.closing = False
        # The bytes the heads of all connections hold, counted per read, bounded by
        # limits.max_held_head_bytes: unfinished heads (EdgeConnection._hold_head), and
        # what was read while requests queued behind a slow one or kept unparsed
        # (_held_changed).
        self.head_bytes_held = 0
        # The connections holding an unfinished head that spanned reads: the largest
        # is found among these, not among all connections.
        self.holding_heads: set[EdgeConnection] = set()
        # The idle keep-alive connections, the longest idle first (moved to the end as
        # one goes idle; one that stopped being idle is dropped as it is met):
        # an OrderedDict, whose first entry is found in O(1) however many were popped.
        self.idle: OrderedDict[EdgeConnection, None] = OrderedDict()
        # Counted for the metrics (read at scrape time): connections accepted and closed
        # at once at the connection limit, idle keep-alive connections closed to make
        # room for a new one, and heads refused because all of them together held too
        # much (the largest one is refused).
        self.refused_at_limit = 0
        self.idle_closed_for_room = 0
        self.heads_over_budget = 0
        self._warned_at = -WARN_EVERY_S  # the loop's time of the last warning of either
        # Told of each request head the edge refuses itself (400, 414, 431), which no
        # handler sees: the metrics count them with the handler's.
        self.on_refused: Callable[[Answer], None] | None = None
        self._all_closed = asyncio.Event()  # set once closing and no connection is left

    def __call__(self) -> asyncio.Protocol:
        limit = self.limits.max_connections
        if limit and len(self.connections) >= limit and not self._close_longest_idle():
            self.refused_at_limit += 1
            self._warn("public connections refused at limits.max_connections", limit)
            return _RefusedConnection()
        return EdgeConnection(self)

    def _warn(self, message: str, limit: int) -> None:
        """A warning that a limit turned clients away, at most once per WARN_EVERY_S:
        the metrics count each one, the log says it is happening."""
        now = self.time()
        if now - self._warned_at >= WARN_EVERY_S:
            self._warned_at = now
            log.warning(
                message,
                extra={
                    "limit": limit,
                    "refused_connections": self.refused_at_limit,
                    "heads_over_budget": self.heads_over_budget,
                },
            )

    def _close_longest_idle(self) -> bool:
        """At the connection limit: closes the keep-alive connection idle the longest
        (its client loses nothing: it connects again), if there is one. O(1) amortized:
        each entry met that is no longer idle was put there by one idle transition."""
        idle = self.idle
        while idle:
            conn, _ = idle.popitem(last=False)
            if conn.idle_until is not None:
                self.idle_closed_for_room += 1
                conn.close_idle()
                return True
        return False

    def refuse_largest_head(self) -> None:
        """The unfinished heads together hold more than limits.max_held_head_bytes: the
        connection holding the largest is refused (431 and closed), the likeliest to be
        hostile, rather than the one whose read came last. A scan of the connections
        holding such a head only, over the budget only; one stopped reading holds none
        (its bytes were let go as it stopped), and only a refusal made is counted."""
        largest: EdgeConnection | None = None
        for conn in self.holding_heads:
            if conn.head_bytes and (largest is None or conn.head_bytes > largest.head_bytes):
                largest = conn
        if largest is not None and largest.refuse_head(HeadRefusal.HEADS_OVER_BUDGET):
            self.heads_over_budget += 1
            self._warn(
                "request heads refused at limits.max_held_head_bytes",
                self.limits.max_held_head_bytes,
            )

    def set_limits(self, limits: EdgeLimits) -> None:
        """Limits for the connections accepted from now on (a config reload)."""
        self.limits = limits

    async def shutdown(self, grace_s: float) -> None:
        """Closes idle connections now, lets busy ones finish their requests (answered with
        `Connection: close`) for up to `grace_s`, then aborts what is left."""
        self.closing = True
        for conn in list(self.connections):
            conn.close_when_idle()
        if self.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_closed.wait(), grace_s)
        for conn in list(self.connections):
            conn.abort()

    def forget(self, conn: EdgeConnection) -> None:
        """A connection closed."""
        self.connections.discard(conn)
        self.idle.pop(conn, None)
        if self.closing and not self.connections:
            self._all_closed.set()


class EdgeConnection(ParsingConnection):
    """One client connection: its parser, its queue of requests, its reply state."""

    # One per client connection, idle ones included: without a __dict__ each takes
    # less memory (docs/performance.md). Each layer lists its own attributes, so the
    # whole has no __dict__ either.
    __slots__ = ("_server",)

    def __init__(self, server: EdgeServer) -> None:
        super().__init__(server.handler, server.loop, server.time, server.limits)
        self._server = server

    def _refused(self, answer: Answer) -> None:
        on_refused = self._server.on_refused
        if on_refused is not None:
            on_refused(answer)

    # --- the transport's events -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not registered as an asyncio.Transport).
        self.transport = cast(asyncio.Transport, transport)
        # Kept bound, as the parser's methods are (see router.edge.parsing).
        self._transport_write = self.transport.write
        self._server.connections.add(self)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self._remote = str(peer[0])
        local = transport.get_extra_info("sockname")
        if isinstance(local, tuple) and len(local) >= 2:
            host = str(local[0])
            self._local_host = f"[{host}]:{local[1]}" if ":" in host else f"{host}:{local[1]}"
        self._set_deadline(self._time() + self._head_timeout_s(), HEAD_DEADLINE)

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            self._discard(len(data))
            return
        if self._unparsed is not None:
            self._unparsed += data  # came with the pause; parsed after what was kept
            self._held_changed(len(data))
            return
        if len(data) > PARSE_SLICE_BYTES:
            self._receive_in_slices(data)
            return
        self._receive(data)

    def _receive_in_slices(self, data: bytes) -> None:
        """A large read, parsed a slice at a time, stopping once MAX_PIPELINED requests
        wait: llhttp parses all it is given, so a 256 KiB read of tiny pipelined
        requests queued about 9,000 of them (some 18 bytes of memory per byte read).
        The rest is kept, reading paused, until the queue drains (finished). A large
        read is most often a body's, which this cuts in more parser calls: a large upload
        goes a little slower (docs/performance.md)."""
        view = memoryview(data)
        size = len(data)
        for start in range(0, size, PARSE_SLICE_BYTES):
            if self._stopped:
                self._discard(size - start)
                return
            if self._pipeline_full:
                self._unparsed = data[start:]
                self._held_changed(size - start)
                self._update_reading()
                return
            self._receive(bytes(view[start : start + PARSE_SLICE_BYTES]))

    def _receive(self, data: bytes) -> None:
        events = self._parse_events
        self._feed(data)
        if events != self._parse_events or self._stopped:
            self._stalled_bytes = 0
        elif self._in_head or self._receiving is not None:
            self._note_stalled(len(data))
        if self._in_head and not self._stopped:
            # A head that did not end in this read: its bytes are held (per read, not
            # per field: a head that comes whole in one read costs this test only).
            self._hold_head(len(data))
        if len(self._queue) > 1:
            self._hold_pipelined(len(data))
        if self._queue and not self._busy:
            self._dispatch()
        if self._stopped or self._deadline_kind == HEAD_DEADLINE:
            return
        if self._in_head or (
            events == self._parse_events
            and self._receiving is None
            and data.strip(b"\r\n")  # llhttp skips line breaks between requests
        ):
            # A head began and did not end in this read, or the read began no head,
            # ended no message, was no body and not only line breaks: the start of a
            # request line (llhttp calls back from its target on). The head's clock
            # starts now, and runs on past the request being handled (_dispatch);
            # unless reading is paused (a kept rest parsed meanwhile): it starts when
            # reading does again (_update_reading).
            if not self._reading_paused:
                self._set_deadline(self._time() + self._head_timeout_s(), HEAD_DEADLINE)
        else:
            # A body that spans reads: each read moves its clock (a later deadline is
            # only stored), and a client silent for longer gets 408. A body that came
            # whole with its head never gets here.
            self._restart_body_clock()

    def _hold_head(self, size: int) -> None:
        """`size` more bytes of an unfinished head, counted for it and for all heads: a
        head over max_head_bytes is refused; all of them over max_held_head_bytes, the
        largest one is (a read that is also pipelined counts in both, as it is held for
        both reasons). A read that also ended earlier requests counts whole, so a head
        is refused within one read (PARSE_SLICE_BYTES) of the bound."""
        self._head_bytes += size
        server = self._server
        server.head_bytes_held += size
        server.holding_heads.add(self)
        if self._head_bytes > self._limits.max_head_bytes:
            self._parse_failed(HeadRefusal.HEAD_TOO_LARGE, "")
        elif server.head_bytes_held > server.limits.max_held_head_bytes and len(self._queue) <= 1:
            # (With requests queued before it, this read is pipelined too: past the
            # budget, _hold_pipelined stops reading this connection, not refuses a head.)
            server.refuse_largest_head()

    def _release_head(self) -> None:
        if self._head_bytes:
            server = self._server
            server.head_bytes_held -= self._head_bytes
            server.holding_heads.discard(self)
            self._head_bytes = 0

    def _held_changed(self, size: int) -> None:
        self._server.head_bytes_held += size

    def _over_budget(self) -> bool:
        server = self._server
        return server.head_bytes_held > server.limits.max_held_head_bytes

    def _went_idle(self) -> None:
        # Two dict operations per idle transition: the longest idle is then found in
        # O(1) at the connection limit (_close_longest_idle).
        idle = self._server.idle
        idle[self] = None
        idle.move_to_end(self)

    @property
    def head_bytes(self) -> int:
        """The bytes of the reads that carried this connection's unfinished head."""
        return self._head_bytes

    def refuse_head(self, kind: HeadRefusal) -> bool:
        """Refuses the unfinished head (431 and closed: EdgeServer.refuse_largest_head);
        False if the connection had stopped reading already (nothing refused)."""
        if self._stopped:
            return False
        self._parse_failed(kind, "")
        return True

    @property
    def idle_until(self) -> float | None:
        """When an idle keep-alive connection times out (None: it is not idle)."""
        if self._deadline_kind != IDLE_DEADLINE or self._stopped or self._queue:
            return None
        return self._deadline

    def close_idle(self) -> None:
        """Closes an idle keep-alive connection (to make room for a new one)."""
        log.debug("closed an idle connection to make room at the connection limit")
        self._close()

    def eof_received(self) -> bool:
        # A client's FIN is taken as its leaving, as aiohttp and nginx (without
        # proxy_ignore_client_abort) take it: half-closed HTTP clients are rare, and a
        # departed one must free its worker connection. The transport closes now;
        # connection_lost does the rest.
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self._stopped = True
        self._release_head()
        self._server.forget(self)
        self._set_deadline(None, 0)
        timer = self._timer
        if timer is not None:
            # Cancelled, it lets go of this connection now, not when it was due.
            self._timer = None
            timer.cancel()
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        receiving = self._receiving
        if receiving is not None and receiving.body is not None:
            receiving.body.fail("the client went away mid-body", malformed=False)
        self._receiving = None
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client went away"))
        if self._queue:
            watcher = self._queue[0].on_client_lost
            if watcher is not None:
                watcher.client_lost()
        self._let_go()

    def _let_go(self) -> None:
        """Breaks the reference cycles a connection is in (its parser and the requests
        it queued point back at it, and it at them), so a closed connection is freed
        at once, with the bytes its heads held, not when the collector next runs (at
        router.service.process's threshold it ran too seldom: docs/performance.md). A
        request with its handler stays queued: finished() pops it."""
        queue = self._queue
        for request in queue[1 if self._busy else 0 :]:
            detach(request)  # parsed, never handed on: nothing else names them
        del queue[1 if self._busy else 0 :]
        self._drop_unparsed()
        if self._pipelined_bytes:
            self._release_pipelined()
        self._parser = _SPENT_PARSER
        self._feed_data = _SPENT_PARSER.feed_data
        self._keeps_alive = _SPENT_PARSER.should_keep_alive
        self._method_of = _SPENT_PARSER.get_method
        self._headers = []
        self._url = b""
        self.transport = None
        self._transport_write = None


class _RefusedConnection(asyncio.Protocol):
    """A connection accepted over the connection limit: closed at once, before anything
    is read (the client sees its connection end, and may try again)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _NoCallbacks:
    """A parser's protocol that takes no callbacks (httptools calls only what exists)."""


# The parser a closed connection points at instead of its own, which pointed back at it:
# never fed.
_SPENT_PARSER: Final = HttpRequestParser(_NoCallbacks())
