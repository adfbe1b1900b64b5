"""The public listener's HTTP/1.1 server: one asyncio protocol per client connection.

This module owns a client connection from accept to close: `EdgeServer` makes one
`EdgeConnection` per accepted client and tracks them for shutdown, and the connection
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

It replaces aiohttp's server on the public port: the same rules at about a third of
the CPU (docs/performance.md). It never decides where a request goes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Final, cast

from router.core import Answer
from router.edge.clock import HEAD_DEADLINE, EdgeLimits
from router.edge.parsing import ParsingConnection
from router.edge.serving import Handler

__all__ = ["PARSE_SLICE_BYTES", "EdgeConnection", "EdgeLimits", "EdgeServer", "Handler"]

# The most bytes of one read parsed before the queue of pipelined requests is looked at
# again: at most ~580 of the tiniest requests fit in one slice.
PARSE_SLICE_BYTES: Final = 16384


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
        # Told of each request head the edge refuses itself (400, 414, 431), which no
        # handler sees: the metrics count them with the handler's.
        self.on_refused: Callable[[Answer], None] | None = None
        self._all_closed = asyncio.Event()  # set once closing and no connection is left

    def __call__(self) -> EdgeConnection:
        return EdgeConnection(self)

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

    def eof_received(self) -> bool:
        # A client's FIN is taken as its leaving, as aiohttp and nginx (without
        # proxy_ignore_client_abort) take it: half-closed HTTP clients are rare, and a
        # departed one must free its worker connection. The transport closes now;
        # connection_lost does the rest.
        return False

    def connection_lost(self, exc: BaseException | None) -> None:
        self._lost = True
        self._stopped = True
        self._server.forget(self)
        self._set_deadline(None, 0)
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
