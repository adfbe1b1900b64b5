"""Faults and hostile input through a real router: the hardening cases no other file pins.

A `RouterService` runs in this process on loopback ports, with workers registered over
its control socket. Clients speak raw HTTP/1.1 (`RawHttp`) where the bytes on the wire are
the point. Two kinds of worker stand behind the router: the `EchoWorker`s of the shared rig,
and `ScriptedWorker`, which records every request byte for byte as it arrived (head and
body) and answers with scripted bytes, so a test can state exactly what reached a worker,
or that nothing did (no connection was ever made), and can send replies no HTTP library
would write (an invalid head, a 101, interim 1xx replies).

Each test asserts the contract of design §1, §3 and §8 (the answers table and HTTP
hygiene): the status, the router's JSON answer code, whether the client connection
was closed or kept, and what the worker saw. Where the router departs from the contract
the test is a strict xfail naming the cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import secrets
import socket
import struct
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config import (
    CookieSourceConfig,
    LimitsConfig,
    PathSourceConfig,
    SessionKindConfig,
    TimeoutsConfig,
    TokenFormatConfig,
    VerifyConfig,
)
from tests.metrics.test_registry import scrape, series
from tests.router_fixtures import (
    TOKEN_HEADER,
    WAIT_S,
    RawHttp,
    RawLease,
    Rig,
    open_rig,
    router_config,
    token,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)

OK_BODY = b'{"ok":true}'
OK_REPLY = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n" + OK_BODY
)
IN_FLIGHT = "episode_router_in_flight_requests"
GAUGE_BACK_S = 1.0  # how soon a departed client's in-flight slot must be free again


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


# --- a worker that speaks bytes ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Arrived:
    """One request exactly as the worker's socket received it."""

    head: bytes  # the request line and header lines, up to and including the blank line
    body: bytes  # the body as framed on the wire (chunk sizes and trailers included)
    decoded: bytes  # the body's content

    @property
    def target(self) -> str:
        return self.head.split(b"\r\n", 1)[0].split(b" ")[1].decode("latin-1")

    @property
    def headers(self) -> list[tuple[str, str]]:
        lines = self.head.decode("latin-1").split("\r\n")[1:]
        pairs = [line.partition(":") for line in lines if line]
        return [(name.lower(), value.strip()) for name, _, value in pairs]

    def values(self, name: str) -> list[str]:
        return [value for key, value in self.headers if key == name.lower()]


class ScriptedWorker:
    """A worker on a loopback port that records each request byte for byte and answers
    every one with `reply` (closing the connection after it when `close`)."""

    def __init__(
        self, worker_id: str, reply: bytes = OK_REPLY, *, close: bool = False, reset: bool = False
    ) -> None:
        self.id = worker_id
        self.reply = reply
        self.close_after_reply = close or reset
        self.reset_after_reply = reset  # closed with a reset (RST), not a FIN
        self.boot = secrets.token_hex(8)
        self.arrived: list[Arrived] = []
        self.connections = 0
        self.lease: RawLease | None = None
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, rig: Rig) -> ScriptedWorker:
        """Listens, then says hello and syncs an empty set on the rig's control socket."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        rig.stack.push_async_callback(self.stop)
        self.lease = await RawLease.open(rig.control_address)
        hello = await self.lease.hello(self.id, self.url, self.boot)
        assert hello["ok"] is True, hello
        synced = await self.lease.call("sync", claims=[], more=False)
        assert synced["ok"] is True, synced
        return self

    async def claim(self, key: str) -> None:
        assert self.lease is not None
        reply = await self.lease.call("claim", key=key)
        assert reply["ok"] is True, reply

    async def stop(self) -> None:
        if self.lease is not None:
            self.lease.abort()
        if self._server is not None:
            self._server.close()
            for writer in self._writers:
                writer.transport.abort()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body, decoded = await _read_body(reader, head)
                self.arrived.append(Arrived(head, body, decoded))
                writer.write(self.reply)
                await writer.drain()
                if self.reset_after_reply:
                    sock = writer.get_extra_info("socket")
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    writer.transport.abort()
                    break
                if self.close_after_reply:
                    break
        except (
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ValueError,
        ):
            pass  # the router broke the request off (or framed it badly): nothing is recorded
        finally:
            self._writers.discard(writer)
            writer.close()


async def _read_body(reader: asyncio.StreamReader, head: bytes) -> tuple[bytes, bytes]:
    """(the body as framed, its content) by the head's Content-Length or chunked coding."""
    arrived = Arrived(head, b"", b"")
    if arrived.values("transfer-encoding"):
        framed, content = bytearray(), bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            framed += size_line
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            framed += data
            content += data[:-2]
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            framed += line  # a trailer field
        framed += line
        return bytes(framed), bytes(content)
    lengths = arrived.values("content-length")
    data = await reader.readexactly(int(lengths[0])) if lengths else b""
    return data, data


