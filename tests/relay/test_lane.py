"""The relay's lane (`Forwarder.start`) against its coroutine path (`Forwarder.forward`).

A forward whose request body is all here and small, with an idle pooled connection to
the worker and no reply learner, goes without a task: callbacks relay a reply that came
whole, and anything else is handed to the coroutine path at the point it reached. The
first request to a worker always takes the coroutine path (no pooled connection yet);
the second, on the kept-alive worker connection, takes the lane.

A real `RouterService` forwards on loopback to scripted workers registered over its
control socket. Each test pins what the lane does by the bytes that crossed the wire,
and most run twice: once as the router runs (`lane`) and once with the lane turned off
(`Forwarder.lane_enabled`, `coroutine`), so the same scenario on the pooled connection
goes the coroutine path and both must come out the same. The Forwarder's counters of
the forwards the lane took, declined and handed over say which path each request took,
so a test cannot pass by never reaching the lane.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import pytest

from router.config import TimeoutsConfig
from router.service.router_service import RouterService
from tests.app.test_faults import OK_BODY, gauge, in_flight_is_zero, request_bytes
from tests.app.test_faults import ScriptedWorker as RecordingWorker
from tests.metrics.test_registry import REQ, scrape, series
from tests.relay.test_forwarder import OK, Conversation, stale_after_one
from tests.relay.test_forwarder import ScriptedWorker as ConversationWorker
from tests.router_fixtures import (
    TOKEN_HEADER,
    WAIT_S,
    RawHttp,
    RawLease,
    Rig,
    episode_key,
    open_rig,
    token,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)

FREED_S = 1.0  # how soon a departed client's worker connection and slot must be let go
PAUSE_S = 0.1  # between two writes of a worker's reply: long enough to be two reads


def timeouts(first_byte_s: float = 5.0) -> TimeoutsConfig:
    return TimeoutsConfig(
        connect_s=1.0, first_byte_s=first_byte_s, stream_idle_s=5.0, shutdown_grace_s=3.0
    )


# --- which path a request took ------------------------------------------------------------


@dataclasses.dataclass
class Paths:
    """How the router's forwards went, from its Forwarder's counters: how many
    `Forwarder.start` took on the lane and declined, and how many lane forwards were
    handed over to the coroutine path (`Forwarder.resume`). `lane`: False when the lane
    was turned off for the test (every forward then takes `Forwarder.forward`)."""

    rig: Rig
    lane: bool

    @property
    def started(self) -> int:
        return self.rig.router.forwarder.lane_started

    @property
    def declined(self) -> int:
        return self.rig.router.forwarder.lane_declined

    @property
    def resumed(self) -> int:
        return self.rig.router.forwarder.lane_handovers

    def expect(self, on_lane: list[bool], handovers: int) -> None:
        """The paths taken: `on_lane` (one entry per forward, True for one the lane
        took) and `handovers` on the lane's run; on the coroutine path's, no request was
        started on the lane and none was handed over. Only the counts are compared: a
        test whose order is not forced (the first forward to a worker never finds an
        idle connection) checks the counts at the point that matters too."""
        taken = (self.started, self.declined, self.resumed)
        if self.lane:
            assert taken == (on_lane.count(True), on_lane.count(False), handovers)
        else:
            assert taken == (0, len(on_lane), 0)


@pytest.fixture(params=["lane", "coroutine"])
def paths(request: pytest.FixtureRequest, rig: Rig, monkeypatch: pytest.MonkeyPatch) -> Paths:
    """Counts the lane's forwards; with `coroutine`, the lane is turned off (it then
    declines every request, as it does one that cannot go at once), so every forward
    takes `Forwarder.forward`."""
    lane = request.param == "lane"
    start_router = rig.start_router

    async def start_with_lane(*args: Any, **kwargs: Any) -> RouterService:
        service = await start_router(*args, **kwargs)
        service.forwarder.lane_enabled = lane
        return service

    monkeypatch.setattr(rig, "start_router", start_with_lane)
    return Paths(rig, lane)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


async def register(rig: Rig, worker: ConversationWorker) -> str:
    """Starts `worker` and registers it over the control socket; returns its id."""
    upstream = await worker.start(rig.stack)
    lease = await RawLease.open(rig.control_address)
    rig.stack.callback(lease.abort)
    hello = await lease.hello(upstream.worker_id, upstream.url, secrets.token_hex(8))
    assert hello["ok"] is True, hello
    synced = await lease.call("sync", claims=[], more=False)
    assert synced["ok"] is True, synced
    return upstream.worker_id


# --- the client side ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ClientReply:
    """A reply as the client read it: its head lines without Date, its body (de-chunked)."""

    lines: tuple[str, ...]
    body: bytes

    @property
    def status(self) -> int:
        return int(self.lines[0].split(" ")[1])

    def values(self, name: str) -> list[str]:
        prefix = name.lower() + ":"
        return [
            line.split(":", 1)[1].strip() for line in self.lines if line.lower().startswith(prefix)
        ]


async def read_reply(conn: RawHttp, *, head_request: bool = False) -> ClientReply:
    """The next reply on `conn`, framed by Content-Length or chunked (none after HEAD)."""
    _, headers, raw = await conn.read_head()
    lines = raw.decode("latin-1").split("\r\n")[:-2]
    dates = [line for line in lines if line.lower().startswith("date:")]
    assert len(dates) == 1, lines  # exactly one Date, whoever wrote it
    kept = tuple(line for line in lines if not line.lower().startswith("date:"))
    reader = conn.reader
    if head_request:
        return ClientReply(kept, b"")
    if headers.get("transfer-encoding") == "chunked":
        body = bytearray()
        while True:
            size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), WAIT_S)
            size = int(size_line, 16)
            chunk = await asyncio.wait_for(reader.readexactly(size + 2), WAIT_S)
            assert chunk.endswith(b"\r\n"), chunk[-10:]
            if size == 0:
                return ClientReply(kept, bytes(body))
            body += chunk[:-2]
    length = int(headers["content-length"])
    return ClientReply(kept, await asyncio.wait_for(reader.readexactly(length), WAIT_S))


def answer_of(reply: ClientReply) -> tuple[int, str, str]:
    """(status, error code, detail) of one of the router's own JSON answers."""
    assert reply.values("content-type") == ["application/json"], reply.lines
    body = json.loads(reply.body)
    assert set(body) == {"error", "detail", "session"}, body
    return reply.status, body["error"], body["detail"]


