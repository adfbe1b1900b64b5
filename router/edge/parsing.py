"""A public client connection's parser: llhttp's callbacks, under the router's limits.

This module owns `ParsingConnection`, the layer of `router.edge.server.EdgeConnection` that
turns the bytes read into requests for the queue:
- request heads and bodies are parsed with llhttp (httptools, strict: no lenient flags),
  under the router's limits: a request line over `max_line_bytes` is 414, a header over
  `max_header_bytes` or more than `max_headers` of them is 431 (a whole head over
  `max_head_bytes` too, counted per read by router.edge.server), a Content-Length
  above `MAX_CONTENT_LENGTH` is 400, any other malformed
  head is 400, each the router's JSON answer with the connection closed, logged at
  debug level so hostile traffic cannot flood the log; a read that delivers nothing
  past what a whole field may take is a field over the limit too;
- trailers of a chunked body are parsed and dropped: they never become headers;
- a malformed chunk after the head fails that request's body (its handler answers 400
  if nothing was sent yet), and the connection closes after it;
- an Upgrade or CONNECT request with a body, and an HTTP/1.1 request without exactly
  one Host (unless its target names the authority), are refused.

It never reads the socket itself (the connection feeds it), never hands a request to
the handler and never writes a reply but the refusal of a head.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from httptools import (
    HttpParserCallbackError,
    HttpParserError,
    HttpParserUpgrade,
    HttpRequestParser,
)

from router.edge.clock import BODY_DEADLINE, HEAD_DEADLINE, IDLE_DEADLINE, EdgeLimits
from router.edge.framing import content_length_number
from router.edge.head_text import HTTP_11, host_text, method_text, target_of, version_of
from router.edge.request import PublicRequest, RequestBody
from router.edge.serving import MAX_PIPELINED, Handler, ServingConnection
from router.edge.wire import HeadRefusal, head_refusal_answer

__all__ = ["ParsingConnection"]

log = logging.getLogger("episode_router.edge")

# The largest Content-Length forwarded: a signed 64-bit size (nginx's off_t), past which
# no worker's length parses; llhttp itself takes up to 2^64 - 1.
MAX_CONTENT_LENGTH: Final = 2**63 - 1


class _HeadLimit(Exception):
    """Raised from a parser callback to stop at a head over the limits."""


class ParsingConnection(ServingConnection):
    """A client connection as llhttp calls it back (nothing else calls the on_* methods)."""

    __slots__ = (
        "_connection_seen",
        "_expect",
        "_feed_data",
        "_head_bytes",
        "_headers",
        "_host",
        "_host_refused",
        "_keeps_alive",
        "_length_text",
        "_local_host",
        "_method_of",
        "_parse_events",
        "_parser",
        "_refusal_kind",
        "_remote",
        "_stalled_bytes",
        "_te_seen",
        "_trailer_fields",
        "_upgrade_seen",
        "_url",
    )

    def __init__(
        self,
        handler: Handler,
        loop: asyncio.AbstractEventLoop,
        time: Callable[[], float],
        limits: EdgeLimits,
    ) -> None:
        super().__init__(handler, loop, time, limits)
        self._parser = HttpRequestParser(self)
        # The parser's methods called per request, kept bound (the transport's too, in
        # router.edge.server's connection_made): the compiled build calls a bound method
        # directly, where a call by name looks the method up each time. Measured together
        # with the same in router.relay.connection and router.relay.reply_parser, lists for deques
        # (router.edge.serving), the lane's objects (router.relay.lane.LaneDone) and the
        # usual header spellings (on_header): docs/performance.md.
        self._feed_data = self._parser.feed_data
        self._keeps_alive = self._parser.should_keep_alive
        self._method_of = self._parser.get_method
        # The client's address and the one it connected to (set as the connection is made).
        self._remote: str | None = None
        self._local_host = ""
        # Heads begun (on_url), fields and body bytes that came out, messages ended: a
        # read that moved none may be the start of a request line, or inside one field
        # (data_received).
        self._parse_events = 0
        self._stalled_bytes = 0  # read since anything last came out (_note_stalled)
        # The bytes of the reads that carried the unfinished head, counted per read by
        # router.edge.server (and held in its count of all heads) until the head ends.
        self._head_bytes = 0
        self._url = b""
        # The header pairs as llhttp gave them, bytes: decoded only when something asks
        # for text (see PublicRequest.header_list).
        self._headers: list[tuple[bytes, bytes]] = []
        self._trailer_fields = 0  # of the body being read, if chunked
        self._note_head_start()
        self._refusal_kind = HeadRefusal.MALFORMED

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

    # No on_message_begin: a head begins with its target's first bytes (on_url), and
    # data_received starts the head's clock for the bytes before them. A callback per
    # request cost more than its work does moved into on_url.

    def _note_head_start(self) -> None:
        # The headers the edge itself reads, noted as they arrive (the first of each; any
        # Transfer-Encoding at all) instead of looked up in the multidict afterwards.
        self._te_seen = False
        self._connection_seen = False
        self._length_text: bytes | None = None
        self._host: str | None = None
        self._expect: bytes | None = None
        self._upgrade_seen = False
        self._host_refused = False  # repeated, or a value that is no host

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
        limits = self._limits
        if not self._in_head:
            # A trailer field of a chunked body: dropped, never a header, but held to the
            # head's bounds, or a client could send them for as long as it likes (each
            # one moves the body clock on). Over them, the body is refused (400).
            self._parse_events += 1  # a field came out (the stall count)
            self._trailer_fields += 1
            if (
                self._trailer_fields > limits.max_headers
                or len(name) + len(value) + 2 > limits.max_header_bytes
            ):
                self._refusal_kind = HeadRefusal.TOO_MANY_HEADERS
                raise _HeadLimit
            return
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
        # a new object.
        size = len(name)
        if size == 4:
            if name == b"Host" or name == b"host" or name.lower() == b"host":
                host = host_text(value) if self._host is None else None
                if host is None:
                    self._host_refused = True
                else:
                    self._host = host
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

    def _release_head(self) -> None:
        """The unfinished head's bytes are held no more: it ended, was refused, or its
        connection closed (router.edge.server takes them out of its count too)."""
        self._head_bytes = 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._trailer_fields = 0
        if self._head_bytes:  # the head spanned reads
            self._release_head()
        kind = self._deadline_kind
        if kind in (HEAD_DEADLINE, IDLE_DEADLINE):
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
        if content_length is not None and content_length > MAX_CONTENT_LENGTH:
            self._refusal_kind = HeadRefusal.LENGTH_TOO_LARGE
            raise _HeadLimit
        body = RequestBody(self, self._loop) if chunked or (content_length or 0) > 0 else None
        method = method_text(self._method_of())
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
            # text (measured with router.app.handler's clock read as
            # time.perf_counter, not through the time module: docs/performance.md).
            version = HTTP_11
        else:
            version = version_of(parser.get_http_version())
        target, authority = target_of(self._url)
        if self._host_refused or (self._host is None and authority is None and version >= HTTP_11):
            # RFC 9112 §3.2: 400 for an HTTP/1.1 request with no Host (unless its target
            # names the authority), with more than one, which two hops could each read
            # differently, or with one that is no host (nginx refuses all three).
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
        if self._deadline_kind == BODY_DEADLINE:
            self._set_deadline(None, 0)
        receiving = self._receiving
        if receiving is not None and receiving.body is not None:
            receiving.body.feed_eof()
        self._receiving = None

    def _parse_failed(self, kind: HeadRefusal, error: str) -> None:
        self._stopped = True
        self._set_deadline(None, 0)
        if self._head_bytes:
            self._release_head()
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