# --- helpers ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Received:
    """Every byte a raw client got until the router closed the connection, split into
    the first reply's head and body."""

    status: int
    headers: dict[str, str]
    body: bytes
    rest: bytes  # anything after the first reply's body

    @classmethod
    def parse(cls, everything: bytes) -> Received:
        head, separator, after = everything.partition(b"\r\n\r\n")
        assert separator and head.startswith(b"HTTP/1."), everything[:300]
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers["content-length"])
        return cls(int(lines[0].split(" ")[1]), headers, after[:length], after[length:])

    def assert_answer(self, status: int, code: str, session: str | None) -> None:
        """The router's own JSON answer (design §1), and nothing after it."""
        assert self.status == status, (self.status, self.body)
        assert self.headers["content-type"] == "application/json"
        body = json.loads(self.body)
        assert set(body) == {"error", "detail", "session"}, body
        assert (body["error"], body["session"]) == (code, session), body
        assert isinstance(body["detail"], str) and body["detail"], body
        assert self.rest == b"", self.rest[:200]


async def exchange_until_closed(port: int, data: bytes) -> bytes:
    """Sends `data` on a new connection; everything the router sends until it closes."""
    conn = await RawHttp.open(port)
    try:
        conn.send(data)
        return await conn.read_to_end()
    finally:
        conn.close()


def request_bytes(
    method: str, target: str, headers: Sequence[tuple[str, str]] = (), body: bytes = b""
) -> bytes:
    """A request written by hand: `Host: public.example`, then `headers` in order, then a
    Content-Length when there is a body. Header names and values go out as latin-1."""
    lines = [f"{method} {target} HTTP/1.1", "Host: public.example"]
    lines += [f"{name}: {value}" for name, value in headers]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def gauge(rig: Rig, name: str) -> dict[str, float]:
    """One metric's samples from the admin listener, by their `worker` label."""
    text = (await rig.admin("GET", "/metrics")).body.decode()
    return {
        sample.labels.get("worker", ""): sample.value
        for family in text_string_to_metric_families(text)
        if family.name == name
        for sample in family.samples
    }


async def in_flight_is_zero(rig: Rig, worker_id: str) -> bool:
    views = await rig.worker_views()
    return views[worker_id]["in_flight"] == 0 and (await gauge(rig, IN_FLIGHT)).get(worker_id) == 0


def limits(**fields: Any) -> LimitsConfig:
    return dataclasses.replace(LimitsConfig(), **fields)


# --- heads the router refuses itself ----------------------------------------------------------

_CHUNKED = [("Transfer-Encoding", "chunked")]


def _post_chunked(chunks: bytes, headers: Sequence[tuple[str, str]] = _CHUNKED) -> bytes:
    return request_bytes("POST", "/upload", headers) + chunks


