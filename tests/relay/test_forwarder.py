"""What the lean forwarding path (router.relay.forwarder) does beyond the shared contract of
tests/relay/test_forwarding.py: its pooled connections, its retry of a stale one, interim replies,
and the framing of what it relays. A real router app forwards to scripted workers on
loopback; clients are raw sockets where bytes matter.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import pytest

from router.core.answers import Answer
from router.edge.request import PublicRequest
from router.edge.server import EdgeLimits, EdgeServer
from router.relay.contract import as_value
from router.relay.forwarder import Forwarder, ForwardTimeouts, Upstream, UpstreamFailure

pytestmark = pytest.mark.timeout(30)

TIMEOUTS = ForwardTimeouts(connect_s=1.0, first_byte_s=2.0, stream_idle_s=2.0)
Conversation = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class ScriptedWorker:
    """A worker whose Nth connection runs the Nth conversation (the last one repeats)."""

    def __init__(self, *conversations: Conversation) -> None:
        self.conversations = conversations
        self.connections = 0
        self.requests: list[bytes] = []  # every request head read, in order
        self.port = 0
        self.server: asyncio.Server | None = None

    async def start(self, stack: AsyncExitStack) -> Upstream:
        server = self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        stack.push_async_callback(server.wait_closed)
        stack.callback(server.close)
        self.port = server.sockets[0].getsockname()[1]
        return Upstream("w1", f"http://127.0.0.1:{self.port}")

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = min(self.connections, len(self.conversations) - 1)
        self.connections += 1
        try:
            await self.conversations[index](reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        """Reads one request head and its Content-Length body; returns the head."""
        head = await reader.readuntil(b"\r\n\r\n")
        self.requests.append(head)
        for line in head.split(b"\r\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                await reader.readexactly(int(value))
        return head


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def answering(worker_ref: list[ScriptedWorker], replies: list[bytes]) -> Conversation:
    """A conversation answering each request with the next of `replies`, then closing."""

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for reply in replies:
            await worker_ref[0].request(reader)
            writer.write(reply)
            await writer.drain()

    return talk


class Router:
    def __init__(self, forwarder: Forwarder, upstream: Upstream) -> None:
        self.forwarder = forwarder
        self.upstream = upstream
        self.failures: list[UpstreamFailure] = []
        self.port = 0

    async def handle(self, request: PublicRequest) -> None:
        try:
            await self.forwarder.forward(request, self.upstream)
        except UpstreamFailure as failure:
            self.failures.append(failure)
            request.client.answer(request, Answer("upstream_error", failure.kind))


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as resources:
        yield resources


async def start_router(stack: AsyncExitStack, upstream: Upstream, pool_size: int = 256) -> Router:
    forwarder = Forwarder(TIMEOUTS, pool_size_per_upstream=pool_size)
    stack.push_async_callback(forwarder.close)
    router = Router(forwarder, upstream)
    edge = EdgeServer(router.handle, EdgeLimits(), asyncio.get_running_loop())
    server = await asyncio.get_running_loop().create_server(edge, "127.0.0.1", 0)
    stack.push_async_callback(edge.shutdown, 0.5)
    stack.callback(server.close)
    router.port = server.sockets[0].getsockname()[1]
    return router


async def router_to_a_worker_answering(stack: AsyncExitStack, replies: list[bytes]) -> Router:
    """A router in front of a worker whose connection answers each request with the
    next of `replies`."""
    ref: list[ScriptedWorker] = []
    worker = ScriptedWorker(answering(ref, replies))
    ref.append(worker)
    return await start_router(stack, await worker.start(stack))


async def exchange(port: int, data: bytes, replies: int = 1) -> list[bytes]:
    """Sends `data` on one connection; returns `replies` replies (Content-Length framed,
    and no body after the head of a reply to HEAD)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        out = []
        for _ in range(replies):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.lower() == b"content-length":
                    length = int(value)
            if data.startswith(b"HEAD "):
                length = 0
            out.append(head + await reader.readexactly(length))
        return out
    finally:
        writer.close()


def status_and_body(reply: bytes) -> tuple[bytes, bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0], body


# --- a stale pooled connection ---------------------------------------------------------------


