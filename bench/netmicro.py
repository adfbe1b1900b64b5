"""Micro-benchmarks through a real router process: streaming bodies and idle connections.

This module owns the two measurements that need the router as its own process,
so that its memory is its own: a large request and a large reply streamed
through it (its peak RSS growth), and many idle keep-alive client connections
held by it (its RSS per connection). One bench worker claims one episode over
the control socket; every request carries that episode's token. All traffic is
on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from bench.episodes import mint_episodes
from bench.figures import STREAM_TARGET_GROWTH, Figure, MiB, judge
from bench.launch import Child, free_port, raise_fd_limit, start_router, start_worker
from bench.load import run_async
from bench.peers import TOKEN_HEADER, router_config
from bench.procstat import peak_rss_bytes, rss_bytes

__all__ = ["bench_idle", "bench_streaming"]

CHUNK = 256 * 1024  # what the client sends and receives at a time
OPEN_BATCH = 200  # idle connections opened concurrently
OPEN_TIMEOUT_S = 120.0  # a bound on opening all of them
SETTLE_S = 1.0  # after the last connection opened, before the router's RSS is read
SAMPLE_S = 0.02  # RSS sampling period when the peak cannot be reset


@contextlib.contextmanager
def _router_with_worker(folder: Path) -> Iterator[tuple[Child, str]]:
    """A router process and one worker that claimed one episode; yields (router, token)."""
    episode = mint_episodes(1, 1)[0]
    control = folder / "control.sock"
    port = free_port()
    config = folder / "router.yaml"
    config.write_text(router_config(port, free_port(), control))
    router = start_router(config, port, folder / "router.log")
    worker: Child | None = None
    try:
        keys = folder / "keys.json"
        keys.write_text(json.dumps([episode.key]))
        worker = start_worker("w0", f"unix:{control}", keys, folder / "w0.log")
        yield router, episode.token
    finally:
        if worker is not None:
            worker.stop()
        router.stop()


@contextlib.contextmanager
def _scratch_router() -> Iterator[tuple[Child, str]]:
    """`_router_with_worker` in a temporary folder, removed afterwards."""
    with (
        tempfile.TemporaryDirectory(prefix="episode-router-micro-") as scratch,
        _router_with_worker(Path(scratch)) as rig,
    ):
        yield rig


class PeakWatch:
    """The peak RSS of a process over a stretch of time.

    Resets the kernel's high-water mark (`/proc/<pid>/clear_refs` 5) when allowed
    and also samples VmRSS, taking the larger of the two.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.reset = False
        self.sampled = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="rss-sampler", daemon=True)

    def __enter__(self) -> PeakWatch:
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            self.reset = True
        except OSError:
            self.reset = False
        self.before = rss_bytes(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sampled = max(self.sampled, rss_bytes(self.pid))

    @property
    def growth(self) -> int:
        peak = max(self.sampled, peak_rss_bytes(self.pid) if self.reset else 0)
        return max(0, peak - self.before)


def _read_head(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """Status, lower-cased headers and the body bytes already read after the head."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise OSError("the connection closed before the reply head")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, rest


def upload(port: int, token: str, size: int) -> float:
    """POSTs `size` bytes to the worker's /sink through the router; returns the seconds.
    Raises OSError or ValueError when the worker did not get every byte."""
    chunk = memoryview(b"\0" * CHUNK)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        head = (
            f"POST /sink HTTP/1.1\r\nHost: 127.0.0.1\r\n{TOKEN_HEADER}: {token}\r\n"
            f"Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n\r\n"
        )
        started = time.perf_counter()
        sock.sendall(head.encode())
        left = size
        while left > 0:
            step = min(left, CHUNK)
            sock.sendall(chunk[:step])
            left -= step
        status, headers, body = _read_head(sock)
        while len(body) < int(headers.get("content-length", "0")):
            more = sock.recv(65536)
            if not more:
                raise OSError("upload: the connection closed in the reply body")
            body += more
        elapsed = time.perf_counter() - started
    received = json.loads(body).get("bytes") if status == 200 else None
    if received != size:
        raise ValueError(f"upload: status {status}, the worker got {received} of {size} bytes")
    return elapsed


def download(port: int, token: str, size: int) -> float:
    """GETs `size` bytes from the worker's /source through the router; returns the seconds."""
    buffer = bytearray(CHUNK)
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        request = (
            f"GET /source?bytes={size} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"{TOKEN_HEADER}: {token}\r\n\r\n"
        )
        started = time.perf_counter()
        sock.sendall(request.encode())
        status, headers, rest = _read_head(sock)
        if status != 200:
            raise ValueError(f"download: status {status}")
        left = int(headers.get("content-length", "-1")) - len(rest)
        got = len(rest)
        while left > 0:
            n = sock.recv_into(buffer, min(left, CHUNK))
            if n == 0:
                break
            left -= n
            got += n
        elapsed = time.perf_counter() - started
    if got != size:
        raise ValueError(f"download: got {got} of {size} bytes")
    return elapsed


def bench_streaming(size: int, full: bool) -> list[Figure]:
    """A `size`-byte request and a `size`-byte reply through a router process."""
    figures = []
    with _scratch_router() as (router, token):
        for label, transfer in (("request", upload), ("reply", download)):
            with PeakWatch(router.pid) as watch:
                seconds = transfer(router.port, token, size)
            growth = watch.growth
            figures.append(
                Figure(
                    "streaming",
                    f"{size / MiB:,.0f} MiB {label}: router RSS growth",
                    growth / MiB,
                    "MiB",
                    "<= 32 MiB for 1 GiB",
                    judge(full, growth <= STREAM_TARGET_GROWTH),
                    f"{size / MiB / seconds:,.0f} MiB/s",
                )
            )
    return figures


async def _open_idle(port: int, token: str, count: int) -> list[asyncio.StreamWriter]:
    """`count` connections that each made one request, read its reply and now idle."""
    request = (
        f"POST /tools/echo HTTP/1.1\r\nHost: 127.0.0.1\r\n{TOKEN_HEADER}: {token}\r\n"
        "Content-Length: 2\r\n\r\n{}"
    ).encode()

    async def one() -> asyncio.StreamWriter:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise ValueError(f"an idle connection's request got {head[:40]!r}")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        return writer

    writers: list[asyncio.StreamWriter] = []
    try:
        async with asyncio.timeout(OPEN_TIMEOUT_S):
            for start in range(0, count, OPEN_BATCH):
                batch = min(OPEN_BATCH, count - start)
                writers += await asyncio.gather(*(one() for _ in range(batch)))
    except BaseException:
        _close_all(writers)
        raise
    return writers


def _close_all(writers: list[asyncio.StreamWriter]) -> None:
    for writer in writers:
        writer.close()


def _fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _hold_idle(router: Child, token: str, count: int) -> tuple[int, int]:
    """(RSS growth, fd growth) of the router while `count` idle connections are held."""
    gc.collect()
    await asyncio.sleep(0.2)
    rss_before, fds_before = router.rss_bytes(), _fd_count(router.pid)
    writers = await _open_idle(router.port, token, count)
    try:
        await asyncio.sleep(SETTLE_S)
        return router.rss_bytes() - rss_before, _fd_count(router.pid) - fds_before
    finally:
        _close_all(writers)
        await asyncio.sleep(0.1)


def bench_idle(count: int) -> list[Figure]:
    """The router's memory per idle keep-alive client connection, `count` held at once."""
    limit = raise_fd_limit(count + 1024)
    if limit < count + 256:
        note = f"the open-file limit is {limit}: holding {limit - 256} connections"
        count = limit - 256
    else:
        note = ""
    with _scratch_router() as (router, token):
        grown, fds = run_async(_hold_idle(router, token, count))
    if fds < count * 0.95:
        raise RuntimeError(f"the router held {fds} new sockets for {count} connections")
    return [
        Figure(
            "idle",
            f"{count:,} idle keep-alive connections: router RSS",
            grown / MiB,
            "MiB",
            note=f"{grown / count / 1024:.1f} KiB per connection" + (f"; {note}" if note else ""),
        )
    ]
