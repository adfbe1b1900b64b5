"""The request side of a relayed exchange: its head and body as the worker gets them,
and the failures of getting them, or a connection for them, to it.

This module owns how a client's request is put to a worker before any byte is written:
the request target as the client wrote it, whether the body goes in the same write as
the head (all here and small) or streams, the framing that always comes with a body,
the message written first, and the `UpstreamFailure` a refused request, a broken client
body or a failed connect becomes. It never writes to a socket and never waits on a
worker.
"""

from __future__ import annotations

import errno
import os
from typing import Final

from router.edge import BodyBroken, PublicRequest
from router.relay.contract import ForwardTimeouts, UpstreamFailure
from router.relay.exchange import Exchange
from router.relay.pool import PoolBusy, PoolClosed
from router.relay.wire import worker_request_head

__all__ = ["WHOLE_BODY_MAX", "body_failure", "connect_failure", "framed_body", "outgoing"]

# A request body at most this large that has fully arrived goes out with its head in one
# write; anything else streams. A reply body this large (known length) is read whole and
# sent with its head in one write; anything larger, or of unknown length, streams.
WHOLE_BODY_MAX: Final = 64 * 1024
_REFUSED_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ENOENT})  # ENOENT: no socket file


def outgoing(
    exchange: Exchange,
    extra: dict[str, str],
    body: bytes | None,
    limit: int | None,
    kept: frozenset[str],
) -> tuple[bytes, bool]:
    """What to write first, and whether it is the whole request: the head and the
    framed body when the body is all here (True), else the head alone, the body to
    stream after it (False). Head and body are joined in one piece, as the worker
    reads them in one recv (no copy of the head into a second bytes object). `limit`:
    the body limit for a body whose length was not announced (None: none). `kept`: the
    headers a client's Connection options never remove. Raises UpstreamFailure (nothing
    was sent)."""
    request = exchange.request
    method = request.method
    if method == "CONNECT":
        raise UpstreamFailure("error", "CONNECT is not forwarded", request_sent=False)
    try:
        payload, length, chunked = framed_body(request, body)
    except BodyBroken as broken:
        raise body_failure(broken, request_sent=False) from None
    # A chunked body announced no length: measured here once all read (read_now()
    # returns what framed_body read and kept).
    if chunked and payload is not None and limit is not None and len(request.read_now()) > limit:
        raise UpstreamFailure("too_large", "the request body is over the limit", request_sent=False)
    if payload is None:
        exchange.uploaded = False
        exchange.chunked = chunked
    try:
        head = worker_request_head(
            method,
            request.target,
            request.raw_headers,
            worker_host=exchange.pool.address.host_header,
            client_ip=request.remote,
            scheme=request.scheme,
            extra=extra,
            content_length=length,
            chunked=chunked,
            authority=request.authority,
            body=b"" if payload is None else payload,
            kept=kept,
        )
    except ValueError as exc:
        raise UpstreamFailure(
            "error", f"cannot send the request: {exc}", request_sent=False
        ) from exc
    return head, payload is not None


def framed_body(
    request: PublicRequest, body: bytes | None
) -> tuple[bytes | None, int | None, bool]:
    """(payload, content_length, chunked) for the worker's request.

    The payload is the body framed for the worker when it is all here and small (None:
    it streams). A body always goes with explicit framing: the client's Content-Length
    (the length the caller read), or chunked when the client sent chunked, so no header
    rule can leave a body unframed. Raises BodyBroken when the body arrived malformed.
    """
    if body is not None:
        return body, len(body), False
    stream = request.body
    if stream is None:
        return b"", None, False  # the client's own `Content-Length: 0`, if any, stays
    chunked = request.chunked
    if stream.broken is not None:
        raise stream.broken
    if not stream.complete or stream.received > WHOLE_BODY_MAX:
        return None, None if chunked else request.content_length, chunked
    # The whole body is here: no wait. What is read is kept: a request tried again on
    # another worker (connect refused) sends it again.
    data = request.read_now()
    if not chunked:
        return data, len(data), False
    # The client chose chunked framing; the worker gets it too, in the same write.
    return (b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"), None, True


def connect_failure(
    exc: BaseException, timeouts: ForwardTimeouts, *, request_sent: bool
) -> UpstreamFailure:
    """The UpstreamFailure for a connection that could not be had."""
    if isinstance(exc, PoolClosed):
        return UpstreamFailure(
            "error", "its connections were closed (it exited)", request_sent=request_sent
        )
    if isinstance(exc, PoolBusy):
        detail = f"all its connections stayed busy for {timeouts.connect_s:g} s"
        return UpstreamFailure("busy", detail, request_sent=request_sent)
    if isinstance(exc, TimeoutError):
        detail = f"no connection within {timeouts.connect_s:g} s"
        return UpstreamFailure("timeout", detail, request_sent=request_sent)
    code = exc.errno if isinstance(exc, OSError) else None
    # asyncio's own message names only the address; the errno says what went wrong.
    # Resolver errors carry negative codes and a message of their own.
    reason = os.strerror(code) if code and code > 0 else str(exc)
    detail = f"cannot connect: {reason}"
    if code in _REFUSED_ERRNOS:
        return UpstreamFailure("refused", detail, request_sent=request_sent)
    return UpstreamFailure("error", detail, request_sent=request_sent)


def body_failure(broken: BodyBroken, *, request_sent: bool) -> UpstreamFailure:
    """The failure a broken client body becomes: 400 when malformed, 408 when the client
    went silent, else the client left."""
    if broken.malformed:
        return UpstreamFailure("bad_body", broken.reason, request_sent=request_sent)
    if broken.timed_out:
        return UpstreamFailure("client_timeout", broken.reason, request_sent=request_sent)
    return UpstreamFailure("client_left", broken.reason, request_sent=request_sent)