REFUSED_HEADS: dict[str, bytes] = {
    # Content-Length that is not a plain decimal number or a list of them.
    "content-length-plus-sign": request_bytes("POST", "/", [("Content-Length", "+5")]) + b"hello",
    "content-length-hex": request_bytes("POST", "/", [("Content-Length", "0x10")]) + b"h" * 16,
    "content-length-underscore": request_bytes("POST", "/", [("Content-Length", "1_0")])
    + b"h" * 10,
    "content-length-negative": request_bytes("POST", "/", [("Content-Length", "-1")]) + b"h",
    "content-length-list": request_bytes("POST", "/", [("Content-Length", "3, 3")]) + b"abc",
    # Bare LF line endings.
    "bare-lf-head": b"GET / HTTP/1.1\nHost: public.example\n\n",
    "one-bare-lf-header-line": b"GET / HTTP/1.1\r\nHost: public.example\nX-After: y\r\n\r\n",
    # A single disguised framing name.
    "te-space-before-colon": _post_chunked(
        b"5\r\nhello\r\n0\r\n\r\n", [("Transfer-Encoding ", "chunked")]
    ),
    "te-tab-before-colon": _post_chunked(
        b"5\r\nhello\r\n0\r\n\r\n", [("Transfer-Encoding\t", "chunked")]
    ),
    "ctl-before-content-length": request_bytes("POST", "/", [("\x01Content-Length", "5")])
    + b"hello",
    "obs-text-in-te-name": _post_chunked(
        b"5\r\nhello\r\n0\r\n\r\n", [("Transfer-Encoding\x88", "chunked")]
    ),
    # Bad chunk framing.
    "chunk-size-not-hex": _post_chunked(b"zz\r\nhello\r\n0\r\n\r\n"),
    "chunk-size-negative": _post_chunked(b"-1\r\nhello\r\n0\r\n\r\n"),
    "chunk-size-0x-prefix": _post_chunked(b"0x5\r\nhello\r\n0\r\n\r\n"),
    "chunk-size-17-hex-digits": _post_chunked(b"fffffffffffffffff\r\nhello\r\n0\r\n\r\n"),
    "chunk-extension-bare-lf": _post_chunked(b"5;a=b\n;c=d\r\nhello\r\n0\r\n\r\n"),
    "chunk-data-over-its-size": _post_chunked(b"3\r\nhello\r\n0\r\n\r\n"),
    # Protocol switches and tunnels.
    "http2-preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "connect": b"CONNECT worker.example:443 HTTP/1.1\r\nHost: worker.example:443\r\n\r\n",
    "options-asterisk": b"OPTIONS * HTTP/1.1\r\nHost: public.example\r\n\r\n",
}


@pytest.mark.parametrize("name", list(REFUSED_HEADS))
async def test_a_refused_request_is_400_bad_request_closed_and_never_reaches_a_worker(
    rig: Rig, name: str
) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0").start(rig)  # sessionless: it would get the request

    everything = await exchange_until_closed(router.public_port, REFUSED_HEADS[name])

    Received.parse(everything).assert_answer(400, "bad_request", None)
    assert (worker.connections, worker.arrived) == (0, [])


# --- sessions: empty token, repeated cookie ---------------------------------------------------


