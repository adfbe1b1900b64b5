"""The forwarding path between a real router app and real workers.

The router is the router's own public server (router.edge.server) with a handler that calls
`Forwarder.forward` to a fixed upstream. Workers are aiohttp apps, or `RawWorker`
(scripted bytes) where the reply's framing is the point, on loopback and on Unix sockets
under tmp_path. Clients are aiohttp clients, or raw sockets where the request's framing
or the reply's exact bytes matter.
The header rules are also tested as pure functions, with no event loop.

Every test that forwards runs against both forwarders with the same interface: the one
built on aiohttp's client (router.relay.contract) and the lean one (router.relay.forwarder).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from multidict import CIMultiDict

from router.core.answers import Answer
from router.edge.request import PublicRequest
from router.edge.server import EdgeLimits, EdgeServer
from router.relay import forwarder as relay
from router.relay.contract import (
    MAX_CACHED_ROLES,
    ForwardTimeouts,
    Upstream,
    UpstreamFailure,
    remember_role,
    reply_headers_for_client,
    request_headers_for_worker,
    rewrite_location,
)

pytestmark = pytest.mark.timeout(30)


def test_a_role_cache_stops_growing_at_its_bound_and_still_answers() -> None:
    cache: dict[bytes, int] = {}
    for i in range(MAX_CACHED_ROLES + 10):
        assert remember_role(cache, b"X-Invented-%d" % i, i % 3) == i % 3
    assert len(cache) == MAX_CACHED_ROLES
    assert cache[b"X-Invented-0"] == 0 and b"X-Invented-%d" % MAX_CACHED_ROLES not in cache


TIMEOUTS = ForwardTimeouts(connect_s=1.0, first_byte_s=2.0, stream_idle_s=2.0)
LIMITS = EdgeLimits()
BOOT = {"X-Episode-Router-Boot": "boot-1"}
PUBLIC = "http://public.example:8080"
MiB = 1 << 20
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


# --- rig -----------------------------------------------------------------------------------


Forwarder = relay.Forwarder
# The forwarding contract's implementations (the aiohttp-client one was retired for the
# lean relay; another one would be added here and run every test below).
IMPLEMENTATIONS: dict[str, type[Forwarder]] = {
    "relay": relay.Forwarder,
}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def forwarder_class(request: pytest.FixtureRequest) -> type[Forwarder]:
    return IMPLEMENTATIONS[request.param]


class Rig(AsyncExitStack):
    """The resources of one test, closed in reverse, and the Forwarder it runs against."""

    def __init__(self, forwarder_class: type[Forwarder]) -> None:
        super().__init__()
        self.forwarder_class = forwarder_class

    def forwarder(self, timeouts: ForwardTimeouts = TIMEOUTS, pool_size: int = 256) -> Forwarder:
        forwarder = self.forwarder_class(timeouts, pool_size_per_upstream=pool_size)
        self.push_async_callback(forwarder.close)
        return forwarder


@pytest.fixture
async def stack(forwarder_class: type[Forwarder]) -> AsyncIterator[Rig]:
    async with Rig(forwarder_class) as resources:
        yield resources


async def serve(
    stack: Rig,
    app: web.Application,
    *,
    handler_cancellation: bool = False,
    unix_path: Path | None = None,
) -> int:
    """Serves `app` on a loopback port (returned) or on `unix_path`."""
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site: web.BaseSite
    if unix_path is not None:
        site = web.UnixSite(runner, str(unix_path))
    else:
        site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return 0 if unix_path is not None else int(runner.addresses[0][1])


async def serve_worker(stack: Rig, app: web.Application, **kwargs: Any) -> Upstream:
    port = await serve(stack, app, **kwargs)
    return Upstream("w1", f"http://127.0.0.1:{port}")


def worker_app(handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.Application:
    app = web.Application(client_max_size=0)
    app.router.add_route("*", "/{tail:.*}", handler)
    return app


class Router:
    """The router under test: every request goes to `upstream`; failures are recorded."""

    def __init__(self, upstream: Upstream, forwarder: Forwarder) -> None:
        self.upstream = upstream
        self.forwarder = forwarder
        self.failures: list[UpstreamFailure] = []
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: PublicRequest) -> None:
        try:
            await self.forwarder.forward(
                request, self.upstream, extra_headers=BOOT, public_base=PUBLIC
            )
        except UpstreamFailure as failure:
            self.failures.append(failure)
            request.client.answer(request, Answer("upstream_error", failure.kind))


async def serve_edge(
    stack: Rig,
    handler: Callable[[PublicRequest], Awaitable[None]],
    limits: EdgeLimits = LIMITS,
) -> int:
    """Serves `handler` on the router's public server, on a loopback port (returned)."""
    loop = asyncio.get_running_loop()
    edge = EdgeServer(handler, limits, loop)
    server = await loop.create_server(edge, "127.0.0.1", 0)
    stack.push_async_callback(edge.shutdown, 0.5)
    stack.callback(server.close)
    return int(server.sockets[0].getsockname()[1])


async def start_router(
    stack: Rig,
    upstream: Upstream,
    *,
    timeouts: ForwardTimeouts = TIMEOUTS,
    pool_size: int = 256,
    limits: EdgeLimits = LIMITS,
) -> Router:
    forwarder = stack.forwarder(timeouts, pool_size)
    router = Router(upstream, forwarder)
    router.port = await serve_edge(stack, router.handle, limits)
    return router


@pytest.fixture
async def client(stack: Rig) -> aiohttp.ClientSession:
    session = aiohttp.ClientSession(auto_decompress=False)
    stack.push_async_callback(session.close)
    return session


