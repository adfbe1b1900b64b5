"""The rig for the router's functional tests: a real `RouterService` and real workers.

`Rig` starts a router in-process on loopback ports and a Unix control socket
under `tmp_path`, adds `EchoWorker`s (aiohttp apps on loopback that register
over the control socket, with the bundled `ControlClient` or a hand-written
`RawLease`) and talks to both listeners through an aiohttp client. Workers echo
who they are and what they received, so a test can assert which worker
answered and which headers crossed the router. `RawHttp` speaks HTTP/1.1 by
hand where the exact bytes on the wire are the point.

Every wait is bounded: polls end after `WAIT_S`, parked requests after `HOLD_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import aiohttp
from aiohttp import web
from multidict import CIMultiDictProxy

from router.client import ControlClient, aiohttp_boot_middleware
from router.config import (
    AdminConfig,
    ClaimsConfig,
    Config,
    ControlConfig,
    ListenConfig,
    default_config,
)
from router.service.router_service import RouterService
from router.tokens import SigningKey, episode_key, mint_token, new_nonce

__all__ = [
    "BOOT_HEADER",
    "CHUNK",
    "HOLD_S",
    "SIGNING_KEY",
    "TOKEN_HEADER",
    "WAIT_S",
    "EchoWorker",
    "MiB",
    "PeakRss",
    "RawHttp",
    "RawLease",
    "Reply",
    "Rig",
    "episode_key",
    "open_rig",
    "pattern_sha256",
    "pattern_stream",
    "router_config",
    "token",
    "wait_until",
]

TOKEN_HEADER = "X-NeMo-Gym-Episode-Token"
BOOT_HEADER = "X-Episode-Router-Boot"
SIGNING_KEY = SigningKey.generate("HS256")
MiB = 1 << 20
CHUNK = 256 * 1024  # the size workers and clients stream bodies in
WAIT_S = 5.0  # the longest a test polls for a state it expects
HOLD_S = 10.0  # the longest a worker parks a request (/slow, /hang) before giving up
_PATTERN = bytes(range(256)) * (CHUNK // 256)  # one chunk, reused: streaming allocates nothing

LeaseKind = Literal["client", "raw"]


def token(ep: str, att: int = 0, *, key: SigningKey = SIGNING_KEY, exp: int | None = None) -> str:
    """A fresh episode token for attempt `att` of `ep` (key `{ep}-a{att}`)."""
    return mint_token(ep=ep, att=att, nonce=new_nonce(), key=key, iat=int(time.time()), exp=exp)


def router_config(
    tmp_path: Path,
    *,
    lease_timeout_s: float = 15.0,
    reconnect_grace_s: float = 5.0,
    recovery_window_s: float = 0.0,
    **fields: Any,
) -> Config:
    """Loopback listeners on free ports, the control socket under `tmp_path`, no recovery
    window unless asked; `fields` replace whole top-level sections."""
    base = default_config()
    config = dataclasses.replace(
        base,
        listen=ListenConfig("127.0.0.1", 0),
        admin=AdminConfig("127.0.0.1", 0),
        control=dataclasses.replace(
            ControlConfig(),
            socket=f"unix:{tmp_path}/c.sock",
            lease_timeout_s=lease_timeout_s,
            reconnect_grace_s=reconnect_grace_s,
        ),
        claims=dataclasses.replace(ClaimsConfig(), recovery_window_s=recovery_window_s),
        timeouts=dataclasses.replace(base.timeouts, shutdown_grace_s=3.0),
    )
    return dataclasses.replace(config, **fields)


async def wait_until(
    check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = WAIT_S
) -> float:
    """Polls `check` until it is true; returns the seconds it took. Fails after `timeout_s`."""
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        if await check():
            return time.monotonic() - started
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.02)


# --- replies ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Reply:
    """A whole HTTP reply as the client received it."""

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def worker(self) -> str:
        """The id of the echo worker that answered."""
        value = self.json()["worker"]
        assert isinstance(value, str)
        return value

    def seen_headers(self, name: str) -> list[str]:
        """The values of header `name` the echo worker received, in order."""
        lower = name.lower()
        return [v for k, v in self.json()["headers"] if k.lower() == lower]

    def assert_answer(self, status: int, code: str, session: str | None) -> None:
        """The reply is the router's own answer: exact JSON shape and headers (design §1)."""
        assert self.status == status, (self.status, self.body)
        assert self.headers.getall("Content-Type") == ["application/json"]
        body = self.json()
        assert set(body) == {"error", "detail", "session"}, body
        assert body["error"] == code, body
        assert body["session"] == session, body
        assert isinstance(body["detail"], str) and body["detail"], body
        assert "X-Worker" not in self.headers  # no worker was involved in writing it
        if status == 401:
            assert self.headers.getall("WWW-Authenticate") == [f'EpisodeToken error="{code}"']
        else:
            assert "WWW-Authenticate" not in self.headers
        if code in ("no_worker", "recovering", "shutting_down"):
            retry = self.headers.getall("Retry-After")
            assert len(retry) == 1 and retry[0].isdigit() and int(retry[0]) >= 1, retry