def stale_after_one(ref: list[ScriptedWorker]) -> Conversation:
    """Answers one request, then reads the next and closes without a byte of reply: the
    worker closing an idle connection just as the router reused it."""

    async def talk(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)
        writer.write(OK)
        await writer.drain()
        await ref[0].request(reader)

    return talk


@pytest.mark.parametrize("method", [b"GET", b"HEAD", b"PUT", b"DELETE", b"OPTIONS"])
async def test_an_idempotent_request_is_retried_once_on_a_fresh_connection(
    stack: AsyncExitStack, method: bytes
) -> None:
    ref: list[ScriptedWorker] = []
    worker = ScriptedWorker(stale_after_one(ref), answering(ref, [OK]))
    ref.append(worker)
    router = await start_router(stack, await worker.start(stack))
    first = await exchange(router.port, b"GET /1 HTTP/1.1\r\nHost: h\r\n\r\n")
    assert status_and_body(first[0]) == (b"HTTP/1.1 200 OK", b"ok")
    body = b"Content-Length: 4\r\n\r\nbody" if method == b"PUT" else b"\r\n"
    second = await exchange(router.port, method + b" /2 HTTP/1.1\r\nHost: h\r\n" + body)
    assert status_and_body(second[0])[0] == b"HTTP/1.1 200 OK"
    assert worker.connections == 2
    assert [head.split(b" ")[:2] for head in worker.requests] == [
        [b"GET", b"/1"],
        [method, b"/2"],  # on the stale connection
        [method, b"/2"],  # again, on a fresh one
    ]
    assert router.failures == []


async def test_an_idempotent_request_whose_worker_died_under_it_may_be_sent_again(
    stack: AsyncExitStack,
) -> None:
    # The worker (or a peer router) was killed: its kept-alive connection closes as the
    # request goes in, and the retry's connect is refused. By the rule that allowed the
    # retry, the request may be sent again: the failure says so (not sent), and the
    # router may try elsewhere (another worker; another router's answer for a hop).
    ref: list[ScriptedWorker] = []

    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)
        writer.write(OK)
        await writer.drain()
        await ref[0].request(reader)
        assert ref[0].server is not None
        ref[0].server.close()  # nothing listens any more, then the connection closes

    worker = ScriptedWorker(dies)
    ref.append(worker)
    router = await start_router(stack, await worker.start(stack))
    await exchange(router.port, b"GET /1 HTTP/1.1\r\nHost: h\r\n\r\n")
    reply = await exchange(router.port, b"GET /2 HTTP/1.1\r\nHost: h\r\n\r\n")
    assert status_and_body(reply[0])[0] == b"HTTP/1.1 502 Bad Gateway"  # the stand-in's
    [failure] = router.failures
    assert (failure.kind, failure.request_sent) == ("refused", False)
    assert (worker.connections, len(worker.requests)) == (1, 2)


async def test_a_post_on_a_stale_connection_is_never_retried(stack: AsyncExitStack) -> None:
    ref: list[ScriptedWorker] = []
    worker = ScriptedWorker(stale_after_one(ref), answering(ref, [OK]))
    ref.append(worker)
    router = await start_router(stack, await worker.start(stack))
    await exchange(router.port, b"GET /1 HTTP/1.1\r\nHost: h\r\n\r\n")
    reply = await exchange(
        router.port, b"POST /2 HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\nx"
    )
    assert status_and_body(reply[0])[0] == b"HTTP/1.1 502 Bad Gateway"
    [failure] = router.failures
    assert (failure.kind, failure.detail, failure.request_sent) == (
        "error",
        "it closed the connection before replying",
        True,
    )
    assert (worker.connections, len(worker.requests)) == (1, 2)