# --- 1. the same request on both paths ------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Twin:
    """A request sent twice on one client connection, and the worker's reply to each."""

    request: Callable[[], bytes]
    reply: Callable[[str], bytes]  # from the worker's private origin
    expected_lines: tuple[str, ...]  # the client's reply head, without Date
    expected_body: bytes
    head_request: bool = False


EPISODE_TOKEN = token("lane")
JSON_BODY = b'{"value": 5}'

OK_REPLY_X = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nX-Worker: scripted\r\n"
    b"Content-Length: 11\r\n\r\n" + OK_BODY
)
OK_REPLY_X_LINES = (  # its head, as the client gets it (Date aside)
    "HTTP/1.1 200 OK",
    "Content-Type: application/json",
    "X-Worker: scripted",
    "Content-Length: 11",
)


TWINS: dict[str, Twin] = {
    "post-with-body": Twin(
        request=lambda: request_bytes(
            "POST",
            "/tools/add?x=1",
            [(TOKEN_HEADER, EPISODE_TOKEN), ("Content-Type", "application/json")],
            JSON_BODY,
        ),
        reply=lambda origin: OK_REPLY_X,
        expected_lines=OK_REPLY_X_LINES,
        expected_body=OK_BODY,
    ),
    "chunked-request-body": Twin(
        request=lambda: (
            request_bytes("POST", "/upload", [("Transfer-Encoding", "chunked")])
            + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
        ),
        reply=lambda origin: OK_REPLY_X,
        expected_lines=OK_REPLY_X_LINES,
        expected_body=OK_BODY,
    ),
    "head": Twin(
        request=lambda: request_bytes("HEAD", "/resource"),
        reply=lambda origin: (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\n"
        ),
        expected_lines=("HTTP/1.1 200 OK", "Content-Type: text/plain", "Content-Length: 5"),
        expected_body=b"",
        head_request=True,
    ),
    "cookies-and-location": Twin(
        request=lambda: request_bytes("GET", "/login"),
        reply=lambda origin: (
            "HTTP/1.1 302 Found\r\n"
            f"Location: {origin}/next?step=2\r\n"
            f"Content-Location: {origin}/here\r\n"
            "Set-Cookie: a=1; Path=/\r\n"
            "Set-Cookie: b=2; HttpOnly\r\n"
            "Link: <http://elsewhere.example/x>\r\n"
            "Connection: X-Private\r\n"
            "X-Private: secret\r\n"
            "Keep-Alive: timeout=9\r\n"
            "Content-Length: 4\r\n\r\nmove"
        ).encode(),
        expected_lines=(
            "HTTP/1.1 302 Found",
            "Location: http://public.example/next?step=2",
            "Content-Location: http://public.example/here",
            "Set-Cookie: a=1; Path=/",
            "Set-Cookie: b=2; HttpOnly",
            "Link: <http://elsewhere.example/x>",
            "Content-Length: 4",
        ),
        expected_body=b"move",
    ),
    "interim-then-final": Twin(
        request=lambda: request_bytes("GET", "/hints"),
        reply=lambda origin: b"HTTP/1.1 103 Early Hints\r\nLink: </s>\r\n\r\n" + OK_REPLY_X,
        expected_lines=OK_REPLY_X_LINES,
        expected_body=OK_BODY,
    ),
}


