"""Worker pools one client cannot monopolise, through a real router (design §1, §8).

A `RouterService` runs in this process on loopback ports with a small pool per worker
(`limits.worker_connections`), so a handful of hostile clients is enough to fill it when the
router lets them: slow uploads, uploads too large to buffer, and clients that never read
their replies. Each test then asks what a well-behaved client of the same worker gets,
and what the worker saw: slow clients must cost their own bytes, not its connections,
and a pool that is full anyway is 503 `worker_busy`, never the worker's fault.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from router.config import LimitsConfig, TimeoutsConfig
from router.relay import BufferLimits
from router.service.router_service import RouterService
from tests.app.test_faults import OK_REPLY, ScriptedWorker, request_bytes
from tests.metrics.test_registry import scrape, series
from tests.router_fixtures import TOKEN_HEADER, RawHttp, Rig, open_rig, router_config, token

pytestmark = pytest.mark.timeout(30)

POOL = 4  # connections per worker in these tests: the share for paced exchanges is 2


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


async def start(rig: Rig, tmp_path: Path, **limit_fields: Any) -> RouterService:
    """A router whose pools hold POOL connections, with `limits` changed by `limit_fields`."""
    timeouts = TimeoutsConfig(connect_s=0.5, first_byte_s=5.0, stream_idle_s=5.0)
    fields = {"worker_connections": POOL, **limit_fields}
    limits = dataclasses.replace(LimitsConfig(), **fields)
    return await rig.start_router(router_config(tmp_path, timeouts=timeouts, limits=limits))


def episode_headers(body_length: int | None = None) -> list[tuple[str, str]]:
    headers = [(TOKEN_HEADER, token("ep"))]
    if body_length is not None:
        headers.append(("Content-Length", str(body_length)))
    return headers


async def steady_call(router: RouterService) -> tuple[int, float]:
    """One small call for the episode: its status and how long it took."""
    conn = await RawHttp.open(router.public_port)
    try:
        started = time.monotonic()
        conn.send(request_bytes("POST", "/tool", episode_headers(), b'{"x":1}'))
        status, _, _ = await conn.read_reply()
        return status, time.monotonic() - started
    finally:
        conn.close()


async def open_clients(router: RouterService, count: int, first_bytes: bytes) -> list[RawHttp]:
    clients = []
    for _ in range(count):
        conn = await RawHttp.open(router.public_port)
        conn.send(first_bytes)
        clients.append(conn)
    return clients


def upstream_failures(router: RouterService) -> dict[str, float]:
    return series(scrape(router.metrics), "episode_router_upstream_failures_total")


async def test_slow_uploads_that_fit_the_buffer_hold_no_worker_connection(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path)
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    slow_head = request_bytes("POST", "/upload", episode_headers(1000)) + b"a" * 10
    slow = await open_clients(router, 3 * POOL, slow_head)  # 10 bytes of 1000, then silence
    try:
        await asyncio.sleep(0.3)
        results = [await steady_call(router) for _ in range(5)]
    finally:
        for conn in slow:
            conn.close()

    assert [status for status, _ in results] == [200] * 5
    assert max(took for _, took in results) < 2.0, results  # never a wait for a connection
    assert worker.connections == 1  # only the steady calls' connection, kept alive
    assert [arrived.target for arrived in worker.arrived] == ["/tool"] * 5
    assert upstream_failures(router) == {}


async def test_a_body_buffered_behind_expect_100_continue_gets_the_routers_100(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path)
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    headers = [*episode_headers(5), ("Expect", "100-continue")]
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("POST", "/upload", headers))
        interim, _, _ = await conn.read_head()
        await asyncio.sleep(0.3)
        assert worker.connections == 0  # no connection is taken before the body is in
        conn.send(b"hello")
        status, _, _ = await conn.read_reply()
    finally:
        conn.close()

    assert (interim, status) == (100, 200)
    [arrived] = worker.arrived
    assert arrived.body == b"hello"
    assert arrived.values("expect") == []


async def test_a_chunked_body_that_grows_past_the_buffer_streams_from_where_it_ended(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, body_buffer_bytes=1024)
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    headers = [*episode_headers(), ("Transfer-Encoding", "chunked")]
    parts = [bytes([65 + n]) * 700 for n in range(4)]
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("POST", "/upload", headers))
        for part in parts:
            conn.send(b"%x\r\n%b\r\n" % (len(part), part))
            await asyncio.sleep(0.05)
        conn.send(b"0\r\n\r\n")
        status, _, _ = await conn.read_reply()
    finally:
        conn.close()

    assert status == 200
    [arrived] = worker.arrived
    assert arrived.decoded == b"".join(parts)
    assert arrived.values("transfer-encoding") == ["chunked"]  # it streamed


async def test_uploads_too_large_to_buffer_hold_only_their_share_and_the_rest_is_503(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, body_buffer_bytes=16)
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    big_head = request_bytes("POST", "/upload", episode_headers(100_000)) + b"b" * 100
    streaming = await open_clients(router, POOL // 2, big_head)
    extra = await RawHttp.open(router.public_port)
    try:
        await asyncio.sleep(0.3)
        extra.send(big_head)
        status, headers, body = await extra.read_reply()
        steady = [await steady_call(router) for _ in range(3)]
    finally:
        for conn in [*streaming, extra]:
            conn.close()

    assert (status, json.loads(body)["error"]) == (503, "worker_busy"), body
    assert headers["retry-after"] == "1"
    assert [status for status, _ in steady] == [200] * 3
    assert worker.connections == POOL // 2 + 1  # the two uploads, and the steady calls'
    assert upstream_failures(router) == {}
    assert (await rig.worker_views())["w0"]["state"] == "live"


async def test_a_full_pool_is_503_worker_busy_and_the_worker_is_not_blamed(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, worker_connections=1)
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    held = asyncio.ensure_future(rig.request("POST", "/hang", episode=token("ep"), data=b"a"))
    try:
        for _ in range(100):  # 2 s at most
            if worker.parked:
                break
            await asyncio.sleep(0.02)
        started = time.monotonic()
        reply = await rig.request("POST", "/tool", episode=token("ep"), data=b"b")
        took = time.monotonic() - started
    finally:
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)

    assert (reply.status, reply.json()["error"]) == (503, "worker_busy"), reply
    assert reply.headers["Retry-After"] == "1"
    assert 0.4 <= took < 3.0, took  # it waited connect_s for a turn
    assert upstream_failures(router) == {}
    assert (await rig.worker_views())["w0"]["state"] == "live"


def _reading_nothing() -> socket.socket:
    """A client socket with the smallest receive buffer: what it does not read stays in
    the router, not in its kernel."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    return sock


