"""A worker's reply on its way to the client, when it cannot go in one write.

This module owns the client side of a relayed reply that is not sent whole: streaming
a reply chunk by chunk as it arrives (bounded by the stream-idle timeout; a client that
left wakes the wait at once through the request's `on_client_lost`), and a reply that
broke after its head: the bytes the worker sent, then the client connection ended
without a clean terminator. The framing for the client is the connection's business
(`router.edge.server`). It never reads the request, never decides whether a worker
connection is reused (the caller settles it) and never raises UpstreamFailure: past
the head, a failure can only end the client connection.
"""

from __future__ import annotations

import asyncio
import logging

from router.edge import PublicRequest
from router.relay.connection import INTERRUPTED, WorkerConnection

__all__ = ["CLIENT_GONE", "ReplyHead", "send_cut", "stream_reply"]

log = logging.getLogger("episode_router.forward")

CLIENT_GONE = "the client went away"

# status, reason, the headers for the client (the worker's bytes)
ReplyHead = tuple[int, bytes, list[tuple[bytes, bytes]]]


def send_cut(request: PublicRequest, head: ReplyHead, body: bytes, why: str, idle_s: float) -> None:
    """Sends the head and the `body` bytes the worker sent before its reply broke off,
    then ends the client connection so the client sees the reply is incomplete."""
    client = request.client
    status, reason, headers = head
    client.reply_start(request, status, reason, headers, body)
    log.info("reply to %s %s aborted: %s", request.method, request.path, why)
    client.reply_abort(idle_s)


async def stream_reply(
    request: PublicRequest,
    head: ReplyHead,
    conn: WorkerConnection,
    idle_s: float,
    send_s: float | None = None,
) -> str | None:
    """Sends the head with the body bytes already read, then each chunk as it arrives.

    `send_s`: when set, the client must take what was written to it (its connection
    drained) within that many seconds each time, or the reply stops (a reply streamed
    past the pool's share: `router.relay.forwarder`).

    Returns None once the worker's reply ended cleanly (the caller then settles the worker
    connection and writes the end), else why it stopped; the client connection is left
    for the caller to end.
    """
    client = request.client
    status, reason, headers = head
    # The head goes out now, with the bytes read so far (b"": the head alone, so an
    # event stream's client sees its head before the first event).
    client.reply_start(request, status, reason, headers, conn.take_body())
    if client.client_gone:
        return CLIENT_GONE
    if send_s is not None:
        why = await _taken_within(request, send_s)
        if why is not None:
            return why
    # The relay set request.on_client_lost to wake `conn` when it sent the request.
    return await _copy_body(request, conn, idle_s, send_s)


async def _taken_within(request: PublicRequest, send_s: float) -> str | None:
    """None once the client took what was written to it, within `send_s`; else why not."""
    try:
        async with asyncio.timeout(send_s):
            await request.client.drain()
    except ConnectionError:
        return CLIENT_GONE
    except TimeoutError:
        return f"the client took nothing for {send_s:g} s of a reply past the pool's share"
    return None


async def _copy_body(
    request: PublicRequest, conn: WorkerConnection, idle_s: float, send_s: float | None
) -> str | None:
    """Copies chunks as they arrive; None at a clean end, else why it stopped."""
    reply = conn.reply
    client = request.client
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(None) as idle:
            while True:
                # The deadline covers the worker's silence only. A client slower than the
                # reply is the edge's to judge (pause_writing: dropped after
                # idle_timeout_s with nothing taken): one reading slowly but steadily
                # was cut here, and the worker blamed for it.
                idle.reschedule(loop.time() + idle_s)
                while not reply.chunks:
                    if reply.complete:
                        return None
                    if reply.broken is not None:
                        return f"the worker's reply broke off ({reply.broken})"
                    if client.client_gone:
                        return CLIENT_GONE
                    if await conn.wait(None) == INTERRUPTED:
                        return CLIENT_GONE
                idle.reschedule(None)
                # Written as it arrives, never held back: SSE events go out at once
                # (what arrived together goes out together).
                client.reply_write(conn.take_body())
                if send_s is not None:
                    # Its own timeout, caught inside: the idle one is unset (None) here.
                    why = await _taken_within(request, send_s)
                    if why is not None:
                        return why
                    continue
                try:
                    await client.drain()
                except ConnectionError:
                    return CLIENT_GONE
    except TimeoutError:
        return f"no reply data for {idle_s:g} s"
