"""The public listener's HTTP/1.1 server: one asyncio protocol per client connection.

This module owns a client connection from accept to close:
- parsing request heads and bodies with llhttp (httptools, strict: no lenient flags),
  under the router's limits: a request line over `max_line_bytes` is 414, a header over
  `max_header_bytes` or more than `max_headers` of them is 431, any other malformed
  head is 400, each the router's JSON answer with the connection closed, logged at
  debug level so hostile traffic cannot flood the log;
- trailers of a chunked body are parsed and dropped: they never become headers;
- a malformed chunk after the head fails that request's body (its handler answers 400
  if nothing was sent yet), and the connection closes after it;
- pipelined requests are handled one at a time, answered in order; reading stops while
  more than `MAX_PIPELINED` wait or a body holds more than its high-water mark;
- a head must arrive complete within `header_timeout_s` of its first byte (of the
  connection's start, for the first request); an idle keep-alive connection closes
  after `idle_timeout_s`;
- the reply: relayed replies and the router's own answers are written through the
  connection (`reply_*`, `answer`), framed for the client's HTTP version, and the
  connection stays open only when both sides allow it and every body byte was read;
- a connection closed after an answer to a body still arriving lingers (reads and
  drops) for up to `LINGER_S`, so the client reads the answer instead of a reset.

It replaces aiohttp's server on the public port: the same rules at about a third of
the CPU (see README "Performance"). It never decides where a request goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final, cast

from httptools import (
    HttpParserCallbackError,
    HttpParserError,
    HttpParserUpgrade,
    HttpRequestParser,
)

from router.answers import Answer, render
from router.edge_request import PublicRequest, RequestBody
from router.edge_wire import (
    BodyFraming,
    HeadRefusal,
    answer_head,
    continue_line,
    head_additions,
    head_refusal_answer,
    reply_head,
    split_target,
)
from router.framing import content_length_number

__all__ = ["EdgeConnection", "EdgeLimits", "EdgeServer", "Handler"]

log = logging.getLogger("episode_router.edge")

# A handler either returns an awaitable, which the connection runs in a task (the
# request is finished when it returns), or returns None and calls `finished()` on the
# request's connection once it is done with it: at once, or later from a callback.
Handler = Callable[[PublicRequest], Awaitable[None] | None]

MAX_PIPELINED: Final = 16  # requests parsed ahead of the one being handled, before reading stops
LINGER_S: Final = 2.0  # how long a closing connection keeps reading (and dropping) a client's body
LINGER_MAX_BYTES: Final = 1 << 20  # ... and how much of it, before it closes at once

# Why the connection's deadline is set (what happens when it passes).
_HEAD: Final = 1  # a request head is arriving: close
_IDLE: Final = 2  # kept alive, nothing in flight: close
_LINGER: Final = 3  # closing, reading what the client still sends: close
_BODY: Final = 4  # a request body is arriving and went silent: 408


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """Per-connection bounds (`limits` in the config)."""

    header_timeout_s: float = 10.0
    idle_timeout_s: float = 75.0
    max_line_bytes: int = 8190
    max_header_bytes: int = 8190
    max_headers: int = 100
    body_timeout_s: float = 60.0


# The usual versions and methods, looked up instead of parsed and decoded per request
# (part of 270,700 -> 251,500 instructions per routed request, callgrind on
# bench.hotpath, with the other trims of that change).
_VERSIONS: Final = {"1.1": (1, 1), "1.0": (1, 0)}
_METHODS: Final = {
    m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH")
}


_HTTP_11: Final = (1, 1)


def _version(text: str) -> tuple[int, int]:
    major, _, minor = text.partition(".")
    return int(major), int(minor)


class _HeadLimit(Exception):
    """Raised from a parser callback to stop at a head over the limits."""


class _LastRead:
    """The last bytes of one kind read as text: the bytes, the text, and the authority
    of a request target (None for other kinds)."""

    def __init__(self, raw: bytes = b"", text: str = "") -> None:
        self.raw = raw
        self.text = text
        self.authority: str | None = None


# Clients send the same Host, and mostly the same method and target, request after
# request: the last one's text is reused when the bytes are the same, instead of
# decoding them (or looking the bytes up by hash). Instructions, callgrind on
# bench.hotpath, compiled: on_header 1,540 -> 1,150 (Host); on_headers_complete
# 2,820 -> 1,900 (method, target).
_LAST_HOST: Final = _LastRead()
_LAST_METHOD: Final = _LastRead(b"POST", "POST")
_LAST_TARGET: Final = _LastRead()


def _host_text(value: bytes) -> str:
    last = _LAST_HOST
    if value == last.raw:
        return last.text
    text = value.decode("utf-8", "surrogateescape")
    last.raw = value
    last.text = text
    return text


def _method_text(method: bytes) -> str:
    last = _LAST_METHOD
    if method == last.raw:
        return last.text
    text = _METHODS.get(method) or method.decode("ascii")
    last.raw = method
    last.text = text
    return text


def _target_of(url: bytes) -> tuple[str, str | None]:
    """The request target and authority (`split_target`) of `url` as llhttp gave it."""
    last = _LAST_TARGET
    if url == last.raw:
        return last.text, last.authority
    target, authority = split_target(url.decode("utf-8", "surrogateescape"))
    last.raw = url
    last.text = target
    last.authority = authority
    return target, authority


class EdgeServer:
    """Makes an `EdgeConnection` per accepted client and tracks them for shutdown."""

    def __init__(
        self, handler: Handler, limits: EdgeLimits, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.loop = loop
        self.time = loop.time  # kept bound for the connections (see EdgeConnection)
        self.connections: set[EdgeConnection] = set()
        self.closing = False
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


class EdgeConnection(asyncio.Protocol):
    """One client connection: its parser, its queue of requests, its reply state."""

    # One per client connection, idle ones included: without a __dict__, 10,000 idle
    # connections take 4.9 KiB each instead of 6.3 (bench.micro --only idle).
    __slots__ = (
        "_body_backlog",
        "_busy",
        "_closing",
        "_connection_seen",
        "_deadline",
        "_deadline_kind",
        "_discarded",
        "_dispatching",
        "_drain_waiter",
        "_expect",
        "_feed_data",
        "_framing",
        "_halted",
        "_handler",
        "_headers",
        "_host",
        "_host_repeated",
        "_in_head",
        "_keeps_alive",
        "_length_text",
        "_limits",
        "_local_host",
        "_loop",
        "_lost",
        "_method_of",
        "_parse_events",
        "_parser",
        "_pipeline_full",
        "_queue",
        "_reading_paused",
        "_receiving",
        "_refusal",
        "_refusal_kind",
        "_remote",
        "_replied",
        "_reply_keep_alive",
        "_server",
        "_stalled_bytes",
        "_stopped",
        "_task",
        "_te_seen",
        "_time",
        "_timer",
        "_timer_when",
        "_transport_write",
        "_upgrade_seen",
        "_url",
        "_write_paused",
        "transport",
    )

    def __init__(self, server: EdgeServer) -> None:
        self._server = server
        self._loop = server.loop
        self._time = server.time
        self._limits = server.limits
        self._handler = server.handler
        self._parser = HttpRequestParser(self)
        # The parser's and the transport's methods called per request, kept bound: the
        # compiled build calls a bound method directly, where a call by name looks the
        # method up each time. With the same in router.relay_pool and relay_wire, lists
        # for deques, the lane's objects (router.relay.LaneDone) and the usual header
        # spellings (on_header), instructions per routed request went 86,800 -> 81,100
        # (callgrind on bench.hotpath, compiled).
        self._feed_data = self._parser.feed_data
        self._keeps_alive = self._parser.should_keep_alive
        self._method_of = self._parser.get_method
        self._transport_write: Callable[[bytes], object] | None = None
        self.transport: asyncio.Transport | None = None
        self._remote: str | None = None
        self._local_host = ""
        # The head being parsed.
        self._in_head = False
        # Heads begun (on_url), fields and body bytes that came out, messages ended: a
        # read that moved none may be the start of a request line, or inside one field
        # (data_received).
        self._parse_events = 0
        self._stalled_bytes = 0  # read since anything last came out (_note_stalled)
        self._url = b""
        # The header pairs as llhttp gave them, bytes: decoded only when something asks
        # for text (see PublicRequest.header_list).
        self._headers: list[tuple[bytes, bytes]] = []
        self._note_head_start()
        self._refusal_kind = HeadRefusal.MALFORMED
        # Requests parsed and not yet answered, the one being handled first.
        # A list, not a deque: the compiled build appends to and pops from a list
        # directly, and calls a deque's methods by name; reading stops past
        # MAX_PIPELINED, so popping the first one moves a few pointers (see above).
        # An empty list is also ~570 bytes smaller than an empty deque, per connection.
        self._queue: list[PublicRequest] = []
        self._receiving: PublicRequest | None = None  # its body is still arriving
        self._busy = False  # the request at the head of the queue is with the handler
        self._dispatching = False  # _dispatch() is on the stack
        self._halted = False  # no more requests are handed to the handler
        self._task: asyncio.Task[None] | None = None  # a handler's awaitable, running
        self._refusal: Answer | None = None  # a bad head after the queued requests
        self._stopped = False  # no more requests are read on this connection
        self._lost = False
        self._closing = False  # answer what is queued with Connection: close, then close
        self._discarded = 0  # bytes dropped while lingering
        # Reading stops for either reason; it starts again when both are gone.
        self._pipeline_full = False
        self._body_backlog = False
        self._reading_paused = False
        # The reply being written.
        self._framing = BodyFraming.NONE
        self._reply_keep_alive = False
        self._replied = False  # a reply head went out for the current request
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        # One timer per connection, moved lazily: setting a later deadline only stores it
        # (the timer re-arms itself when it fires early), so a kept-alive connection
        # costs no timer call per request.
        self._deadline: float | None = None
        self._deadline_kind = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0

    # --- the transport's events -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not registered as an asyncio.Transport).
        self.transport = cast(asyncio.Transport, transport)
        self._transport_write = self.transport.write
        self._server.connections.add(self)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and peer:
            self._remote = str(peer[0])
        local = transport.get_extra_info("sockname")
        if isinstance(local, tuple) and len(local) >= 2:
            host = str(local[0])
            self._local_host = f"[{host}]:{local[1]}" if ":" in host else f"{host}:{local[1]}"
        self._set_deadline(self._time() + self._head_timeout_s(), _HEAD)

    def data_received(self, data: bytes) -> None:
        if self._stopped:
            if self._deadline_kind == _LINGER:
                self._discarded += len(data)
                if self._discarded > LINGER_MAX_BYTES:
                    self._close()
            return
        events = self._parse_events
        self._feed(data)
        if events != self._parse_events or self._stopped:
            self._stalled_bytes = 0
        elif self._in_head or self._receiving is not None:
            self._note_stalled(len(data))
        if self._queue and not self._busy:
            self._dispatch()
        if self._stopped or self._deadline_kind == _HEAD:
            return
        if self._in_head or (
            events == self._parse_events
            and self._receiving is None
            and data.strip(b"\r\n")  # llhttp skips line breaks between requests
        ):
            # A head began and did not end in this read, or the read began no head,
            # ended no message, was no body and not only line breaks: the start of a
            # request line (llhttp calls back from its target on). The head's clock
            # starts now, and runs on past the request being handled (_dispatch).
            self._set_deadline(self._time() + self._head_timeout_s(), _HEAD)
        else:
            # A body that spans reads: each read moves its clock (a later deadline is
            # only stored), and a client silent for longer gets 408. A body that came
            # whole with its head never gets here.
            self._restart_body_clock()

    def _note_stalled(self, size: int) -> None:
        """A read that delivered nothing (no head began, no field or body bytes came out,
        no message ended): llhttp is inside one header field, trailer or request line,
        whose bytes httptools gathers until the field ends. Past the bound a whole field
        may take, the request is refused, instead of held in memory until the head's
        clock runs out. A read in which something came out restarts the count, so the
        gathered bytes stay under the bound plus one read."""
        self._stalled_bytes += size
        limits = self._limits
        # The longest stretch with nothing out, within the limits: the rest of a target,
        # the version and its line break, a whole first field and its line break
        # (httptools hands a field over when the next one begins); 64 covers the breaks.
        if self._stalled_bytes > limits.max_line_bytes + limits.max_header_bytes + 64:
            self._parse_failed(HeadRefusal.FIELD_TOO_LONG, "a header field is over the limit")

    def _head_timeout_s(self) -> float:
        # The idle bound covers a connection on which no request is being handled, a
        # head still arriving included: the shorter of the two applies.
        limits = self._limits
        return min(limits.header_timeout_s, limits.idle_timeout_s)

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

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- parsing (llhttp's callbacks: nothing else calls the on_* methods) -------------

    def _feed(self, data: bytes) -> None:
        while True:
            try:
                self._feed_data(data)
            except HttpParserUpgrade as exc:
                # An Upgrade request is served as plain HTTP (never switched); llhttp
                # stops after it, so parsing goes on from where it stopped.
                rest = data[int(exc.args[0]) :]
                if rest and not self._stopped:
                    data = rest
                    continue
            except HttpParserCallbackError:
                self._parse_failed(self._refusal_kind, "")
            except HttpParserError as exc:
                self._parse_failed(HeadRefusal.MALFORMED, str(exc))
            return

    # No on_message_begin: a head begins with its target's first bytes (on_url), and
    # data_received starts the head's clock for the bytes before them. The callback
    # cost ~1,300 instructions a request; with its work moved into on_url, ~900 were
    # saved (callgrind on bench.hotpath, compiled: with content_length_number, 80,570
    # -> 78,064).

    def _note_head_start(self) -> None:
        # The headers the edge itself reads, noted as they arrive (the first of each; any
        # Transfer-Encoding at all) instead of looked up in the multidict afterwards.
        self._te_seen = False
        self._connection_seen = False
        self._length_text: bytes | None = None
        self._host: str | None = None
        self._expect: bytes | None = None
        self._upgrade_seen = False
        self._host_repeated = False

    def on_url(self, url: bytes) -> None:
        if not self._in_head:
            self._in_head = True
            self._parse_events += 1
            self._url = url
            self._headers = []
            self._note_head_start()
        else:
            self._url += url  # the target came in pieces
        if len(self._url) > self._limits.max_line_bytes:
            self._refusal_kind = HeadRefusal.LINE_TOO_LONG
            raise _HeadLimit

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._in_head:
            self._parse_events += 1  # a trailer field came out (the stall count)
            return  # a trailer of a chunked body: dropped, never a header
        limits = self._limits
        if len(name) + len(value) + 2 > limits.max_header_bytes:
            self._refusal_kind = HeadRefusal.FIELD_TOO_LONG
            raise _HeadLimit
        if len(self._headers) >= limits.max_headers:
            self._refusal_kind = HeadRefusal.TOO_MANY_HEADERS
            raise _HeadLimit
        self._parse_events += 1  # a field came out (data_received's stall count)
        # Kept as the bytes llhttp gave (only token characters in a name, no CR or LF in a
        # value): the worker's head is built from them, and text is decoded only for the
        # few headers the router reads.
        self._headers.append((name, value))
        # Their lengths rule most names out without a lower(), and the usual spellings
        # of Host and Content-Length are compared first: a lower() is a call by name and
        # a new object: on_header went 2,740 -> 1,890 instructions for bench.hotpath's
        # four headers (callgrind, compiled).
        size = len(name)
        if size == 4:
            if name == b"Host" or name == b"host" or name.lower() == b"host":
                if self._host is None:
                    self._host = _host_text(value)
                else:
                    self._host_repeated = True
        elif size == 14:
            if self._length_text is None and (
                name == b"Content-Length"
                or name == b"content-length"
                or name.lower() == b"content-length"
            ):
                self._length_text = value
        elif size == 17:
            if name.lower() == b"transfer-encoding":
                self._te_seen = True
        elif size == 10 or size == 16:
            lower = name.lower()
            if lower == b"connection" or lower == b"proxy-connection":
                self._connection_seen = True  # llhttp reads both
        elif size == 6 and self._expect is None and name.lower() == b"expect":
            self._expect = value
        elif size == 7 and name.lower() == b"upgrade":
            self._upgrade_seen = True

    def on_headers_complete(self) -> None:
        self._in_head = False
        kind = self._deadline_kind
        if kind in (_HEAD, _IDLE):
            # Either clock stops for a request being handled: the idle one may still
            # run from the last reply when this head came whole in one read.
            self._set_deadline(None, 0)
        parser = self._parser
        chunked = self._te_seen
        length_text = self._length_text
        # llhttp accepted only digits and refused a repeat or a length with chunked.
        content_length = (
            content_length_number(length_text) if length_text is not None and not chunked else None
        )
        body = RequestBody(self, self._loop) if chunked or (content_length or 0) > 0 else None
        method = _method_text(self._method_of())
        if (
            body is not None
            and (self._upgrade_seen or method == "CONNECT")
            and parser.should_upgrade()
        ):
            # llhttp hands what follows an upgrade's head (Connection: upgrade, or
            # CONNECT) over as the new protocol's bytes, never as this request's body:
            # the body would be parsed as the next request, one smuggled in the other.
            # The router tunnels no protocol, so such a request is refused.
            self._refusal_kind = HeadRefusal.UPGRADE_WITH_BODY
            raise _HeadLimit
        keep_alive = self._keeps_alive()
        if keep_alive and not self._connection_seen:
            # Only HTTP/1.1 is kept alive with no Connection header (llhttp takes 0.9,
            # 1.0, 1.1 and 2.0), so the version is known without asking llhttp for its
            # text. With router.app's clock read as time.perf_counter (not through the
            # time module), instructions per routed request (callgrind on
            # bench.hotpath, compiled): 95,000 -> 91,700.
            version = _HTTP_11
        else:
            version_text = parser.get_http_version()
            version = _VERSIONS.get(version_text) or _version(version_text)
        target, authority = _target_of(self._url)
        if self._host_repeated or (
            self._host is None and authority is None and version >= _HTTP_11
        ):
            # RFC 9112 §3.2: 400 for an HTTP/1.1 request with no Host (unless its target
            # names the authority) or with more than one, which two hops could each read
            # differently (nginx refuses both the same way).
            self._refusal_kind = HeadRefusal.BAD_HOST
            raise _HeadLimit
        request = PublicRequest(
            method,
            target,
            version,
            remote=self._remote,
            host=authority or self._host or self._local_host,
            authority=authority,
            keep_alive=keep_alive,
            content_length=content_length,
            chunked=chunked,
            body=body,
            client=self,
            raw_headers=self._headers,
        )
        if body is not None:
            self._receiving = request
            expect = self._expect
            request.expect_continue = (
                expect is not None and expect.lower() == b"100-continue" and version >= (1, 1)
            )
        # Handed to the handler once this read is parsed (data_received), so a body that
        # came with its head is complete by then.
        self._queue.append(request)
        if len(self._queue) > MAX_PIPELINED and not self._pipeline_full:
            self._pipeline_full = True
            self._update_reading()

    def on_body(self, body: bytes) -> None:
        self._parse_events += 1  # body bytes came out (the stall count)
        receiving = self._receiving
        if receiving is not None and receiving.body is not None:
            receiving.body.feed(body)

    def on_message_complete(self) -> None:
        self._parse_events += 1
        if self._deadline_kind == _BODY:
            self._set_deadline(None, 0)
        receiving = self._receiving
        if receiving is not None and receiving.body is not None:
            receiving.body.feed_eof()
        self._receiving = None

    def _parse_failed(self, kind: HeadRefusal, error: str) -> None:
        self._stopped = True
        self._set_deadline(None, 0)
        receiving = self._receiving
        if receiving is not None and receiving.body is not None and not self._in_head:
            # The head was fine and handed on; its body is not: that request fails.
            self._closing = True
            receiving.body.fail(f"the request body is malformed: {error}", malformed=True)
            self._receiving = None
            log.debug("refused a malformed request body", extra={"error": error[:120]})
            return
        answer = head_refusal_answer(kind, error)
        log.debug("refused a malformed request head", extra={"error": answer.code})
        if not self._busy and not self._queue:
            self._write_answer_and_close(answer)
        else:
            # Answered in order, after the requests before it, whose replies keep the
            # connection open for it (_dispatch writes it once the queue is empty).
            self._refusal = answer

    # --- flow control -----------------------------------------------------------------

    def body_backlogged(self) -> None:
        self._body_backlog = True
        self._update_reading()

    def body_drained(self) -> None:
        self._body_backlog = False
        self._update_reading()

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or self._lost:
            return
        pause = self._pipeline_full or self._body_backlog
        if pause and not self._reading_paused:
            self._reading_paused = True
            transport.pause_reading()
            if self._deadline_kind == _BODY:
                self._set_deadline(None, 0)  # not the client's silence while not read
        elif not pause and self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
            self._restart_body_clock()

    def _restart_body_clock(self) -> None:
        """Gives the body arriving body_timeout_s from now, when its clock runs: the
        router reads it, and its client was not asked to wait (one that sent `Expect:
        100-continue` rightly sends nothing until the 100 goes out: send_continue
        starts the clock then)."""
        receiving = self._receiving
        if (
            receiving is not None
            and not self._reading_paused
            and not self._stopped
            and not receiving.expect_continue
        ):
            self._set_deadline(self._time() + self._limits.body_timeout_s, _BODY)

    # --- serving ----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Hands the queued requests to the handler in order, as far as they go now.

        A request the handler finishes at once, or drives by callbacks, takes no task (the
        router's usual forward; with the relay's lane, instructions per routed request
        went 297,000 -> 270,700, callgrind on bench.hotpath); one whose handler returns an
        awaitable runs in a task, and the queue moves on when it ends. Once the queue is
        empty, a refusal waiting behind it is written, or the idle clock starts.
        """
        queue = self._queue
        self._dispatching = True
        try:
            while queue and not self._busy and not self._halted and not self._lost:
                request = queue[0]
                self._replied = False
                self._busy = True
                try:
                    pending = self._handler(request)
                except Exception:
                    self._handler_failed()
                    return
                if pending is not None:
                    self._task = self._loop.create_task(self._run_handler(request, pending))
                    return
        finally:
            self._dispatching = False
        if queue or self._busy or self._halted or self._lost:
            return
        # A head has begun when llhttp is in one, or when a read started one before its
        # target (data_received started its clock then).
        head_begun = self._in_head or self._deadline_kind == _HEAD
        if self._refusal is not None:
            self._write_answer_and_close(self._refusal)
        elif self._closing and not head_begun:
            self._close()
        elif not head_begun:
            self._set_deadline(self._time() + self._limits.idle_timeout_s, _IDLE)

    async def _run_handler(self, request: PublicRequest, pending: Awaitable[None]) -> None:
        try:
            await pending
        except Exception:
            self._handler_failed()
            return
        finally:
            self._task = None
        self.finished(request)

    def carry_on(self, request: PublicRequest, rest: Awaitable[None]) -> None:
        """The handler, having returned None for `request`, finishes it in a task after
        all: `rest` runs as a returned awaitable would (`finished()` when it ends)."""
        self._task = self._loop.create_task(self._run_handler(request, rest))

    def finished(self, request: PublicRequest) -> None:
        """The handler is done with `request`, the one at the head of the queue: its reply
        went out (or the client was dropped). The next request is handed on, or the
        connection closes after a reply that said so."""
        queue = self._queue
        if not queue or queue[0] is not request or not self._busy:
            raise RuntimeError("finished() for a request that is not being handled")
        self._busy = False
        queue.pop(0)
        if not self._replied:
            log.error("the request handler sent no reply; closing the connection")
            self._halted = True
            self.abort()
            return
        if self._pipeline_full and len(queue) <= MAX_PIPELINED:
            self._pipeline_full = False
            self._update_reading()
        if not self._reply_keep_alive:
            self._halted = True
            self._close_after(request)
            return
        if not self._dispatching:
            self._dispatch()

    def _handler_failed(self) -> None:
        log.exception("the request handler failed")
        self._halted = True
        self.abort()

    def close_when_idle(self) -> None:
        """Shutdown: an idle connection closes now; a busy one after its queue."""
        self._closing = True
        if not self._busy and not self._queue:
            self._close()

    def abort(self) -> None:
        transport = self.transport
        if transport is not None:
            transport.abort()

    def _close_after(self, request: PublicRequest) -> None:
        """Closes once a reply said `Connection: close`; lingers when the client may
        still be sending the body of the request it was an answer to."""
        self._stopped = True
        if request.body_complete:
            self._close()
        else:
            self._linger()

    def _linger(self) -> None:
        """Shuts the sending side after the answer written, and reads (and drops) what
        the client still sends for a while: closing with unread bytes would reset the
        connection, and the client could lose the answer."""
        self._stopped = True
        transport = self.transport
        if transport is None or self._lost:
            return
        if not transport.can_write_eof():
            self._close()
            return
        transport.write_eof()  # the answer is all the client gets; it may stop sending
        self._set_deadline(self._time() + LINGER_S, _LINGER)
        self._pipeline_full = self._body_backlog = False
        self._update_reading()

    def _close(self) -> None:
        self._stopped = True
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()

    # --- deadlines ----------------------------------------------------------------------

    def _set_deadline(self, when: float | None, kind: int) -> None:
        self._deadline = when
        self._deadline_kind = kind
        if when is None:
            return
        timer = self._timer
        if timer is not None:
            if self._timer_when <= when:
                return  # it fires early, sees the later deadline, and re-arms
            timer.cancel()
        self._timer = self._loop.call_at(when, self._deadline_passed)
        self._timer_when = when

    def _deadline_passed(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None or self._lost:
            return
        if self._time() < deadline:
            self._timer = self._loop.call_at(deadline, self._deadline_passed)
            self._timer_when = deadline
            return
        kind = self._deadline_kind
        self._deadline = None
        receiving = self._receiving
        if kind == _BODY and receiving is not None and receiving.body is not None:
            # The handler answers 408 when it reads the body, then the connection closes
            # (its rest is never parsed as a next request).
            self._receiving = None
            self._stopped = True
            reason = f"no bytes for {self._limits.body_timeout_s:g} s"
            receiving.body.fail(reason, malformed=False, timed_out=True)
            return
        if kind == _HEAD:
            log.debug("closed a connection whose request head did not arrive in time")
        self._close()

    # --- replies (called by the handler, for the request at the head of the queue) ----

    def send_continue(self) -> None:
        """`100 Continue`, for a client waiting for it before it sends the body (the one
        arriving), whose silence counts from now."""
        transport = self.transport
        if transport is not None and not self._lost:
            transport.write(continue_line())
        receiving = self._receiving
        if receiving is not None:
            receiving.expect_continue = False  # said: never again, and the clock runs
            self._restart_body_clock()

    def answer(self, request: PublicRequest, answer: Answer) -> None:
        """One of the router's own answers, whole. The connection closes after a
        400 (its framing cannot be trusted) and after any answer to a request whose body
        has not all arrived (its rest is never read as a next request)."""
        status, headers, body = render(answer)
        keep_alive = (
            request.keep_alive
            and not self._closing
            and answer.code != "bad_request"
            and request.body_complete
        )
        head = answer_head(
            status, headers, len(body), keep_alive=keep_alive, version_11=request.version_11
        )
        self._write(head + body if request.method != "HEAD" else head)
        self._replied = True
        self._reply_keep_alive = keep_alive

    def reply_whole(
        self,
        request: PublicRequest,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        """A relayed reply whose body is all here: head and body in one write."""
        head, framing = self._reply_head(request, status, reason, headers)
        if framing is BodyFraming.LENGTH or framing is BodyFraming.CLOSE:
            self._write(head + body)
        elif framing is BodyFraming.CHUNKED:
            self._write(
                head + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if body else head + b"0\r\n\r\n"
            )
        else:
            self._write(head)

    def reply_as_is(
        self,
        request: PublicRequest,
        status: int,
        whole: bytes,
        body_length: int | None,
        has_date: bool,
    ) -> bool:
        """Relays `whole`, a worker's whole HTTP/1.1 reply with `status` whose headers
        are all kept for the client, as its bytes (a Date line added if it has none)
        when that is what `reply_whole` would say (`head_additions`); else writes nothing
        and returns False. `body_length`: its Content-Length; `has_date`: a Date header
        is among its headers.

        No head rebuilt and no body copied: instructions per routed request (callgrind
        on bench.hotpath, compiled, medians of three interleaved runs): 91,700 -> 87,800."""
        additions = head_additions(
            status,
            body_length is not None,
            has_date,
            version_11=request.version_11,
            head_request=request.method == "HEAD",
            keep_alive=request.keep_alive and not self._closing and request.body_complete,
        )
        if additions is None:
            return False
        if additions:
            assert body_length is not None
            cut = len(whole) - body_length - 2  # the empty line that ends the head
            whole = b"".join((whole[:cut], additions, whole[cut:]))
        self._framing = BodyFraming.LENGTH
        self._reply_keep_alive = True
        self._replied = True
        self._write(whole)
        return True

    def reply_start(
        self,
        request: PublicRequest,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        first: bytes,
    ) -> None:
        """The head of a streamed reply, with the body bytes already here (b"": the head
        alone, so an event stream's client sees it before the first event)."""
        head, _ = self._reply_head(request, status, reason, headers)
        self._replied = False  # not finished until reply_end
        self._write(head + self._framed(first) if first else head)

    def reply_write(self, data: bytes) -> None:
        """More of a streamed reply's body, as it arrived."""
        if data:
            self._write(self._framed(data))

    def reply_end(self) -> None:
        """The end of a streamed reply (the chunked terminator, if chunked)."""
        if self._framing is BodyFraming.CHUNKED:
            self._write(b"0\r\n\r\n")
        elif self._framing is BodyFraming.CLOSE:
            self._reply_keep_alive = False
        self._replied = True

    def reply_abort(self, idle_s: float) -> None:
        """Ends the connection with no clean terminator after what was relayed, so the
        client sees the reply is incomplete. A client that does not read what is left
        gets the connection reset after `idle_s`."""
        self._replied = True
        self._reply_keep_alive = False
        self._stopped = True
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.close()
        if transport.get_write_buffer_size():
            self._loop.call_later(idle_s, transport.abort)

    def drop(self) -> None:
        """No reply for this request (its client left): the connection ends."""
        self._replied = True
        self._reply_keep_alive = False
        self.abort()

    @property
    def client_gone(self) -> bool:
        return self._lost

    async def drain(self) -> None:
        """Waits while the client is slower than the reply; raises ConnectionResetError
        once the client is gone."""
        if self._lost:
            raise ConnectionResetError("the client went away")
        if not self._write_paused:
            return
        self._drain_waiter = self._loop.create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None

    def _reply_head(
        self,
        request: PublicRequest,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> tuple[bytes, BodyFraming]:
        keep_alive = request.keep_alive and not self._closing and request.body_complete
        head, framing, keep_alive = reply_head(
            status,
            reason,
            headers,
            version_11=request.version_11,
            head_request=request.method == "HEAD",
            keep_alive=keep_alive,
        )
        self._framing = framing
        self._reply_keep_alive = keep_alive
        self._replied = True
        return head, framing

    def _framed(self, data: bytes) -> bytes:
        if self._framing is BodyFraming.CHUNKED:
            return b"%x\r\n%b\r\n" % (len(data), data)
        return data

    def _write(self, data: bytes) -> None:
        write = self._transport_write
        if write is not None and not self._lost:
            write(data)

    def _write_answer_and_close(self, answer: Answer) -> None:
        status, headers, body = render(answer)
        self._write(answer_head(status, headers, len(body), keep_alive=False) + body)
        self._refusal = None
        # The client may still be sending the rest of the refused head, or requests after
        # it: it reads the answer rather than a reset.
        self._linger()