async def test_an_empty_token_header_is_401_invalid_token(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")

    reply = await rig.request("POST", "/tools/add", headers=[(TOKEN_HEADER, "")], data=b"{}")

    reply.assert_answer(401, "invalid_token", None)
    assert worker.seen == []


async def test_a_session_cookie_repeated_with_different_values_is_400_ambiguous(
    rig: Rig, tmp_path: Path
) -> None:
    kind = SessionKindConfig(name="episode", cookie=CookieSourceConfig("sid", "raw"))
    await rig.start_router(router_config(tmp_path, sessions=(kind,)))
    worker = await rig.add_worker("w0")
    await worker.claim("s1")
    await worker.claim("s2")

    one_header = await rig.request("GET", "/a", headers=[("Cookie", "sid=s1; sid=s2")])
    two_headers = await rig.request(
        "GET", "/b", headers=[("Cookie", "sid=s1"), ("Cookie", "sid=s2")]
    )
    same_twice = await rig.request("GET", "/c", headers=[("Cookie", "sid=s1; other=x; sid=s1")])

    one_header.assert_answer(400, "ambiguous_session", None)
    two_headers.assert_answer(400, "ambiguous_session", None)
    assert (same_twice.status, same_twice.worker) == (200, "w0")
    assert worker.paths_seen() == ["/c"]


# --- the router's own answers leave no unread body behind -------------------------------------


async def _answer_setup(rig: Rig, tmp_path: Path, code: str) -> str:
    """Starts a router and a worker; returns a token that gets the answer `code`."""
    if code == "bad_signature":
        verify = VerifyConfig(alg="HS256", key=secrets.token_bytes(32))
        kind = SessionKindConfig(
            name="episode", header=TOKEN_HEADER, token=TokenFormatConfig("jws", verify=verify)
        )
        await rig.start_router(router_config(tmp_path, sessions=(kind,)))
        worker = await rig.add_worker("w0")
        await worker.claim("ep-a0")
        return token("ep")  # signed with another key
    if code == "recovering":
        await rig.start_router(recovery_window_s=30.0)
        await rig.add_worker("w0")
        return token("unknown")
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    await worker.release_key("ep-a0")
    return token("ep")


@pytest.mark.parametrize(
    ("code", "status", "session"),
    [
        ("bad_signature", 403, None),
        ("episode_ended", 410, "ep-a0"),
        ("recovering", 503, "unknown-a0"),
    ],
)
async def test_an_answer_to_a_request_with_an_unread_body_closes_without_100_continue(
    rig: Rig, tmp_path: Path, code: str, status: int, session: str | None
) -> None:
    value = await _answer_setup(rig, tmp_path, code)
    smuggled = b"GET /smuggled HTTP/1.1\r\nHost: public.example\r\n\r\n"
    headers = [
        (TOKEN_HEADER, value),
        ("Expect", "100-continue"),
        ("Content-Length", str(len(smuggled))),
    ]
    conn = await RawHttp.open(rig.router.public_port)
    try:
        conn.send(request_bytes("POST", "/tools/add", headers))  # the body waits for a 100
        status_in, headers_in, body = await conn.read_reply()  # the first reply is the final one
        conn.send(smuggled)  # a client that sends the body anyway
        after = await conn.read_to_end()
    finally:
        conn.close()

    assert status_in == status
    assert headers_in["connection"] == "close"
    answer = json.loads(body)
    assert (answer["error"], answer["session"]) == (code, session)
    assert after == b""  # closed: the body was never read as a request
    assert rig.workers["w0"].seen == []


# --- request bodies: chunk framing after the head, trailers, stalls ---------------------------


async def test_a_malformed_chunk_after_the_head_was_forwarded_is_400_and_closed(
    rig: Rig, tmp_path: Path
) -> None:
    timeouts = TimeoutsConfig(connect_s=1.0, first_byte_s=1.0, stream_idle_s=5.0)
    # No body buffer: the chunked body streams, so its head is forwarded before the chunk.
    config = router_config(tmp_path, timeouts=timeouts, limits=limits(body_buffer_bytes=0))
    router = await rig.start_router(config)
    worker = await ScriptedWorker("w0").start(rig)
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("POST", "/upload", _CHUNKED) + b"5\r\nhello\r\n")

        async def forwarded() -> bool:
            return worker.connections == 1

        await wait_until(forwarded, "the head to reach the worker")
        conn.send(b"zz\r\nhello\r\n0\r\n\r\n")
        status, headers, body = await conn.read_reply()
        assert (status, json.loads(body)["error"]) == (400, "bad_request"), body
        assert headers["connection"] == "close"
        assert await conn.read_to_end() == b""
    finally:
        conn.close()

    assert worker.arrived == []  # the worker never got a whole request


async def test_a_trailer_never_reaches_the_worker_as_a_header(rig: Rig) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0").start(rig)
    chunks = b"5\r\nhello\r\n0\r\nX-Injected: yes\r\n\r\n"
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(_post_chunked(chunks))
        status, _, body = await conn.read_reply()
    finally:
        conn.close()

    assert (status, body) == (200, OK_BODY)
    [upload] = worker.arrived
    assert (upload.target, upload.decoded) == ("/upload", b"hello")
    assert upload.body == b"5\r\nhello\r\n0\r\n\r\n"  # re-framed, with no trailer
    assert b"x-injected" not in upload.head.lower()


