"""The public listener's edge rules: answers to malformed heads and the head timeout."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import NamedTuple

import pytest

from router.config import LimitsConfig, TimeoutsConfig
from router.core.answers import Answer
from router.edge.request import PublicRequest
from router.edge.server import PARSE_SLICE_BYTES, EdgeLimits, EdgeServer
from router.edge.serving import MAX_PIPELINED
from router.edge.wire import HeadRefusal, head_refusal_answer
from tests.metrics.test_registry import scrape, series
from tests.router_fixtures import EchoWorker, RawHttp, Rig, open_rig, router_config, wait_until


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


# --- pure -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("refusal", "error", "code"),
    [
        (HeadRefusal.LINE_TOO_LONG, "", "uri_too_long"),
        (HeadRefusal.FIELD_TOO_LONG, "", "headers_too_large"),
        (HeadRefusal.TOO_MANY_HEADERS, "", "headers_too_large"),
        (HeadRefusal.MALFORMED, "Duplicate Content-Length", "bad_request"),
        (HeadRefusal.MALFORMED, "", "bad_request"),
    ],
)
def test_a_refused_head_gets_the_answer_for_its_fault(
    refusal: HeadRefusal, error: str, code: str
) -> None:
    answer = head_refusal_answer(refusal, error)
    assert answer.code == code
    assert answer.session is None
    assert answer.detail.endswith(".")
    assert error in answer.detail


def test_a_parser_error_is_cut_in_the_answer() -> None:
    answer = head_refusal_answer(HeadRefusal.MALFORMED, "x" * 500)
    assert len(answer.detail) < 200


# --- the head timeout -------------------------------------------------------------------------


def limits(**fields: float) -> LimitsConfig:
    return dataclasses.replace(LimitsConfig(), **fields)  # type: ignore[arg-type]


async def a_connection(
    rig: Rig,
    tmp_path: Path,
    *,
    header_timeout_s: float = 10.0,
    first_byte_s: float | None = None,
    **fields: float,
) -> tuple[RawHttp, EchoWorker]:
    """A client connection to a router with this head timeout (idle: 30 s), other
    `limits` as `fields` say, the worker's first-byte timeout if given, and one worker,
    w0."""
    bounds = limits(header_timeout_s=header_timeout_s, **{"idle_timeout_s": 30.0, **fields})
    timeouts = TimeoutsConfig()
    if first_byte_s is not None:
        timeouts = dataclasses.replace(timeouts, first_byte_s=first_byte_s)
    await rig.start_router(router_config(tmp_path, limits=bounds, timeouts=timeouts))
    worker = await rig.add_worker("w0")
    return await RawHttp.open(rig.router.public_port), worker


async def send_a_parked_post(conn: RawHttp, *, content_length: int, then: bytes) -> None:
    """A POST to /slow (the worker parks it) with `content_length` announced and two body
    bytes sent; `then` follows in a read of its own, 0.1 s later."""
    conn.send(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\nab" % content_length)
    await asyncio.sleep(0.1)
    conn.send(then)


async def status_of(conn: RawHttp, request: bytes) -> int:
    """The status of the reply to `request`, sent on `conn`."""
    conn.send(request)
    status, _, _ = await conn.read_reply()
    return status


async def seconds_until_closed(conn: RawHttp, started: float) -> float:
    """Seconds from `started` (time.monotonic) until the router closed `conn`, having
    sent nothing more on it."""
    assert await conn.read_to_end() == b""
    return time.monotonic() - started


async def status_once_released(conn: RawHttp, worker: EchoWorker) -> int:
    """The status of the reply to the request `worker` parked, once it lets it go."""
    worker.release.set()
    status, _, _ = await conn.read_reply()
    return status


async def test_a_second_head_dribbled_on_a_kept_alive_connection_is_cut_at_the_timeout(
    rig: Rig, tmp_path: Path
) -> None:
    conn, _ = await a_connection(rig, tmp_path, header_timeout_s=0.4)
    try:
        assert await status_of(conn, b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n") == 200
        await asyncio.sleep(0.6)  # idle longer than the head timeout: allowed
        assert (
            await status_of(conn, b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n") == 200
        )  # the idle time did not count against the head
        started = time.monotonic()
        conn.send(b"GET /three HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        assert 0.3 <= await seconds_until_closed(conn, started) < 2.0
    finally:
        conn.close()
    assert [seen.path for seen in rig.workers["w0"].seen] == ["/one", "/two"]


async def test_a_slow_body_is_not_cut_by_the_head_timeout(rig: Rig, tmp_path: Path) -> None:
    conn, _ = await a_connection(rig, tmp_path, header_timeout_s=0.3)
    try:
        conn.send(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nab")
        await asyncio.sleep(0.6)
        conn.send(b"cd")
        status, _, _ = await conn.read_reply()
        assert status == 200
    finally:
        conn.close()


async def test_a_request_line_dribbled_before_its_target_is_cut_at_the_head_timeout(
    rig: Rig, tmp_path: Path
) -> None:
    # llhttp says nothing until the target: the edge starts the head's clock for a read
    # that began no head, ended no message and was no body.
    conn, _ = await a_connection(rig, tmp_path, header_timeout_s=0.4)
    try:
        assert await status_of(conn, b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n") == 200
        started = time.monotonic()
        conn.send(b"GE")
        await asyncio.sleep(0.1)
        conn.send(b"T")
        assert 0.3 <= await seconds_until_closed(conn, started) < 2.0
    finally:
        conn.close()


async def test_a_request_whose_body_ends_in_a_later_read_is_not_cut_by_the_head_timeout(
    rig: Rig, tmp_path: Path
) -> None:
    # The read that ends a body began no head but ended a message: no head clock starts
    # while the worker takes longer than the head timeout to answer.
    conn, worker = await a_connection(rig, tmp_path, header_timeout_s=0.3)
    try:
        await send_a_parked_post(conn, content_length=4, then=b"cd")
        await asyncio.sleep(0.6)  # twice the head timeout, the worker still parked
        assert worker.parked == 1
        assert await status_once_released(conn, worker) == 200
    finally:
        conn.close()


async def test_a_line_break_between_requests_starts_no_head_clock(rig: Rig, tmp_path: Path) -> None:
    # llhttp skips CR and LF between requests: a read of only those begins no head, so
    # neither a request being handled nor an idle connection gets the head timeout.
    conn, worker = await a_connection(rig, tmp_path, header_timeout_s=0.3)
    try:
        await send_a_parked_post(conn, content_length=2, then=b"\r\n")
        await asyncio.sleep(0.6)  # twice the head timeout, the worker still parked
        assert await status_once_released(conn, worker) == 200
        conn.send(b"\r\n")
        await asyncio.sleep(0.6)  # idle, not a head: the idle timeout applies
        assert await status_of(conn, b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n") == 200
    finally:
        conn.close()


async def test_a_request_line_begun_while_another_is_handled_keeps_its_head_clock(
    rig: Rig, tmp_path: Path
) -> None:
    conn, worker = await a_connection(rig, tmp_path, header_timeout_s=0.5)
    try:
        await send_a_parked_post(conn, content_length=2, then=b"GE")  # GE: the next request
        started = time.monotonic()
        await asyncio.sleep(0.1)
        assert await status_once_released(conn, worker) == 200
        # The first request's end does not restart the clock as an idle one.
        assert 0.4 <= await seconds_until_closed(conn, started) < 2.0
    finally:
        conn.close()


async def test_a_head_late_behind_a_request_in_flight_lets_its_reply_out_then_closes(
    rig: Rig, tmp_path: Path
) -> None:
    conn, worker = await a_connection(rig, tmp_path, header_timeout_s=0.3)
    try:
        await send_a_parked_post(conn, content_length=2, then=b"GET /next HTT")
        await asyncio.sleep(0.6)  # the next head's time runs out while /slow is in flight
        worker.release.set()
        status, headers, _ = await conn.read_reply()
        assert (status, headers.get("connection")) == (200, "close")
        assert await conn.read_to_end() == b""
    finally:
        conn.close()
    assert [seen.path for seen in worker.seen] == ["/slow"]
    requests = series(scrape(rig.router.metrics), "episode_router_requests_total")
    assert requests == {"kind=none,outcome=forwarded,status_class=2xx": 1}, requests


# --- the request's headers ----------------------------------------------------------------


async def requests_read(data: bytes) -> list[PublicRequest]:
    """The requests an edge reads from `data`, sent on one connection, each answered 503
    by the handler (the reply is awaited: the request was read whole)."""
    return await requests_read_in_pieces([data], EdgeLimits())


@pytest.mark.parametrize(
    ("head", "version", "keep_alive"),
    [
        (b"GET / HTTP/1.1\r\nHost: h\r\n", (1, 1), True),
        (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n", (1, 1), False),
        (b"GET / HTTP/1.1\r\nHost: h\r\nConnection: keep-alive\r\n", (1, 1), True),
        (b"GET / HTTP/1.0\r\nHost: h\r\n", (1, 0), False),
        (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n", (1, 0), True),
        (b"GET / HTTP/1.0\r\nProxy-Connection: Keep-Alive\r\n", (1, 0), True),
        (b"GET / HTTP/2.0\r\nHost: h\r\n", (2, 0), False),
    ],
)
async def test_a_request_has_the_version_and_keep_alive_it_was_sent_with(
    head: bytes, version: tuple[int, int], keep_alive: bool
) -> None:
    """The edge knows HTTP/1.1 from llhttp's keep-alive when no Connection header could
    have set it, and asks llhttp for the version otherwise: both ways agree with what
    was sent."""
    [request] = await requests_read(head + b"\r\n")
    assert (request.version, request.keep_alive) == (version, keep_alive)


async def test_a_request_reads_a_header_off_its_list_as_the_multidict_does() -> None:
    """`PublicRequest.getall` (how the handler reads a forwarded request's session, with
    no multidict built) answers what `headers.getall` does: any case, repeats in order,
    the default when absent, no prefix or longer name matched."""
    names = ("x-token", "X-TOKEN", "X-Token", "cookie", "HOST", "x-tok", "x-token-2", "absent")
    [request] = await requests_read(
        b"GET / HTTP/1.1\r\nHost: h\r\nX-Token: a\r\nx-tok: b\r\nX-TOKEN: c\r\n"
        b"Cookie: k=v\r\nX-Token-2: d\r\nx-token: e\r\n\r\n"
    )
    views = {n: (request.getall(n, ["-"]), request.headers.getall(n, ["-"])) for n in names}
    assert views["x-token"][0] == ["a", "c", "e"]
    assert views["x-tok"][0] == ["b"]
    assert views["absent"][0] == ["-"]
    for name, (from_list, from_multidict) in views.items():
        assert from_list == from_multidict, name


async def test_each_request_has_the_host_it_was_sent_with() -> None:
    # The last Host's text is reused while the bytes are the same: a change is seen.
    hosts = [b"a.example:8080", b"b.example", b"a.example:8080", b"[::1]:81", b"b.example"]
    data = b"".join(b"GET / HTTP/1.1\r\nHost: %b\r\n\r\n" % host for host in hosts)
    seen = await requests_read(data)
    assert [request.host for request in seen] == [host.decode() for host in hosts]


async def test_each_request_has_the_method_and_target_it_was_sent_with() -> None:
    # The last method's and target's text is reused while the bytes are the same.
    lines = [
        (b"POST", b"/run?x=1"),
        (b"POST", b"/run?x=1"),
        (b"GET", b"/run?x=1"),
        (b"GET", b"http://a.example:81/run?x=1"),
        (b"GET", b"/caf%C3%A9"),
        (b"PATCH", b"http://a.example:81/run?x=1"),
        (b"MKCOL", b"/run?x=1"),
    ]
    data = b"".join(b"%b %b HTTP/1.1\r\nHost: h\r\n\r\n" % line for line in lines)
    seen = await requests_read(data)
    assert [(r.method, r.target, r.authority, r.host) for r in seen] == [
        ("POST", "/run?x=1", None, "h"),
        ("POST", "/run?x=1", None, "h"),
        ("GET", "/run?x=1", None, "h"),
        ("GET", "/run?x=1", "a.example:81", "a.example:81"),
        ("GET", "/caf%C3%A9", None, "h"),
        ("PATCH", "/run?x=1", "a.example:81", "a.example:81"),
        ("MKCOL", "/run?x=1", None, "h"),
    ]


# --- hostile or unlucky timing ----------------------------------------------------------------


async def test_a_request_late_in_the_idle_window_is_not_cut_by_the_idle_timeout(
    rig: Rig, tmp_path: Path
) -> None:
    # The idle clock starts after the first reply; the second request comes whole in one
    # read before it runs out, and is still being handled when it would have.
    conn, worker = await a_connection(rig, tmp_path, header_timeout_s=5.0, idle_timeout_s=0.5)
    try:
        assert await status_of(conn, b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n") == 200
        await asyncio.sleep(0.3)
        conn.send(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.6)  # past the idle deadline, the worker still parked
        assert worker.parked == 1
        assert await status_once_released(conn, worker) == 200
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("head", "body"),
    [
        (
            b"POST /up HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
            b"Content-Length: 36\r\n\r\n",
            b"GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n",
        ),
        (
            b"POST /up HTTP/1.1\r\nHost: x\r\nConnection: upgrade\r\nUpgrade: h2c\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n",
            b"5\r\nhello\r\n0\r\n\r\n",
        ),
    ],
)
async def test_an_upgrade_request_with_a_body_is_refused_not_split_in_two(
    rig: Rig, tmp_path: Path, head: bytes, body: bytes
) -> None:
    # llhttp hands what follows an upgrade's head over as another protocol's bytes: read
    # as HTTP, the body would be the next request.
    conn, worker = await a_connection(rig, tmp_path)
    try:
        conn.send(head + body)
        status, _, answer = await conn.read_reply()
        assert status == 400
        assert b'"bad_request"' in answer and b"Upgrade" in answer
        assert await conn.read_to_end() == b""
    finally:
        conn.close()
    assert worker.paths_seen() == []


async def test_an_upgrade_request_without_a_body_is_served_as_plain_http(
    rig: Rig, tmp_path: Path
) -> None:
    conn, worker = await a_connection(rig, tmp_path)
    try:
        request = (
            b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
        )
        assert await status_of(conn, request) == 200
    finally:
        conn.close()
    assert worker.paths_seen() == ["/ws"]


async def test_a_header_field_that_never_ends_is_refused_past_the_limit(
    rig: Rig, tmp_path: Path
) -> None:
    # httptools gathers a field's bytes until its line ends: the edge refuses the head
    # once reads that delivered nothing pass what one field may take, well before the
    # head timeout, and reads (and drops) what follows so the client gets the answer.
    conn, worker = await a_connection(
        rig, tmp_path, header_timeout_s=30.0, max_header_bytes=1024, max_line_bytes=1024
    )
    try:
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: ")
        for _ in range(8):  # 32 KiB in reads of their own, no line end
            await asyncio.sleep(0.02)
            conn.send(b"a" * 4096)
        status, _, answer = await asyncio.wait_for(conn.read_reply(), 5)
        assert status == 431
        assert b'"headers_too_large"' in answer
    finally:
        conn.close()
    assert worker.paths_seen() == []


async def test_a_bad_head_behind_pipelined_requests_is_answered_after_them(
    rig: Rig, tmp_path: Path
) -> None:
    conn, worker = await a_connection(rig, tmp_path)
    try:
        conn.send(
            b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /b HTTP/1.1\r\nHost: x\r\n\r\n"
            b"GET /c HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n"
        )
        replies = [await conn.read_reply() for _ in range(3)]
        assert await conn.read_to_end() == b""
    finally:
        conn.close()
    assert [status for status, _, _ in replies] == [200, 200, 400]
    # The two replies before the refusal keep the connection open for it.
    assert [headers.get("connection") for _, headers, _ in replies] == [None, None, "close"]
    assert worker.paths_seen() == ["/a", "/b"]


async def test_a_body_that_goes_silent_gets_408_not_a_worker_timeout(
    rig: Rig, tmp_path: Path
) -> None:
    # The worker waits for the body: the silence is the client's, answered 408 at the
    # body timeout, long before the worker's first-byte timeout would call it a 504.
    conn, _ = await a_connection(rig, tmp_path, body_timeout_s=0.4, first_byte_s=30.0)
    try:
        started = time.monotonic()
        conn.send(b"POST /tool HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        await asyncio.sleep(0.1)
        conn.send(b"0123456789")  # a read of its own: the body spans reads
        status, _, answer = await conn.read_reply()
        assert 0.3 <= time.monotonic() - started < 5.0
        assert await conn.read_to_end() == b""
    finally:
        conn.close()
    assert status == 408
    assert b'"request_timeout"' in answer
    assert series(scrape(rig.router.metrics), "episode_router_upstream_failures_total") == {}


async def test_a_body_that_keeps_coming_is_not_cut_by_the_body_timeout(
    rig: Rig, tmp_path: Path
) -> None:
    conn, _ = await a_connection(rig, tmp_path, body_timeout_s=0.4)
    try:
        conn.send(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 8\r\n\r\nab")
        for piece in (b"cd", b"ef", b"gh"):  # 0.75 s in all, never 0.4 s silent
            await asyncio.sleep(0.25)
            conn.send(piece)
        status, _, _ = await conn.read_reply()
        assert status == 200
        # Kept alive, and the next request has no body clock left over.
        await asyncio.sleep(0.5)
        assert await status_of(conn, b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n") == 200
    finally:
        conn.close()


async def test_trailers_sent_slowly_are_the_clients_time_not_the_workers(
    rig: Rig, tmp_path: Path
) -> None:
    # The body's chunks are in; its trailers come one at a time, for longer than the
    # worker's first-byte timeout: the worker is not timed while the client still sends.
    conn, worker = await a_connection(rig, tmp_path, body_timeout_s=2.0, first_byte_s=0.3)
    try:
        conn.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.send(b"5\r\nhello\r\n0\r\n")
        for number in range(5):  # 1 s in all
            await asyncio.sleep(0.2)
            conn.send(b"X-T%d: a\r\n" % number)
        conn.send(b"\r\n")
        status, _, _ = await conn.read_reply()
    finally:
        conn.close()
    assert status == 200
    assert [seen.body_bytes for seen in worker.seen] == [5]
    assert series(scrape(rig.router.metrics), "episode_router_upstream_failures_total") == {}


async def test_trailers_past_the_head_limits_refuse_the_body(rig: Rig, tmp_path: Path) -> None:
    conn, _ = await a_connection(rig, tmp_path, max_headers=3)
    try:
        conn.send(b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.send(b"5\r\nhello\r\n0\r\n" + b"X-T: a\r\n" * 4 + b"\r\n")
        status, _, answer = await conn.read_reply()
        assert await conn.read_to_end() == b""
    finally:
        conn.close()
    assert (status, b'"bad_request"' in answer) == (400, True)


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (b"GET /none HTTP/1.1\r\n", 400),
        (b"GET /two HTTP/1.1\r\nHost: a\r\nHost: b\r\n", 400),
        (b"GET /two-same HTTP/1.1\r\nHost: a\r\nhost: a\r\n", 400),
        (b"GET /old HTTP/1.0\r\n", 200),  # HTTP/1.0 needs none
        (b"GET http://a/abs HTTP/1.1\r\n", 200),  # the target names the authority
        (b"GET /one HTTP/1.1\r\nHost: a\r\n", 200),
        (b"GET /spaced HTTP/1.1\r\nHost: a b\r\n", 400),
        (b"GET /path HTTP/1.1\r\nHost: a/b\r\n", 400),
        (b"GET /old-spaced HTTP/1.0\r\nHost: a b\r\n", 400),
        (b"GET /empty HTTP/1.1\r\nHost:\r\n", 200),  # no authority: allowed
    ],
    ids=[
        "missing",
        "repeated",
        "repeated-same",
        "http10",
        "absolute-form",
        "one",
        "spaced",
        "path",
        "http10-spaced",
        "empty",
    ],
)
async def test_an_http11_request_needs_exactly_one_host(
    rig: Rig, tmp_path: Path, head: bytes, status: int
) -> None:
    # RFC 9112 §3.2; two Host lines could be read differently by the next hop.
    conn, worker = await a_connection(rig, tmp_path)
    try:
        conn.send(head + b"\r\n")
        answered, _, answer = await conn.read_reply()
    finally:
        conn.close()
    assert answered == status
    if status == 400:
        assert b"exactly one Host" in answer
        assert worker.paths_seen() == []
    else:
        assert len(worker.paths_seen()) == 1


async def test_an_answer_to_an_http10_client_kept_alive_says_so(rig: Rig, tmp_path: Path) -> None:
    # An HTTP/1.0 client takes a reply without `Connection: keep-alive` as the last one.
    await rig.start_router(router_config(tmp_path))  # no worker: the router answers 503
    conn = await RawHttp.open(rig.router.public_port)
    try:
        request = b"GET /a HTTP/1.0\r\nConnection: keep-alive\r\n\r\n"
        conn.send(request)
        first, headers, _ = await conn.read_reply()
        conn.send(request)  # the same connection serves the next one
        second, _, _ = await conn.read_reply()
    finally:
        conn.close()
    assert (first, second) == (503, 503)
    assert headers["connection"] == "keep-alive"


async def test_a_target_and_a_field_each_at_their_limit_are_not_a_stall(tmp_path: Path) -> None:
    # Nothing comes out of the parser from the target's second read to the first field's
    # end (httptools hands a field over when the next begins): within both limits, that
    # stretch is not a field over the limit.
    target = b"/" + b"u" * 1019
    value = b"v" * (1024 - len(b"X-A: ") - 2)  # the field at max_header_bytes exactly
    pieces = [b"GET /", target[1:] + b" HTTP/1.1\r\n", b"X-A: " + value[:500]]
    pieces += [value[500:] + b"\r\n", b"Host: x\r\n\r\n"]
    seen = await requests_read_in_pieces(
        pieces, EdgeLimits(max_line_bytes=1024, max_header_bytes=1024)
    )
    assert [request.target for request in seen] == [target.decode()]


async def requests_read_in_pieces(pieces: list[bytes], limits: EdgeLimits) -> list[PublicRequest]:
    """The requests an edge with `limits` reads from `pieces`, each sent in a read of its
    own; each is answered 503, and the first answer is awaited."""
    seen: list[PublicRequest] = []

    def handler(request: PublicRequest) -> None:
        seen.append(request)
        request.client.answer(request, Answer("no_worker", "read"))
        request.client.finished(request)

    loop = asyncio.get_running_loop()
    edge = EdgeServer(handler, limits, loop)
    server = await loop.create_server(edge, "127.0.0.1", 0)
    try:
        conn = await RawHttp.open(int(server.sockets[0].getsockname()[1]))
        for piece in pieces:
            conn.send(piece)
            await conn.writer.drain()
            await asyncio.sleep(0.05)  # a read each
        status, _, _ = await asyncio.wait_for(conn.read_reply(), 5)
        conn.close()
    finally:
        server.close()
        await edge.shutdown(0.5)
    assert status == 503
    return seen


async def test_a_body_whose_client_waits_for_100_continue_is_not_timed_before_it(
    rig: Rig, tmp_path: Path
) -> None:
    # Queued behind a request that takes longer than the body timeout, an Expect request
    # rightly sends nothing until its 100 Continue: its silence counts from then.
    conn, worker = await a_connection(rig, tmp_path, body_timeout_s=0.3)
    try:
        conn.send(
            b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n"
            b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n"
        )
        await asyncio.sleep(0.6)  # twice the body timeout, the first request parked
        assert await status_once_released(conn, worker) == 200
        status, _, raw = await conn.read_head()
        assert (status, raw) == (100, b"HTTP/1.1 100 Continue\r\n\r\n")
        conn.send(b"hello")
        second, _, _ = await conn.read_reply()
    finally:
        conn.close()
    assert second == 200


# --- a client that does not read its replies ------------------------------------------------


class Unread(NamedTuple):
    edge: EdgeServer
    client: socket.socket
    sender: asyncio.Task[None]


@contextlib.asynccontextmanager
async def pipelined_unread(
    limits: EdgeLimits, requests: int, wait_s: float
) -> AsyncIterator[Unread]:
    """An edge answering every request 503 at once, and a client that sends `requests`
    pipelined GETs (in a task) and reads nothing for `wait_s`; all ended on exit."""

    def handler(request: PublicRequest) -> None:
        request.client.answer(request, Answer("no_worker", "answered at once"))
        request.client.finished(request)

    loop = asyncio.get_running_loop()
    edge = EdgeServer(handler, limits, loop)
    server = await loop.create_server(edge, "127.0.0.1", 0)
    client = socket.socket()
    for buffer in (socket.SO_RCVBUF, socket.SO_SNDBUF):  # small, and set before connect
        client.setsockopt(socket.SOL_SOCKET, buffer, 4096)
    client.setblocking(False)
    await loop.sock_connect(client, server.sockets[0].getsockname())
    data = b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n" * requests
    sender = asyncio.create_task(loop.sock_sendall(client, data), name="pipelining-client")
    try:
        await asyncio.sleep(wait_s)
        yield Unread(edge, client, sender)
    finally:
        sender.cancel()
        client.close()
        server.close()
        await edge.shutdown(0.5)


class AnswerCount:
    """The 503 status lines in a stream read in pieces, one cut across two reads too."""

    LINE = b"HTTP/1.1 503 "

    def __init__(self) -> None:
        self.answered = 0
        self._tail = b""

    def feed(self, read: bytes) -> None:
        assert read, f"the router closed the connection after {self.answered} answers"
        chunk = self._tail + read
        self.answered += chunk.count(self.LINE)
        self._tail = chunk[1 - len(self.LINE) :]

    async def read_until(self, requests: int, read: Callable[[], Awaitable[bytes]]) -> None:
        """Reads with `read` until `requests` answers came (30 s at most)."""
        async with asyncio.timeout(30):
            while self.answered < requests:
                self.feed(await read())


async def test_a_client_that_reads_no_replies_is_not_read_until_it_does() -> None:
    requests = 60_000  # ~8 MB of answers, ~1.7 MB of requests
    loop = asyncio.get_running_loop()
    async with pipelined_unread(EdgeLimits(), requests, 1.0) as unread:
        [conn] = unread.edge.connections
        assert conn.transport is not None
        # The unsent answers stay near the transport's high-water mark (64 KiB): the
        # router stopped reading, and the client's sending stalls.
        assert conn.transport.get_write_buffer_size() < 512 * 1024
        assert not unread.sender.done()
        count = AnswerCount()
        await count.read_until(requests, lambda: loop.sock_recv(unread.client, 1 << 16))
        await unread.sender
        assert count.answered == requests  # every one answered, none lost


async def test_a_client_that_reads_nothing_for_the_idle_timeout_is_dropped() -> None:
    async with pipelined_unread(EdgeLimits(idle_timeout_s=0.5), 30_000, 0.2) as unread:
        assert len(unread.edge.connections) == 1

        async def dropped() -> bool:
            return not unread.edge.connections

        assert 0.2 < await wait_until(dropped, "the connection to be dropped", 5) < 2


async def test_a_large_read_of_pipelined_requests_queues_a_slice_of_it_not_all() -> None:
    release = asyncio.Event()

    async def answer_when_released(request: PublicRequest) -> None:
        await release.wait()
        request.client.answer(request, Answer("no_worker", "answered in turn"))

    loop = asyncio.get_running_loop()
    edge = EdgeServer(answer_when_released, EdgeLimits(), loop)
    server = await loop.create_server(edge, "127.0.0.1", 0)
    requests = 20_000  # 560 KB, sent at once: reads of up to 256 KiB
    conn = await RawHttp.open(int(server.sockets[0].getsockname()[1]))
    try:
        conn.send(b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n" * requests)
        await asyncio.sleep(0.5)
        [connection] = edge.connections
        # What one slice holds at most, past the bound that paused reading.
        tiniest = len(b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (
            MAX_PIPELINED
            < len(connection._queue)
            <= MAX_PIPELINED + 1 + (PARSE_SLICE_BYTES // tiniest)
        )
        release.set()
        count = AnswerCount()
        await count.read_until(requests, lambda: conn.reader.read(1 << 16))
        assert count.answered == requests  # every one, in turn
    finally:
        conn.close()
        server.close()
        await edge.shutdown(0.5)


async def test_a_client_that_reads_its_replies_slowly_is_not_dropped() -> None:
    # It takes less than the router writes, but never nothing for idle_timeout_s: slow,
    # not stopped (nginx's send_timeout counts from the last byte taken, too).
    requests = 60_000
    loop = asyncio.get_running_loop()
    async with pipelined_unread(EdgeLimits(idle_timeout_s=0.5), requests, 0.1) as unread:
        count = AnswerCount()
        for _ in range(20):  # 2 s, four times the idle timeout: 16 KiB every 0.1 s
            count.feed(await loop.sock_recv(unread.client, 16384))
            await asyncio.sleep(0.1)
        assert len(unread.edge.connections) == 1  # still served
        await count.read_until(requests, lambda: loop.sock_recv(unread.client, 1 << 16))
        await unread.sender
        assert count.answered == requests


async def test_heads_the_edge_refuses_are_counted_with_the_other_answers(
    rig: Rig, tmp_path: Path
) -> None:
    await rig.start_router(router_config(tmp_path))
    for head in (
        b"GET /x HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET /" + b"u" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /x HTTP/1.1\r\nHost: x\r\nX-Big: " + b"v" * 17000 + b"\r\n\r\n",
    ):
        conn = await RawHttp.open(rig.router.public_port)
        try:
            conn.send(head)
            assert await conn.read_to_end()  # an answer, then the close
        finally:
            conn.close()
    requests = series(scrape(rig.router.metrics), "episode_router_requests_total")
    assert requests == {
        "kind=none,outcome=bad_request,status_class=4xx": 1,
        "kind=none,outcome=uri_too_long,status_class=4xx": 1,
        "kind=none,outcome=headers_too_large,status_class=4xx": 1,
    }, requests
