"""A worker's bytes nobody asked for never reach a client (design §8, "Worker replies").

A `RouterService` runs in this process; behind it, a worker on a loopback port answers
each GET with its own target as the body, and then, as a broken or hostile worker might,
writes a second, unsolicited reply (`stray`) on the same connection: in the same write,
or a while later, when the router holds the connection idle in its pool. The router must
close such a connection instead of handing it to the next request, and once a worker has
sent stray bytes, stop reusing its connections: HTTP/1.1 cannot tell a stray reply from
the next request's once that request was written.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from tests.router_fixtures import RawHttp, RawLease, Rig, open_rig, wait_until

pytestmark = pytest.mark.timeout(30)

STRAY = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray"


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


class StrayWorker:
    """Answers every GET with its target, then writes `STRAY` after `delay_s` (None: in the
    same write). Counts its connections and notes when the router closed each."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self.connections = 0
        self.closed_at: list[float] = []  # when the router closed a connection (monotonic)
        self.stray_at: list[float] = []  # when a stray reply went out
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.lease: RawLease | None = None

    async def start(self, rig: Rig) -> StrayWorker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        rig.stack.push_async_callback(self.stop)
        self.lease = await RawLease.open(rig.control_address)
        hello = await self.lease.hello("w0", f"http://127.0.0.1:{self.port}", secrets.token_hex(8))
        assert hello["ok"] is True, hello
        synced = await self.lease.call("sync", claims=[], more=False)
        assert synced["ok"] is True, synced
        return self

    async def stop(self) -> None:
        if self.lease is not None:
            self.lease.abort()
        for task in self._tasks:
            task.cancel()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b" ", 2)[1]
                reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(target), target)
                if self.delay_s is None:
                    writer.write(reply + STRAY)
                    self.stray_at.append(time.monotonic())
                else:
                    writer.write(reply)
                    task = asyncio.create_task(self._stray_later(writer), name="stray-reply")
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        except (ConnectionError, asyncio.IncompleteReadError):
            self.closed_at.append(time.monotonic())
        finally:
            writer.close()

    async def _stray_later(self, writer: asyncio.StreamWriter) -> None:
        assert self.delay_s is not None
        await asyncio.sleep(self.delay_s)
        if not writer.is_closing():
            writer.write(STRAY)
            self.stray_at.append(time.monotonic())


async def _soon(check: Callable[[], bool], what: str) -> None:
    async def holds() -> bool:
        return check()

    await wait_until(holds, what)


async def _get(conn: RawHttp, target: str) -> bytes:
    conn.send(f"GET {target} HTTP/1.1\r\nHost: public.example\r\n\r\n".encode())
    status, _, body = await conn.read_reply()
    assert status == 200, (status, body)
    return body


async def test_a_pooled_connection_that_gets_stray_bytes_while_idle_is_closed_at_once(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    worker = await StrayWorker(delay_s=0.05).start(rig)
    conn = await RawHttp.open(router.public_port)
    try:
        assert await _get(conn, "/first") == b"/first"
        # The stray reply comes 50 ms later, while the router holds the connection idle.
        await _soon(lambda: bool(worker.stray_at), "the stray reply went out")
        await _soon(lambda: bool(worker.closed_at), "the router closed it")
        assert worker.closed_at[0] - worker.stray_at[0] < 1.0  # closed on arrival, not at reuse
        assert await _get(conn, "/second") == b"/second"  # never the stray reply
    finally:
        conn.close()
    assert worker.connections == 2


async def test_stray_bytes_in_the_same_write_as_a_reply_spoil_only_that_connection(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    worker = await StrayWorker(delay_s=None).start(rig)
    conn = await RawHttp.open(router.public_port)
    try:
        bodies = [await _get(conn, f"/call-{n}") for n in range(3)]
    finally:
        conn.close()
    assert bodies == [b"/call-0", b"/call-1", b"/call-2"]
    assert worker.connections == 3  # each connection carried one exchange


async def test_a_worker_that_sent_stray_bytes_gets_no_reused_connection_under_load(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    worker = await StrayWorker(delay_s=0.05).start(rig)
    first = await RawHttp.open(router.public_port)
    try:
        assert await _get(first, "/warm-up") == b"/warm-up"
        await _soon(lambda: bool(worker.closed_at), "the router closed it")  # seen while idle
    finally:
        first.close()

    async def client(index: int) -> list[tuple[bytes, bytes]]:
        conn = await RawHttp.open(router.public_port)
        try:
            got = []
            for call in range(10):
                target = f"/c{index}-{call}"
                got.append((target.encode(), await _get(conn, target)))
            return got
        finally:
            conn.close()

    results = await asyncio.gather(*(client(index) for index in range(16)))
    calls = [pair for result in results for pair in result]
    misdelivered = [(sent, got) for sent, got in calls if sent != got]
    assert len(calls) == 160
    assert misdelivered == []
    assert worker.connections == 1 + 160  # one exchange per connection since the stray
