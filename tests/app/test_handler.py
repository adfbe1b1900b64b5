"""The public handler through a real RouterService: every row of the answers table (design §1),
HTTP hygiene end to end (design §8) and streaming, on loopback and Unix sockets.

Workers are `EchoWorker`s registered over the control socket; the router runs in
this process, so its memory is this process's memory.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from router.config import (
    BodyFieldConfig,
    LimitsConfig,
    LogConfig,
    SessionKindConfig,
    TimeoutsConfig,
    TokenFormatConfig,
    VerifyConfig,
)
from router.tokens import SigningKey
from tests.metrics.test_registry import scrape, series
from tests.router_fixtures import (
    BOOT_HEADER,
    CHUNK,
    SIGNING_KEY,
    TOKEN_HEADER,
    EchoWorker,
    MiB,
    PeakRss,
    RawHttp,
    RawLease,
    Rig,
    episode_key,
    open_rig,
    pattern_sha256,
    pattern_stream,
    router_config,
    token,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


# --- forwarded to the holder ------------------------------------------------------------------


async def test_each_episode_reaches_only_the_worker_that_holds_it(rig: Rig) -> None:
    await rig.start_router()
    workers = [await rig.add_worker(f"w{i}") for i in range(3)]
    holder = {}
    for i in range(6):
        worker = workers[i % 3]
        await worker.claim(episode_key(f"ep{i}", 0))
        holder[f"ep{i}"] = worker.id

    for ep in [f"ep{i}" for i in range(6)] * 2:
        reply = await rig.request("POST", f"/tools/{ep}", episode=token(ep), data=b"{}")
        assert reply.status == 200
        assert reply.worker == holder[ep]
        assert reply.headers["X-Worker"] == holder[ep]  # the worker's own header, unchanged

    for worker in workers:
        mine = sorted(f"/tools/{ep}" for ep, held_by in holder.items() if held_by == worker.id)
        assert sorted(worker.paths_seen()) == sorted(mine * 2)


async def test_a_forwarded_reply_comes_back_unchanged(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    reply = await rig.request("PUT", "/tools/add?x=1&y=%20", episode=token("ep"), data=b"12345")
    assert reply.status == 200
    body = reply.json()
    assert (body["method"], body["path"], body["body_bytes"]) == ("PUT", "/tools/add?x=1&y=%20", 5)
    assert body["sha256"] == hashlib.sha256(b"12345").hexdigest()
    assert reply.headers["Content-Type"] == "application/json; charset=utf-8"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def access_records() -> Iterator[list[logging.LogRecord]]:
    """The access log's records while the test runs."""
    logger = logging.getLogger("episode_router.access")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_the_admin_listeners_access_lines_have_the_same_fields(
    rig: Rig, access_records: list[logging.LogRecord]
) -> None:
    await rig.start_router(log=LogConfig(access=True))
    assert (await rig.admin("GET", "/healthz")).status == 200
    [line] = [vars(record) for record in access_records]
    assert line["msg"] == "admin request"
    fields = {name: line[name] for name in ("method", "path", "status", "client")}
    assert fields == {"method": "GET", "path": "/healthz", "status": 200, "client": "127.0.0.1"}
    assert line["duration_ms"] >= 0


async def test_the_access_log_has_one_line_per_request_forwarded_or_answered(
    rig: Rig, access_records: list[logging.LogRecord]
) -> None:
    await rig.start_router(log=LogConfig(access=True))
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    # The first forward opens a worker connection; the second goes on it, without a task.
    for _ in range(2):
        reply = await rig.request("POST", "/tools/echo?q=1", episode=token("ep"), data=b"{}")
        assert reply.status == 200
    assert (await rig.request("POST", "/tools/x", episode=token("nobody"))).status == 401
    fields = [vars(record) for record in access_records]  # extras are record attributes
    lines = [
        {name: f[name] for name in ("method", "path", "status", "outcome", "kind")} for f in fields
    ]
    forwarded = {
        "method": "POST",
        "path": "/tools/echo",
        "status": 200,
        "outcome": "forwarded",
        "kind": "episode",
    }
    unknown = {
        "method": "POST",
        "path": "/tools/x",
        "status": 401,
        "outcome": "unknown_episode",
        "kind": "episode",
    }
    assert lines == [forwarded, forwarded, unknown]
    assert all(f["msg"] == "request" and f["duration_ms"] >= 0 for f in fields)
    assert {f["client"] for f in fields} == {"127.0.0.1"}