@pytest.mark.parametrize("case", list(TWINS))
async def test_a_request_on_the_lane_is_the_twin_of_the_same_request_on_a_new_connection(
    rig: Rig, case: str
) -> None:
    """The first request goes the coroutine path on a new worker connection, the second
    the lane on that connection, kept alive: the worker reads the same bytes twice and
    the client gets the same reply twice."""
    twin = TWINS[case]
    router = await rig.start_router()
    seen = Paths(rig, lane=True)
    worker = await RecordingWorker("w0").start(rig)
    await worker.claim(episode_key("lane", 0))
    worker.reply = twin.reply(worker.url)

    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(twin.request())
        first = await read_reply(conn, head_request=twin.head_request)
        conn.send(twin.request())
        second = await read_reply(conn, head_request=twin.head_request)
    finally:
        conn.close()

    # The first went the coroutine path on a new connection, the second the lane, whole.
    seen.expect([False, True], 0)
    assert worker.connections == 1
    # The worker received the same bytes twice.
    arrived_first, arrived_second = worker.arrived
    assert arrived_second.head == arrived_first.head
    assert arrived_second.body == arrived_first.body
    # The client received the same reply twice (Date aside), and the right one.
    assert second == first
    assert first.lines == twin.expected_lines
    assert first.body == twin.expected_body


async def test_the_twin_request_reaches_the_worker_byte_for_byte(rig: Rig) -> None:
    """What the twin compares is the right thing: the exact request the worker reads."""
    router = await rig.start_router()
    worker = await RecordingWorker("w0").start(rig)
    await worker.claim("lane-a0")
    conn = await RawHttp.open(router.public_port)
    try:
        for _ in range(2):
            conn.send(TWINS["post-with-body"].request())
            assert (await read_reply(conn)).body == OK_BODY
    finally:
        conn.close()

    expected = (
        "POST /tools/add?x=1 HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{worker.port}\r\n"
        f"{TOKEN_HEADER}: {EPISODE_TOKEN}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(JSON_BODY)}\r\n"
        "X-Forwarded-Host: public.example\r\n"
        "X-Forwarded-For: 127.0.0.1\r\n"
        "X-Forwarded-Proto: http\r\n"
        f"X-Episode-Router-Boot: {worker.boot}\r\n\r\n"
    ).encode()
    assert [(a.head, a.body) for a in worker.arrived] == [(expected, JSON_BODY)] * 2


# --- 2. what the lane hands over, each on the second request of a kept-alive connection ---