async def test_a_probe_tells_an_upstream_that_takes_connections_from_one_that_is_gone(
    stack: AsyncExitStack,
) -> None:
    # After a forward failed: nothing is written on the probe's connection, and it is
    # not kept (the worker sees a connection with no request, then its close).
    ref: list[ScriptedWorker] = []
    worker = ScriptedWorker(answering(ref, [OK]))
    ref.append(worker)
    upstream = await worker.start(stack)
    forwarder = Forwarder(TIMEOUTS)
    stack.push_async_callback(forwarder.close)
    assert await forwarder.accepts_connections(upstream)
    for _ in range(50):  # the worker's side of the probe: accepted, nothing read, closed
        if worker.connections:
            break
        await asyncio.sleep(0.01)
    assert (worker.connections, worker.requests) == (1, [])
    assert worker.server is not None
    worker.server.close()
    await worker.server.wait_closed()
    assert not await forwarder.accepts_connections(upstream)  # refused
    gone = Upstream("w2", "unix:///nonexistent/episode-router-probe.sock")
    assert not await forwarder.accepts_connections(gone)


async def test_a_fresh_connection_closed_before_replying_is_not_retried(
    stack: AsyncExitStack,
) -> None:
    ref: list[ScriptedWorker] = []

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)

    worker = ScriptedWorker(hang_up)
    ref.append(worker)
    router = await start_router(stack, await worker.start(stack))
    reply = await exchange(router.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert status_and_body(reply[0])[0] == b"HTTP/1.1 502 Bad Gateway"
    assert (worker.connections, router.failures[0].kind) == (1, "error")


# --- pooled connections ------------------------------------------------------------------------


async def test_keep_alive_after_head_and_no_body_replies(stack: AsyncExitStack) -> None:
    ref: list[ScriptedWorker] = []
    replies = [
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",  # to HEAD: no body follows
        b"HTTP/1.1 204 No Content\r\n\r\n",
        b"HTTP/1.1 304 Not Modified\r\nContent-Length: 9\r\n\r\n",
        OK,
    ]
    worker = ScriptedWorker(answering(ref, replies))
    ref.append(worker)
    router = await start_router(stack, await worker.start(stack))
    for method, status in [
        (b"HEAD", b"HTTP/1.1 200 OK"),
        (b"GET", b"HTTP/1.1 204 No Content"),
        (b"GET", b"HTTP/1.1 304 Not Modified"),
    ]:
        reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
        writer.write(method + b" / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
        reply = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        assert reply.startswith(status) and reply.endswith(b"\r\n\r\n")
    last = await exchange(router.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert status_and_body(last[0]) == (b"HTTP/1.1 200 OK", b"ok")
    assert worker.connections == 1  # all four on one kept-alive connection


async def test_a_worker_that_says_close_gets_a_new_connection(stack: AsyncExitStack) -> None:
    ref: list[ScriptedWorker] = []
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"

    async def say_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)
        writer.write(closing)
        await writer.drain()
        await asyncio.sleep(0.5)  # it says close but holds the socket open a while

    worker = ScriptedWorker(say_close)
    ref.append(worker)
    router = await start_router(stack, await worker.start(stack))
    for _ in range(2):
        reply = await exchange(router.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        assert status_and_body(reply[0]) == (b"HTTP/1.1 200 OK", b"ok")
    assert worker.connections == 2


# --- what is relayed ---------------------------------------------------------------------------


async def test_interim_replies_never_reach_the_client(stack: AsyncExitStack) -> None:
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </s>\r\n\r\n"
    router = await router_to_a_worker_answering(stack, [interim + OK])
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert reply.startswith(b"HTTP/1.1 200 OK\r\n") and reply.endswith(b"\r\n\r\nok")
    assert b"Continue" not in reply and b"Link" not in reply


AS_SENT = b"HTTP/1.1 200 Fine\r\nX-Odd:value \t\r\nDate: Mon, 30 Nov 2026 08:00:00 GMT\r\n"
SIZED = AS_SENT + b"Content-Length: 2\r\n\r\nok"
GET_11 = b"GET / HTTP/1.1\r\nHost: h\r\n"


@pytest.mark.parametrize(
    ("request_head", "reply", "as_is"),
    [
        (GET_11, SIZED, True),
        # The router adds a Connection header, or speaks HTTP/1.0, or drops a header.
        (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n", SIZED, False),
        (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n", SIZED, False),
        (GET_11, SIZED.replace(b"Date", b"Keep-Alive: timeout=5\r\nDate"), False),
        # The router frames a body with no length, and keeps a 204 free of one.
        (GET_11, AS_SENT + b"Transfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", False),
        (GET_11, AS_SENT.replace(b"200", b"204") + b"Content-Length: 0\r\n\r\n", False),
    ],
)
async def test_a_reply_the_router_would_not_change_goes_as_the_worker_wrote_it(
    stack: AsyncExitStack, request_head: bytes, reply: bytes, as_is: bool
) -> None:
    """A whole reply the client may have as it is (kept alive, HTTP/1.1, every header
    kept, framed by its length, dated) is relayed as the worker's bytes: its odd spacing
    stays. Any other is rebuilt, and the spacing is the router's."""
    router = await router_to_a_worker_answering(stack, [reply])
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(request_head + b"\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    writer.close()
    assert (b"X-Odd:value \t\r\n" in head) is as_is
    assert (head == reply[: len(head)]) is as_is
    assert b"X-Odd: value \t\r\n" in head or as_is


async def test_a_reply_with_no_date_goes_as_written_with_the_date_added(
    stack: AsyncExitStack,
) -> None:
    reply = b"HTTP/1.1 200 OK\r\nX-Odd:value\r\nContent-Length: 2\r\n\r\nok"
    router = await router_to_a_worker_answering(stack, [reply])
    [relayed] = await exchange(router.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    head, _, date = relayed.rpartition(b"\r\n\r\n")[0].rpartition(b"\r\n")
    assert head + b"\r\n" == reply[: len(head) + 2]
    assert date.startswith(b"Date: ") and date.endswith(b" GMT")
    assert relayed.endswith(b"\r\n\r\nok")


@pytest.mark.parametrize(
    "after",
    [b"HTTP/1.1 404 Injected\r\nContent-Length: 0\r\n\r\n", b"\r\n"],
    ids=["another-reply", "a-line-break"],
)
async def test_bytes_a_worker_sends_after_its_reply_never_reach_the_client(
    stack: AsyncExitStack, after: bytes
) -> None:
    """A worker's reply followed in the same write by a reply nobody asked for, or by a
    stray line break, reaches the client alone and whole (the Date the router adds in
    its head, not in its body), and nothing follows it on the connection."""
    reply = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    router = await router_to_a_worker_answering(stack, [reply + after])
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        body = await asyncio.wait_for(reader.readexactly(5), 5)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.read(1), 0.3)
    finally:
        writer.close()
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nDate: " in head
    assert body == b"hello"


async def test_a_reply_ended_by_close_is_relayed_whole(stack: AsyncExitStack) -> None:
    router = await router_to_a_worker_answering(stack, [b"HTTP/1.1 200 OK\r\n\r\nuntil close"])
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    reply = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body == b"b\r\nuntil close\r\n0\r\n\r\n"


async def test_a_small_reply_arriving_in_pieces_is_relayed_whole(stack: AsyncExitStack) -> None:
    ref: list[ScriptedWorker] = []

    async def slowly(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)
        for piece in (b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\n", b"abc", b"def"):
            writer.write(piece)
            await writer.drain()
            await asyncio.sleep(0.05)

    worker = ScriptedWorker(slowly)
    ref.append(worker)
    router = await start_router(stack, await worker.start(stack))
    reader, writer = await asyncio.open_connection("127.0.0.1", router.port)
    writer.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    # The head waits for the body: both come in one segment once the reply is whole.
    first = await asyncio.wait_for(reader.read(1 << 16), 5)
    writer.close()
    assert first.startswith(b"HTTP/1.1 200 OK\r\n") and first.endswith(b"\r\n\r\nabcdef")


async def test_a_request_body_already_here_goes_with_its_head(stack: AsyncExitStack) -> None:
    seen: list[bytes] = []

    async def one_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.read(1 << 16))  # one recv: head and body together
        writer.write(OK)
        await writer.drain()

    worker = ScriptedWorker(one_read)
    router = await start_router(stack, await worker.start(stack))
    reply = await exchange(
        router.port, b"POST /t HTTP/1.1\r\nHost: h\r\nContent-Length: 11\r\n\r\nhello world"
    )
    assert status_and_body(reply[0]) == (b"HTTP/1.1 200 OK", b"ok")
    assert seen[0].startswith(b"POST /t HTTP/1.1\r\n")
    assert seen[0].endswith(
        b"\r\nContent-Length: 11\r\nX-Forwarded-Host: h\r\n"
        b"X-Forwarded-For: 127.0.0.1\r\nX-Forwarded-Proto: http\r\n\r\n"
        b"hello world"
    )


async def test_a_runaway_reply_head_is_an_error(stack: AsyncExitStack) -> None:
    endless = b"HTTP/1.1 200 OK\r\n" + (b"X-Filler: " + b"f" * 1000 + b"\r\n") * 300
    router = await router_to_a_worker_answering(stack, [endless])
    reply = await exchange(router.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert status_and_body(reply[0])[0] == b"HTTP/1.1 502 Bad Gateway"
    [failure] = router.failures
    assert failure.detail == "invalid reply: a reply head over 256 KiB"


@pytest.mark.parametrize(
    ("reply", "detail"),
    [
        (b"HTTP/1.1 099 Odd\r\nContent-Length: 2\r\n\r\nok", "invalid reply: status 99"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nConnection: close\r\n\r\n\x1f\x8b",
            "invalid reply: a transfer coding other than chunked",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
            b"2\r\n\x1f\x8b\r\n0\r\n\r\n",
            "invalid reply: a transfer coding other than chunked",
        ),
        (  # two fields make one list: gzip, then chunked
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\n\x1f\x8b\r\n0\r\n\r\n",
            "invalid reply: a transfer coding other than chunked",
        ),
    ],
    ids=["status-below-100", "gzip", "gzip-chunked", "gzip-chunked-in-two-fields"],
)
async def test_a_reply_the_client_could_not_read_as_meant_is_an_error_at_once(
    stack: AsyncExitStack, reply: bytes, detail: str
) -> None:
    # A coding the router would take off with chunked, or a status with no meaning,
    # is a 502 as soon as the head is in: never relayed, never waited on as interim.
    router = await router_to_a_worker_answering(stack, [reply])
    started = time.monotonic()
    [answer] = await exchange(router.port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    assert time.monotonic() - started < TIMEOUTS.first_byte_s
    assert status_and_body(answer)[0] == b"HTTP/1.1 502 Bad Gateway"
    [failure] = router.failures
    assert (failure.kind, failure.detail) == ("error", detail)


async def test_a_waiting_request_handed_a_connection_the_worker_closed_goes_on_a_fresh_one(
    stack: AsyncExitStack,
) -> None:
    # One connection in the pool: the POST waits for it while the GET holds it. The
    # worker replies to the GET (keep-alive) and closes at once: the connection is
    # handed to the POST before its end is read. Nothing was written on it, so the POST
    # (which is never retried once sent) goes on a new connection instead.
    ref: list[ScriptedWorker] = []

    async def reply_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await ref[0].request(reader)
        await asyncio.sleep(0.3)  # the POST is in line by now
        writer.write(OK)

    worker = ScriptedWorker(reply_then_close, answering(ref, [OK]))
    ref.append(worker)
    router = await start_router(stack, await worker.start(stack), pool_size=1)
    port = router.port

    first = asyncio.create_task(exchange(port, b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n"))
    await asyncio.sleep(0.1)
    second = await exchange(port, b"POST /b HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\nx")
    assert status_and_body((await first)[0]) == (b"HTTP/1.1 200 OK", b"ok")
    assert status_and_body(second[0]) == (b"HTTP/1.1 200 OK", b"ok")
    assert router.failures == []
    assert [head.split(b"\r\n")[0] for head in worker.requests] == [
        b"GET /a HTTP/1.1",
        b"POST /b HTTP/1.1",
    ]
    assert worker.connections == 2


def test_a_failure_made_a_value_holds_no_frames_nor_its_causes() -> None:
    def connect() -> None:
        raise ConnectionRefusedError("refused")

    def forward() -> None:
        try:
            connect()
        except OSError as exc:
            raise UpstreamFailure("refused", "connect refused", request_sent=False) from exc

    try:
        forward()
    except UpstreamFailure as caught:
        failure = as_value(caught)
    assert failure.__traceback__ is None
    assert failure.__cause__ is not None and failure.__cause__.__traceback__ is None
    assert failure.kind == "refused"  # the value itself is untouched