class RawWorker:
    """A worker that speaks scripted bytes.

    Per connection it reads one request head (and a Content-Length body), then runs the
    script. `done` is set when the test ends, so a script that holds a connection ends too.
    """

    def __init__(self, make: Callable[[RawWorker], Script]) -> None:
        self.script = make(self)
        self.port = 0
        self.connections = 0
        self.heads: list[bytes] = []
        self.done = asyncio.Event()
        self.got_request = asyncio.Event()

    @property
    def upstream(self) -> Upstream:
        return Upstream("w1", f"http://127.0.0.1:{self.port}")

    async def start(self, stack: Rig) -> None:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        stack.push_async_callback(self._stop, server)
        self.port = server.sockets[0].getsockname()[1]

    async def _stop(self, server: asyncio.Server) -> None:
        self.done.set()
        server.close()
        await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head)
            length = header_value(head, "content-length")
            if length:
                await reader.readexactly(int(length))
            self.got_request.set()
            await self.script(reader, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()


def header_value(head: bytes, name: str) -> str | None:
    for line in head.decode("latin-1").split("\r\n")[1:]:
        key, _, value = line.partition(":")
        if key.strip().lower() == name:
            return value.strip()
    return None


def reply_script(data: bytes, *, hold: bool = False) -> Callable[[RawWorker], Script]:
    """A script writing `data` then closing (or holding the connection open when `hold`)."""

    def bind(worker: RawWorker) -> Script:
        async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(data)
            await writer.drain()
            if hold:
                await worker.done.wait()

        return script

    return bind


async def raw_worker(stack: Rig, make: Callable[[RawWorker], Script]) -> RawWorker:
    worker = RawWorker(make)
    await worker.start(stack)
    return worker


async def raw_request(port: int, data: bytes) -> bytes:
    """Sends `data` to the router and returns every byte until it closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


def split_reply(data: bytes) -> tuple[str, list[tuple[str, str]], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    pairs = [line.split(": ", 1) for line in lines[1:]]
    return lines[0], [(k, v) for k, v in pairs], body


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def eventually(check: Callable[[], bool], *, within: float = 3.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakGrowth:
    """Samples this process's resident memory while a transfer runs."""

    def __init__(self) -> None:
        self.base = resident_bytes()
        self.peak = self.base
        self._task = asyncio.create_task(self._sample(), name="rss-sampler")

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, resident_bytes())
            await asyncio.sleep(0.005)

    async def stop(self) -> int:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        self.peak = max(self.peak, resident_bytes())
        return self.peak - self.base


async def echo(request: web.Request) -> web.Response:
    """The worker's view of a request: method, target, headers in order, body."""
    body = await request.read()
    seen = {
        "method": request.method,
        "target": request.raw_path,
        "headers": list(request.headers.items()),
        "body_sha": hashlib.sha256(body).hexdigest(),
        "body_len": len(body),
    }
    return web.json_response(seen)


# --- header rules, pure --------------------------------------------------------------------


def test_request_headers_follow_the_hygiene_rules() -> None:
    client = [
        ("Host", "public.example:8080"),
        ("Connection", "keep-alive, X-Named"),
        ("connection", "X-Also"),
        ("X-Named", "1"),
        ("X-Also", "1"),
        ("Keep-Alive", "timeout=5"),
        ("TE", "trailers"),
        ("Trailer", "X-T"),
        ("Upgrade", "websocket"),
        ("Proxy-Connection", "keep-alive"),
        ("Proxy-Authorization", "Basic eA=="),
        ("Proxy-Anything", "1"),
        ("Content_Length", "5"),
        ("Transfer_Encoding", "chunked"),
        ("X-Forwarded-For", "6.6.6.6"),
        ("x-forwarded-proto", "https"),
        ("Forwarded", "for=6.6.6.6"),
        ("X-Real-IP", "6.6.6.6"),
        ("X-Episode-Router-Boot", "forged"),
        ("Expect", "100-continue"),
        ("Accept", "text/plain"),
        ("X-Rep", "1"),
        ("X-Rep", "2"),
        ("Content-Length", "3"),
    ]
    out = request_headers_for_worker(
        client, worker_host="127.0.0.1:9002", client_ip="10.0.0.7", scheme="http", extra=BOOT
    )
    assert list(out.items()) == [
        ("Host", "127.0.0.1:9002"),
        ("Accept", "text/plain"),
        ("X-Rep", "1"),
        ("X-Rep", "2"),
        ("Content-Length", "3"),
        ("X-Forwarded-Host", "public.example:8080"),
        ("X-Forwarded-For", "10.0.0.7"),
        ("X-Forwarded-Proto", "http"),
        ("X-Episode-Router-Boot", "boot-1"),
    ]


def test_request_headers_without_host_or_peer_and_with_chunked_body() -> None:
    client = [("Transfer-Encoding", "chunked"), ("Content-Length", "10"), ("X-A", "1")]
    out = request_headers_for_worker(
        client, worker_host="localhost", client_ip=None, scheme="https"
    )
    # Transfer-Encoding wins over Content-Length (RFC 9112 §6.3): both go, the body is
    # re-framed as chunked by the client side.
    assert list(out.items()) == [
        ("Host", "localhost"),
        ("X-A", "1"),
        ("X-Forwarded-Proto", "https"),
    ]