# --- worker exited, episode ended ---------------------------------------------------------


async def test_a_worker_that_dies_without_bye_is_410_quickly(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0", lease="raw")
    await worker.claim("ep-a0")
    assert (await rig.request("GET", "/", episode=token("ep"))).worker == "w0"

    await worker.close_http()  # the process is gone: its port refuses...
    assert worker.lease is not None
    worker.lease.abort()  # ...and its control connection breaks off without a bye
    took = await rig.wait_worker_state("w0", "exited")

    assert took < 1.0  # a refused probe right away, not the reconnect grace
    reply = await rig.request("GET", "/", episode=token("ep"))
    reply.assert_answer(410, "worker_exited", "ep-a0")
    assert (await rig.worker_views())["w0"]["claims"] == 0


async def test_bye_makes_the_workers_episodes_410_at_once(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    assert worker.client is not None

    await worker.client.stop()  # says bye; its HTTP side still listens

    reply = await rig.request("GET", "/after-bye", episode=token("ep"))
    reply.assert_answer(410, "worker_exited", "ep-a0")
    assert worker.seen == []
    assert (await rig.worker_views())["w0"]["state"] == "exited"


async def test_a_released_episode_is_episode_ended(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    await worker.claim("ep-a1")

    await worker.release_key("ep-a0")

    (await rig.request("GET", "/", episode=token("ep", 0))).assert_answer(
        410, "episode_ended", "ep-a0"
    )
    assert (await rig.request("GET", "/", episode=token("ep", 1))).worker == "w0"
    assert worker.paths_seen() == ["/"]


# --- tokens: unknown, malformed, edge verification ----------------------------------------


async def test_an_unknown_episode_is_401_with_the_episode_token_scheme(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("known-a0")

    reply = await rig.request("POST", "/tools/add", episode=token("never-claimed"), data=b"{}")

    reply.assert_answer(401, "unknown_episode", "never-claimed-a0")
    assert "Bearer" not in reply.headers["WWW-Authenticate"]
    assert worker.seen == []


def _alg_none_token() -> str:
    header = _b64(json.dumps({"alg": "none"}).encode())
    payload = _b64(json.dumps({"ep": "ep", "att": 0, "nonce": "n", "iat": 0}).encode())
    return f"{header}.{payload}.{_b64(b'x' * 32)}"


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("garbage", id="not-a-jws"),
        pytest.param("a.b", id="two-segments"),
        pytest.param(_alg_none_token(), id="alg-none"),
        pytest.param(token("ep", exp=int(time.time()) - 60), id="expired"),
        pytest.param(token("ep") + "=", id="padded-signature"),
    ],
)
async def test_a_malformed_token_is_401_invalid_token(rig: Rig, value: str) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")

    (await rig.request("GET", "/", episode=value)).assert_answer(401, "invalid_token", None)
    assert worker.seen == []


async def test_edge_verification_refuses_forgeries_and_forwards_good_tokens(
    rig: Rig, tmp_path: Path
) -> None:
    secret = secrets.token_bytes(32)
    kind = SessionKindConfig(
        name="episode",
        header=TOKEN_HEADER,
        token=TokenFormatConfig(format="jws", verify=VerifyConfig(alg="HS256", key=secret)),
    )
    await rig.start_router(router_config(tmp_path, sessions=(kind,)))
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    good = SigningKey.hs256(secret)

    forged = await rig.request("GET", "/forged", episode=token("ep", key=SIGNING_KEY))
    forged.assert_answer(403, "bad_signature", None)
    other_alg = await rig.request(
        "GET", "/eddsa", episode=token("ep", key=SigningKey.generate("EdDSA"))
    )
    other_alg.assert_answer(403, "bad_signature", None)
    malformed = await rig.request("GET", "/malformed", episode="x.y")
    malformed.assert_answer(401, "invalid_token", None)  # structure is checked first
    unknown = await rig.request("GET", "/unknown", episode=token("other", key=good))
    unknown.assert_answer(401, "unknown_episode", "other-a0")

    reply = await rig.request("GET", "/signed", episode=token("ep", key=good))
    assert reply.status == 200 and reply.worker == "w0"
    assert worker.paths_seen() == ["/signed"]


# --- balancing, no worker, recovering ---------------------------------------------------------


async def test_sessionless_requests_go_to_the_worker_with_fewest_claims_not_draining(
    rig: Rig,
) -> None:
    await rig.start_router()
    w0, w1, w2 = [await rig.add_worker(f"w{i}") for i in range(3)]
    for key in ("a-a0", "b-a0"):
        await w0.claim(key)
    await w1.claim("c-a0")

    assert (await rig.request("POST", "/seed")).worker == "w2"
    assert w2.client is not None
    await w2.client.drain(True)
    assert (await rig.request("POST", "/seed")).worker == "w1"
    assert (await rig.admin("POST", "/admin/workers/w1/drain")).status == 200
    assert (await rig.request("POST", "/seed")).worker == "w0"
    assert (await rig.admin("DELETE", "/admin/workers/w1/drain")).status == 200
    assert (await rig.request("POST", "/seed")).worker == "w1"
    await w2.client.drain(False)
    assert (await rig.request("POST", "/seed")).worker == "w2"

    # A draining worker's own episodes go on.
    assert w0.client is not None
    await w0.client.drain(True)
    assert (await rig.request("GET", "/held", episode=token("a"))).worker == "w0"


async def test_between_equal_claim_counts_the_worker_with_fewer_requests_in_flight_wins(
    rig: Rig,
) -> None:
    await rig.start_router()
    w0 = await rig.add_worker("w0")
    await rig.add_worker("w1")
    assert (await rig.request("POST", "/seed")).worker == "w0"  # a tie: the lowest id
    parked = asyncio.create_task(rig.request("POST", "/slow"))  # to w0

    async def w0_busy() -> bool:
        return w0.parked == 1

    await wait_until(w0_busy, "the slow request to reach w0")
    assert (await rig.request("POST", "/seed")).worker == "w1"
    w0.release.set()
    assert (await parked).worker == "w0"


async def test_no_live_worker_is_503_no_worker_with_retry_after(rig: Rig) -> None:
    await rig.start_router()
    (await rig.request("POST", "/seed", data=b"x")).assert_answer(503, "no_worker", None)

    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    assert worker.client is not None
    await worker.client.drain(True)
    (await rig.request("POST", "/seed")).assert_answer(503, "no_worker", None)
    assert (await rig.request("GET", "/held", episode=token("ep"))).worker == "w0"


async def test_an_unknown_episode_while_recovering_is_503_recovering(rig: Rig) -> None:
    await rig.start_router(recovery_window_s=30.0)
    worker = await rig.add_worker("w0")  # says hello and syncs, but nobody is expected
    await worker.claim("ep-a0")

    reply = await rig.request("GET", "/", episode=token("unknown"))
    reply.assert_answer(503, "recovering", "unknown-a0")
    assert 25 <= int(reply.headers["Retry-After"]) <= 30
    assert (await rig.request("GET", "/", episode=token("ep"))).worker == "w0"
    assert (await rig.admin("GET", "/readyz")).json()["recovering"] is True


async def test_recovery_ends_when_its_window_passes(rig: Rig) -> None:
    started = time.monotonic()
    await rig.start_router(recovery_window_s=0.6)
    (await rig.request("GET", "/", episode=token("unknown"))).assert_answer(
        503, "recovering", "unknown-a0"
    )

    async def unknown_is_401() -> bool:
        reply = await rig.request("GET", "/", episode=token("unknown"))
        return reply.status == 401

    await wait_until(unknown_is_401, "the recovery window to end")
    assert time.monotonic() - started >= 0.6
    (await rig.request("GET", "/", episode=token("unknown"))).assert_answer(
        401, "unknown_episode", "unknown-a0"
    )


# --- ambiguous sessions -----------------------------------------------------------------------


async def test_a_session_header_repeated_with_different_values_is_400(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    await worker.claim("other-a0")

    both = [(TOKEN_HEADER, token("ep")), (TOKEN_HEADER, token("other"))]
    reply = await rig.request("POST", "/", headers=both, data=b"{}")
    reply.assert_answer(400, "ambiguous_session", None)
    assert worker.seen == []

    same = token("ep")
    for repeated in (
        [(TOKEN_HEADER, same), (TOKEN_HEADER, same)],
        [(TOKEN_HEADER, f"{same}, {same}")],
    ):
        reply = await rig.request("GET", "/same", headers=repeated)
        assert reply.status == 200 and reply.worker == "w0"
        # The worker gets it in one line, as the router read it: one value.
        [seen] = worker.seen[-1:]
        assert [v for n, v in seen.headers if n.lower() == TOKEN_HEADER.lower()] == [same]


# --- upstream failures ------------------------------------------------------------------------


async def test_a_refused_connect_is_410_and_retires_the_worker(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0", lease="raw")  # its lease stays up
    await worker.claim("ep-a0")
    await worker.close_http()

    reply = await rig.request("POST", "/tools/add", episode=token("ep"), data=b"{}")

    reply.assert_answer(410, "worker_exited", "ep-a0")
    views = await rig.worker_views()
    assert (views["w0"]["state"], views["w0"]["claims"]) == ("exited", 0)
    assert worker.lease is not None and await worker.lease.closed_by_peer()
    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )


async def test_a_live_worker_that_drops_the_connection_is_502(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")

    reply = await rig.request("POST", "/drop", episode=token("ep"), data=b"{}")

    reply.assert_answer(502, "upstream_error", "ep-a0")
    assert worker.paths_seen() == ["/drop"]  # sent once, never replayed
    assert (await rig.worker_views())["w0"]["state"] == "live"
    assert (await rig.request("POST", "/next", episode=token("ep"))).worker == "w0"


async def test_a_lost_worker_that_drops_the_connection_is_410(rig: Rig) -> None:
    await rig.start_router(reconnect_grace_s=30.0)
    worker = await rig.add_worker("w0", lease="raw")
    await worker.claim("ep-a0")
    assert worker.lease is not None
    worker.lease.abort()
    await rig.wait_worker_state("w0", "lost")

    reply = await rig.request("POST", "/drop", episode=token("ep"), data=b"{}")

    reply.assert_answer(410, "worker_exited", "ep-a0")  # the lease is gone: not a 502
    assert worker.paths_seen() == ["/drop"]


async def test_a_worker_that_never_replies_is_504(rig: Rig, tmp_path: Path) -> None:
    timeouts = TimeoutsConfig(connect_s=1.0, first_byte_s=0.3, stream_idle_s=5.0)
    await rig.start_router(router_config(tmp_path, timeouts=timeouts))
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")

    started = time.monotonic()
    reply = await rig.request("POST", "/hang", episode=token("ep"), data=b"{}")

    reply.assert_answer(504, "upstream_timeout", "ep-a0")
    assert 0.3 <= time.monotonic() - started < 3.0
    assert worker.parked == 1  # the router gave up; the worker still holds the call
    assert (await rig.worker_views())["w0"]["state"] == "live"


async def test_a_sessionless_request_refused_by_one_worker_is_retried_on_another(
    rig: Rig,
) -> None:
    await rig.start_router()
    gone = await rig.add_worker("w0", lease="raw")  # first pick: lowest id
    await rig.add_worker("w1")
    await gone.close_http()

    reply = await rig.request("POST", "/seed", data=b"payload")

    assert reply.status == 200 and reply.worker == "w1"
    assert reply.json()["body_bytes"] == 7  # the body went out once, whole, to w1
    assert (await rig.worker_views())["w0"]["state"] == "exited"


async def test_a_sessionless_request_refused_everywhere_is_410_about_the_request(
    rig: Rig,
) -> None:
    await rig.start_router()
    for worker_id in ("w0", "w1", "w2", "w3"):
        gone = await rig.add_worker(worker_id, lease="raw")
        await gone.close_http()

    reply = await rig.request("POST", "/seed", data=b"x")

    reply.assert_answer(410, "worker_exited", None)  # three tried, the last one answered
    assert (await rig.worker_views())["w3"]["state"] == "live"
    assert (
        reply.json()["detail"]
        == "The worker that was chosen for this request is no longer running."
    )


async def test_a_sessionless_request_queued_for_a_worker_that_exits_goes_to_another(
    rig: Rig,
) -> None:
    await rig.start_router()
    rig.router.forwarder.pool_size = 1  # one connection to w0: the next request queues
    w0 = await rig.add_worker("w0", lease="raw")
    await rig.add_worker("w1")
    assert (await rig.admin("POST", "/admin/workers/w1/drain")).status == 200
    held = asyncio.ensure_future(rig.request("POST", "/hang", data=b"a"))

    async def w0_holds_it() -> bool:
        return w0.parked == 1

    await wait_until(w0_holds_it, "w0 to hold the first request")
    queued = asyncio.ensure_future(rig.request("POST", "/queued", data=b"bb"))
    await asyncio.sleep(0.2)  # decided for w0, waiting for its one connection
    assert (await rig.admin("DELETE", "/admin/workers/w1/drain")).status == 200
    # w0's process is replaced (a new boot): the old one's pool closes under the queue.
    assert w0.lease is not None
    w0.lease.abort()
    await rig.wait_worker_state("w0", "lost")
    again = await RawLease.open(rig.control_address)
    assert (await again.hello("w0", w0.url, "boot-2"))["ok"] is True

    reply = await queued

    assert reply.status == 200 and reply.worker == "w1"  # nothing had reached w0
    assert reply.json()["body_bytes"] == 2
    assert [seen.path for seen in w0.seen] == ["/hang"]
    held.cancel()
    await asyncio.gather(held, return_exceptions=True)
    again.abort()


async def test_a_session_request_is_never_retried_on_another_worker(rig: Rig) -> None:
    await rig.start_router()
    gone = await rig.add_worker("w0", lease="raw")
    other = await rig.add_worker("w1")
    await gone.claim("ep-a0")
    await gone.close_http()

    (await rig.request("POST", "/", episode=token("ep"), data=b"x")).assert_answer(
        410, "worker_exited", "ep-a0"
    )
    assert other.seen == []


async def test_a_body_over_the_limit_is_413_by_its_content_length(rig: Rig, tmp_path: Path) -> None:
    limits = dataclasses.replace(LimitsConfig(), max_body_bytes=16)
    await rig.start_router(router_config(tmp_path, limits=limits))
    worker = await rig.add_worker("w0")

    (await rig.request("POST", "/big", data=b"x" * 17)).assert_answer(
        413, "payload_too_large", None
    )
    assert (await rig.request("POST", "/small", data=b"x" * 16)).json()["body_bytes"] == 16
    assert worker.paths_seen() == ["/small"]


# --- HTTP hygiene (design §8) -----------------------------------------------------------------


async def test_hop_by_hop_and_router_owned_headers_are_dropped_end_to_end(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")

    reply = await rig.request(
        "POST",
        "/hop",
        episode=token("ep"),
        data=b"{}",
        headers=[
            ("Host", "public.example:8080"),
            ("Connection", "keep-alive, X-Hop-Named"),
            ("X-Hop-Named", "dropped"),
            ("Keep-Alive", "timeout=5"),
            ("TE", "trailers"),
            ("Upgrade", "h2c"),
            ("Proxy-Authorization", "Basic eDp5"),
            ("Proxy-Anything", "dropped"),
            ("Foo_Bar", "dropped"),
            ("Content_Length", "99"),
            ("X-Forwarded-For", "203.0.113.9"),
            ("X-Forwarded-Host", "evil.example"),
            ("X-Forwarded-Proto", "https"),
            ("Forwarded", "for=203.0.113.9"),
            (BOOT_HEADER, "forged-boot"),
            ("X-Episode-Router-Anything", "dropped"),
            ("X-Kept", "yes"),
            ("X-Kept", "twice"),
        ],
    )

    assert reply.status == 200 and reply.worker == "w0"
    names = {name.lower() for name, _ in reply.json()["headers"]}
    for dropped in (
        "x-hop-named",
        "keep-alive",
        "te",
        "upgrade",
        "proxy-authorization",
        "proxy-anything",
        "foo_bar",
        "content_length",
        "forwarded",
        "x-episode-router-anything",
    ):
        assert dropped not in names, dropped
    assert all("x-hop-named" not in v.lower() for v in reply.seen_headers("Connection"))
    assert reply.seen_headers("Host") == [f"127.0.0.1:{worker.port}"]
    assert reply.seen_headers("X-Forwarded-Host") == ["public.example:8080"]
    assert reply.seen_headers("X-Forwarded-For") == ["127.0.0.1"]
    assert reply.seen_headers("X-Forwarded-Proto") == ["http"]
    assert reply.seen_headers(BOOT_HEADER) == [worker.boot]
    assert reply.seen_headers("X-Kept") == ["yes", "twice"]
    assert reply.seen_headers(TOKEN_HEADER) != []
    # The reply's hop-by-hop headers are dropped on the way back too.
    assert reply.headers.getall("X-Reply-Public") == ["kept"]
    for dropped in ("X-Reply-Private", "Keep-Alive", "Proxy-Agent"):
        assert dropped not in reply.headers, dropped


def _head(method: str, path: str, port: int, headers: list[tuple[str, str]], length: int) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Length: {length}"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def test_an_answer_the_router_gives_itself_sends_no_100_continue(rig: Rig) -> None:
    router = await rig.start_router()
    worker = await rig.add_worker("w0")
    conn = await RawHttp.open(router.public_port)
    try:
        headers = [(TOKEN_HEADER, "bad"), ("Expect", "100-continue")]
        conn.send(_head("POST", "/", router.public_port, headers, 5))
        status, headers_in, body = await conn.read_reply()  # the body was never sent
        # The first bytes back are the final answer: no interim 100 came before it.
        assert status == 401
        assert headers_in["connection"] == "close"  # its body is left unread
        assert json.loads(body)["error"] == "invalid_token"
        conn.send(b"hello")  # a client that sends the body anyway gets nothing more
        assert await conn.read_to_end() == b""
    finally:
        conn.close()
    assert worker.seen == []


async def test_a_forwarded_request_gets_100_continue_then_its_body_goes_through(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    conn = await RawHttp.open(router.public_port)
    try:
        headers = [(TOKEN_HEADER, token("ep")), ("Expect", "100-continue")]
        conn.send(_head("POST", "/upload", router.public_port, headers, 5))
        status, _, raw = await conn.read_head()
        assert (status, raw) == (100, b"HTTP/1.1 100 Continue\r\n\r\n")
        conn.send(b"hello")
        status, _, body = await conn.read_reply()
    finally:
        conn.close()
    assert status == 200
    echoed = json.loads(body)
    assert (echoed["worker"], echoed["body_bytes"]) == ("w0", 5)
    assert "expect" not in {name.lower() for name, _ in echoed["headers"]}


async def test_a_body_read_for_its_session_gets_100_continue_first(
    rig: Rig, tmp_path: Path
) -> None:
    # The session is in the body: a client that waits for 100 Continue before sending
    # it must get one, or it stalls until its own expect timeout.
    kind = SessionKindConfig("sid", body_field=BodyFieldConfig("/session_id"), unclaimed="forward")
    router = await rig.start_router(router_config(tmp_path, sessions=(kind,)))
    await rig.add_worker("w0")
    body = b'{"session_id": "s1"}'
    conn = await RawHttp.open(router.public_port)
    try:
        headers = [("Content-Type", "application/json"), ("Expect", "100-continue")]
        conn.send(_head("POST", "/tool", router.public_port, headers, len(body)))
        status, _, raw = await conn.read_head()
        assert (status, raw) == (100, b"HTTP/1.1 100 Continue\r\n\r\n")
        conn.send(body)
        status, _, reply = await conn.read_reply()
    finally:
        conn.close()
    assert status == 200
    assert json.loads(reply)["body_bytes"] == len(body)


async def test_a_body_read_for_its_session_that_goes_silent_gets_408(
    rig: Rig, tmp_path: Path
) -> None:
    kind = SessionKindConfig("sid", body_field=BodyFieldConfig("/session_id"), unclaimed="forward")
    limits = dataclasses.replace(LimitsConfig(), body_timeout_s=0.4)
    router = await rig.start_router(router_config(tmp_path, sessions=(kind,), limits=limits))
    worker = await rig.add_worker("w0")
    conn = await RawHttp.open(router.public_port)
    try:
        headers = [("Content-Type", "application/json")]
        conn.send(_head("POST", "/tool", router.public_port, headers, 100))
        await asyncio.sleep(0.1)
        conn.send(b'{"session_id": ')  # and no more
        status, _, reply = await conn.read_reply()
    finally:
        conn.close()
    assert status == 408
    assert json.loads(reply)["error"] == "request_timeout"
    assert worker.seen == []


@pytest.mark.parametrize("body_with_head", [True, False], ids=["with-head", "after-answer"])
async def test_an_unread_body_is_never_read_as_the_next_request(
    rig: Rig, body_with_head: bool
) -> None:
    router = await rig.start_router()
    worker = await rig.add_worker("w0")  # a smuggled sessionless request would reach it
    smuggled = b"GET /xy HTTP/1.1\r\n\r\n"
    assert len(smuggled) == 20
    second = b"GET /second HTTP/1.1\r\nHost: x\r\n\r\n"
    head = _head("POST", "/", router.public_port, [(TOKEN_HEADER, "bad")], 20)
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(head + smuggled if body_with_head else head)
        status, headers, _ = await conn.read_reply()
        assert status == 401
        if not body_with_head:
            assert headers["connection"] == "close"
            conn.send(smuggled + second)
        else:
            conn.send(second)
        if headers.get("connection") == "close":
            assert await conn.read_to_end() == b""
            assert worker.seen == []
        else:  # the whole body had arrived: it was framed as a body and skipped
            status, _, body = await conn.read_reply()
            assert (status, json.loads(body)["path"]) == (200, "/second")
            assert worker.paths_seen() == ["/second"]
    finally:
        conn.close()


async def test_a_location_naming_the_workers_private_address_is_rewritten(rig: Rig) -> None:
    router = await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")

    async with rig.http.get(
        rig.url("/redirect"), headers={TOKEN_HEADER: token("ep")}, allow_redirects=False
    ) as reply:
        assert reply.status == 302
        public = f"http://127.0.0.1:{router.public_port}/next"
        assert reply.headers.getall("Location") == [public]
        assert reply.headers.getall("Content-Location") == [public]
        assert reply.headers.getall("Link") == [f"{worker.url}/next"]  # only those two


_MALFORMED_HEADS = {
    "header-line-over-the-limit": (
        b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n",
        (431, "headers_too_large"),
    ),
    "too-many-headers": (
        b"GET / HTTP/1.1\r\nHost: x\r\n"
        + b"".join(b"X-H%d: 1\r\n" % i for i in range(120))
        + b"\r\n",
        (431, "headers_too_large"),
    ),
    "request-line-over-the-limit": (
        b"GET /" + b"a" * 9_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
        (414, "uri_too_long"),
    ),
    "content-length-and-chunked": (
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
        (400, "bad_request"),
    ),
    "two-content-lengths": (
        b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
        (400, "bad_request"),
    ),
    "unknown-transfer-encoding": (
        b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\nabc",
        (400, "bad_request"),
    ),
}


async def _send_malformed(rig: Rig, name: str) -> bytes:
    router = await rig.start_router()
    await rig.add_worker("w0")  # sessionless: anything read as a request would reach it
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(_MALFORMED_HEADS[name][0])
        return await conn.read_to_end()  # the connection is closed after the answer
    finally:
        conn.close()


@pytest.mark.parametrize("name", list(_MALFORMED_HEADS))
async def test_a_malformed_or_oversized_head_is_refused_and_the_connection_closed(
    rig: Rig, name: str
) -> None:
    everything = await _send_malformed(rig, name)
    assert everything.startswith(b"HTTP/1.")
    status = int(everything.split(b" ", 2)[1])
    assert status in (400, 414, 431), everything[:200]
    assert rig.workers["w0"].seen == []


@pytest.mark.parametrize("name", list(_MALFORMED_HEADS))
async def test_a_malformed_or_oversized_head_gets_the_routers_json_answer(
    rig: Rig, name: str
) -> None:
    everything = await _send_malformed(rig, name)
    head, _, body = everything.partition(b"\r\n\r\n")
    status, code = _MALFORMED_HEADS[name][1]
    assert head.startswith(b"HTTP/1.") and head[9:13] == b"%d " % status, head
    assert b"\r\nContent-Type: application/json\r\n" in head + b"\r\n"
    assert json.loads(body) == {
        "error": code,
        "detail": json.loads(body)["detail"],
        "session": None,
    }


async def test_a_request_head_that_never_completes_is_closed_by_the_idle_bound(
    rig: Rig, tmp_path: Path
) -> None:
    limits = dataclasses.replace(LimitsConfig(), idle_timeout_s=0.5)
    router = await rig.start_router(router_config(tmp_path, limits=limits))
    conn = await RawHttp.open(router.public_port)
    started = time.monotonic()
    try:
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        assert await conn.read_to_end() == b""
    finally:
        conn.close()
    assert 0.4 <= time.monotonic() - started < 3.0


async def test_a_request_head_that_never_completes_is_closed_after_the_header_timeout(
    rig: Rig, tmp_path: Path
) -> None:
    limits = dataclasses.replace(LimitsConfig(), header_timeout_s=0.3, idle_timeout_s=10.0)
    router = await rig.start_router(router_config(tmp_path, limits=limits))
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        async with asyncio.timeout(1.5):
            with contextlib.suppress(ConnectionResetError):
                while await conn.reader.read(65536):
                    pass
    finally:
        conn.close()


async def test_a_worker_on_a_unix_socket_is_forwarded_to_and_its_exit_is_410(
    rig: Rig, tmp_path: Path
) -> None:
    await rig.start_router()
    worker = EchoWorker("u0", rig.control_address, unix_path=tmp_path / "u0.sock")
    await worker.serve()
    rig.stack.push_async_callback(worker.close)
    await worker.connect("raw")
    await worker.claim("ep-a0")

    reply = await rig.request("POST", "/tools", episode=token("ep"), data=b"abc")
    assert (reply.status, reply.worker, reply.json()["body_bytes"]) == (200, "u0", 3)
    assert reply.seen_headers("Host") == ["localhost"]
    assert (await rig.worker_views())["u0"]["url"] == f"unix:{tmp_path}/u0.sock"

    await worker.close_http()
    assert worker.lease is not None
    worker.lease.abort()
    await rig.wait_worker_state("u0", "exited")
    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )


# --- streaming --------------------------------------------------------------------------------


async def test_64_mib_each_way_streams_through_without_buffering(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    size = 64 * MiB
    headers = {TOKEN_HEADER: token("ep")}

    with PeakRss() as upload_rss:
        async with rig.http.post(
            rig.url("/upload"), headers=headers, data=pattern_stream(size)
        ) as reply:
            echoed = await reply.json()
    assert reply.status == 200
    assert (echoed["worker"], echoed["body_bytes"]) == ("w0", size)
    assert echoed["sha256"] == pattern_sha256(size)

    digest, total = hashlib.sha256(), 0
    with PeakRss() as download_rss:
        async with rig.http.get(rig.url(f"/big?bytes={size}"), headers=headers) as reply:
            assert reply.status == 200
            async for chunk in reply.content.iter_chunked(CHUNK):
                digest.update(chunk)
                total += len(chunk)
    assert total == size and digest.hexdigest() == pattern_sha256(size)

    assert upload_rss.growth < 32 * MiB, upload_rss.growth
    assert download_rss.growth < 32 * MiB, download_rss.growth


async def test_an_sse_event_reaches_the_client_before_the_next_is_sent(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")

    async with rig.http.get(rig.url("/sse"), headers={TOKEN_HEADER: token("ep")}) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"] == "text/event-stream"
        first = await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5)
        assert first == b"data: first\n\n"
        assert worker.sse_second_sent is False
        worker.sse_go.set()
        second = await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5)
        assert second == b"data: second\n\n"
        assert await reply.content.read() == b""


DECISIONS = "episode_router_decision_duration_seconds_count"


async def test_each_routed_request_times_its_decision_once_and_a_stream_at_its_start(
    rig: Rig,
) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    metrics = rig.router.metrics
    assert metrics is not None

    def decisions() -> float:
        return series(scrape(metrics), DECISIONS, nonzero=False)[""]

    # Refused by the session read (a malformed token): decided too, under its kind.
    refused = await rig.request("GET", "/tools/x", headers={TOKEN_HEADER: "not-a-token"})
    assert refused.status == 401
    assert decisions() == 1
    requests = series(scrape(metrics), "episode_router_requests_total")
    assert requests == {"kind=episode,outcome=invalid_token,status_class=4xx": 1}, requests
    # Routed and relayed whole (the relay's lane): one.
    replied = await rig.request("GET", "/tools/x", headers={TOKEN_HEADER: token("ep")})
    assert replied.status == 200
    assert decisions() == 2
    # Routed by the claim table to an answer of the router's own (an unknown episode): one.
    unknown = await rig.request("GET", "/tools/x", headers={TOKEN_HEADER: token("nobody")})
    assert unknown.status == 401
    assert decisions() == 3
    # A reply that streams is timed at its start, not when it ends.
    async with rig.http.get(rig.url("/sse"), headers={TOKEN_HEADER: token("ep")}) as reply:
        assert await asyncio.wait_for(reply.content.readuntil(b"\n\n"), 5) == b"data: first\n\n"
        assert decisions() == 4
        worker.sse_go.set()
        await reply.content.read()
    assert decisions() == 4


async def test_a_streamed_chunked_body_over_the_limit_gets_413_and_never_completes(
    rig: Rig, tmp_path: Path
) -> None:
    limits = dataclasses.replace(LimitsConfig(), max_body_bytes=100_000)
    await rig.start_router(router_config(tmp_path, limits=limits))
    worker = await rig.add_worker("w0")
    conn = await RawHttp.open(rig.router.public_port)
    try:
        conn.send(b"POST /upload HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 50_000
        for _ in range(4):  # 200,000 bytes in four chunks, as they would stream
            conn.send(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            await asyncio.sleep(0.01)
        conn.send(b"0\r\n\r\n")
        status, _, body = await conn.read_reply()
    finally:
        conn.close()
    assert status == 413 and json.loads(body)["error"] == "payload_too_large"
    assert worker.seen == []  # the worker never got a complete request