async def test_a_trailer_never_becomes_a_header_of_the_next_pipelined_request(rig: Rig) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0").start(rig)
    chunks = b"5\r\nhello\r\n0\r\nX-Injected: yes\r\n\r\n"
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(_post_chunked(chunks) + request_bytes("GET", "/next"))
        first = await conn.read_reply()
        second = await conn.read_reply()
    finally:
        conn.close()

    assert (first[0], second[0]) == (200, 200)
    upload, after = worker.arrived
    assert (upload.target, upload.decoded, after.target) == ("/upload", b"hello", "/next")
    assert after.values("x-injected") == [], after.head


async def test_a_stalled_upload_is_408_at_body_timeout_s_and_its_connection_closed(
    rig: Rig, tmp_path: Path
) -> None:
    # The worker's first-byte timeout is shorter, and does not run while the client is
    # the one to send: the silence is the client's, and so is the answer.
    timeouts = TimeoutsConfig(connect_s=1.0, first_byte_s=0.4, stream_idle_s=5.0)
    bounds = limits(body_timeout_s=1.0)
    router = await rig.start_router(router_config(tmp_path, timeouts=timeouts, limits=bounds))
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    headers = [(TOKEN_HEADER, token("ep")), ("Content-Length", "10")]
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("POST", "/upload", headers) + b"abc")  # 3 of 10, then silence
        started = time.monotonic()
        status, headers_in, body = await conn.read_reply()
        took = time.monotonic() - started
        conn.send(b"defghij" + request_bytes("GET", "/smuggled"))  # the rest, then a request
        after = await conn.read_to_end()
    finally:
        conn.close()

    assert 1.0 <= took < 4.0, took
    assert (status, headers_in["connection"]) == (408, "close")
    answer = json.loads(body)
    assert (answer["error"], answer["session"]) == ("request_timeout", None)
    assert after == b""  # closed: the bytes after the answer were never read as a request
    assert worker.seen == []  # its body never came whole, so the echo worker recorded nothing
    assert (await rig.worker_views())["w0"]["state"] == "live"  # a slow client is no fault of its


# --- the slowloris trickle --------------------------------------------------------------------


async def test_a_head_trickled_a_byte_at_a_time_is_cut_at_the_header_timeout(
    rig: Rig, tmp_path: Path
) -> None:
    config = router_config(tmp_path, limits=limits(header_timeout_s=0.5, idle_timeout_s=30.0))
    router = await rig.start_router(config)
    worker = await ScriptedWorker("w0").start(rig)
    head = request_bytes("GET", "/", [("X-Padding", "p" * 100)])
    conn = await RawHttp.open(router.public_port)
    started = time.monotonic()

    async def trickle() -> int:
        """One byte every 0.1 s (pacing, not a wait for a state); returns the bytes sent."""
        for sent in range(len(head)):
            if conn.writer.transport.is_closing() or conn.reader.at_eof():
                return sent
            conn.send(head[sent : sent + 1])
            await asyncio.sleep(0.1)
        return len(head)

    sender = asyncio.create_task(trickle(), name="slowloris")
    try:
        everything = await conn.read_to_end()
        cut_after = time.monotonic() - started
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await sender
        conn.close()

    assert everything == b""
    assert 0.45 <= cut_after < 1.2, cut_after  # each byte did not restart the clock
    assert (worker.connections, worker.arrived) == (0, [])


# --- pipelining -------------------------------------------------------------------------------


