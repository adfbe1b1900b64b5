"""The floor: about the least CPU a Python proxy can spend per request, as a reference row.

Not a product and not a peer: it shows what the interpreter and the event loop cost
on their own, so the table can tell the router's price for its features (header
hygiene, signed tokens, the claim table, timeouts, metrics, failure answers) from
the price of being written in Python at all. It runs on the same stack as the router
(uvloop, httptools' llhttp, asyncio protocols driven by callbacks, no tasks) and does
only what a sticky proxy must to pass the benchmark's routing check: parse the
request, pick a worker by a hash of the token header, send the request on a
kept-alive connection with its Host replaced, parse the reply and send it back with
a Content-Length. No limits, no timeouts, no X-Forwarded-*, no chunked bodies (501),
no pipelining, no error answers beyond 502; never put it in front of anything.

`python -m bench.floor --port P --worker 127.0.0.1:9001 --worker 127.0.0.1:9002`
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import zlib
from collections.abc import Sequence
from typing import cast

import uvloop
from httptools import HttpParserError, HttpRequestParser, HttpResponseParser

__all__ = ["Floor", "floor_protocol", "main", "serve"]

TOKEN_HEADER = b"x-nemo-gym-episode-token"
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"host", b"content-length"})
BAD_GATEWAY = b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
NOT_IMPLEMENTED = b"HTTP/1.1 501 Not Implemented\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class _Link(asyncio.Protocol):
    """A connection fed to an llhttp parser; `_broken()` when the peer's bytes are not HTTP."""

    def __init__(self, parser: HttpRequestParser | HttpResponseParser) -> None:
        self._parser = parser
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except HttpParserError:
            self._broken()

    def _broken(self) -> None:
        raise NotImplementedError


class _Upstream(_Link):
    """One kept-alive connection to a worker, carrying one client's request at a time."""

    def __init__(self, idle: list[_Upstream]) -> None:
        super().__init__(HttpResponseParser(self))
        self._idle = idle
        self.client: _Client | None = None
        self._head: list[bytes] = []
        self._body: list[bytes] = []

    def _broken(self) -> None:
        self._fail()

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self._idle:
            self._idle.remove(self)
        self._fail()

    def on_message_begin(self) -> None:
        self._head = []
        self._body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() not in _HOP_BY_HOP:
            self._head.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self._body)
        assert isinstance(self._parser, HttpResponseParser)
        status = self._parser.get_status_code()
        head = b"HTTP/1.1 %d X\r\n%bContent-Length: %d\r\n\r\n" % (
            status,
            b"".join(self._head),
            len(body),
        )
        client, self.client = self.client, None
        self._idle.append(self)
        if client is not None:
            client.reply(head + body)

    def _fail(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.reply(BAD_GATEWAY, close=True)
        if self.transport is not None:
            self.transport.close()


class _Client(_Link):
    """One client connection: one request at a time, each sent on a pooled connection."""

    def __init__(self, floor: Floor) -> None:
        super().__init__(HttpRequestParser(self))
        self._floor = floor
        self._url = b""
        self._token = b""
        self._head: list[bytes] = []
        self._body: list[bytes] = []
        self._chunked = False

    def _broken(self) -> None:
        self.reply(BAD_GATEWAY, close=True)

    def on_message_begin(self) -> None:
        self._url = self._token = b""
        self._head = []
        self._body = []
        self._chunked = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == TOKEN_HEADER:
            self._token = value
        elif lower == b"transfer-encoding":
            self._chunked = True
        if lower not in _HOP_BY_HOP:
            self._head.append(name + b": " + value + b"\r\n")

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._chunked:
            self.reply(NOT_IMPLEMENTED, close=True)
            return
        body = b"".join(self._body)
        assert isinstance(self._parser, HttpRequestParser)
        method = self._parser.get_method()
        message = b"%b %b HTTP/1.1\r\nHost: worker\r\n%bContent-Length: %d\r\n\r\n%b" % (
            method,
            self._url,
            b"".join(self._head),
            len(body),
            body,
        )
        self._floor.send(self, zlib.crc32(self._token), message)

    def reply(self, data: bytes, *, close: bool = False) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(data)
            if close:
                transport.close()


class Floor:
    """The listener's state: an idle pool per worker."""

    def __init__(self, workers: Sequence[tuple[str, int]]) -> None:
        self._workers = list(workers)
        self._idle: list[list[_Upstream]] = [[] for _ in workers]

    def close(self) -> None:
        """Closes the idle worker connections."""
        for idle in self._idle:
            while idle:
                upstream = idle.pop()
                if upstream.transport is not None:
                    upstream.transport.close()

    def send(self, client: _Client, hashed: int, message: bytes) -> None:
        index = hashed % len(self._workers)
        idle = self._idle[index]
        while idle:
            upstream = idle.pop()
            if upstream.transport is not None and not upstream.transport.is_closing():
                upstream.client = client
                upstream.transport.write(message)
                return
        asyncio.get_running_loop().create_task(self._connect(client, index, message))

    async def _connect(self, client: _Client, index: int, message: bytes) -> None:
        host, port = self._workers[index]
        idle = self._idle[index]
        try:
            _, upstream = await asyncio.get_running_loop().create_connection(
                lambda: _Upstream(idle), host, port
            )
        except OSError:
            client.reply(BAD_GATEWAY, close=True)
            return
        upstream.client = client
        assert upstream.transport is not None
        upstream.transport.write(message)


def floor_protocol(floor: Floor) -> asyncio.Protocol:
    """The protocol of one client connection (for `loop.create_server`)."""
    return _Client(floor)


async def serve(port: int, workers: Sequence[tuple[str, int]]) -> None:
    """Serves on 127.0.0.1:`port` until SIGTERM or SIGINT."""
    loop = asyncio.get_running_loop()
    floor = Floor(workers)
    server = await loop.create_server(lambda: floor_protocol(floor), "127.0.0.1", port)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        await stop.wait()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker", action="append", type=_address, required=True)
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, args.worker))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
