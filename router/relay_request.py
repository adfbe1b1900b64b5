"""The request side of a relayed exchange: its target, its body's framing, and the
failures of getting a connection for it.

This module owns how a client's request is put to a worker before any byte is written:
the request target as the client wrote it, whether the body goes in the same write as
the head (all here and small) or streams, the framing that always comes with a body, and
the `UpstreamFailure` a failed connect becomes. It never writes to a socket and never
waits on a worker.
"""

from __future__ import annotations

import errno
import os
from typing import Final

from router.edge_request import PublicRequest
from router.forward import ForwardTimeouts, UpstreamFailure
from router.relay_pool import PoolClosed

__all__ = ["WHOLE_BODY_MAX", "connect_failure", "framed_body"]

# A request body at most this large that has fully arrived goes out with its head in one
# write; anything else streams. A reply body this large (known length) is read whole and
# sent with its head in one write; anything larger, or of unknown length, streams.
WHOLE_BODY_MAX: Final = 64 * 1024
_REFUSED_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ENOENT})  # ENOENT: no socket file


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
