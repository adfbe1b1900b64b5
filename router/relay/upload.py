"""A request body streamed to a worker as it arrives from the client.

This module owns the upload of a body that was not all here (or too large) to go with
its head: the head written, then each piece the client sends copied on in a task of its
own (chunked when the client sent chunked), with backpressure from the worker's socket,
the body limit for a body whose length was not announced, and the reply-head deadline
pushed on by each piece. It never waits for the reply (the exchange's wait does, and is
woken when the upload breaks) and never raises: how it ended is left on the exchange.
"""

from __future__ import annotations

import asyncio

from router.edge import BodyBroken
from router.relay.connection import WorkerConnection
from router.relay.exchange import Exchange

__all__ = ["start_upload"]


def start_upload(
    exchange: Exchange,
    conn: WorkerConnection,
    head: bytes,
    loop: asyncio.AbstractEventLoop,
    first_byte_s: float,
    limit: int | None,
) -> None:
    """Writes the head, then streams the body from the client in a task of its own, so
    a worker that answers before reading the whole body is heard at once. `limit`: the
    body limit in bytes (None: none)."""
    conn.expect_reply(head_request=exchange.request.method == "HEAD")
    conn.write(head)
    exchange.deadline = loop.time() + first_byte_s
    exchange.upload = asyncio.create_task(
        _upload(exchange, conn, loop, first_byte_s, limit),
        name=f"forward-upload {exchange.pool.url}",
    )


async def _upload(
    exchange: Exchange,
    conn: WorkerConnection,
    loop: asyncio.AbstractEventLoop,
    first_byte_s: float,
    limit: int | None,
) -> None:
    content = exchange.request.body
    assert content is not None
    chunked = exchange.chunked
    sent = 0
    while True:
        exchange.awaiting_client = True
        try:
            # readany hands over what arrived since the last call, in one piece.
            chunk = await content.readany()
        except BodyBroken as broken:
            exchange.body_broke = broken
            conn.interrupt()
            return
        finally:
            exchange.awaiting_client = False
        if conn.closed:
            return  # the worker's side ended; the reply says how
        if not chunk:
            break
        sent += len(chunk)
        if limit is not None and sent > limit:
            # Over the limit: the worker's connection is dropped mid-body (it sees a
            # cut chunked message, never a complete one) and the client gets 413.
            exchange.too_large = True
            conn.interrupt()
            return
        conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk) if chunked else chunk)
        # Upload progress pushes the reply-head deadline on: first_byte_s bounds a
        # worker that stops taking the upload (drain), and after its last chunk the
        # wait for the reply head; not the client's pauses (awaiting_client).
        exchange.deadline = loop.time() + first_byte_s
        await conn.drain()
    if chunked:
        conn.write(b"0\r\n\r\n")
    exchange.uploaded = True
    exchange.deadline = loop.time() + first_byte_s
