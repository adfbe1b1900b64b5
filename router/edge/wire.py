"""The bytes of the public side: reply heads for clients, the Date header, head refusals.

This module owns the wire format the router writes to its clients: the head of a
relayed reply (the worker's headers, the framing the client's HTTP version allows,
`Connection` when the router closes or an HTTP/1.0 client keeps alive, Date when the
worker sent none), the head of the router's own answers, and the answer a request head
that the edge refuses gets (400, 414 or 431). It is pure: no sockets, no event loop.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Iterable
from email.utils import formatdate
from http import HTTPStatus
from typing import Final

from router.core import Answer

__all__ = [
    "BodyFraming",
    "HeadRefusal",
    "answer_head",
    "continue_line",
    "date_header",
    "head_additions",
    "head_refusal_answer",
    "reply_head",
    "split_target",
]

_REASONS: Final = {status.value: status.phrase for status in HTTPStatus}
_NO_BODY_STATUSES: Final = frozenset({204, 304})


class BodyFraming(enum.Enum):
    """How a reply body is delimited on the client connection."""

    NONE = "none"  # no body may follow (HEAD, 1xx, 204, 304)
    LENGTH = "length"  # Content-Length: the bytes are sent as they are
    CHUNKED = "chunked"  # no length known, HTTP/1.1 client: chunked framing
    CLOSE = "close"  # no length known, HTTP/1.0 client: the connection's end ends it


class HeadRefusal(enum.Enum):
    """Why the edge refused a request head before any handler saw it."""

    MALFORMED = "malformed"
    LINE_TOO_LONG = "line_too_long"
    FIELD_TOO_LONG = "field_too_long"
    TOO_MANY_HEADERS = "too_many_headers"
    UPGRADE_WITH_BODY = "upgrade_with_body"
    BAD_HOST = "bad_host"
    HEAD_TOO_LARGE = "head_too_large"  # the whole head over max_head_bytes
    HEADS_OVER_BUDGET = "heads_over_budget"  # the largest of the heads over max_held_head_bytes
    LENGTH_TOO_LARGE = "length_too_large"  # a Content-Length above MAX_CONTENT_LENGTH


def head_refusal_answer(refusal: HeadRefusal, parser_error: str = "") -> Answer:
    """The router's answer to a request head it refused (sent with the connection closed)."""
    if refusal is HeadRefusal.LINE_TOO_LONG:
        return Answer("uri_too_long", "The request line is over the router's limit.")
    if refusal is HeadRefusal.FIELD_TOO_LONG:
        return Answer("headers_too_large", "A request header is over the router's limit.")
    if refusal is HeadRefusal.TOO_MANY_HEADERS:
        return Answer("headers_too_large", "The request has more headers than the router allows.")
    if refusal is HeadRefusal.HEAD_TOO_LARGE:
        return Answer("headers_too_large", "The request head is over the router's limit.")
    if refusal is HeadRefusal.HEADS_OVER_BUDGET:
        return Answer(
            "headers_too_large",
            "The router holds as many unfinished request heads as it may; this one was the "
            "largest.",
        )
    if refusal is HeadRefusal.LENGTH_TOO_LARGE:
        return Answer("bad_request", "The Content-Length is larger than any body a worker takes.")
    if refusal is HeadRefusal.UPGRADE_WITH_BODY:
        return Answer(
            "bad_request",
            "An Upgrade or CONNECT request with a body is not served: no protocol is tunnelled.",
        )
    if refusal is HeadRefusal.BAD_HOST:
        return Answer(
            "bad_request", "An HTTP/1.1 request needs exactly one Host header, naming a host."
        )
    text = parser_error.strip().rstrip(".")
    detail = f"The request is malformed: {text[:120]}." if text else "The request is malformed."
    return Answer("bad_request", detail)


_wall_clock: Final = time.time