WriteReply = Callable[[asyncio.StreamWriter], Awaitable[None]]


def third_request_after(ref: list[ConversationWorker], second: WriteReply) -> Conversation:
    """Answers the first request with OK, the second with `second(writer)`, the third
    with OK: the third shows whether the worker connection was kept after the second."""

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)
        writer.write(OK)
        await writer.drain()
        await ref[0].request(reader)
        await second(writer)
        await ref[0].request(reader)
        writer.write(OK)
        await writer.drain()

    return talk


async def three_gets(
    rig: Rig, second: WriteReply, targets: Sequence[str]
) -> tuple[ConversationWorker, list[ClientReply]]:
    """A worker answering as `third_request_after(second)`, and the replies to three GETs
    of `targets` sent one after another on one client connection."""
    ref: list[ConversationWorker] = []
    worker = ConversationWorker(third_request_after(ref, second))
    ref.append(worker)
    await register(rig, worker)
    conn = await RawHttp.open(rig.router.public_port)
    try:
        replies = []
        for target in targets:
            conn.send(request_bytes("GET", target))
            replies.append(await read_reply(conn))
    finally:
        conn.close()
    return worker, replies


def in_pieces(*pieces: bytes) -> WriteReply:
    """Writes `pieces` one by one, with a pause between two."""

    async def write(writer: asyncio.StreamWriter) -> None:
        for index, piece in enumerate(pieces):
            if index:
                await asyncio.sleep(PAUSE_S)
            writer.write(piece)
            await writer.drain()

    return write


SIX = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n"

PIECES: dict[str, tuple[Sequence[bytes], int]] = {
    # (the second reply in writes, how many times the lane hands over)
    "body-in-two-writes": ((SIX + b"abc", b"def"), 1),
    "head-in-two-writes": ((SIX[:20], SIX[20:] + b"abcdef"), 0),  # the lane listens again
    "interim-then-final": ((b"HTTP/1.1 100 Continue\r\n\r\n", SIX + b"abcdef"), 0),
}


@pytest.mark.parametrize("case", list(PIECES))
async def test_a_reply_in_pieces_is_relayed_whole_and_the_connection_kept(
    rig: Rig, paths: Paths, case: str
) -> None:
    pieces, handovers = PIECES[case]
    await rig.start_router()
    worker, replies = await three_gets(rig, in_pieces(*pieces), ("/1", "/2", "/3"))

    assert [(r.status, r.body) for r in replies] == [(200, b"ok"), (200, b"abcdef"), (200, b"ok")]
    assert replies[1].lines == ("HTTP/1.1 200 OK", "Content-Length: 6")
    assert worker.connections == 1  # the worker connection was kept after the second reply
    assert [head.split(b" ")[1] for head in worker.requests] == [b"/1", b"/2", b"/3"]
    paths.expect([False, True, True], handovers)


BIG = bytes(range(256)) * 640  # 160 KiB: over the 64 KiB a reply is read whole up to


