"""What one Redis round trip costs a minimal asyncio server here: bench.fleet's floor for
a first ask served serially.

A router answering a first ask serially (design §10: a key its table and its lookup
cache do not know, one request at a time) waits on one lookup round trip: it writes the
call, sleeps in its loop, and wakes for the reply. The issue's target for a miss is "at
most 10 µs of router CPU and one round trip"; what the round trip itself costs in CPU
depends on the machine (system calls, the wake-up, a virtual machine's interrupts), so
bench.fleet measures it beside the routers with two of these servers:

- `--mode answer`: every chunk a connection receives is answered at once with a fixed
  HTTP reply (the client sends one request at a time);
- `--mode roundtrip`: the same, after one PING to Redis and its PONG, over one
  connection a protocol reads (the router's tracked lookups do the same:
  router/directory/tracking.py).

The difference of their CPU per request, driven the same way, is one round trip's. It
knows nothing of HTTP beyond its one reply: the benchmark's client is the only one.

Run it as `python -m bench.roundtrip --mode roundtrip --redis-port P --port Q`.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections import deque
from collections.abc import Callable, Sequence
from typing import cast

import uvloop

REPLY = b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 0\r\n\r\n"
PING = b"*1\r\n$4\r\nPING\r\n"
PONG = b"+PONG\r\n"


class RedisLink(asyncio.Protocol):
    """One connection to Redis: a PING out, its PONG hands the next waiter its turn."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._waiting: deque[Callable[[], None]] = deque()
        self._unread = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._unread += data
        while self._unread.startswith(PONG):
            self._unread = self._unread[len(PONG) :]
            self._waiting.popleft()()

    def ping(self, then: Callable[[], None]) -> None:
        assert self.transport is not None
        self._waiting.append(then)
        self.transport.write(PING)


class Answering(asyncio.Protocol):
    """Answers each chunk it reads: at once, or after a round trip on `link`."""

    def __init__(self, link: RedisLink | None) -> None:
        self._link = link
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if self._link is None:
            self._answer()
        else:
            self._link.ping(self._answer)

    def _answer(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(REPLY)


async def serve(mode: str, port: int, redis_port: int) -> None:
    loop = asyncio.get_running_loop()
    link: RedisLink | None = None
    if mode == "roundtrip":
        _, link = await loop.create_connection(RedisLink, "127.0.0.1", redis_port)
    server = await loop.create_server(lambda: Answering(link), "127.0.0.1", port)
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    async with server:
        await stop


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.roundtrip")
    parser.add_argument("--mode", choices=("answer", "roundtrip"), required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis-port", type=int, default=6379)
    args = parser.parse_args(argv)
    uvloop.run(serve(args.mode, args.port, args.redis_port))  # the router's loop
    return 0


if __name__ == "__main__":
    sys.exit(main())