async def test_clients_that_never_read_a_reply_that_fits_the_buffer_hold_no_connection(
    rig: Rig, tmp_path: Path
) -> None:
    # Replies larger than the kernel's socket buffers on loopback (4 MiB at most), so what
    # a client does not read stays in the router; the reply buffer is raised to fit them.
    size = 6_000_000
    router = await start(rig, tmp_path, reply_buffer_bytes=8 << 20)
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    ask = request_bytes("GET", f"/big?bytes={size}", episode_headers())
    loop = asyncio.get_running_loop()
    idle: list[socket.socket] = []
    try:
        for _ in range(2 * POOL):
            sock = _reading_nothing()
            sock.setblocking(False)
            await loop.sock_connect(sock, ("127.0.0.1", router.public_port))
            await loop.sock_sendall(sock, ask)
            idle.append(sock)
        await asyncio.sleep(0.5)
        results = [await steady_call(router) for _ in range(3)]
        held = router.forwarder.budget.held
        shown = series(scrape(router.metrics), "episode_router_buffered_bytes")
    finally:
        for sock in idle:
            sock.close()

    assert [status for status, _ in results] == [200] * 3
    assert max(took for _, took in results) < 2.0, results
    assert 2 * POOL * size // 2 <= held <= router.forwarder.budget.limit  # in memory, within budget
    assert shown == {"": held}  # and shown to operators
    assert upstream_failures(router) == {}


async def test_past_the_budget_a_body_streams_as_a_large_one_would(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, buffer_budget_bytes=0)
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("POST", "/upload", episode_headers(20)) + b"c" * 10)
        for _ in range(100):  # 2 s at most
            if worker.connections:
                break
            await asyncio.sleep(0.02)
        streamed = worker.connections
        conn.send(b"c" * 10)
        status, _, _ = await conn.read_reply()
    finally:
        conn.close()

    assert (streamed, status) == (1, 200)  # the worker had the head before the body was in
    refusals = series(scrape(router.metrics), "episode_router_buffer_budget_refusals_total")
    assert refusals == {"": router.forwarder.budget.refused} and router.forwarder.budget.refused


