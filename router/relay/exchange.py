"""One request on its way to a worker, and its reply relayed when it came all in.

This module owns what one relayed exchange holds and how it lets go: the worker
connection it took from the pool (back to the pool after a complete exchange, else
dropped), its streamed upload's state, the wake-up of its wait when the client leaves,
the reply that is all in relayed in one write, the reply's headers as the client gets
them, and whether a failed request may go once more on a fresh connection. It never
waits (the coroutine path is `router.relay.forwarder`'s, the task-free one `router.relay.lane`'s),
never picks a pool and never writes an answer of its own.
"""

from __future__ import annotations

import asyncio

from router.edge import BodyBroken, ClientLost, PublicRequest
from router.relay.connection import WorkerConnection
from router.relay.contract import keeps_every_reply_header, relayed_reply_headers
from router.relay.pool import WorkerPool
from router.relay.reply_parser import CLOSED_BEFORE_REPLY
from router.relay.wire import IDEMPOTENT_METHODS

__all__ = ["Exchange", "client_headers", "send_whole", "stale"]


class Exchange(ClientLost):
    """One request on its way to a worker: the connection it holds and its upload. It
    is the request's `on_client_lost` while it holds a connection: a client that leaves
    wakes the wait for the reply at once."""

    __slots__ = (
        "awaiting_client",
        "body_broke",
        "chunked",
        "conn",
        "deadline",
        "paced",
        "pool",
        "request",
        "reserved",
        "too_large",
        "upload",
        "uploaded",
    )

    def __init__(self, request: PublicRequest, pool: WorkerPool) -> None:
        self.request = request
        self.pool = pool
        self.conn: WorkerConnection | None = None
        self.upload: asyncio.Task[None] | None = None  # the streamed request body
        self.uploaded = True  # the whole request went out (False while it streams)
        self.chunked = False  # a streamed body goes out in chunked framing
        self.body_broke: BodyBroken | None = None  # the client's body did not complete
        self.too_large = False  # the streamed body went over max_body_bytes
        self.deadline = 0.0  # for the reply head; pushed on by each uploaded chunk
        # The streamed upload waits for the client's next body bytes: the wait for the
        # reply head is not the worker's then (the client's body clock bounds it).
        self.awaiting_client = False
        self.paced = False  # it holds one of its pool's places for client-paced exchanges
        self.reserved = 0  # bytes of the buffer budget it holds (the forwarder's count)

    def body_failed(self) -> bool:
        """The client's body broke or went over the limit. A method, not the attributes
        read where they were checked before an await: mypy keeps an attribute narrowed
        (to None) across the await, and the compiled build then checks that type."""
        return self.body_broke is not None or self.too_large

    def settle(self, clean: bool) -> None:
        """Lets go of the worker connection: back to the pool after a complete exchange
        (`clean`), else dropped. Idempotent."""
        if self.paced:
            self.paced = False
            self.pool.give_paced()
        conn = self.conn
        if conn is None:
            return
        self.conn = None
        self.request.on_client_lost = None
        upload = self.upload
        if upload is not None and not upload.done():
            upload.cancel()
        if clean and self.uploaded:
            self.pool.release(conn)
        else:
            conn.abort()

    def client_lost(self) -> None:
        conn = self.conn
        if conn is not None:
            conn.interrupt()


def send_whole(exchange: Exchange, public_base: str | None) -> int:
    """Relays a reply that is all in: head and body in one write; returns its status."""
    conn = exchange.conn
    assert conn is not None
    reply = conn.reply
    request = exchange.request
    whole = reply.whole
    client = request.client
    if (
        whole is not None
        and keeps_every_reply_header(reply.raw_headers)
        and client.reply_as_is(request, reply.status, whole, reply.content_length, reply.has_date)
    ):
        conn.take_body()  # it went within `whole`
        # After the client write here (the write calls back into nothing), before
        # the caller hears: the next request may have the connection.
        exchange.settle(clean=True)
        return reply.status
    headers = client_headers(exchange, public_base)
    body = conn.take_body()
    exchange.settle(clean=True)  # before the client write: the reply is all in
    client.reply_whole(request, reply.status, reply.raw_reason, headers, body)
    return reply.status


def client_headers(exchange: Exchange, public_base: str | None) -> list[tuple[bytes, bytes]]:
    """The reply's headers as the client gets them."""
    conn = exchange.conn
    assert conn is not None
    return relayed_reply_headers(
        conn.reply.raw_headers,
        private_origin=exchange.pool.address.private_origin,
        public_base=public_base,
    )


def stale(conn: WorkerConnection, method: str) -> bool:
    """True when a request failed on a reused connection the worker had closed before
    any reply byte, and may be sent again (idempotent, its body was not streamed)."""
    reply = conn.reply
    return (
        conn.reused
        and reply.broken == CLOSED_BEFORE_REPLY
        and reply.received == 0
        and method in IDEMPOTENT_METHODS
    )