# --- a worker ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Seen:
    """One request as a worker received it."""

    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body_bytes: int


class RawLease:
    """A control connection written by hand, so a test decides when it speaks, stays
    silent or breaks off."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._next_id = 0

    @classmethod
    async def open(cls, address: str) -> RawLease:
        """Connects to `unix:/path` or `tcp://127.0.0.1:port`."""
        if address.startswith("unix:"):
            reader, writer = await asyncio.open_unix_connection(
                address[len("unix:") :], limit=4 * MiB
            )
        else:
            host, _, port = address[len("tcp://") :].rpartition(":")
            reader, writer = await asyncio.open_connection(host, int(port), limit=4 * MiB)
        return cls(reader, writer)

    async def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """Sends one request and returns its reply (whose id must match)."""
        self._next_id += 1
        request_id = self._next_id
        self.send_line({"op": op, "id": request_id, **fields})
        reply = await self.read_reply()
        assert reply["id"] == request_id, reply
        return reply

    async def hello(self, worker_id: str, url: str, boot: str, **fields: Any) -> dict[str, Any]:
        return await self.call("hello", v=1, worker=worker_id, url=url, boot=boot, **fields)

    def send_line(self, message: Mapping[str, Any]) -> None:
        self.writer.write(json.dumps(message).encode() + b"\n")

    async def read_reply(self) -> dict[str, Any]:
        line = await asyncio.wait_for(self.reader.readline(), WAIT_S)
        assert line.endswith(b"\n"), line
        reply = json.loads(line)
        assert isinstance(reply, dict)
        return reply

    async def closed_by_peer(self, timeout_s: float = WAIT_S) -> bool:
        """True once the router closed the connection (EOF or reset), reading what is left."""
        try:
            async with asyncio.timeout(timeout_s):
                while await self.reader.read(65536):
                    pass
        except ConnectionError:
            return True
        except TimeoutError:
            return False
        return True

    def abort(self) -> None:
        """Drops the connection at once, without a bye."""
        self.writer.transport.abort()


class EchoWorker:
    """A worker on a loopback port that echoes who it is and what it received.

    Paths: `/slow` and `/hang` park until `release` is set; `/drop` closes the
    connection without a reply; `/big?bytes=N` streams N bytes; `/sse` sends one
    event, then a second once `sse_go` is set; `/hop` replies with hop-by-hop
    headers; `/redirect` answers 302 to its own private address. Everything else
    is echoed as JSON (the body is streamed and hashed).
    """

    def __init__(
        self, worker_id: str, control_address: str, *, unix_path: Path | None = None
    ) -> None:
        self.id = worker_id
        self.control_address = control_address
        self.unix_path = unix_path  # listen on this Unix socket instead of a loopback port
        self.boot = secrets.token_hex(8)
        self.seen: list[Seen] = []
        self.release = asyncio.Event()
        self.sse_go = asyncio.Event()
        self.sse_second_sent = False
        self.parked = 0
        self.client: ControlClient | None = None
        self.lease: RawLease | None = None
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        return f"http://127.0.0.1:{self.port}"

    def paths_seen(self) -> list[str]:
        return [seen.path for seen in self.seen]

    # -- lifecycle --

    async def serve(self) -> None:
        """Starts the HTTP side (on a free port the first time, the same port after)."""
        app = web.Application(middlewares=[aiohttp_boot_middleware(self.boot)], client_max_size=0)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site: web.BaseSite
        if self.unix_path is not None:
            site = web.UnixSite(self._runner, str(self.unix_path))
            await site.start()
            return
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def close_http(self) -> None:
        """Stops listening: its port refuses connections from now on."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def connect(self, lease: LeaseKind = "client") -> None:
        """Says hello (and syncs an empty set) with the bundled client or a raw lease."""
        if lease == "client":
            self.client = ControlClient(
                self.control_address, worker_id=self.id, url=self.url, boot=self.boot
            )
            await self.client.start()
            return
        self.lease = await RawLease.open(self.control_address)
        reply = await self.lease.hello(self.id, self.url, self.boot)
        assert reply["ok"] is True, reply
        synced = await self.lease.call("sync", claims=[], more=False)
        assert synced["ok"] is True, synced

    async def claim(self, key: str) -> None:
        if self.client is not None:
            await self.client.claim(key)
            return
        assert self.lease is not None
        reply = await self.lease.call("claim", key=key)
        assert reply["ok"] is True, reply

    async def release_key(self, key: str) -> None:
        if self.client is not None:
            await self.client.release(key)
            return
        assert self.lease is not None
        reply = await self.lease.call("release", key=key)
        assert reply["ok"] is True, reply

    async def close(self) -> None:
        """Lets parked requests go, says bye (client) or drops the lease, stops listening."""
        self.release.set()
        self.sse_go.set()
        if self.client is not None:
            await self.client.stop()
        if self.lease is not None:
            self.lease.abort()
        await self.close_http()

    # -- HTTP --

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/drop":
            self._record(request, 0)
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if request.path == "/big":
            return await self._big(request)
        if request.path == "/sse":
            return await self._sse(request)
        if request.path == "/redirect":
            self._record(request, 0)
            private = f"{self.url}/next"
            headers = {"Location": private, "Content-Location": private, "Link": private}
            return web.Response(status=302, headers=headers)
        body_bytes, digest = await _consume(request)
        self._record(request, body_bytes)
        if request.path in ("/slow", "/hang"):
            self.parked += 1
            try:
                await asyncio.wait_for(self.release.wait(), HOLD_S)
            finally:
                self.parked -= 1
        return web.json_response(
            {
                "worker": self.id,
                "method": request.method,
                "path": request.path_qs,
                "headers": list(request.headers.items()),
                "body_bytes": body_bytes,
                "sha256": digest,
            },
            headers=_HOP_REPLY if request.path == "/hop" else {"X-Worker": self.id},
        )

    def _record(self, request: web.Request, body_bytes: int) -> None:
        headers = tuple(request.headers.items())
        self.seen.append(Seen(request.method, request.path, headers, body_bytes))

    async def _big(self, request: web.Request) -> web.StreamResponse:
        self._record(request, 0)
        size = int(request.query["bytes"])
        response = web.StreamResponse(headers={"X-Worker": self.id})
        response.content_length = size
        await response.prepare(request)
        sent = 0
        while sent < size:
            part = _PATTERN[: min(CHUNK, size - sent)]
            await response.write(part)  # waits while the router is not reading: backpressure
            sent += len(part)
        await response.write_eof()
        return response

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        self._record(request, 0)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Worker": self.id}
        )
        await response.prepare(request)
        await response.write(b"data: first\n\n")
        await asyncio.wait_for(self.sse_go.wait(), HOLD_S)
        self.sse_second_sent = True
        await response.write(b"data: second\n\n")
        await response.write_eof()
        return response


