"""A worker's reply read from the bytes of its connection, with llhttp.

This module owns the reply side of the worker wire: a reply parsed by llhttp (httptools,
the parser uvicorn uses) into its status, reason, headers in order with repeats, body
chunks, the message end, whether the connection may carry another exchange, and whether
the reply came as one piece that may be relayed as it is. It is fed bytes and answers
with state: it never does I/O, never touches an event loop, never raises on a peer's
bytes (a malformed reply becomes a `broken` reason) and knows nothing of the request
that was sent (`router.relay.wire` builds that) or of aiohttp's server.
"""

from __future__ import annotations

from typing import Final

from httptools import HttpParserError, HttpParserUpgrade, HttpResponseParser

from router.edge import content_length_number

__all__ = [
    "CLOSED_BEFORE_REPLY",
    "CONNECTION_BROKE",
    "MAX_REPLY_FIELD",
    "MAX_REPLY_HEAD",
    "SWITCHED",
    "ReplyParser",
]

# A reply header line from a worker may be this long: workers are our own processes and a
# large Set-Cookie or MCP header must pass, but a runaway one still fails the reply.
# (Final, as the limits below: the compiled build reads a Final from a C variable, a
# plain module name from the module's dict, and ReplyParser.on_header reads
# MAX_REPLY_FIELD for every header.)
MAX_REPLY_FIELD: Final = 64 * 1024
# The whole reply head (every line, interim 1xx heads included) is bounded too, so a
# worker streaming headers forever cannot grow the router's memory.
MAX_REPLY_HEAD: Final = 256 * 1024
# A chunked body's trailer fields: at most this many, each a header line's length, and
# no run of bytes from which nothing comes out (httptools gathers a field's bytes until
# it ends) longer than a line: a worker sending one trailer for ever grew the router's
# memory without bound until the stream's idle timeout.
MAX_REPLY_TRAILERS: Final = 100
_HTTP_11_STATUS: Final = b"HTTP/1.1 "
_CR: Final = 13
_LF: Final = 10
CLOSED_BEFORE_REPLY = "it closed the connection before replying"
CONNECTION_BROKE = "its connection broke"  # a reset: the start of the reply's `broken`
SWITCHED = "it switched protocols, which is not forwarded"


def _until_close(content_length: int | None, transfer_encoding: str | None) -> bool:
    """RFC 9112 §6.3: a reply with neither a length nor chunked framing ends at close."""
    if transfer_encoding is not None:
        return transfer_encoding.rsplit(",", 1)[-1].strip().lower() != "chunked"
    return content_length is None


def _ends_at_its_body(data: bytes, content_length: int) -> bool:
    """True when `data`, one whole reply that llhttp read to its end and began no other
    message after, ends where its body (of `content_length` bytes) ends. llhttp skips
    a CR or LF after a message without a callback (any other byte begins a message), so
    a last byte that is neither is the body's. Else the head's end is searched for (it
    is the first empty line), which costs far more than a byte compare."""
    last = data[len(data) - 1]
    if content_length > 0 and last != _CR and last != _LF:
        return True
    return data.find(b"\r\n\r\n") + 4 + content_length == len(data)