def test_reply_headers_drop_hop_by_hop_and_keep_repeats() -> None:
    worker = [
        ("Connection", "keep-alive, X-Hop"),
        ("X-Hop", "secret"),
        ("Keep-Alive", "timeout=5"),
        ("Transfer-Encoding", "chunked"),
        ("TE", "trailers"),
        ("Trailer", "X-T"),
        ("Upgrade", "h2c"),
        ("Proxy-Authenticate", "Basic"),
        ("Proxy-Foo", "x"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
        ("Location", "http://127.0.0.1:9002/next"),
        ("X_Under", "kept"),
    ]
    out = reply_headers_for_client(
        worker, private_origin="http://127.0.0.1:9002", public_base=PUBLIC
    )
    assert out == [
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
        ("Location", "http://public.example:8080/next"),
        ("X_Under", "kept"),
    ]
    untouched = reply_headers_for_client(
        [("Location", "http://127.0.0.1:9002/next")],
        private_origin="http://127.0.0.1:9002",
        public_base=None,
    )
    assert untouched == [("Location", "http://127.0.0.1:9002/next")]


@pytest.mark.parametrize(
    ("value", "rewritten"),
    [
        ("http://127.0.0.1:9002/a?b=1", "http://public.example:8080/a?b=1"),
        ("HTTP://127.0.0.1:9002/a", "http://public.example:8080/a"),
        ("http://127.0.0.1:9002", "http://public.example:8080"),
        ("http://127.0.0.1:9002?x", "http://public.example:8080?x"),
        ("http://127.0.0.1:90021/a", "http://127.0.0.1:90021/a"),
        ("http://127.0.0.1:9003/a", "http://127.0.0.1:9003/a"),
        ("https://127.0.0.1:9002/a", "https://127.0.0.1:9002/a"),
        ("/relative", "/relative"),
        ("", ""),
    ],
)
def test_rewrite_location(value: str, rewritten: str) -> None:
    assert rewrite_location(value, "http://127.0.0.1:9002", PUBLIC + "/") == rewritten


def test_rewrite_location_matches_the_host_in_any_case() -> None:
    assert rewrite_location("http://LocalHost/x", "http://localhost", PUBLIC) == PUBLIC + "/x"


@pytest.mark.parametrize("field", ["connect_s", "first_byte_s", "stream_idle_s"])
@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_timeouts_must_be_positive(field: str, bad: float) -> None:
    values = {"connect_s": 1.0, "first_byte_s": 1.0, "stream_idle_s": 1.0, field: bad}
    with pytest.raises(ValueError, match=field):
        ForwardTimeouts(**values)


def test_pool_size_must_be_positive(forwarder_class: type[Forwarder]) -> None:
    with pytest.raises(ValueError, match="pool_size_per_upstream"):
        forwarder_class(TIMEOUTS, pool_size_per_upstream=0)


def test_upstream_failure_carries_its_fields() -> None:
    failure = UpstreamFailure("refused", "cannot connect", request_sent=False)
    assert (failure.kind, failure.detail, failure.request_sent) == (
        "refused",
        "cannot connect",
        False,
    )
    assert str(failure) == "refused: cannot connect"
    assert UpstreamFailure("error", "x").request_sent is True


# --- relaying ------------------------------------------------------------------------------


async def test_get_relays_status_reason_headers_and_body(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(
            status=299, reason="Made It", text=f"hello {request.query['q']}", headers={"X-R": "1"}
        )

    router = await start_router(stack, await serve_worker(stack, worker_app(handler)))
    async with client.get(f"{router.url}/thing?q=there") as resp:
        assert (resp.status, resp.reason) == (299, "Made It")
        assert resp.headers["X-R"] == "1"
        assert resp.headers["Content-Length"] == "11"
        assert await resp.read() == b"hello there"
    assert router.failures == []


async def test_post_with_content_length_reaches_the_worker_fixed_length(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    router = await start_router(stack, await serve_worker(stack, worker_app(echo)))
    body = bytes(range(256)) * 1000
    async with client.post(f"{router.url}/sink", data=body) as resp:
        seen = await resp.json()
    headers = dict(seen["headers"])
    assert seen["method"] == "POST"
    assert headers["Content-Length"] == str(len(body))
    assert "Transfer-Encoding" not in headers
    assert (seen["body_len"], seen["body_sha"]) == (len(body), hashlib.sha256(body).hexdigest())


async def test_chunked_post_reaches_the_worker_chunked(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    router = await start_router(stack, await serve_worker(stack, worker_app(echo)))
    parts = [b"first part ", b"", b"second part"]

    async def body() -> AsyncIterator[bytes]:
        for part in parts:
            yield part

    async with client.post(f"{router.url}/sink", data=body()) as resp:
        seen = await resp.json()
    headers = dict(seen["headers"])
    assert headers["Transfer-Encoding"] == "chunked"
    assert "Content-Length" not in headers
    assert seen["body_sha"] == hashlib.sha256(b"".join(parts)).hexdigest()


async def test_request_head_as_the_worker_sees_it(stack: Rig) -> None:
    upstream = await serve_worker(stack, worker_app(echo))
    router = await start_router(stack, upstream)
    request = (
        b"GET /a/../b%2Fc/./d?x=%20&y HTTP/1.1\r\n"
        b"Host: public.example:8080\r\n"
        b"Connection: close, X-Named\r\n"
        b"X-Named: 1\r\n"
        b"Keep-Alive: timeout=5\r\n"
        b"TE: trailers\r\n"
        b"Trailer: X-T\r\n"
        b"Upgrade: websocket\r\n"
        b"Proxy-Connection: keep-alive\r\n"
        b"Proxy-Authorization: Basic eA==\r\n"
        b"Proxy-Other: 1\r\n"
        b"Content_Length: 5\r\n"
        b"Transfer_Encoding: chunked\r\n"
        b"X-Forwarded-For: 6.6.6.6\r\n"
        b"X-Forwarded-Host: evil.example\r\n"
        b"X-Forwarded-Proto: https\r\n"
        b"Forwarded: for=6.6.6.6\r\n"
        b"X-Real-IP: 6.6.6.6\r\n"
        b"X-Episode-Router-Boot: forged\r\n"
        b"X-Episode-Router-Other: forged\r\n"
        b"Accept: text/plain\r\n"
        b"X-Rep: 1\r\n"
        b"X-Rep: 2\r\n"
        b"\r\n"
    )
    status, _, body = split_reply(await raw_request(router.port, request))
    assert status == "HTTP/1.1 200 OK"
    seen = json.loads(body)
    assert seen["target"] == "/a/../b%2Fc/./d?x=%20&y"
    assert [tuple(pair) for pair in seen["headers"]] == [
        ("Host", upstream.url.removeprefix("http://")),
        ("Accept", "text/plain"),
        ("X-Rep", "1"),
        ("X-Rep", "2"),
        ("X-Forwarded-Host", "public.example:8080"),
        ("X-Forwarded-For", "127.0.0.1"),
        ("X-Forwarded-Proto", "http"),
        ("X-Episode-Router-Boot", "boot-1"),
    ]


@pytest.mark.parametrize(
    ("request_head", "framing"),
    [
        (b"POST /s HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\nConnection: close\r\n\r\n", "0"),
        (b"GET /s HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n", None),
    ],
)
async def test_request_without_body_sends_none(
    stack: Rig, request_head: bytes, framing: str | None
) -> None:
    router = await start_router(stack, await serve_worker(stack, worker_app(echo)))
    _, _, body = split_reply(await raw_request(router.port, request_head))
    headers = dict(json.loads(body)["headers"])
    assert headers.get("Content-Length") == framing
    assert "Transfer-Encoding" not in headers
    assert json.loads(body)["body_len"] == 0


async def test_reply_head_as_the_client_sees_it(stack: Rig) -> None:
    worker = await raw_worker(
        stack,
        reply_script(
            b"HTTP/1.1 200 Fine Thanks\r\n"
            b"Date: Mon, 01 Jan 2024 00:00:00 GMT\r\n"
            b"Server: worker/1\r\n"
            b"Connection: keep-alive, X-Hop\r\n"
            b"X-Hop: secret\r\n"
            b"Keep-Alive: timeout=5\r\n"
            b"TE: trailers\r\n"
            b"Trailer: X-T\r\n"
            b"Upgrade: h2c\r\n"
            b"Proxy-Authenticate: Basic\r\n"
            b"Proxy-Foo: x\r\n"
            b"Set-Cookie: a=1\r\n"
            b"Set-Cookie: b=2\r\n"
            b"Content-Type: text/x-worker\r\n"
            b"Content-Length: 2\r\n"
            b"\r\n"
            b"ok"
        ),
    )
    router = await start_router(stack, worker.upstream)
    reply = await raw_request(
        router.port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    status, headers, body = split_reply(reply)
    assert status == "HTTP/1.1 200 Fine Thanks"
    assert headers == [
        ("Date", "Mon, 01 Jan 2024 00:00:00 GMT"),
        ("Server", "worker/1"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
        ("Content-Type", "text/x-worker"),
        ("Content-Length", "2"),
        ("Connection", "close"),  # the client asked to close: the router's own connection
    ]
    assert body == b"ok"


async def test_router_invents_no_server_or_content_type_but_dates_the_reply(
    stack: Rig,
) -> None:
    worker = await raw_worker(
        stack,
        reply_script(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"),
    )
    router = await start_router(stack, worker.upstream)
    reply = await raw_request(
        router.port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    status, headers, body = split_reply(reply)
    names = [name for name, _ in headers]
    assert status == "HTTP/1.1 200 OK"
    assert names == ["Transfer-Encoding", "Date", "Connection"]
    assert body == b"2\r\nok\r\n0\r\n\r\n"
    # The worker's request carried only what the client sent plus the router's headers.
    sent = worker.heads[0].decode("latin-1").split("\r\n")[1:-2]
    assert [line.split(":")[0] for line in sent] == [
        "Host",
        "X-Forwarded-Host",
        "X-Forwarded-For",
        "X-Forwarded-Proto",
        "X-Episode-Router-Boot",
    ]


async def test_location_naming_the_worker_is_rewritten_to_the_public_address(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    async def handler(request: web.Request) -> web.Response:
        private = f"http://{request.host}"
        return web.Response(
            status=302,
            headers={
                "Location": f"{private}/next?a=1",
                "Content-Location": f"{private.upper()}/c",
                "Link": f"<{private}/l>",
            },
        )

    router = await start_router(stack, await serve_worker(stack, worker_app(handler)))
    async with client.get(f"{router.url}/go", allow_redirects=False) as resp:
        assert resp.status == 302
        assert resp.headers["Location"] == f"{PUBLIC}/next?a=1"
        assert resp.headers["Content-Location"] == f"{PUBLIC}/c"
        assert resp.headers["Link"].startswith("<http://127.0.0.1:")  # only the two are rewritten


async def test_unix_socket_upstream(
    stack: Rig, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    path = tmp_path / "worker.sock"
    await serve(stack, worker_app(echo), unix_path=path)
    router = await start_router(stack, Upstream("w1", f"unix:{path}"))
    async with client.put(f"{router.url}/u?x=1", data=b"over unix") as resp:
        seen = await resp.json()
    assert (seen["method"], seen["target"]) == ("PUT", "/u?x=1")
    assert dict(seen["headers"])["Host"] == "localhost"
    assert seen["body_sha"] == hashlib.sha256(b"over unix").hexdigest()


# --- streaming -----------------------------------------------------------------------------


async def test_large_request_body_streams_through(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    size = 64 * MiB
    worker_got_bytes = asyncio.Event()

    async def sink(request: web.Request) -> web.Response:
        total = 0
        async for chunk in request.content.iter_any():
            total += len(chunk)
            worker_got_bytes.set()
        return web.json_response({"total": total, "length": request.content_length})

    router = await start_router(stack, await serve_worker(stack, worker_app(sink)))
    block = b"u" * (64 * 1024)

    async def body() -> AsyncIterator[bytes]:
        for i in range(size // len(block)):
            if i == 16:
                # Streaming, not buffering: the worker has bytes before the client sent 2 MiB.
                await asyncio.wait_for(worker_got_bytes.wait(), 5)
            yield block

    growth = PeakGrowth()
    async with client.post(
        f"{router.url}/sink", data=body(), headers={"Content-Length": str(size)}
    ) as resp:
        seen = await resp.json()
    assert await growth.stop() < 32 * MiB
    assert seen == {"total": size, "length": size}


async def test_large_reply_body_streams_through(stack: Rig, client: aiohttp.ClientSession) -> None:
    size = 64 * MiB
    client_got_bytes = asyncio.Event()

    async def source(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.content_length = size
        await response.prepare(request)
        block = b"d" * (64 * 1024)
        for i in range(size // len(block)):
            if i == 16:
                await asyncio.wait_for(client_got_bytes.wait(), 5)
            await response.write(block)
        return response

    router = await start_router(stack, await serve_worker(stack, worker_app(source)))
    growth = PeakGrowth()
    total = 0
    async with client.get(f"{router.url}/big") as resp:
        assert resp.headers["Content-Length"] == str(size)
        async for chunk in resp.content.iter_any():
            total += len(chunk)
            client_got_bytes.set()
    assert await growth.stop() < 32 * MiB
    assert total == size


def sse_app(events: list[tuple[float, bytes]], sent_at: list[float]) -> web.Application:
    """A worker sending each (delay, event) after its delay, recording when each went out."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for delay, event in events:
            await asyncio.sleep(delay)
            sent_at.append(time.monotonic())
            await response.write(event)
        return response

    return worker_app(stream)


async def test_sse_event_reaches_the_client_before_the_next_is_sent(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    sent_at: list[float] = []
    events = [(0.0, b"data: one\n\n"), (0.5, b"data: two\n\n")]
    router = await start_router(stack, await serve_worker(stack, sse_app(events, sent_at)))
    received: list[tuple[float, bytes]] = []
    async with client.get(f"{router.url}/events") as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        async for chunk in resp.content.iter_any():
            received.append((time.monotonic(), chunk))
    assert b"".join(chunk for _, chunk in received) == b"data: one\n\ndata: two\n\n"
    assert received[0][1] == b"data: one\n\n"
    assert received[0][0] < sent_at[1]


async def test_stream_idle_bound_is_not_a_total_bound(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    timeouts = ForwardTimeouts(connect_s=1.0, first_byte_s=1.0, stream_idle_s=0.3)
    events = [(0.1, b"data: %d\n\n" % i) for i in range(10)]  # 1 s in all, 0.1 s apart
    upstream = await serve_worker(stack, sse_app(events, []))
    router = await start_router(stack, upstream, timeouts=timeouts)
    async with client.get(f"{router.url}/events") as resp:
        assert await resp.read() == b"".join(event for _, event in events)
    assert router.failures == []


async def test_stream_idle_timeout_aborts_the_client_and_releases_the_worker(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    worker_cancelled = asyncio.Event()

    async def stalls(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            worker_cancelled.set()
            raise
        return response

    timeouts = ForwardTimeouts(connect_s=1.0, first_byte_s=1.0, stream_idle_s=0.3)
    upstream = await serve_worker(stack, worker_app(stalls), handler_cancellation=True)
    router = await start_router(stack, upstream, timeouts=timeouts)
    started = time.monotonic()
    async with client.get(f"{router.url}/events") as resp:
        assert await resp.content.readany() == b"data: one\n\n"
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.content.read()
    assert 0.3 <= time.monotonic() - started < 2.0
    await asyncio.wait_for(worker_cancelled.wait(), 2)


async def test_truncated_reply_with_length_reaches_the_client_incomplete(
    stack: Rig,
) -> None:
    partial = b"p" * 40
    worker = await raw_worker(
        stack, reply_script(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + partial)
    )
    router = await start_router(stack, worker.upstream)
    reply = await raw_request(router.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    status, headers, body = split_reply(reply)
    assert status == "HTTP/1.1 200 OK"
    assert ("Content-Length", "100") in headers
    assert body == partial  # then the connection closed: 60 bytes short
    assert router.failures == []


async def test_truncated_chunked_reply_reaches_the_client_without_terminator(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    worker = await raw_worker(
        stack,
        reply_script(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"),
    )
    router = await start_router(stack, worker.upstream)
    reply = await raw_request(router.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    _, headers, body = split_reply(reply)
    assert ("Transfer-Encoding", "chunked") in headers
    assert body == b"5\r\nhello\r\n"  # no 0-size terminating chunk
    async with client.get(f"{router.url}/") as resp:
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()


async def test_client_leaving_mid_stream_releases_the_worker(stack: Rig) -> None:
    worker_ended = asyncio.Event()

    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        try:
            for _ in range(1000):  # 10 s at most
                await response.write(b"x" * 1024)
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            worker_ended.set()
            raise
        except ConnectionError:
            worker_ended.set()
        return response

    router = await start_router(stack, await serve_worker(stack, worker_app(endless)))
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    await reader.readuntil(b"\r\n\r\n")
    await reader.read(1024)
    writer.close()
    await asyncio.wait_for(worker_ended.wait(), 1.0)


async def test_client_leaving_an_idle_stream_releases_the_worker(stack: Rig) -> None:
    worker_cancelled = asyncio.Event()

    async def idle(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: one\n\n")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            worker_cancelled.set()
            raise
        return response

    upstream = await serve_worker(stack, worker_app(idle), handler_cancellation=True)
    router = await start_router(stack, upstream)
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(b"GET /events HTTP/1.1\r\nHost: h\r\n\r\n")
    await reader.readuntil(b"data: one\n\n")
    writer.close()
    await asyncio.wait_for(worker_cancelled.wait(), 1.0)


async def test_client_leaving_mid_upload_releases_the_worker(stack: Rig) -> None:
    worker_got_bytes = asyncio.Event()
    worker_failed = asyncio.Event()

    async def sink(request: web.Request) -> web.Response:
        try:
            async for _ in request.content.iter_any():
                worker_got_bytes.set()
        except (aiohttp.ClientPayloadError, ConnectionError):
            worker_failed.set()
            return web.Response(text="cut short")
        return web.Response(text="all read")

    router = await start_router(stack, await serve_worker(stack, worker_app(sink)))
    _, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 2000000\r\n\r\n" + b"b" * 1000)
    await asyncio.wait_for(worker_got_bytes.wait(), 2)
    writer.close()
    await asyncio.wait_for(worker_failed.wait(), 1.0)
    await eventually(lambda: len(router.failures) == 1)
    assert (router.failures[0].kind, router.failures[0].detail) == (
        "client_left",
        "the client went away mid-body",
    )


async def test_head_204_and_304_replies_carry_no_body(stack: Rig) -> None:
    async def handler(request: web.Request) -> web.Response:
        if request.path == "/204":
            return web.Response(status=204)
        if request.path == "/304":
            return web.Response(status=304, headers={"ETag": '"v1"', "Content-Length": "5"})
        return web.Response(text="hello")

    router = await start_router(stack, await serve_worker(stack, worker_app(handler)))
    pipelined = (
        b"HEAD /len HTTP/1.1\r\nHost: h\r\n\r\n"
        b"GET /204 HTTP/1.1\r\nHost: h\r\n\r\n"
        b'GET /304 HTTP/1.1\r\nHost: h\r\nIf-None-Match: "v1"\r\nConnection: close\r\n\r\n'
    )
    heads = (await raw_request(router.port, pipelined)).split(b"\r\n\r\n")
    assert heads[-1] == b""  # nothing follows the last head: no body bytes anywhere
    assert len(heads) == 4
    replies = [split_reply(head + b"\r\n\r\n") for head in heads[:3]]
    assert [status for status, _, _ in replies] == [
        "HTTP/1.1 200 OK",
        "HTTP/1.1 204 No Content",
        "HTTP/1.1 304 Not Modified",
    ]
    head_headers, no_content, not_modified = (CIMultiDict(headers) for _, headers, _ in replies)
    assert head_headers["Content-Length"] == "5"
    assert "Content-Length" not in no_content and "Transfer-Encoding" not in no_content
    assert not_modified["ETag"] == '"v1"'
    assert "Transfer-Encoding" not in not_modified


async def test_304_keeps_the_workers_content_length(stack: Rig) -> None:
    worker = await raw_worker(
        stack,
        reply_script(b'HTTP/1.1 304 Not Modified\r\nETag: "v1"\r\nContent-Length: 5\r\n\r\n'),
    )
    router = await start_router(stack, worker.upstream)
    reply = await raw_request(
        router.port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
    )
    status, headers, body = split_reply(reply)
    assert status == "HTTP/1.1 304 Not Modified"
    assert sorted((k.lower(), v) for k, v in headers if k.lower() != "date") == [
        ("connection", "close"),
        ("content-length", "5"),
        ("etag", '"v1"'),
    ]
    assert body == b""


async def test_keep_alive_reuses_one_worker_connection_until_forgotten(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    transports: list[object] = []

    async def handler(request: web.Request) -> web.Response:
        transports.append(request.transport)  # kept referenced, so identities stay distinct
        return web.Response(text=str(len(transports)))

    router = await start_router(stack, await serve_worker(stack, worker_app(handler)))
    for expected in ("1", "2"):
        async with client.get(f"{router.url}/") as resp:
            assert await resp.text() == expected
    assert len({id(t) for t in transports}) == 1
    router.forwarder.forget("w1")
    router.forwarder.forget("never-seen")
    async with client.get(f"{router.url}/") as resp:
        assert await resp.text() == "3"
    assert len({id(t) for t in transports}) == 2


async def test_a_worker_back_at_a_new_address_gets_a_new_pool(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    async def first(request: web.Request) -> web.Response:
        return web.Response(text="first")

    async def second(request: web.Request) -> web.Response:
        return web.Response(text="second")

    router = await start_router(stack, await serve_worker(stack, worker_app(first)))
    async with client.get(f"{router.url}/") as resp:
        assert await resp.text() == "first"
    router.upstream = await serve_worker(stack, worker_app(second))
    async with client.get(f"{router.url}/") as resp:
        assert await resp.text() == "second"


# --- failures before the reply head --------------------------------------------------------


async def test_connect_refused(stack: Rig, client: aiohttp.ClientSession) -> None:
    router = await start_router(stack, Upstream("w1", f"http://127.0.0.1:{closed_port()}"))
    async with client.post(f"{router.url}/", data=b"body") as resp:
        assert resp.status == 502
    [failure] = router.failures
    assert (failure.kind, failure.request_sent) == ("refused", False)
    assert "refused" in failure.detail.lower()


async def test_a_forward_tried_again_after_a_refused_connect_sends_the_body_again(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    upstream = await serve_worker(stack, worker_app(echo))
    refused = Upstream("w0", f"http://127.0.0.1:{closed_port()}")
    forwarder = stack.forwarder()
    failures: list[UpstreamFailure] = []

    async def handle(request: PublicRequest) -> None:
        # What the public handler does for a sessionless request: another worker.
        try:
            await forwarder.forward(request, refused)
            return
        except UpstreamFailure as failure:
            failures.append(failure)
        await forwarder.forward(request, upstream)

    port = await serve_edge(stack, handle)
    async with client.post(f"http://127.0.0.1:{port}/x", data=b"payload") as resp:
        seen = await resp.json()
    assert [(f.kind, f.request_sent) for f in failures] == [("refused", False)]
    assert (seen["body_len"], seen["body_sha"]) == (7, hashlib.sha256(b"payload").hexdigest())


async def test_missing_unix_socket_is_refused(
    stack: Rig, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    router = await start_router(stack, Upstream("w1", f"unix:{tmp_path / 'gone.sock'}"))
    async with client.get(f"{router.url}/") as resp:
        assert resp.status == 502
    [failure] = router.failures
    assert (failure.kind, failure.request_sent) == ("refused", False)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:1", "http://h:1/path", "unix:", "127.0.0.1:80"])
async def test_unsupported_worker_address_is_an_error(
    stack: Rig, client: aiohttp.ClientSession, url: str
) -> None:
    router = await start_router(stack, Upstream("w1", url))
    async with client.get(f"{router.url}/") as resp:
        assert resp.status == 502
    [failure] = router.failures
    assert (failure.kind, failure.request_sent) == ("error", False)
    assert "unsupported worker address" in failure.detail


async def test_first_byte_timeout(stack: Rig, client: aiohttp.ClientSession) -> None:
    worker = await raw_worker(stack, reply_script(b"", hold=True))
    timeouts = ForwardTimeouts(connect_s=1.0, first_byte_s=0.3, stream_idle_s=5.0)
    router = await start_router(stack, worker.upstream, timeouts=timeouts)
    started = time.monotonic()
    async with client.get(f"{router.url}/") as resp:
        assert resp.status == 502
    assert 0.3 <= time.monotonic() - started < 1.5
    [failure] = router.failures
    assert (failure.kind, failure.request_sent) == ("timeout", True)
    assert worker.connections == 1


async def test_a_stalled_upload_is_the_clients_timeout_and_a_slow_steady_one_is_none(
    stack: Rig,
) -> None:
    # The body's silence is bounded by the edge's body timeout (the client's fault, 408),
    # not by the worker's first-byte timeout, which is shorter here.
    timeouts = ForwardTimeouts(connect_s=1.0, first_byte_s=0.4, stream_idle_s=5.0)
    router = await start_router(
        stack,
        await serve_worker(stack, worker_app(echo)),
        timeouts=timeouts,
        limits=EdgeLimits(body_timeout_s=1.0),
    )
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 8\r\n\r\n")
    for _ in range(8):  # 1.2 s in all, never 0.4 s without progress
        await asyncio.sleep(0.15)
        writer.write(b"s")
    status, _, body = split_reply(await asyncio.wait_for(reader.readuntil(b"}"), 5))
    assert status == "HTTP/1.1 200 OK"
    assert json.loads(body)["body_len"] == 8
    writer.write(b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 8\r\n\r\nfour")
    status, _, _ = split_reply(await asyncio.wait_for(reader.readuntil(b"}"), 5))
    writer.close()
    assert status == "HTTP/1.1 502 Bad Gateway"  # this harness answers every failure so
    [failure] = router.failures
    # The body was being buffered: nothing of the request reached the worker.
    assert (failure.kind, failure.request_sent) == ("client_timeout", False)


async def test_waiting_for_a_pooled_connection_is_bounded_by_connect(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    worker = await raw_worker(stack, reply_script(b"", hold=True))
    timeouts = ForwardTimeouts(connect_s=0.3, first_byte_s=5.0, stream_idle_s=5.0)
    router = await start_router(
        stack,
        worker.upstream,
        timeouts=timeouts,
        pool_size=1,
    )
    held = asyncio.create_task(client.get(f"{router.url}/held"), name="held-request")
    await asyncio.wait_for(worker.got_request.wait(), 2)
    started = time.monotonic()
    async with client.get(f"{router.url}/second") as resp:
        assert resp.status == 502
    assert time.monotonic() - started < 1.5
    [failure] = router.failures
    # The pool was full: the router's crowding, not the worker's timeout.
    assert (failure.kind, failure.request_sent) == ("busy", False)
    assert worker.connections == 1
    worker.done.set()
    (await held).close()


@pytest.mark.parametrize(
    ("reply", "detail"),
    [
        (b"", "it closed the connection before replying"),
        (b"HTTP/1.1 abc nope\r\n\r\n", "invalid reply"),
        (b"NOT HTTP AT ALL\r\n\r\n", "invalid reply"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n0\r\n\r\n",
            "invalid reply",
        ),
        (
            b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n",
            "switched",
        ),
    ],
)
async def test_bad_or_missing_reply_head_is_an_error(
    stack: Rig, client: aiohttp.ClientSession, reply: bytes, detail: str
) -> None:
    worker = await raw_worker(stack, reply_script(reply))
    router = await start_router(stack, worker.upstream)
    async with client.post(f"{router.url}/", data=b"body") as resp:
        assert resp.status == 502
    [failure] = router.failures
    assert (failure.kind, failure.request_sent) == ("error", True)
    assert detail in failure.detail
    assert worker.connections == 1


async def test_forwards_after_close_fail_cleanly(stack: Rig, client: aiohttp.ClientSession) -> None:
    router = await start_router(stack, await serve_worker(stack, worker_app(echo)))
    await router.forwarder.close()
    async with client.get(f"{router.url}/") as resp:
        assert resp.status == 502
    [failure] = router.failures
    assert (failure.kind, failure.request_sent) == ("error", False)


# --- observing replies and pre-read bodies -------------------------------------------------


class Watcher:
    """A ReplyObserver that records what it was shown, and when."""

    directory_write = None  # it writes no claims to a claims directory

    def __init__(self, wants: int) -> None:
        self.wants = wants
        self.heads: list[tuple[int, str | None, list[str]]] = []
        self.bodies: list[bytes] = []

    def head(self, status: int, headers: Any, set_cookies: list[str]) -> int:
        self.heads.append((status, headers.get("X-Session"), set_cookies))
        return self.wants

    def body(self, data: bytes) -> None:
        self.bodies.append(data)


async def observed_router(
    stack: Rig, upstream: Upstream, watcher: Watcher, body: bytes | None = None
) -> Router:
    forwarder = stack.forwarder()
    router = Router(upstream, forwarder)

    async def handle(request: PublicRequest) -> None:
        await forwarder.forward(request, upstream, observer=watcher, body=body)

    router.port = await serve_edge(stack, handle)
    return router


async def test_the_observer_sees_the_head_and_a_small_body_before_the_client(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    async def seed(request: web.Request) -> web.StreamResponse:
        reply = web.json_response({"mcp": {"headers": {"X-Token": "t1"}}})
        reply.headers["X-Session"] = "s1"
        reply.set_cookie("a", "1")
        reply.set_cookie("b", "2")
        return reply

    watcher = Watcher(wants=65536)
    router = await observed_router(stack, await serve_worker(stack, worker_app(seed)), watcher)
    async with client.post(router.url + "/seed") as reply:
        assert watcher.heads and watcher.bodies  # both seen before the client read anything
        assert await reply.json() == {"mcp": {"headers": {"X-Token": "t1"}}}
    status, session, cookies = watcher.heads[0]
    assert (status, session) == (200, "s1")
    assert [c.split(";")[0] for c in cookies] == ["a=1", "b=2"]
    assert json.loads(watcher.bodies[0]) == {"mcp": {"headers": {"X-Token": "t1"}}}


@pytest.mark.parametrize("chunked", [False, True])
async def test_a_body_over_what_the_observer_wants_is_streamed_unseen(
    stack: Rig, client: aiohttp.ClientSession, chunked: bool
) -> None:
    payload = os.urandom(200_000)

    async def big(request: web.Request) -> web.StreamResponse:
        reply = web.StreamResponse()
        if not chunked:
            reply.content_length = len(payload)
        await reply.prepare(request)
        for start in range(0, len(payload), 50_000):
            await reply.write(payload[start : start + 50_000])
        await reply.write_eof()
        return reply

    watcher = Watcher(wants=1000)
    router = await observed_router(stack, await serve_worker(stack, worker_app(big)), watcher)
    async with client.get(router.url + "/big") as reply:
        assert await reply.read() == payload
    assert len(watcher.heads) == 1
    assert watcher.bodies == []


async def test_an_observer_that_wants_nothing_leaves_the_stream_alone(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    async def small(request: web.Request) -> web.StreamResponse:
        return web.Response(text="hello")

    watcher = Watcher(wants=0)
    router = await observed_router(stack, await serve_worker(stack, worker_app(small)), watcher)
    async with client.get(router.url + "/") as reply:
        assert await reply.text() == "hello"
    assert [h[0] for h in watcher.heads] == [200]
    assert watcher.bodies == []


async def test_a_body_read_ahead_by_the_caller_is_sent_as_it_is(
    stack: Rig, client: aiohttp.ClientSession
) -> None:
    seen: list[tuple[bytes, str | None]] = []

    async def echo(request: web.Request) -> web.StreamResponse:
        seen.append((await request.read(), request.headers.get("Content-Length")))
        return web.Response(text="ok")

    upstream = await serve_worker(stack, worker_app(echo))
    router = await observed_router(stack, upstream, Watcher(0), body=b'{"session_id": "s9"}')
    async with client.post(router.url + "/x", data=b'{"session_id": "s9"}') as reply:
        assert reply.status == 200
    assert seen == [(b'{"session_id": "s9"}', "20")]


async def test_a_client_reading_a_long_reply_slowly_is_no_stalled_worker(stack: Rig) -> None:
    # The worker has it all out at once; the client pauses longer than stream_idle_s
    # while the router waits for it to take more (past the kernel's 4 MiB of buffers):
    # the worker's idle deadline must not cut it.
    size = 12 << 20
    payload = bytes(range(256)) * (size // 256)
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size
    worker = await raw_worker(stack, reply_script(head + payload, hold=True))
    timeouts = ForwardTimeouts(connect_s=1.0, first_byte_s=2.0, stream_idle_s=0.3)
    router = await start_router(stack, worker.upstream, timeouts=timeouts)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    client.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(client, ("127.0.0.1", router.port))
        await loop.sock_sendall(client, b"GET /long HTTP/1.1\r\nHost: h\r\n\r\n")
        received = bytearray()
        async with asyncio.timeout(30):
            while len(received) < len(head) + size:
                read = await loop.sock_recv(client, 1 << 20)
                assert read, f"cut after {len(received)} bytes"
                if not received:
                    await asyncio.sleep(1.0)  # three times stream_idle_s, once
                received += read
    finally:
        client.close()
        worker.done.set()
    assert bytes(received).endswith(payload)
    assert router.failures == []
