"""The relay's connection pool on real sockets: loopback TCP and Unix sockets under tmp_path.

The worker here is a plain asyncio server that records its connections and, per
connection, reads what comes and answers only what a test tells it to.
"""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from router.relay import pool as relay_pool
from router.relay.connection import WOKE, WorkerConnection
from router.relay.pool import PoolBusy, PoolClosed, WorkerPool, paced_limit
from router.relay.wire import parse_worker_address

pytestmark = pytest.mark.timeout(30)
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


class Peer:
    """One connection the worker accepted."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.closed = asyncio.Event()  # the router's side closed it
        self.got = bytearray()  # every byte the router sent on it

    async def watch(self) -> None:
        while data := await self.reader.read(1 << 16):
            self.got += data
        self.closed.set()


class Worker:
    """A loopback (or Unix) server keeping every connection it accepts."""

    def __init__(self) -> None:
        self.peers: list[Peer] = []
        self.server: asyncio.Server | None = None
        self.url = ""
        self._tasks: set[asyncio.Task[None]] = set()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = Peer(reader, writer)
        self.peers.append(peer)
        task = asyncio.create_task(peer.watch(), name="peer-watch")
        self._tasks.add(task)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for peer in self.peers:
            peer.writer.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def started_worker() -> Worker:
    """A worker listening on loopback TCP (stop it with `stop()`)."""
    w = Worker()
    w.server = await asyncio.start_server(w._accept, "127.0.0.1", 0)
    w.url = f"http://127.0.0.1:{w.server.sockets[0].getsockname()[1]}"
    return w


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    w = await started_worker()
    yield w
    await w.stop()


def make_pool(url: str, limit: int = 4) -> WorkerPool:
    loop = asyncio.get_running_loop()
    return WorkerPool(url, parse_worker_address(url), limit, loop)


def soon(seconds: float = 1.0) -> float:
    return asyncio.get_running_loop().time() + seconds


async def eventually(check: object, within: float = 2.0) -> None:
    deadline = time.monotonic() + within
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def first_connection(worker: Worker) -> tuple[WorkerPool, WorkerConnection]:
    """A fresh pool to `worker` and its first connection, held, once the worker has it."""
    pool = make_pool(worker.url)
    conn = await pool.acquire(soon())
    await eventually(lambda: len(worker.peers) == 1)
    return pool, conn


async def exchange(conn: WorkerConnection, worker: Worker, index: int) -> None:
    """One complete exchange on `conn`: the worker answers OK on its `index`th peer."""
    conn.reply.begin(head_request=False)
    worker.peers[index].writer.write(OK)
    while not conn.reply.complete:
        assert await conn.wait(soon()) == WOKE
    assert conn.take_body() == b"ok"


async def test_a_released_connection_is_reused(worker: Worker) -> None:
    pool = make_pool(worker.url)
    first = await pool.acquire(soon())
    await eventually(lambda: len(worker.peers) == 1)
    await exchange(first, worker, 0)
    assert not first.reused
    pool.release(first)
    again = await pool.acquire(soon())
    assert (again is first, again.reused, len(worker.peers)) == (True, True, 1)
    pool.close()


async def test_a_connection_whose_reply_cannot_go_on_is_closed_on_release(
    worker: Worker,
) -> None:
    pool, conn = await first_connection(worker)
    conn.reply.begin(head_request=False)
    worker.peers[0].writer.write(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    while not conn.reply.complete:
        await conn.wait(soon())
    pool.release(conn)
    assert conn.closed
    await asyncio.wait_for(worker.peers[0].closed.wait(), 2)
    other = await pool.acquire(soon())
    assert other is not conn and not other.reused
    pool.close()


async def test_at_the_limit_a_request_waits_for_a_released_connection(worker: Worker) -> None:
    pool = make_pool(worker.url, limit=1)
    held = await pool.acquire(soon())
    await eventually(lambda: len(worker.peers) == 1)
    waiting = asyncio.create_task(pool.acquire(soon(2)), name="waiting")
    await asyncio.sleep(0.05)
    assert not waiting.done()
    await exchange(held, worker, 0)
    pool.release(held)
    assert await waiting is held
    assert (held.reused, len(worker.peers)) == (True, 1)
    pool.close()


async def test_waiting_for_a_connection_is_bounded_and_says_the_pool_was_busy(
    worker: Worker,
) -> None:
    pool = make_pool(worker.url, limit=1)
    held = await pool.acquire(soon())
    started = time.monotonic()
    with pytest.raises(PoolBusy):
        await pool.acquire(soon(0.2))
    assert 0.15 <= time.monotonic() - started < 1.0
    await eventually(lambda: len(worker.peers) == 1)
    await exchange(held, worker, 0)
    pool.release(held)  # nobody waits any more: it goes idle, no place leaked
    assert await pool.acquire(soon()) is held
    pool.close()


async def test_a_closed_connection_gives_its_place_to_the_next_in_line(worker: Worker) -> None:
    pool = make_pool(worker.url, limit=1)
    held = await pool.acquire(soon())
    waiting = asyncio.create_task(pool.acquire(soon(2)), name="waiting")
    await asyncio.sleep(0.05)
    held.abort()
    fresh = await waiting
    assert fresh is not held and not fresh.reused
    await eventually(lambda: len(worker.peers) == 2)
    with pytest.raises(PoolBusy):  # the limit still holds: one connection, held
        await pool.acquire(soon(0.1))
    pool.close()


async def test_an_idle_connection_the_worker_closes_leaves_the_pool(worker: Worker) -> None:
    pool = make_pool(worker.url, limit=1)
    conn = await pool.acquire(soon())
    await eventually(lambda: len(worker.peers) == 1)
    await exchange(conn, worker, 0)
    pool.release(conn)
    worker.peers[0].writer.close()
    await eventually(lambda: conn.closed)
    fresh = await pool.acquire(soon(0.5))  # its place is free: no wait
    assert fresh is not conn and not fresh.reused
    pool.close()


async def test_bytes_from_an_idle_worker_spoil_the_connection(worker: Worker) -> None:
    pool, conn = await first_connection(worker)
    await exchange(conn, worker, 0)
    pool.release(conn)
    worker.peers[0].writer.write(OK)  # a reply nobody asked for
    await eventually(lambda: not conn.reply.reusable)
    fresh = await pool.acquire(soon())
    assert fresh is not conn and conn.closed
    pool.close()


async def test_idle_connections_close_after_the_keepalive_bound(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(relay_pool, "KEEPALIVE_S", 0.2)
    pool = make_pool(worker.url)
    conns = [await pool.acquire(soon()), await pool.acquire(soon())]
    await eventually(lambda: len(worker.peers) == 2)
    for index, conn in enumerate(conns):
        await exchange(conn, worker, index)
        pool.release(conn)
    await asyncio.wait_for(asyncio.gather(*(p.closed.wait() for p in worker.peers)), 2)
    assert all(conn.closed for conn in conns)
    assert not (await pool.acquire(soon())).reused
    pool.close()


async def test_an_idle_connection_past_the_bound_is_never_handed_out(
    worker: Worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    pool, conn = await first_connection(worker)
    await exchange(conn, worker, 0)
    pool.release(conn)
    monkeypatch.setattr(relay_pool, "KEEPALIVE_S", 0.0)  # as if the sweep were late
    fresh = await pool.acquire(soon())
    assert (fresh is conn, conn.closed) == (False, True)
    pool.close()


async def test_reopen_replaces_a_stale_connection_with_a_fresh_one(worker: Worker) -> None:
    pool = make_pool(worker.url, limit=1)
    conn = await pool.acquire(soon())
    await eventually(lambda: len(worker.peers) == 1)
    await exchange(conn, worker, 0)
    pool.release(conn)
    reused = await pool.acquire(soon())
    fresh = await pool.reopen(reused, soon())
    assert (fresh is reused, fresh.reused, reused.closed) == (False, False, True)
    await eventually(lambda: len(worker.peers) == 2)
    await asyncio.wait_for(worker.peers[0].closed.wait(), 2)
    pool.close()


async def test_close_fails_waiters_and_later_acquires(worker: Worker) -> None:
    pool = make_pool(worker.url, limit=1)
    held = await pool.acquire(soon())
    waiting = asyncio.create_task(pool.acquire(soon(2)), name="waiting")
    await asyncio.sleep(0.05)
    pool.close()
    with pytest.raises(PoolClosed):
        await waiting
    with pytest.raises(PoolClosed):
        await pool.acquire(soon())
    assert held.closed
    await eventually(lambda: len(worker.peers) == 1)
    await asyncio.wait_for(worker.peers[0].closed.wait(), 2)


async def test_a_refused_connect_keeps_its_errno_and_frees_its_place() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    for host in ("127.0.0.1", "localhost"):  # a literal, and a name resolved address by address
        pool = make_pool(f"http://{host}:{port}", limit=1)
        for _ in range(2):  # the second try is refused too, not left waiting
            with pytest.raises(OSError) as caught:
                await pool.acquire(soon())
            assert caught.value.errno == errno.ECONNREFUSED
        pool.close()


async def test_a_missing_unix_socket_is_enoent(tmp_path: Path) -> None:
    pool = make_pool(f"unix:{tmp_path / 'gone.sock'}")
    with pytest.raises(OSError) as caught:
        await pool.acquire(soon())
    assert caught.value.errno == errno.ENOENT
    pool.close()


async def test_unix_socket_connection(tmp_path: Path) -> None:
    worker = Worker()
    path = tmp_path / "w.sock"
    worker.server = await asyncio.start_unix_server(worker._accept, str(path))
    try:
        pool = make_pool(f"unix:{path}")
        conn = await pool.acquire(soon())
        conn.write(b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
        await eventually(lambda: len(worker.peers) == 1)
        await eventually(lambda: worker.peers[0].got.endswith(b"\r\n\r\n"))
        assert worker.peers[0].got == b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"
        await exchange(conn, worker, 0)
        pool.close()
    finally:
        await worker.stop()


def test_the_paced_share_is_a_part_of_the_pool_and_at_least_one_place() -> None:
    assert [paced_limit(256, 0.5), paced_limit(10, 0.25), paced_limit(1, 0.5)] == [128, 2, 1]
    assert paced_limit(4, 1.0) == 4


async def test_places_held_at_a_clients_pace_stop_at_their_share(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    pool = WorkerPool(worker.url, parse_worker_address(worker.url), 4, loop, paced_share=0.5)
    assert (pool.take_paced(), pool.take_paced(), pool.take_paced()) == (True, True, False)
    assert pool.paced == 2
    pool.give_paced()
    assert (pool.take_paced(), pool.paced) == (True, 2)
    pool.close()


async def test_a_paced_place_given_back_goes_to_the_first_waiting_for_one(
    worker: Worker,
) -> None:
    loop = asyncio.get_running_loop()
    pool = WorkerPool(worker.url, parse_worker_address(worker.url), 4, loop, paced_share=0.5)
    assert pool.take_paced() and pool.take_paced()
    first = asyncio.ensure_future(pool.wait_paced(soon(2.0)))
    second = asyncio.ensure_future(pool.wait_paced(soon(2.0)))
    await asyncio.sleep(0)
    pool.give_paced()
    assert await first is True
    assert not second.done() and pool.paced == 2  # handed on, still counted
    pool.close()
    assert await second is False  # the pool closed: no place will come


async def test_waiting_for_a_paced_place_is_bounded(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    pool = WorkerPool(worker.url, parse_worker_address(worker.url), 2, loop, paced_share=0.5)
    assert pool.take_paced()
    started = loop.time()
    assert await pool.wait_paced(soon(0.2)) is False
    assert 0.15 <= loop.time() - started < 2.0
    pool.give_paced()
    assert pool.paced == 0  # nobody waits: the place is free again
    pool.close()


async def test_a_waiter_handed_a_paced_place_as_it_gives_up_hands_it_on(worker: Worker) -> None:
    loop = asyncio.get_running_loop()
    pool = WorkerPool(worker.url, parse_worker_address(worker.url), 2, loop, paced_share=0.5)
    assert pool.take_paced()
    leaving = asyncio.ensure_future(pool.wait_paced(soon(2.0)))
    staying = asyncio.ensure_future(pool.wait_paced(soon(2.0)))
    await asyncio.sleep(0)
    pool.give_paced()  # to `leaving`, cancelled before it runs
    leaving.cancel()
    assert await staying is True
    assert pool.paced == 1
    pool.close()
