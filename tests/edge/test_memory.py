"""The public edge's memory: a head bounded by bytes, all heads by a budget, pipelined
bytes by backpressure, and a closed connection freed at once, with the collector off."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from router.core.answers import Answer
from router.edge.parsing import MAX_CONTENT_LENGTH
from router.edge.request import PublicRequest, RequestBody
from router.edge.server import PARSE_SLICE_BYTES, EdgeConnection, EdgeLimits, EdgeServer
from router.edge.serving import MAX_PIPELINED_BYTES
from tests.router_fixtures import RawHttp, open_rig, router_config, wait_until

GET = b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n"
# The most a transport reads at once (asyncio's and uvloop's 256 KiB).
READ_MAX_BYTES = 256 * 1024
FIELD = b"X-Filler: " + b"f" * 8000 + b"\r\n"  # one line of a large head


def unfinished_head(size: int) -> bytes:
    """A request head of `size` bytes or a line more that never ends (no empty line)."""
    return b"GET /big HTTP/1.1\r\nHost: x\r\n" + FIELD * (size // len(FIELD) + 1)


class Edge(NamedTuple):
    server: EdgeServer
    port: int
    release: asyncio.Event  # lets the requests to /slow go


@contextlib.asynccontextmanager
async def an_edge(limits: EdgeLimits) -> AsyncIterator[Edge]:
    """An edge on loopback answering 503 at once, but parking /slow until released."""
    release = asyncio.Event()

    async def handler(request: PublicRequest) -> None:
        if request.target == "/slow":
            await release.wait()
        request.client.answer(request, Answer("no_worker", "answered"))

    loop = asyncio.get_running_loop()
    edge = EdgeServer(handler, limits, loop)
    listener = await loop.create_server(edge, "127.0.0.1", 0)
    try:
        yield Edge(edge, int(listener.sockets[0].getsockname()[1]), release)
    finally:
        release.set()
        listener.close()
        await edge.shutdown(0.5)


def live(kind: type) -> int:
    """How many objects of `kind` are alive (tracked by the collector, not collected)."""
    return sum(1 for obj in gc.get_objects() if type(obj) is kind)


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def closed(edge: EdgeServer) -> bool:
    return not edge.connections


# --- a head bounded by its bytes --------------------------------------------------------------


async def test_a_head_over_max_head_bytes_is_refused_431_though_each_line_is_within_bounds() -> (
    None
):
    async with an_edge(EdgeLimits(max_head_bytes=32768)) as edge:
        conn = await RawHttp.open(edge.port)
        try:
            conn.send(unfinished_head(40000))  # five lines of 8 KiB: each under its bound
            status, _, body = await conn.read_reply()
            assert status == 431
            assert b'"headers_too_large"' in body
            assert b"request head is over" in body
            assert await conn.read_to_end() == b""  # and closed
        finally:
            conn.close()
        await wait_until(lambda: closed(edge.server), "the connection to close", 5)
        assert edge.server.head_bytes_held == 0


async def test_a_head_within_max_head_bytes_in_many_reads_is_served() -> None:
    async with an_edge(EdgeLimits(max_head_bytes=32768)) as edge:
        conn = await RawHttp.open(edge.port)
        try:
            for _ in range(3):  # 24 KiB in three reads
                conn.send(FIELD if _ else b"GET /p HTTP/1.1\r\nHost: x\r\n" + FIELD)
                await asyncio.sleep(0.05)
            assert edge.server.head_bytes_held > 3 * 8000  # held while unfinished
            conn.send(b"\r\n")
            status, _, _ = await conn.read_reply()
            assert status == 503  # the handler's answer: the head was served
            assert edge.server.head_bytes_held == 0  # and let go once it ended
        finally:
            conn.close()


async def test_unfinished_heads_over_the_budget_refuse_the_largest_one() -> None:
    limits = EdgeLimits(max_head_bytes=65536, max_held_head_bytes=100_000)
    async with an_edge(limits) as edge:
        large = await RawHttp.open(edge.port)
        small = await RawHttp.open(edge.port)
        last = await RawHttp.open(edge.port)
        try:
            large.send(unfinished_head(60000))
            await wait_until(
                lambda: _true(edge.server.head_bytes_held > 50000), "the large head", 5
            )
            small.send(unfinished_head(20000))
            await asyncio.sleep(0.1)
            last.send(unfinished_head(30000))  # over the budget together
            status, _, body = await large.read_reply()
            assert status == 431
            assert b"largest" in body
            assert edge.server.heads_over_budget == 1
            # The others are still held, and served once they end.
            for conn in (small, last):
                conn.send(b"\r\n")
                status, _, _ = await conn.read_reply()
                assert status == 503
        finally:
            for conn in (large, small, last):
                conn.close()


async def _true(value: bool) -> bool:
    return value


# --- pipelined bytes: backpressure ------------------------------------------------------------


async def test_pipelined_heads_behind_a_slow_request_stop_reading_past_their_byte_bound() -> None:
    async with an_edge(EdgeLimits()) as edge:
        client = socket.socket()
        for buffer in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # small, and set before connect
            client.setsockopt(socket.SOL_SOCKET, buffer, 4096)
        client.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(client, ("127.0.0.1", edge.port))
        big_get = b"GET /p HTTP/1.1\r\nHost: x\r\n" + FIELD * 7 + b"\r\n"  # ~56 KiB each
        data = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + big_get * 15
        sender = asyncio.create_task(loop.sock_sendall(client, data), name="pipelining-client")
        try:
            await asyncio.sleep(0.5)
            [conn] = edge.server.connections
            # Fewer than MAX_PIPELINED queued: the byte bound stopped reading first,
            # within a slice and one read kept unparsed.
            assert conn._pipeline_full
            held = sum(len(request.header_list) for request in conn._queue)
            assert len(conn._queue) < 8
            assert held < 8 * 8
            assert conn._pipelined_bytes <= MAX_PIPELINED_BYTES + PARSE_SLICE_BYTES
            edge.release.set()
            answered = b""
            async with asyncio.timeout(20):
                while answered.count(b"HTTP/1.1 503 ") < 16:
                    answered += await loop.sock_recv(client, 1 << 16)
            await sender  # every one read and answered: backpressure, no refusal
        finally:
            sender.cancel()
            client.close()


async def test_a_late_head_behind_a_request_in_flight_lets_go_of_its_bytes() -> None:
    # The head's clock passes while /slow is with the handler: the connection stops
    # reading (and closes after the reply), and its head's bytes are no longer held, so
    # the budget refuses other heads rather than choosing this one, which it cannot.
    limits = EdgeLimits(header_timeout_s=0.3, max_head_bytes=65536, max_held_head_bytes=100_000)
    async with an_edge(limits) as edge:
        stuck = await RawHttp.open(edge.port)
        opened = [stuck]
        try:
            stuck.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.05)
            stuck.send(unfinished_head(60000))
            await wait_until(lambda: _true(edge.server.head_bytes_held > 50000), "the late head", 5)
            await wait_until(
                lambda: _true(edge.server.head_bytes_held == 0), "the late head let go", 5
            )
            large = await RawHttp.open(edge.port)  # (each head's clock runs from its start)
            last = await RawHttp.open(edge.port)
            opened += (large, last)
            large.send(unfinished_head(60000))
            await asyncio.sleep(0.1)
            last.send(unfinished_head(50000))  # over the budget with the large one
            status, _, body = await large.read_reply()
            assert status == 431
            assert b"largest" in body
            assert edge.server.heads_over_budget == 1  # the one refusal made
            last.send(b"\r\n")
            assert (await last.read_reply())[0] == 503
            edge.release.set()
            assert (await stuck.read_reply())[0] == 503  # its reply still went out
        finally:
            for conn in opened:
                conn.close()
        await wait_until(lambda: closed(edge.server), "the connections to close", 5)
        assert edge.server.head_bytes_held == 0


async def test_pipelined_bytes_count_in_the_budget_and_stop_reading_past_it() -> None:
    # Complete heads queued behind a slow request, and a read's rest kept unparsed, are
    # held as an unfinished head is: counted in the budget of all connections, and past
    # it the connection stops reading (backpressure) until its queue is down to one.
    budget = 80_000  # more than one head (~56 KiB), less than MAX_PIPELINED_BYTES
    async with an_edge(EdgeLimits(max_held_head_bytes=budget)) as edge:
        client = socket.socket()
        for buffer in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # small, and set before connect
            client.setsockopt(socket.SOL_SOCKET, buffer, 4096)
        client.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(client, ("127.0.0.1", edge.port))
        big_get = b"GET /p HTTP/1.1\r\nHost: x\r\n" + FIELD * 7 + b"\r\n"  # ~56 KiB each
        data = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + big_get * 15
        sender = asyncio.create_task(loop.sock_sendall(client, data), name="pipelining-client")
        try:
            await asyncio.sleep(0.5)
            [conn] = edge.server.connections
            assert conn._pipeline_full
            assert conn._pipelined_bytes > 0
            kept = len(conn._unparsed or b"")
            # Held in the budget (the queued heads and the read's rest kept unparsed), and
            # stopped within one read of it: before MAX_PIPELINED_BYTES, the bound of one
            # connection, which alone let it read on.
            assert edge.server.head_bytes_held >= conn._pipelined_bytes + kept
            assert edge.server.head_bytes_held <= budget + READ_MAX_BYTES + 65536
            assert conn._pipelined_bytes < MAX_PIPELINED_BYTES
            edge.release.set()
            answered = b""
            async with asyncio.timeout(20):
                while answered.count(b"HTTP/1.1 503 ") < 16:
                    answered += await loop.sock_recv(client, 1 << 16)
            await sender  # every one read and answered: backpressure, no refusal
            assert edge.server.heads_over_budget == 0
            assert edge.server.head_bytes_held == 0  # all let go once handled
        finally:
            sender.cancel()
            client.close()


async def test_a_closed_pipelining_connection_lets_go_of_its_held_bytes() -> None:
    async with an_edge(EdgeLimits()) as edge:
        conn = await RawHttp.open(edge.port)
        big_get = b"GET /p HTTP/1.1\r\nHost: x\r\n" + FIELD * 7 + b"\r\n"
        conn.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + big_get * 6)
        await wait_until(
            lambda: _true(edge.server.head_bytes_held > 100_000), "the pipelined heads", 5
        )
        conn.close()
        edge.release.set()
        await wait_until(lambda: closed(edge.server), "the connection to close", 5)
        await wait_until(
            lambda: _true(edge.server.head_bytes_held == 0), "the held bytes let go", 5
        )


# --- an absurd Content-Length ---------------------------------------------------------------


@pytest.mark.parametrize("length", [MAX_CONTENT_LENGTH + 1, 2**64 - 1])
async def test_a_content_length_no_worker_can_take_is_refused_400(length: int) -> None:
    async with an_edge(EdgeLimits()) as edge:
        conn = await RawHttp.open(edge.port)
        try:
            conn.send(b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\nab" % length)
            status, _, body = await conn.read_reply()
            assert status == 400
            assert b'"bad_request"' in body
            assert await conn.read_to_end() == b""
        finally:
            conn.close()


async def test_the_largest_content_length_is_taken() -> None:
    seen: list[int | None] = []

    def handler(request: PublicRequest) -> None:
        seen.append(request.content_length)
        request.client.answer(request, Answer("no_worker", "answered"))
        request.client.finished(request)

    loop = asyncio.get_running_loop()
    edge = EdgeServer(handler, EdgeLimits(), loop)
    listener = await loop.create_server(edge, "127.0.0.1", 0)
    conn = await RawHttp.open(int(listener.sockets[0].getsockname()[1]))
    try:
        conn.send(
            b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\nab" % MAX_CONTENT_LENGTH
        )
        status, _, _ = await conn.read_reply()
        assert status == 503
        assert seen == [MAX_CONTENT_LENGTH]
    finally:
        conn.close()
        listener.close()
        await edge.shutdown(0.5)


# --- closed connections are freed at once ------------------------------------------------------


async def test_closed_connections_are_freed_with_the_collector_off() -> None:
    connections = 40
    async with an_edge(EdgeLimits()) as edge:
        with collector_off():
            before = live(EdgeConnection)
            clients = [await RawHttp.open(edge.port) for _ in range(connections)]
            for index, client in enumerate(clients):
                if index % 2:
                    client.send(unfinished_head(60000))
                else:  # a slow request, pipelined ones behind it, one with a body
                    client.send(
                        b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
                        + GET * 4
                        + b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nabc"
                        + b"GET /next HTTP/1.1\r\nHost: x\r\nX-A: "
                    )
            await wait_until(
                lambda: _true(live(EdgeConnection) - before == connections), "accepted", 5
            )
            await asyncio.sleep(0.3)
            assert edge.server.head_bytes_held > connections // 2 * 50000
            assert live(PublicRequest) >= connections // 2 * 6
            for client in clients:
                client.close()
            await wait_until(lambda: closed(edge.server), "the connections to close", 5)
            edge.release.set()  # the slow requests' handlers finish (for nobody)
            await asyncio.sleep(0.2)
            assert edge.server.head_bytes_held == 0
            assert live(EdgeConnection) == before
            assert live(PublicRequest) == 0
            assert live(RequestBody) == 0


async def test_connections_closed_on_a_router_are_freed_with_the_collector_off(
    tmp_path: Path,
) -> None:
    # The whole router: requests forwarded to a worker (one parked there when its client
    # leaves), unfinished heads, answers the router gives itself.
    async with open_rig(tmp_path) as rig:
        await rig.start_router(router_config(tmp_path))
        worker = await rig.add_worker("w0")
        port = rig.router.public_port
        with collector_off():
            before = live(EdgeConnection)
            clients = [await RawHttp.open(port) for _ in range(12)]
            for index, client in enumerate(clients):
                if index % 3 == 0:
                    client.send(unfinished_head(60000))
                elif index % 3 == 1:
                    client.send(GET + b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nab")
                else:
                    client.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + GET)
            await wait_until(lambda: _true(worker.parked == 4), "the slow requests to park", 5)
            for client in clients:
                client.close()
            edge = rig.router._edge
            assert edge is not None
            await wait_until(lambda: closed(edge), "the connections to close", 5)
            worker.release.set()
            await asyncio.sleep(0.3)
            # The requests handled may live on in the relay's own cycles (an exception's
            # traceback holding their frames) until the collector runs; their connections
            # do not.
            assert live(EdgeConnection) == before
            assert edge.head_bytes_held == 0
            left = [obj for obj in gc.get_objects() if type(obj) is PublicRequest]
            assert all(not request.raw_headers for request in left)  # nor their heads
