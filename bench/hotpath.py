"""The forwarding hot path in one process: CPU microseconds the router adds per request.

`python -m bench.hotpath [--requests N] [--connections C] [--episodes E] [--profile FILE]`

A real `RouterService` (public server, core, relay, metrics), a trivial worker (an
asyncio protocol that answers every request with fixed bytes, registered over the
control socket) and closed-loop clients (C keep-alive connections, each sending its
next request when its reply is in, the requests rotating over E claimed episodes' tokens)
share one uvloop loop on loopback. The process's
CPU time for N requests through the router, minus its CPU time for N requests sent to
the worker directly, divided by N, is what the router costs per request: user code and
system calls alike, on one core, with no other process in the measurement, so it moves
far less than a figure read across processes. With --profile, the routed run is
profiled (cProfile: deterministic counts, slower) and the top functions printed.

Only loopback and a Unix socket in a temporary folder are used; every run is bounded by
its request count and a time limit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import dataclasses
import functools
import pstats
import tempfile
import time
from pathlib import Path

import uvloop
from httptools import HttpRequestParser, HttpResponseParser

from bench.episodes import mint_episodes
from bench.launch import quiet_router_warnings
from bench.load import build_request
from router.client import ControlClient
from router.config import AdminConfig, ControlConfig, ListenConfig, default_config
from router.service.router_service import RouterService

__all__ = ["main", "measure"]

WORKER_REPLY = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 16\r\n\r\n"
    b'{"result": "ok"}'
)
EPISODES = 64  # the default; the profile-guided build trains on it (setup.py)
RUN_LIMIT_S = 120.0  # a run that takes longer than this failed


class _Worker(asyncio.Protocol):
    """Answers each complete request with WORKER_REPLY."""

    def __init__(self) -> None:
        self._parser = HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        if self._transport is not None:
            self._transport.write(WORKER_REPLY)


class _Rotation:
    """The requests every connection takes its next one from, in turn: the connections
    together rotate over all the episodes, as wrk's script does, whatever the count per
    connection (each cycling a list of its own from the start would reach only its first
    `count` episodes)."""

    __slots__ = ("_next", "_requests")

    def __init__(self, requests: list[bytes]) -> None:
        if not requests:
            raise ValueError("no requests to rotate over")
        self._requests = requests
        self._next = 0

    def take(self) -> bytes:
        request = self._requests[self._next]
        self._next = (self._next + 1) % len(self._requests)
        return request


class _Client(asyncio.Protocol):
    """Sends its requests one after another on one connection, each after the last reply."""

    def __init__(self, requests: _Rotation, count: int, done: asyncio.Future[None]) -> None:
        self._requests = requests
        self._left = count
        self._done = done
        self._parser = HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._send()

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        if self._parser.get_status_code() != 200:
            self._finish(RuntimeError(f"status {self._parser.get_status_code()}"))
            return
        self._left -= 1
        if self._left <= 0:
            self._finish(None)
        else:
            self._send()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._left > 0:
            self._finish(ConnectionError(f"closed with {self._left} requests left"))

    def _send(self) -> None:
        assert self._transport is not None
        self._transport.write(self._requests.take())

    def _finish(self, error: Exception | None) -> None:
        if not self._done.done():
            if error is None:
                self._done.set_result(None)
            else:
                self._done.set_exception(error)
        if self._transport is not None:
            self._transport.close()


async def _drive(port: int, requests: _Rotation, total: int, connections: int) -> float:
    """CPU seconds of this process while `total` requests are answered."""
    loop = asyncio.get_running_loop()
    per_connection = total // connections
    dones = [loop.create_future() for _ in range(connections)]
    started = time.process_time()
    for done in dones:
        await loop.create_connection(
            functools.partial(_Client, requests, per_connection, done), "127.0.0.1", port
        )
    await asyncio.wait_for(asyncio.gather(*dones), RUN_LIMIT_S)
    return time.process_time() - started


@dataclasses.dataclass(frozen=True)
class HotPathResult:
    requests: int
    direct_us: float  # CPU per request, client and worker only
    routed_us: float  # CPU per request through the router
    router_us: float  # the difference: what the router costs


async def measure(
    requests: int,
    connections: int,
    folder: Path,
    profile: cProfile.Profile | None = None,
    only: str | None = None,
    episode_count: int = EPISODES,
) -> HotPathResult:
    loop = asyncio.get_running_loop()
    worker_server = await loop.create_server(_Worker, "127.0.0.1", 0)
    worker_port = worker_server.sockets[0].getsockname()[1]
    base = default_config()
    config = dataclasses.replace(
        base,
        listen=ListenConfig("127.0.0.1", 0),
        admin=AdminConfig("127.0.0.1", 0),
        control=dataclasses.replace(ControlConfig(), socket=f"unix:{folder}/control.sock"),
        claims=dataclasses.replace(base.claims, recovery_window_s=0.0),
    )
    service = RouterService(config)
    await service.start()
    client = ControlClient(
        f"unix:{folder}/control.sock", worker_id="w0", url=f"http://127.0.0.1:{worker_port}"
    )
    try:
        await client.start()
        episodes = mint_episodes(episode_count, 1)
        for episode in episodes:
            await client.claim(episode.key)
        routed = _Rotation([build_request(e.token, service.public_port) for e in episodes])
        direct = _Rotation([build_request(e.token, worker_port) for e in episodes])
        warmup = max(requests // 10, connections)
        direct_s = routed_s = 0.0
        if only != "routed":
            await _drive(worker_port, direct, warmup, connections)
            direct_s = await _drive(worker_port, direct, requests, connections)
        if only != "direct":
            await _drive(service.public_port, routed, warmup, connections)
            if profile is not None:
                profile.enable()
            routed_s = await _drive(service.public_port, routed, requests, connections)
            if profile is not None:
                profile.disable()
    finally:
        await client.stop()
        await service.stop()
        worker_server.close()
    direct_us = direct_s / requests * 1e6
    routed_us = routed_s / requests * 1e6
    return HotPathResult(requests, direct_us, routed_us, routed_us - direct_us)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hotpath", description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument(
        "--episodes",
        type=int,
        default=EPISODES,
        help="live episodes claimed, their tokens rotated over (default %(default)s)",
    )
    parser.add_argument("--runs", type=int, default=3, help="report the best of this many")
    parser.add_argument("--profile", type=Path, help="write a cProfile of one routed run here")
    parser.add_argument(
        "--only",
        choices=("routed", "direct"),
        help="run one side only (to count instructions under callgrind, for instance)",
    )
    args = parser.parse_args(argv)
    if args.episodes < 1:
        parser.error("--episodes must be positive")
    results = []
    for run in range(args.runs):
        profile = cProfile.Profile() if args.profile is not None and run == 0 else None
        with (
            tempfile.TemporaryDirectory(prefix="episode-router-hotpath-") as folder,
            quiet_router_warnings(),
        ):
            result = uvloop.run(
                measure(
                    args.requests,
                    args.connections,
                    Path(folder),
                    profile,
                    args.only,
                    args.episodes,
                )
            )
        if profile is not None:
            profile.dump_stats(args.profile)
            stats = pstats.Stats(str(args.profile))
            stats.sort_stats("tottime").print_stats(25)
            continue  # a profiled run's time is not the router's
        results.append(result)
        print(
            f"run {run + 1}: direct {result.direct_us:.1f} us/request, routed "
            f"{result.routed_us:.1f}, the router {result.router_us:.1f}",
            flush=True,
        )
    if results:
        best = min(results, key=lambda r: r.router_us)
        print(
            f"router CPU per forwarded request (one process, best of {len(results)}): "
            f"{best.router_us:.1f} us ({args.requests:,} requests, {args.connections} "
            f"connections) over {args.episodes:,} episodes"
        )
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