async def open_non_readers(router: RouterService, count: int, ask: bytes) -> list[socket.socket]:
    loop = asyncio.get_running_loop()
    idle: list[socket.socket] = []
    for _ in range(count):
        sock = _reading_nothing()
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", router.public_port))
        await loop.sock_sendall(sock, ask)
        idle.append(sock)
    return idle


async def test_replies_too_large_to_buffer_past_the_share_are_read_into_memory(
    rig: Rig, tmp_path: Path
) -> None:
    # A reply buffer far under the replies: each is relayed at its client's pace, two (the
    # share of 4) holding connections; the others are read whole within the budget.
    router = await start(rig, tmp_path, reply_buffer_bytes=1024)
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    size = 6_000_000
    ask = request_bytes("GET", f"/big?bytes={size}", episode_headers())
    idle = await open_non_readers(router, 2 * POOL, ask)
    try:
        await asyncio.sleep(0.5)
        results = [await steady_call(router) for _ in range(3)]
        held = router.forwarder.budget.held
    finally:
        for sock in idle:
            sock.close()

    assert [status for status, _ in results] == [200] * 3
    assert held >= (2 * POOL - POOL // 2) * size  # the ones past the share, in memory
    assert router.forwarder.paced_over_share == 0
    assert upstream_failures(router) == {}


async def test_past_the_share_and_the_budget_a_reply_streams_and_is_counted(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, reply_buffer_bytes=1024, buffer_budget_bytes=0)
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    ask = request_bytes("GET", "/big?bytes=6000000", episode_headers())
    idle = await open_non_readers(router, POOL // 2 + 1, ask)
    try:
        for _ in range(100):  # 2 s at most
            if router.forwarder.paced_over_share:
                break
            await asyncio.sleep(0.02)
        status, _ = await steady_call(router)  # the last free connection
    finally:
        for sock in idle:
            sock.close()

    assert (router.forwarder.paced_over_share, status) == (1, 200)
    over = series(scrape(router.metrics), "episode_router_paced_over_share_total")
    assert over == {"": 1}


async def test_event_streams_flush_at_once_and_take_no_paced_place(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, body_buffer_bytes=16)
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    conns: list[RawHttp] = []
    streams = []
    try:
        for _ in range(POOL // 2):  # as many as the paced share: if they took it...
            conn = await RawHttp.open(router.public_port)
            conns.append(conn)
            conn.send(request_bytes("GET", "/sse", episode_headers()))
            status, headers, _ = await conn.read_head()
            first = await asyncio.wait_for(conn.reader.readuntil(b"\n\n"), 5)
            streams.append((status, headers["content-type"].split(";")[0], first))
        # ...an upload too large to buffer would find no paced place (503).
        upload = await RawHttp.open(router.public_port)
        conns.append(upload)
        upload.send(request_bytes("POST", "/upload", episode_headers(64)) + b"u" * 32)
        await asyncio.sleep(0.2)  # it streams: over the body buffer, not all in
        upload.send(b"u" * 32)
        uploaded, _, _ = await upload.read_reply()
    finally:
        worker.sse_go.set()
        for conn in conns:
            conn.close()

    assert [(status, kind) for status, kind, _ in streams] == [(200, "text/event-stream")] * 2
    assert all(first.endswith(b"data: first\n\n") for _, _, first in streams), streams
    assert uploaded == 200


async def test_a_buffered_chunked_body_over_max_body_bytes_is_413_and_reaches_no_worker(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, max_body_bytes=100)
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    headers = [*episode_headers(), ("Transfer-Encoding", "chunked")]
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("POST", "/upload", headers) + b"50\r\n" + b"a" * 80 + b"\r\n")
        await asyncio.sleep(0.1)
        conn.send(b"50\r\n" + b"b" * 80 + b"\r\n0\r\n\r\n")
        status, _, body = await conn.read_reply()
    finally:
        conn.close()

    assert (status, json.loads(body)["error"]) == (413, "payload_too_large")
    assert worker.connections == 0


async def test_a_reload_changes_the_paced_share_of_pools_already_open(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, body_buffer_bytes=16)
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    assert (await steady_call(router))[0] == 200  # the pool is open
    router.forwarder.set_buffering(BufferLimits(body_bytes=16, paced_share=0.25))
    big_head = request_bytes("POST", "/upload", episode_headers(100_000)) + b"b" * 100
    streaming = await open_clients(router, 1, big_head)  # the one place of 4 x 0.25
    extra = await RawHttp.open(router.public_port)
    try:
        await asyncio.sleep(0.3)
        extra.send(big_head)
        status, _, body = await extra.read_reply()
    finally:
        for conn in [*streaming, extra]:
            conn.close()

    assert (status, json.loads(body)["error"]) == (503, "worker_busy"), body


async def test_a_sessionless_request_that_finds_its_worker_busy_goes_to_another(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, worker_connections=1)
    w0 = await rig.add_worker("w0")
    await rig.add_worker("w1")
    assert (await rig.admin("POST", "/admin/workers/w1/drain")).status == 200
    held = asyncio.ensure_future(rig.request("POST", "/hang", data=b"a"))
    try:
        for _ in range(100):  # 2 s at most
            if w0.parked:
                break
            await asyncio.sleep(0.02)
        queued = asyncio.ensure_future(rig.request("POST", "/queued", data=b"bb"))
        await asyncio.sleep(0.1)  # decided for w0, waiting for its one connection
        assert (await rig.admin("DELETE", "/admin/workers/w1/drain")).status == 200
        reply = await queued
    finally:
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)

    assert (reply.status, reply.worker) == (200, "w1")
    assert upstream_failures(router) == {}


async def test_a_body_announced_and_not_sent_reserves_no_budget(rig: Rig, tmp_path: Path) -> None:
    # Budget is reserved as body bytes arrive, never by the announced length: heads that
    # announce the whole buffer and send 10 bytes hold one step each, not the buffer.
    router = await start(rig, tmp_path, buffer_budget_bytes=4 << 20)
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    head = request_bytes("POST", "/upload", episode_headers(1 << 20)) + b"a" * 10
    announcers = await open_clients(router, 8, head)  # 8 MiB announced, 80 bytes sent
    try:
        await asyncio.sleep(0.3)
        held = router.forwarder.budget.held
        refused = router.forwarder.budget.refused
        upload = request_bytes("POST", "/upload", episode_headers(), b"b" * 300_000)
        conn = await RawHttp.open(router.public_port)
        try:
            conn.send(upload)
            status, _, _ = await conn.read_reply()
        finally:
            conn.close()
    finally:
        for client in announcers:
            client.close()

    assert held <= 8 * 128 * 1024, held  # a step ahead of the bytes each, at most
    assert refused == 0
    assert status == 200
    assert router.forwarder.budget.refused == 0  # the real upload was buffered whole
    assert worker.connections == 1  # and the announcers took no worker connection


CHUNKED_SIZE = 6_000_000  # past the kernel's socket buffers on loopback: it stays in the router


class ChunkedWorker(ScriptedWorker):
    """Answers `/big` with a chunked reply of CHUNKED_SIZE bytes (no Content-Length), and
    anything else with a small one."""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        piece = b"%x\r\n" % 65536 + b"x" * 65536 + b"\r\n"
        tail = CHUNKED_SIZE % 65536
        last = b"%x\r\n" % tail + b"x" * tail + b"\r\n0\r\n\r\n"
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                if not head.startswith(b"GET /big "):
                    writer.write(OK_REPLY)
                    await writer.drain()
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                for _ in range(CHUNKED_SIZE // 65536):
                    writer.write(piece)
                    await writer.drain()
                writer.write(last)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


async def test_chunked_replies_past_the_share_are_read_into_memory(
    rig: Rig, tmp_path: Path
) -> None:
    # A reply of unknown length past the paced share tries the budget as a Content-Length
    # one does: the non-readers past the share hold bytes, not the worker's connections.
    router = await start(rig, tmp_path)
    worker = await ChunkedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    ask = request_bytes("GET", "/big", episode_headers())
    idle = await open_non_readers(router, 2 * POOL, ask)
    try:
        await asyncio.sleep(1.0)
        results = [await steady_call(router) for _ in range(3)]
        held = router.forwarder.budget.held
    finally:
        for sock in idle:
            sock.close()

    assert [status for status, _ in results] == [200] * 3
    assert max(took for _, took in results) < 2.0, results
    assert held >= (2 * POOL - POOL // 2) * CHUNKED_SIZE // 2  # the ones past the share
    assert router.forwarder.paced_over_share == 0
    assert upstream_failures(router) == {}


async def test_past_the_share_and_the_budget_a_client_that_reads_nothing_is_cut(
    rig: Rig, tmp_path: Path
) -> None:
    # No budget: the non-readers past the share wait connect_s for a paced place, then
    # stream past it, and are cut once they take nothing for over_share_send_s: their
    # connections come back, and the steady client gets its 200 from a free pool.
    router = await start(rig, tmp_path, reply_buffer_bytes=1024, buffer_budget_bytes=0)
    router.forwarder.over_share_send_s = 0.5
    worker = await ChunkedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    ask = request_bytes("GET", "/big", episode_headers())
    idle = await open_non_readers(router, POOL, ask)  # 2 in the share, 2 past it
    try:
        for _ in range(200):  # 4 s at most
            if router.forwarder.paced_over_share_cut == POOL - POOL // 2:
                break
            await asyncio.sleep(0.02)
        cut = router.forwarder.paced_over_share_cut
        results = [await steady_call(router) for _ in range(3)]
    finally:
        for sock in idle:
            sock.close()

    assert (router.forwarder.paced_over_share, cut) == (POOL - POOL // 2, POOL - POOL // 2)
    assert [status for status, _ in results] == [200] * 3
    shown = series(scrape(router.metrics), "episode_router_paced_over_share_cut_total")
    assert shown == {"": POOL - POOL // 2}
    assert upstream_failures(router) == {}


async def test_past_the_share_and_the_budget_a_client_that_reads_gets_the_whole_reply(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, reply_buffer_bytes=1024, buffer_budget_bytes=0)
    router.forwarder.over_share_send_s = 0.5
    worker = await ChunkedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    ask = request_bytes("GET", "/big", episode_headers())
    idle = await open_non_readers(router, POOL // 2, ask)  # the share, taken
    conn = await RawHttp.open(router.public_port)
    try:
        for _ in range(100):  # 2 s at most
            if router.forwarder._pools["w0"].paced == POOL // 2:
                break
            await asyncio.sleep(0.02)
        conn.send(request_bytes("GET", "/big", [*episode_headers(), ("Connection", "close")]))
        everything = await conn.read_to_end()
    finally:
        conn.close()
        for sock in idle:
            sock.close()

    head, body = everything.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert body.count(b"x") == CHUNKED_SIZE  # all of it, though past the share
    assert body.endswith(b"0\r\n\r\n")  # and cleanly ended
    assert router.forwarder.paced_over_share == 1
    assert router.forwarder.paced_over_share_cut == 0


async def test_a_body_that_switches_to_streaming_gives_its_budget_back(
    rig: Rig, tmp_path: Path
) -> None:
    router = await start(rig, tmp_path, body_buffer_bytes=1024)
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    headers = [*episode_headers(), ("Transfer-Encoding", "chunked")]
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("POST", "/upload", headers))
        conn.send(b"%x\r\n%b\r\n" % (500, b"a" * 500))  # buffered: budget reserved
        await asyncio.sleep(0.1)
        reserved_while_buffered = router.forwarder.budget.held
        conn.send(b"%x\r\n%b\r\n" % (2000, b"a" * 2000))  # past the buffer: it streams
        for _ in range(100):  # 2 s at most
            if worker.connections:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)
        held_while_streaming = router.forwarder.budget.held
        conn.send(b"0\r\n\r\n")
        status, _, _ = await conn.read_reply()
    finally:
        conn.close()

    assert 500 <= reserved_while_buffered <= 1024  # the bytes here, at most the buffer
    assert (worker.connections, held_while_streaming, status) == (1, 0, 200)


async def test_a_reply_that_switches_to_streaming_gives_its_budget_back(
    rig: Rig, tmp_path: Path
) -> None:
    # Past the share, the third reply is read into a 3 MiB budget that cannot hold it,
    # then streams past the share: what it reserved goes back as it does.
    router = await start(rig, tmp_path, reply_buffer_bytes=1024, buffer_budget_bytes=3 << 20)
    worker = await ChunkedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    ask = request_bytes("GET", "/big", episode_headers())
    idle = await open_non_readers(router, POOL // 2 + 1, ask)
    try:
        for _ in range(200):  # 4 s at most
            if router.forwarder.paced_over_share:
                break
            await asyncio.sleep(0.02)
        over = router.forwarder.paced_over_share
        held = router.forwarder.budget.held
        refused = router.forwarder.budget.refused
    finally:
        for sock in idle:
            sock.close()

    assert (over, held) == (1, 0)
    assert refused >= 1  # it did try the budget first