async def chunked_big(writer: asyncio.StreamWriter) -> None:
    """BIG in chunks of 32 KiB, each its own write."""
    writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Big: yes\r\n\r\n")
    for start in range(0, len(BIG), 32 * 1024):
        part = BIG[start : start + 32 * 1024]
        writer.write(b"%x\r\n%b\r\n" % (len(part), part))
        await writer.drain()
        await asyncio.sleep(0.01)
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def sized_big(writer: asyncio.StreamWriter) -> None:
    """BIG with its length, in two writes."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\nX-Big: yes\r\n\r\n" % len(BIG)
    await in_pieces(head + BIG[:1000], BIG[1000:])(writer)


@pytest.mark.parametrize(
    ("second", "expected_lines"),
    [
        pytest.param(
            chunked_big,
            ("HTTP/1.1 200 OK", "X-Big: yes", "Transfer-Encoding: chunked"),
            id="chunked",
        ),
        pytest.param(
            sized_big,
            ("HTTP/1.1 200 OK", f"Content-Length: {len(BIG)}", "X-Big: yes"),
            id="content-length",
        ),
    ],
)
async def test_a_large_streamed_reply_is_relayed_intact(
    rig: Rig,
    paths: Paths,
    second: WriteReply,
    expected_lines: tuple[str, ...],
) -> None:
    await rig.start_router()
    worker, replies = await three_gets(rig, second, ("/1", "/big", "/3"))

    assert replies[1].lines == expected_lines
    assert replies[1].body == BIG
    assert [(r.status, r.body) for r in (replies[0], replies[2])] == [(200, b"ok"), (200, b"ok")]
    assert worker.connections == 1  # kept after a streamed reply that ended cleanly
    paths.expect([False, True, True], 1)


@pytest.mark.parametrize("method", ["GET", "HEAD", "PUT"])
async def test_an_idempotent_request_on_a_stale_connection_is_retried_on_a_new_one(
    rig: Rig, paths: Paths, method: str
) -> None:
    await rig.start_router()
    ref: list[ConversationWorker] = []
    # The worker reads the second request on the kept-alive connection and closes it
    # without a byte: it closed the idle connection just as the router reused it.
    second_ok = b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n" + (
        b"" if method == "HEAD" else b"second"
    )

    async def answer_retry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)
        writer.write(second_ok)
        await writer.drain()

    worker = ConversationWorker(stale_after_one(ref), answer_retry)
    ref.append(worker)
    await register(rig, worker)
    body = b"put-body" if method == "PUT" else b""

    conn = await RawHttp.open(rig.router.public_port)
    try:
        conn.send(request_bytes("GET", "/1"))
        first = await read_reply(conn)
        conn.send(request_bytes(method, "/2", [], body))
        second = await read_reply(conn, head_request=method == "HEAD")
    finally:
        conn.close()

    assert (first.status, first.body) == (200, b"ok")
    assert second.lines == ("HTTP/1.1 200 OK", "Content-Length: 6")
    assert second.body == (b"" if method == "HEAD" else b"second")
    assert worker.connections == 2
    heads = [head.split(b" ")[:2] for head in worker.requests]
    target = [method.encode(), b"/2"]
    assert heads == [[b"GET", b"/1"], target, target]  # the same request, once more
    assert worker.requests[1] == worker.requests[2]
    paths.expect([False, True], 1)


async def test_a_post_on_a_stale_connection_is_502_and_never_retried(
    rig: Rig, paths: Paths
) -> None:
    await rig.start_router()
    ref: list[ConversationWorker] = []

    async def probed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)  # the router's probe connects and closes at once

    worker = ConversationWorker(stale_after_one(ref), probed)
    ref.append(worker)
    await register(rig, worker)

    conn = await RawHttp.open(rig.router.public_port)
    try:
        conn.send(request_bytes("GET", "/1"))
        first = await read_reply(conn)
        conn.send(request_bytes("POST", "/2", [], b"payload"))
        second = await read_reply(conn)
    finally:
        conn.close()

    assert (first.status, first.body) == (200, b"ok")
    assert answer_of(second) == (
        502,
        "upstream_error",
        "The worker failed: it closed the connection before replying",
    )
    assert [head.split(b" ")[:2] for head in worker.requests] == [[b"GET", b"/1"], [b"POST", b"/2"]]
    failures = series(scrape(rig.router.metrics), "episode_router_upstream_failures_total")
    assert failures == {"kind=error,worker=w1": 1}
    views = await rig.worker_views()
    assert (views["w1"]["state"], views["w1"]["in_flight"]) == ("live", 0)
    paths.expect([False, True], 1)


@dataclasses.dataclass
class Silent:
    """A second request the worker reads and never answers; when its connection ended."""

    read_at: float = 0.0
    ended_at: float = 0.0


def silent_after_one(ref: list[ConversationWorker], silent: Silent) -> Conversation:
    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)
        writer.write(OK)
        await writer.drain()
        await ref[0].request(reader)
        silent.read_at = time.monotonic()
        try:
            await asyncio.wait_for(reader.read(), WAIT_S)  # until the router lets go of it
        finally:
            silent.ended_at = time.monotonic()

    return talk


async def test_a_worker_that_never_answers_is_504_at_first_byte_s(rig: Rig, paths: Paths) -> None:
    await rig.start_router(timeouts=timeouts(first_byte_s=0.5))
    ref: list[ConversationWorker] = []
    silent = Silent()
    worker = ConversationWorker(
        silent_after_one(ref, silent), third_request_after(ref, in_pieces())
    )
    ref.append(worker)
    worker_id = await register(rig, worker)

    conn = await RawHttp.open(rig.router.public_port)
    try:
        conn.send(request_bytes("GET", "/1"))
        first = await read_reply(conn)
        sent = time.monotonic()
        conn.send(request_bytes("GET", "/2"))
        second = await read_reply(conn)
        took = time.monotonic() - sent
    finally:
        conn.close()

    assert (first.status, first.body) == (200, b"ok")
    status, code, detail = answer_of(second)
    assert (status, code, detail) == (504, "upstream_timeout", "The worker did not answer in time.")
    assert 0.5 <= took < 2.0, took
    await wait_until(is_set(lambda: silent.ended_at), "the silent worker connection to be dropped")
    assert silent.ended_at - silent.read_at < 2.0  # dropped at the timeout, not left open
    failures = series(scrape(rig.router.metrics), "episode_router_upstream_failures_total")
    assert failures == {f"kind=timeout,worker={worker_id}": 1}
    assert await in_flight_is_zero(rig, worker_id)
    paths.expect([False, True], 1)


def is_set(value: Callable[[], float]) -> Callable[[], Coroutine[Any, Any, bool]]:
    async def check() -> bool:
        return value() != 0.0

    return check


async def test_a_client_that_leaves_while_the_worker_works_frees_its_connection_and_slot(
    rig: Rig, paths: Paths
) -> None:
    await rig.start_router()
    ref: list[ConversationWorker] = []
    silent = Silent()

    async def answer_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)
        writer.write(OK)
        await writer.drain()

    worker = ConversationWorker(silent_after_one(ref, silent), answer_one)
    ref.append(worker)
    worker_id = await register(rig, worker)

    conn = await RawHttp.open(rig.router.public_port)
    conn.send(request_bytes("GET", "/1"))
    first = await read_reply(conn)
    conn.send(request_bytes("GET", "/2"))
    await wait_until(is_set(lambda: silent.read_at), "the second request to reach the worker")
    views = await rig.worker_views()
    assert views[worker_id]["in_flight"] == 1
    assert (await gauge(rig, "episode_router_in_flight_requests")).get(worker_id) == 1
    # The request the client leaves is the one on the lane (the counts at the end do
    # not say which of the last two it was).
    assert paths.started == (1 if paths.lane else 0)
    left = time.monotonic()
    conn.close()

    await wait_until(
        is_set(lambda: silent.ended_at), "the worker connection to be dropped", FREED_S
    )
    assert silent.ended_at - left < FREED_S

    async def free() -> bool:
        return await in_flight_is_zero(rig, worker_id)

    await wait_until(free, "the in-flight slot to be free", FREED_S)
    requests = series(scrape(rig.router.metrics), REQ)
    assert requests == {
        "kind=none,outcome=forwarded,status_class=2xx": 1,
        "kind=none,outcome=client_closed,status_class=4xx": 1,
    }
    # The worker connection was not put back in the pool: the next request opens another.
    again = await RawHttp.open(rig.router.public_port)
    try:
        again.send(request_bytes("GET", "/3"))
        third = await read_reply(again)
    finally:
        again.close()
    assert (first.body, third.body) == (b"ok", b"ok")
    assert worker.connections == 2
    assert [head.split(b" ")[1] for head in worker.requests] == [b"/1", b"/2", b"/3"]
    # The third request found no idle connection: it went the coroutine path.
    paths.expect([False, True, False], 1)


async def test_a_client_that_leaves_during_a_stale_retry_frees_its_connection_and_slot(
    rig: Rig, paths: Paths
) -> None:
    """The retry of a stale pooled connection goes on a new connection; a client that
    leaves while the worker works on the retried request must wake the wait on that one,
    as it does on a connection that was not retried (the test above)."""
    await rig.start_router(timeouts=timeouts(first_byte_s=3.0))
    ref: list[ConversationWorker] = []
    silent = Silent()

    async def silent_retry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)
        silent.read_at = time.monotonic()
        try:
            await asyncio.wait_for(reader.read(), WAIT_S)
        finally:
            silent.ended_at = time.monotonic()

    worker = ConversationWorker(stale_after_one(ref), silent_retry)
    ref.append(worker)
    worker_id = await register(rig, worker)

    conn = await RawHttp.open(rig.router.public_port)
    conn.send(request_bytes("GET", "/1"))
    assert (await read_reply(conn)).body == b"ok"
    conn.send(request_bytes("GET", "/2"))
    await wait_until(is_set(lambda: silent.read_at), "the retried request to reach the worker")
    assert worker.connections == 2
    paths.expect([False, True], 1)
    conn.close()

    async def free() -> bool:
        return await in_flight_is_zero(rig, worker_id)

    await wait_until(free, "the in-flight slot to be free", FREED_S)
    await wait_until(
        is_set(lambda: silent.ended_at), "the worker connection to be dropped", FREED_S
    )


# --- 3. in-flight accounting ----------------------------------------------------------------


async def test_concurrent_lane_requests_leave_every_worker_with_nothing_in_flight(
    rig: Rig, paths: Paths
) -> None:
    await rig.start_router()
    workers = [await RecordingWorker(f"w{i}").start(rig) for i in range(2)]
    clients = [await RawHttp.open(rig.router.public_port) for _ in range(12)]

    async def one(index: int, client: RawHttp, round_: int) -> ClientReply:
        client.send(request_bytes("POST", f"/r{round_}/c{index}", [], b"x" * index))
        return await read_reply(client)

    try:
        for round_ in range(3):
            replies = await asyncio.gather(
                *(one(index, client, round_) for index, client in enumerate(clients))
            )
            assert [(r.status, r.body) for r in replies] == [(200, OK_BODY)] * len(clients)
    finally:
        for client in clients:
            client.close()

    arrived = sorted(a.target for w in workers for a in w.arrived)
    assert arrived == sorted(f"/r{r}/c{i}" for r in range(3) for i in range(len(clients)))
    assert all(w.arrived for w in workers)  # both workers took part
    assert paths.started + paths.declined == 3 * len(clients)
    if paths.lane:
        assert paths.started >= len(clients)  # later rounds went the lane
    else:
        assert paths.started == 0
    assert paths.resumed == 0
    views = await rig.worker_views()
    assert {w.id: views[w.id]["in_flight"] for w in workers} == {"w0": 0, "w1": 0}
    in_flight = await gauge(rig, "episode_router_in_flight_requests")
    assert {w.id: in_flight.get(w.id) for w in workers} == {"w0": 0, "w1": 0}
    requests = series(scrape(rig.router.metrics), REQ)
    assert requests == {"kind=none,outcome=forwarded,status_class=2xx": 3 * len(clients)}


async def test_pipelined_requests_on_the_lane_are_answered_in_order(rig: Rig, paths: Paths) -> None:
    await rig.start_router()
    ref: list[ConversationWorker] = []

    async def echo_target(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await ref[0].request(reader)
            target = head.split(b" ")[1]
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(target), target))
            await writer.drain()

    worker = ConversationWorker(echo_target)
    ref.append(worker)
    worker_id = await register(rig, worker)

    conn = await RawHttp.open(rig.router.public_port)
    try:
        conn.send(request_bytes("GET", "/warm"))
        assert (await read_reply(conn)).body == b"/warm"
        targets = [f"/p{i}" for i in range(6)]
        conn.send(b"".join(request_bytes("GET", target) for target in targets))
        bodies = [(await read_reply(conn)).body for _ in targets]
    finally:
        conn.close()

    assert bodies == [target.encode() for target in targets]
    assert worker.connections == 1
    assert await in_flight_is_zero(rig, worker_id)
    paths.expect([False] + [True] * 6, 0)