class _DateCache:
    """The Date header's value, formatted once per second: formatdate costs far more
    than a clock read and a compare, and every reply carries it."""

    __slots__ = ("_line", "_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = ""
        self._line = b""

    def __call__(self) -> str:
        self._refresh()
        return self._value

    @property
    def line(self) -> bytes:
        """`Date: <now>` and its CRLF, as bytes."""
        # A method called directly, not self(): the compiled build calls an instance
        # through the generic call protocol. The clock is a Final: no module attribute
        # read.
        self._refresh()
        return self._line

    def _refresh(self) -> None:
        now = _wall_clock()
        second = int(now)
        if second != self._second:
            self._second = second
            self._value = formatdate(now, usegmt=True)
            self._line = f"Date: {self._value}\r\n".encode("ascii")


date_header: Final = _DateCache()


def _has_no_body(status: int, head_request: bool) -> bool:
    """A HEAD reply, a 1xx, 204 or 304 has no body (RFC 9110 §6.4.1)."""
    return head_request or status < 200 or status in _NO_BODY_STATUSES


def head_additions(
    status: int,
    has_length: bool,
    has_date: bool,
    *,
    version_11: bool,
    head_request: bool,
    keep_alive: bool,
) -> bytes | None:
    """What `reply_head` would add to a worker's HTTP/1.1 head (its headers all kept for
    the client; `has_length`, `has_date`: a Content-Length and a Date among them): b""
    for nothing, or the Date line; None when it would write more than that. It adds no
    more to a kept-alive HTTP/1.1 exchange whose reply has a body framed by its
    Content-Length. The worker's head may then be relayed as its bytes, with the
    addition before its final CRLF."""
    if not version_11 or not keep_alive or not has_length or _has_no_body(status, head_request):
        return None
    return b"" if has_date else date_header.line


def reply_head(
    status: int,
    reason: bytes,
    headers: list[tuple[bytes, bytes]],
    *,
    version_11: bool,
    head_request: bool,
    keep_alive: bool,
) -> tuple[bytes, BodyFraming, bool]:
    """The head of a relayed reply for the client, how its body is framed, and whether
    the connection stays open after it.

    `reason` and `headers` are the worker's bytes, the headers already filtered for the
    client (no hop-by-hop header, so no Transfer-Encoding; llhttp let no CR or LF into
    any of them): a Content-Length there frames the body; without one the
    body is chunked for an HTTP/1.1 client and delimited by the connection's end for an
    HTTP/1.0 one. A HEAD reply, a 1xx, 204 or 304 has no body; a 304 and a HEAD reply
    keep the worker's Content-Length (it describes the resource, RFC 9110 §8.6).
    """
    # Built as bytes from the worker's bytes, with no decode and encode of every header
    # (measured with the reply's rules on the bytes too: docs/performance.md).
    parts = [b"HTTP/1.%d %d %b\r\n" % (1 if version_11 else 0, status, reason)]
    no_body = _has_no_body(status, head_request)
    has_length = has_date = False
    for pair in headers:  # indexed, not unpacked: see router.relay.wire.worker_request_head
        name = pair[0]
        # Only two names matter here; their lengths rule most names out without lower().
        size = len(name)
        if size == 14 and name.lower() == b"content-length":
            if status == 204 or status < 200:
                continue  # RFC 9110 §8.6: never in these
            has_length = True
        elif size == 4 and name.lower() == b"date":
            has_date = True
        parts.append(b"%b: %b\r\n" % (name, pair[1]))
    if no_body:
        framing = BodyFraming.NONE
    elif has_length:
        framing = BodyFraming.LENGTH
    elif version_11:
        framing = BodyFraming.CHUNKED
        parts.append(b"Transfer-Encoding: chunked\r\n")
    else:
        framing = BodyFraming.CLOSE
        keep_alive = False
    if not has_date:
        parts.append(date_header.line)
    if not keep_alive:
        parts.append(b"Connection: close\r\n")
    elif not version_11:
        parts.append(b"Connection: keep-alive\r\n")
    parts.append(b"\r\n")
    return b"".join(parts), framing, keep_alive


def answer_head(
    status: int,
    headers: Iterable[tuple[str, str]],
    body_length: int,
    *,
    keep_alive: bool,
    version_11: bool = True,
) -> bytes:
    """The head of one of the router's own answers (always HTTP/1.1, always a length).
    An HTTP/1.0 client kept alive is told so: it would take the connection as closing."""
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}"]
    lines.extend([f"{name}: {value}" for name, value in headers])
    lines.append(f"Content-Length: {body_length}")
    lines.append(f"Date: {date_header()}")
    if not keep_alive:
        lines.append("Connection: close")
    elif not version_11:
        lines.append("Connection: keep-alive")
    return _encode(lines)


def continue_line() -> bytes:
    """The interim reply a client that sent `Expect: 100-continue` waits for."""
    return b"HTTP/1.1 100 Continue\r\n\r\n"


def _encode(lines: list[str]) -> bytes:
    # The router's own answers: ASCII, but for a detail quoting a request (escaped
    # back to the bytes it came as).
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")


def split_target(target: str) -> tuple[str, str | None]:
    """(origin-form target, authority) of a request target as the client wrote it.

    An origin-form target (`/path?query`) is kept exactly, with no authority. An
    absolute-form one (`http://host:port/path?query`) becomes its path and query, never
    re-quoted, and its authority, which RFC 9112 §3.2.2 says stands in for Host.
    """
    if target.startswith("/"):
        return target, None
    scheme, sep, rest = target.partition("://")
    if not sep or not scheme:
        return target, None
    end = len(rest)
    for mark in "/?":
        found = rest.find(mark)
        if found != -1 and found < end:
            end = found
    authority, path = rest[:end], rest[end:]
    if not path.startswith("/"):
        path = "/" + path
    return path, authority.rpartition("@")[2] or None