class ReplyParser:
    """The replies on one worker connection, one exchange at a time.

    Call `begin()` before each request, then `feed()` the bytes as they arrive and
    `feed_eof()` when the worker closes. State, read after each call:
    - `head_done`: the final (non-1xx) reply head is in: `status`, `raw_reason`
      (`reason` decodes it), `raw_headers` (name, value pairs as bytes, in order,
      repeats kept; `headers` decodes them), `content_length`, `has_date` (a Date
      header is among them);
    - `chunks`/`buffered`: body bytes not yet taken (`take_body()`);
    - `complete`: the reply ended; `reusable`: the connection may carry another exchange;
    - `broken`: why the reply cannot be relayed (before the head) or finished (after it);
    - `whole`: the reply's exact bytes, when it came in one `feed()` with nothing before
      or after it (no interim head, not a CR or LF), is an HTTP/1.1 reply framed by its
      Content-Length and does not answer a HEAD; else None, and None once its body is
      taken. A reply that needs no change is relayed as these bytes.

    The `on_*` methods are llhttp's callbacks; nothing else should call them.
    """

    __slots__ = (
        "_feed_data",
        "_head_request",
        "_headers",
        "_interim",
        "_keeps_alive",
        "_messages",
        "_parser",
        "_parser_spent",
        "_quiet_bytes",
        "_status_code",
        "_trailers",
        "_transfer_encoding",
        "_yields",
        "broken",
        "buffered",
        "chunks",
        "complete",
        "content_length",
        "has_date",
        "head_bytes",
        "head_done",
        "raw_headers",
        "raw_reason",
        "received",
        "reusable",
        "status",
        "whole",
    )

    def __init__(self) -> None:
        self._new_parser()
        self.begin(head_request=False)

    def _new_parser(self) -> None:
        parser = self._parser = HttpResponseParser(self)
        self._parser_spent = False
        # Its methods called per reply, kept bound (see router.edge.parsing.ParsingConnection: a
        # call by name looks the method up each time).
        self._feed_data = parser.feed_data
        self._keeps_alive = parser.should_keep_alive
        self._status_code = parser.get_status_code

    def begin(self, *, head_request: bool) -> None:
        """Readies the parser for the reply to the next request (`head_request`: a HEAD,
        whose reply has no body whatever its headers say)."""
        if self._parser_spent:
            # llhttp cannot be told a reply answers HEAD: after one, it may be waiting
            # for body bytes that never come, so the next reply gets a fresh parser.
            self._new_parser()
        self._head_request = head_request
        self._interim = False
        self._messages = 0  # begun since begin(): interim heads count
        self.whole: bytes | None = None
        self._transfer_encoding: str | None = None
        self.broken: str | None = None
        self.buffered = 0
        self.chunks: list[bytes] = []
        self.complete = False
        self.content_length: int | None = None
        self.has_date = False
        self.head_bytes = 0
        self.head_done = False
        self._yields = 0  # callbacks that brought something out (feed's stall count)
        self._quiet_bytes = 0  # fed since the last of them, once the head is done
        self._trailers = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: list[tuple[str, str]] | None = None
        self.raw_reason = b""
        self.received = 0
        self.reusable = False
        self.status = 0

    @property
    def reason(self) -> str:
        """`raw_reason` as text (UTF-8 with surrogate escapes, as header values)."""
        return self.raw_reason.decode("utf-8", "surrogateescape")

    @property
    def headers(self) -> list[tuple[str, str]]:
        """`raw_headers` as text: names as latin-1, values as UTF-8 with surrogate escapes
        (encoding them back gives the exact bytes). Decoded on first use: the relay
        works on the bytes (2 decodes per header per reply saved)."""
        headers = self._headers
        if headers is None:
            headers = [
                (name.decode("latin-1"), value.decode("utf-8", "surrogateescape"))
                for name, value in self.raw_headers
            ]
            if self.head_done:
                self._headers = headers
        return headers

    @property
    def until_close(self) -> bool:
        """True when the reply's body ends only when the worker closes the connection."""
        return _until_close(self.content_length, self._transfer_encoding)

    def feed(self, data: bytes) -> None:
        """Parses `data`; never raises (a malformed reply sets `broken`)."""
        self.received += len(data)
        if not self.head_done:
            self.head_bytes += len(data)
        if self.complete:
            self.reusable = False  # bytes after the reply: nothing may follow on this link
            return
        yields = self._yields
        try:
            self._feed_data(data)
        except HttpParserUpgrade:
            self._fail(SWITCHED)
        except HttpParserError as exc:
            self._fail(self.broken or f"invalid reply: {exc}")
        if self.head_done and not self.complete:
            if yields != self._yields:
                self._quiet_bytes = 0
            else:
                self._quiet_bytes += len(data)
                if self._quiet_bytes > MAX_REPLY_FIELD and self.broken is None:
                    self._fail(
                        f"invalid reply: a chunk or trailer line over {MAX_REPLY_FIELD // 1024} KiB"
                    )
        if not self.head_done and self.head_bytes > MAX_REPLY_HEAD and self.broken is None:
            self._fail(f"invalid reply: a reply head over {MAX_REPLY_HEAD // 1024} KiB")
        elif (
            self.reusable  # complete, kept alive, and no other message after it
            and self.received == len(data)  # all in this read
            and self._messages == 1  # no interim head before it
            and self.content_length is not None
            and not self._head_request
            and data.startswith(_HTTP_11_STATUS)
            and _ends_at_its_body(data, self.content_length)
        ):
            self.whole = data

    def feed_reset(self, why: str) -> None:
        """The connection ended in an error (a reset): a reply not yet complete breaks,
        even one whose body ends at close (a reset is no end)."""
        self.reusable = False
        if not self.complete and self.broken is None:
            self.broken = why

    def feed_eof(self) -> None:
        """The worker closed the connection: ends an until-close body, else breaks the
        reply if it was not complete."""
        self.reusable = False
        if self.complete or self.broken is not None:
            return
        if not self.head_done:
            self.broken = CLOSED_BEFORE_REPLY
        elif self.until_close:
            self.complete = True
        else:
            self.broken = "it closed the connection in the middle of its reply"

    def take_body(self) -> bytes:
        """The body bytes parsed and not yet taken, as one bytes object."""
        chunks = self.chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self.chunks = []
        self.buffered = 0
        self.whole = None  # the read it came in is not kept past its body
        return data

    def peek_body(self) -> bytes:
        """The body bytes parsed and not yet taken, left in place (joined into one)."""
        chunks = self.chunks
        if len(chunks) > 1:
            self.chunks = chunks = [b"".join(chunks)]
        return chunks[0] if chunks else b""

    def _fail(self, reason: str) -> None:
        if self.complete:
            self.reusable = False  # garbage after a whole reply spoils only the connection
        else:
            self.broken = reason
            self.reusable = False

    # --- llhttp callbacks -------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._messages += 1
        if self.complete:
            self.reusable = False  # a reply nobody asked for: the link is out of step

    def on_status(self, reason: bytes) -> None:
        if self.complete:
            return  # a reply nobody asked for changes nothing of this one
        self.raw_reason += reason  # may come in pieces

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.head_done:
            # A chunked body's trailer field: dropped, as aiohttp's client does; bounded.
            self._yields += 1
            self._trailers += 1
            if self._trailers > MAX_REPLY_TRAILERS or len(name) + len(value) > MAX_REPLY_FIELD:
                self.broken = "invalid reply: trailer fields over the limits"
                raise ValueError(self.broken)
            return
        if len(name) + len(value) > MAX_REPLY_FIELD:
            self.broken = f"invalid reply: a header line over {MAX_REPLY_FIELD // 1024} KiB"
            raise ValueError(self.broken)
        size = len(name)
        # Only three names matter here; their lengths rule most names out without lower(),
        # and the usual spellings are compared first (a lower() is a call by name and a
        # new object: see router.edge.parsing's on_header).
        if size == 14:
            if (
                name == b"Content-Length"
                or name == b"content-length"
                or name.lower() == b"content-length"
            ):
                # llhttp has checked it is one number
                self.content_length = content_length_number(value)
        elif size == 17:
            if name.lower() == b"transfer-encoding":
                coding = value.decode("utf-8", "surrogateescape")
                before = self._transfer_encoding  # repeats make one list (RFC 9110 §5.3)
                self._transfer_encoding = coding if before is None else f"{before}, {coding}"

        elif size == 4 and (name == b"Date" or name == b"date" or name.lower() == b"date"):
            self.has_date = True
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        if self.complete:
            return  # a reply nobody asked for (on_message_begin spoilt the link)
        self._yields += 1
        status = self._status_code()
        if status > 599:
            # llhttp takes any three digits: RFC 9110 §15 ends at 599, as the check below
            # starts at 100.
            self.broken = f"invalid reply: status {status}"
            raise ValueError(self.broken)
        if status == 101:
            self.broken = SWITCHED
            raise ValueError(SWITCHED)
        if status < 200:
            if status < 100:
                # llhttp takes any three digits; below 100 there is no such reply (as a
                # final one, the client would be sent what HTTP has no meaning for).
                self.broken = f"invalid reply: status {status}"
                raise ValueError(self.broken)
            # An interim reply (100 Continue, 103 Early Hints) is never relayed: the
            # router already answered Expect itself, and the final head follows.
            self._interim = True
            self.raw_headers = []
            self.raw_reason = b""
            self.content_length = None
            self.has_date = False
            self._transfer_encoding = None
            return
        coding = self._transfer_encoding
        if coding is not None and coding.strip().lower() != "chunked":
            # Transfer-Encoding is hop-by-hop: the router takes chunked off and frames the
            # body itself, so any other coding (gzip, or gzip then chunked) would reach
            # the client undone and unnamed. Refused as nginx does (502).
            self.broken = "invalid reply: a transfer coding other than chunked"
            raise ValueError(self.broken)
        self.status = status
        self.head_done = True
        if self._head_request:
            # A HEAD reply has no body whatever its framing says: it ends with its head.
            self._parser_spent = True
            self.complete = True
            self.reusable = self._keeps_alive()

    def on_body(self, body: bytes) -> None:
        self._yields += 1
        if self.complete:
            self.reusable = False  # body bytes after a HEAD reply: the link is out of step
            return
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self._yields += 1
        if self.complete:
            return  # the end of a HEAD reply, or of one nobody asked for: nothing to do
        if self._interim:
            self._interim = False
            return
        if self._head_request:
            return  # ended at its head already
        self.complete = True
        self.reusable = self._keeps_alive()
