"""A worker connection on real sockets (loopback TCP): the reply it reads, its waits,
and flow control in both directions. Connections come from a pool, as in the router;
the worker and helpers are tests/relay/test_pool.py's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from router.relay.connection import INTERRUPTED, TIMED_OUT, WOKE
from router.relay.reply_parser import CLOSED_BEFORE_REPLY
from tests.relay.test_pool import (
    Worker,
    eventually,
    exchange,
    first_connection,
    make_pool,
    soon,
    started_worker,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = await started_worker()
    yield w
    await w.stop()


async def test_a_connection_lost_while_handed_over_breaks_its_next_reply_at_once(
    worker: Worker,
) -> None:
    pool = make_pool(worker.url)
    conn = await pool.acquire(soon())  # held, as by an exchange about to write on it
    await eventually(lambda: len(worker.peers) == 1)
    worker.peers[0].writer.close()
    await eventually(lambda: conn.closed)  # its connection_lost ran
    conn.expect_reply(head_request=False)
    # Broken as connection_lost left it, not wiped by the new exchange: the wait for the
    # reply ends at once (and a kept-alive connection's request may be retried).
    assert conn.reply.broken == CLOSED_BEFORE_REPLY
    assert (conn.reply.head_done, conn.reply.received) == (False, 0)
    conn.write(b"GET / HTTP/1.1\r\nHost: w\r\n\r\n")  # nothing to send it on: dropped
    pool.close()


async def test_expect_reply_readies_an_open_connection_for_the_next_reply(worker: Worker) -> None:
    pool, conn = await first_connection(worker)
    await exchange(conn, worker, 0)
    conn.expect_reply(head_request=True)
    assert (conn.reply.broken, conn.reply.complete, conn.reply.head_done) == (None, False, False)
    worker.peers[0].writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")
    while not conn.reply.complete:  # a HEAD reply ends at its head, whatever its length
        assert await conn.wait(soon()) == WOKE
    assert conn.reply.status == 200
    pool.close()


async def test_wait_times_out_and_can_be_interrupted(worker: Worker) -> None:
    pool = make_pool(worker.url)
    conn = await pool.acquire(soon())
    conn.reply.begin(head_request=False)
    assert await conn.wait(soon(0.05)) == TIMED_OUT
    waiting = asyncio.create_task(conn.wait(None), name="wait")
    await asyncio.sleep(0.01)
    conn.interrupt()
    assert await waiting == INTERRUPTED
    pool.close()


async def test_reading_pauses_while_a_large_body_is_not_taken(worker: Worker) -> None:
    pool, conn = await first_connection(worker)
    conn.reply.begin(head_request=False)
    size = 8 << 20
    writer = worker.peers[0].writer
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size + b"x" * size)
    await eventually(lambda: conn.reply.buffered > 256 * 1024)
    await asyncio.sleep(0.1)
    transport = conn.transport
    assert transport is not None and not transport.is_reading()
    assert conn.reply.buffered < 2 << 20  # the rest waits in the sockets, not in memory
    total = 0
    while not conn.reply.complete:
        total += len(conn.take_body())
        await conn.wait(soon())
    total += len(conn.take_body())
    assert total == size and transport.is_reading()
    pool.close()


async def test_drain_waits_while_the_worker_does_not_read() -> None:
    readers: list[asyncio.StreamReader] = []
    server = await asyncio.start_server(lambda r, w: readers.append(r), "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        pool = make_pool(url)
        conn = await pool.acquire(soon())
        await eventually(lambda: len(readers) == 1)
        block = b"u" * (1 << 20)
        for _ in range(32):  # the worker reads nothing: more than the kernel buffers hold
            conn.write(block)
        assert conn.write_paused
        draining = asyncio.create_task(conn.drain(), name="drain")
        await asyncio.sleep(0.05)
        assert not draining.done()
        while not draining.done():  # the worker reads: writing may go on
            await asyncio.wait_for(readers[0].read(1 << 20), 2)
        assert not conn.write_paused
        pool.close()
    finally:
        server.close()