async def test_pipelined_requests_each_reach_their_own_holder_and_are_answered_in_order(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    w0 = await rig.add_worker("w0")
    w1 = await rig.add_worker("w1")
    for key in ("a-a0", "c-a0"):
        await w0.claim(key)
    await w1.claim("b-a0")  # fewer claims: a sessionless request goes to w1
    pipeline = [
        ("POST", "/a1", token("a"), b"one"),
        ("POST", "/b1", token("b"), b"two"),
        ("GET", "/unknown", token("nobody"), b""),
        ("POST", "/c1", token("c"), b"three"),
        ("POST", "/a2", token("a"), b"four"),
        ("GET", "/none", None, b""),
    ]
    data = b"".join(
        request_bytes(method, path, [(TOKEN_HEADER, value)] if value else [], body)
        for method, path, value, body in pipeline
    )
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(data)  # all six in one write
        replies = [await conn.read_reply() for _ in pipeline]
        conn.send(request_bytes("GET", "/still-open"))
        last = await conn.read_reply()
    finally:
        conn.close()

    seen = []
    for status, headers, body in replies:
        answer = json.loads(body)
        if status == 401:
            assert "connection" not in headers  # no body was left unread: the connection stays
            seen.append((status, answer["error"], answer["session"]))
        else:
            seen.append((status, answer["worker"], answer["path"]))
    assert seen == [
        (200, "w0", "/a1"),
        (200, "w1", "/b1"),
        (401, "unknown_episode", "nobody-a0"),
        (200, "w0", "/c1"),
        (200, "w0", "/a2"),
        (200, "w1", "/none"),
    ]
    assert (last[0], json.loads(last[2])["path"]) == (200, "/still-open")
    assert w0.paths_seen() == ["/a1", "/c1", "/a2"]
    assert w1.paths_seen() == ["/b1", "/none", "/still-open"]
    assert [seen.body_bytes for seen in w0.seen] == [3, 5, 4]


# --- protocol upgrades ------------------------------------------------------------------------

UPGRADES = {
    "websocket": [
        ("Connection", "Upgrade"),
        ("Upgrade", "websocket"),
        ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
        ("Sec-WebSocket-Version", "13"),
    ],
    "h2c": [
        ("Connection", "Upgrade, HTTP2-Settings"),
        ("Upgrade", "h2c"),
        ("HTTP2-Settings", "AAMAAABkAAQCAAAAAAIAAAAA"),
    ],
}


@pytest.mark.parametrize("name", list(UPGRADES))
async def test_an_upgrade_request_is_forwarded_as_plain_http_never_switched(
    rig: Rig, name: str
) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0").start(rig)
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("GET", "/chat", UPGRADES[name]))
        status, _, body = await conn.read_reply()
        conn.send(request_bytes("GET", "/after"))  # still HTTP/1.1 on the same connection
        after_status, _, _ = await conn.read_reply()
    finally:
        conn.close()

    assert (status, body, after_status) == (200, OK_BODY, 200)
    upgrade, after = worker.arrived
    assert (upgrade.target, after.target) == ("/chat", "/after")
    names = {key for key, _ in upgrade.headers}
    assert not names & {"upgrade", "http2-settings"}, upgrade.head
    assert all("upgrade" not in value.lower() for value in upgrade.values("connection"))


# --- worker replies the router must not relay -------------------------------------------------

BAD_REPLIES = {
    "content-length-and-chunked": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "bad-status-line": b"HTTP/1.1 abc nope\r\nContent-Length: 2\r\n\r\nok",
    "not-http": b"NOT HTTP AT ALL\r\n\r\n",
    "switching-protocols": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
    b"Connection: Upgrade\r\n\r\n",
}


@pytest.mark.parametrize("name", list(BAD_REPLIES))
async def test_an_invalid_or_switching_reply_is_502_upstream_error_and_nothing_relayed(
    rig: Rig, name: str
) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0", BAD_REPLIES[name], close=True).start(rig)
    await worker.claim("ep-a0")
    headers = [(TOKEN_HEADER, token("ep")), ("Connection", "close")]

    everything = await exchange_until_closed(
        router.public_port, request_bytes("POST", "/tools/add", headers, b"{}")
    )

    Received.parse(everything).assert_answer(502, "upstream_error", "ep-a0")
    [arrived] = worker.arrived  # sent once, never replayed
    assert (arrived.target, arrived.decoded) == ("/tools/add", b"{}")
    assert (await rig.worker_views())["w0"]["state"] == "live"  # a bad reply is not an exit