# A worker's reply carrying hop-by-hop headers, one of them named by its Connection header.
_HOP_REPLY = {
    "X-Worker": "hop",
    "Connection": "X-Reply-Private",
    "X-Reply-Private": "secret",
    "Keep-Alive": "timeout=99",
    "Proxy-Agent": "worker",
    "X-Reply-Public": "kept",
}


async def _consume(request: web.Request) -> tuple[int, str]:
    """Reads the body as it arrives, keeping only its length and hash."""
    digest = hashlib.sha256()
    total = 0
    while chunk := await request.content.readany():
        digest.update(chunk)
        total += len(chunk)
    return total, digest.hexdigest()


def pattern_stream(size: int) -> AsyncIterator[bytes]:
    """`size` bytes of the workers' pattern, produced lazily."""

    async def chunks() -> AsyncIterator[bytes]:
        sent = 0
        while sent < size:
            part = _PATTERN[: min(CHUNK, size - sent)]
            sent += len(part)
            yield part

    return chunks()


def pattern_sha256(size: int) -> str:
    digest = hashlib.sha256()
    full, rest = divmod(size, CHUNK)
    for _ in range(full):
        digest.update(_PATTERN)
    digest.update(_PATTERN[:rest])
    return digest.hexdigest()


# --- the rig ------------------------------------------------------------------------------