@pytest.mark.parametrize(
    "interim",
    [
        b"HTTP/1.1 100 Continue\r\n\r\n",
        b"HTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n",
    ],
    ids=["100", "103", "100-then-103"],
)
async def test_a_workers_interim_replies_are_dropped_and_the_final_reply_relayed(
    rig: Rig, interim: bytes
) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0", interim + OK_REPLY).start(rig)
    await worker.claim("ep-a0")
    headers = [(TOKEN_HEADER, token("ep")), ("Connection", "close")]

    everything = await exchange_until_closed(
        router.public_port, request_bytes("POST", "/tools/add", headers, b"{}")
    )

    assert everything.startswith(b"HTTP/1.1 200 OK\r\n"), everything[:200]
    assert everything.count(b"HTTP/1.1 ") == 1  # exactly one reply: the final one
    received = Received.parse(everything)
    assert (received.body, received.rest) == (OK_BODY, b"")
    assert "link" not in received.headers
    assert len(worker.arrived) == 1


# --- a sessionless request is not replayed once sent ------------------------------------------


async def test_a_sessionless_post_whose_body_reached_a_worker_that_dropped_it_is_not_retried(
    rig: Rig,
) -> None:
    await rig.start_router()
    dropper = await ScriptedWorker("w0", b"", close=True).start(rig)  # reads it all, says nothing
    other = await ScriptedWorker("w1").start(rig)

    reply = await rig.request("POST", "/seed", data=b"payload")

    reply.assert_answer(502, "upstream_error", None)
    [arrived] = dropper.arrived
    assert (arrived.target, arrived.decoded) == ("/seed", b"payload")
    assert (other.connections, other.arrived) == (0, [])  # never replayed elsewhere
    views = await rig.worker_views()
    assert (views["w0"]["state"], views["w1"]["state"]) == ("live", "live")


# --- a departed client frees its worker's slot ------------------------------------------------


async def _hold_until_in_flight(rig: Rig, worker_id: str) -> None:
    async def busy() -> bool:
        views = await rig.worker_views()
        return (
            views[worker_id]["in_flight"] == 1 and (await gauge(rig, IN_FLIGHT)).get(worker_id) == 1
        )

    await wait_until(busy, f"a request in flight to {worker_id}")


async def _until_free(rig: Rig, worker_id: str) -> None:
    async def free() -> bool:
        return await in_flight_is_zero(rig, worker_id)

    await wait_until(free, f"{worker_id}'s in-flight slot to be free", GAUGE_BACK_S)


async def test_a_client_that_leaves_before_the_reply_head_frees_the_slot_within_a_second(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    conn = await RawHttp.open(router.public_port)
    conn.send(request_bytes("POST", "/slow", [(TOKEN_HEADER, token("ep"))], b"{}"))

    async def parked() -> bool:
        return worker.parked == 1

    await wait_until(parked, "the request to reach the worker")
    await _hold_until_in_flight(rig, "w0")
    conn.close()

    await _until_free(rig, "w0")


async def test_a_worker_reset_in_a_reply_that_ends_at_close_is_no_clean_end(rig: Rig) -> None:
    # A reply with no length ends when the worker closes; a reset is not that close: the
    # client sees the reply cut (no last chunk), not a whole one.
    router = await rig.start_router()
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npartial-body"
    worker = await ScriptedWorker("w0", reply, reset=True).start(rig)
    await worker.claim("ep-a0")
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("GET", "/cut", [(TOKEN_HEADER, token("ep"))]))
        everything = await conn.read_to_end()
    finally:
        conn.close()
    assert everything.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"transfer-encoding: chunked" in everything.lower()
    assert not everything.endswith(b"0\r\n\r\n")  # no clean end of the chunked body


async def test_a_client_that_leaves_while_a_small_reply_is_read_frees_the_slot(
    rig: Rig,
) -> None:
    # The reply's head is in, its 10 bytes never come: read whole before anything goes
    # out (a small reply), so the client's leaving must end the wait too.
    router = await rig.start_router()
    worker = await ScriptedWorker("w0", b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n").start(rig)
    await worker.claim("ep-a0")
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("GET", "/short", [(TOKEN_HEADER, token("ep"))]))
        await _hold_until_in_flight(rig, "w0")
    finally:
        conn.close()

    await _until_free(rig, "w0")
    requests = series(scrape(rig.router.metrics), "episode_router_requests_total")
    assert requests == {"kind=episode,outcome=client_closed,status_class=4xx": 1}, requests