class Rig:
    """One test's router, workers and HTTP client; everything is closed by `open_rig`."""

    def __init__(self, tmp_path: Path, stack: AsyncExitStack, http: aiohttp.ClientSession):
        self.tmp_path = tmp_path
        self.stack = stack
        self.http = http
        self.service: RouterService | None = None
        self.workers: dict[str, EchoWorker] = {}

    @property
    def router(self) -> RouterService:
        assert self.service is not None, "start_router() first"
        return self.service

    @property
    def control_address(self) -> str:
        return self.router.config.control.socket

    async def start_router(self, config: Config | None = None, **overrides: Any) -> RouterService:
        """Starts a router (`router_config(tmp_path, **overrides)` unless `config` is given)."""
        service = RouterService(config or router_config(self.tmp_path, **overrides))
        await service.start()
        self.service = service
        self.stack.push_async_callback(self._stop_router, service)
        return service

    async def _stop_router(self, service: RouterService) -> None:
        if service is self.service:
            await self.stop_router()

    async def stop_router(self) -> None:
        service, self.service = self.service, None
        if service is not None:
            await service.stop()

    async def add_worker(self, worker_id: str, *, lease: LeaseKind = "client") -> EchoWorker:
        worker = EchoWorker(worker_id, self.control_address)
        await worker.serve()
        self.stack.push_async_callback(worker.close)
        await worker.connect(lease)
        self.workers[worker_id] = worker
        return worker

    # -- the public listener --

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.router.public_port}{path}"

    async def request(
        self,
        method: str,
        path: str,
        *,
        episode: str | None = None,
        headers: Any = None,
        data: Any = None,
    ) -> Reply:
        """One request to the public port; `episode` is put in the token header."""
        sent: list[tuple[str, str]] = []
        if episode is not None:
            sent.append((TOKEN_HEADER, episode))
        if headers is not None:
            items = headers.items() if hasattr(headers, "items") else headers
            sent.extend(items)
        async with self.http.request(method, self.url(path), headers=sent, data=data) as reply:
            return Reply(reply.status, reply.headers, await reply.read())

    # -- the admin listener --

    def admin_url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.router.admin_port}{path}"

    async def admin(
        self, method: str, path: str, headers: Mapping[str, str] | None = None
    ) -> Reply:
        async with self.http.request(method, self.admin_url(path), headers=headers) as reply:
            return Reply(reply.status, reply.headers, await reply.read())

    async def worker_views(self) -> dict[str, dict[str, Any]]:
        reply = await self.admin("GET", "/admin/workers")
        assert reply.status == 200, reply
        return {view["id"]: view for view in reply.json()["workers"]}

    async def wait_worker_state(self, worker_id: str, state: str) -> float:
        """Polls the admin API until `worker_id` shows `state`; returns the seconds it took."""

        async def shows() -> bool:
            view = (await self.worker_views()).get(worker_id)
            return view is not None and view["state"] == state

        return await wait_until(shows, f"worker {worker_id} to be {state}")


@asynccontextmanager
async def open_rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with AsyncExitStack() as stack:
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        stack.push_async_callback(http.close)
        yield Rig(tmp_path, stack, http)


# --- raw HTTP -------------------------------------------------------------------------------


class RawHttp:
    """An HTTP/1.1 connection written and read byte by byte."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    @classmethod
    async def open(cls, port: int) -> RawHttp:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    def send(self, data: bytes) -> None:
        self.writer.write(data)

    async def read_head(self) -> tuple[int, dict[str, str], bytes]:
        """The next reply head: status, headers (lower-cased names) and its raw bytes."""
        raw = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), WAIT_S)
        lines = raw.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        return status, headers, raw

    async def read_reply(self) -> tuple[int, dict[str, str], bytes]:
        """The next final reply (status, headers, body), framed by Content-Length."""
        status, headers, _ = await self.read_head()
        length = int(headers.get("content-length", "0"))
        body = await asyncio.wait_for(self.reader.readexactly(length), WAIT_S)
        return status, headers, body

    async def read_to_end(self) -> bytes:
        """Everything until the peer closes (fails if it does not within WAIT_S)."""
        data = bytearray()
        async with asyncio.timeout(WAIT_S):
            with contextlib.suppress(ConnectionResetError):
                while chunk := await self.reader.read(65536):
                    data += chunk
        return bytes(data)

    def close(self) -> None:
        self.writer.transport.abort()


# --- memory -------------------------------------------------------------------------------


class PeakRss:
    """Samples this process's resident set size from a thread, to catch peaks the event
    loop would miss while it is busy."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.baseline = _rss_bytes()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT_S)
        self.peak = max(self.peak, _rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.baseline

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, _rss_bytes())


def _rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as statm:
        resident_pages = int(statm.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