async def test_a_client_that_leaves_mid_stream_frees_the_slot_and_the_gauge(rig: Rig) -> None:
    router = await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("GET", "/sse", [(TOKEN_HEADER, token("ep"))]))
        status, _, _ = await conn.read_head()
        first = await asyncio.wait_for(conn.reader.readuntil(b"data: first\n\n"), WAIT_S)
        assert status == 200 and first.endswith(b"data: first\n\n")
        await _hold_until_in_flight(rig, "w0")
    finally:
        conn.close()

    await _until_free(rig, "w0")
    assert worker.sse_second_sent is False


async def test_a_client_that_leaves_mid_upload_frees_the_slot_and_the_gauge(rig: Rig) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    headers = [(TOKEN_HEADER, token("ep")), ("Content-Length", str(1 << 20))]
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("POST", "/upload", headers) + b"x" * 65536)  # 64 KiB of 1 MiB
        await _hold_until_in_flight(rig, "w0")
    finally:
        conn.close()

    await _until_free(rig, "w0")
    assert worker.arrived == []  # the worker never got a whole request
    assert (await rig.worker_views())["w0"]["state"] == "live"


# --- odd request targets ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "//mcp",
        "/mcp/../x",
        "/mcp/%2e%2e/x",
        "/mcp/%2E%2E/%2e/x",
        "/a/./b/../../c?x=/../y",
        "/x%2F..%2Fmcp",
        "/..",
    ],
)
async def test_an_origin_form_target_reaches_the_worker_byte_for_byte(
    rig: Rig, target: str
) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")

    everything = await exchange_until_closed(
        router.public_port,
        request_bytes("GET", target, [(TOKEN_HEADER, token("ep")), ("Connection", "close")]),
    )

    assert Received.parse(everything).status == 200
    [arrived] = worker.arrived
    assert arrived.target == target


async def test_an_absolute_form_target_reaches_the_worker_as_its_path_and_query(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    request = request_bytes(
        "GET", "http://public.example/abs/../x?q=1", [(TOKEN_HEADER, token("ep"))]
    )

    last = request_bytes("GET", "/z", [("Connection", "close")])
    everything = await exchange_until_closed(router.public_port, request + last)

    [arrived, after] = worker.arrived
    assert Received.parse(everything).status == 200
    assert (arrived.target, after.target) == ("/abs/../x?q=1", "/z")
    assert arrived.values("host") == [f"127.0.0.1:{worker.port}"]


async def test_an_absolute_form_targets_authority_is_the_forwarded_host(rig: Rig) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    request = request_bytes(
        "GET",
        "http://target.example:8080/abs?q=1",
        [(TOKEN_HEADER, token("ep")), ("Connection", "close")],
    )

    await exchange_until_closed(router.public_port, request)

    [arrived] = worker.arrived
    assert arrived.values("x-forwarded-host") == ["target.example:8080"]


async def test_a_dot_segment_path_is_matched_as_written_and_names_no_session(
    rig: Rig, tmp_path: Path
) -> None:
    kind = SessionKindConfig(name="episode", path=PathSourceConfig("/rollouts/{key}/stop"))
    router = await rig.start_router(router_config(tmp_path, sessions=(kind,)))
    w0 = await ScriptedWorker("w0").start(rig)
    w1 = await ScriptedWorker("w1").start(rig)
    for key in ("k1", "k3"):
        await w0.claim(key)
    await w1.claim("k2")  # fewer claims: the balancer's pick for a sessionless request

    for target in ("/rollouts/k1/stop", "/rollouts/x/../k1/stop", "//rollouts/k1/stop"):
        everything = await exchange_until_closed(
            router.public_port, request_bytes("POST", target, [("Connection", "close")])
        )
        assert Received.parse(everything).status == 200

    assert [a.target for a in w0.arrived] == ["/rollouts/k1/stop"]
    assert [a.target for a in w1.arrived] == ["/rollouts/x/../k1/stop", "//rollouts/k1/stop"]
