"""The request path of several routers on one directory (design §10), in-process.

Two real `RouterService`s share a real redis-server; each has its own echo workers on
loopback. A claim gets into the directory the way the router itself writes one (its
own `Directory`), so these tests are about what a router does with a key its table does
not know: the peer hop, the 410s, the 503s, and the peer listener's refusals.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import secrets
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.build import compiled
from router.config import Config, DirectoryConfig, PeerConfig
from router.directory import Directory, DirectorySettings, open_redis
from router.fleet import PEER_HEADER, sign
from router.service.router_service import RouterService
from router.worker import ControlError
from tests.directory import conftest as directory_fixtures
from tests.directory.conftest import RedisServer
from tests.router_fixtures import (
    TOKEN_HEADER,
    EchoWorker,
    Reply,
    episode_key,
    router_config,
    token,
    wait_until,
)

redis_server = directory_fixtures.redis_server  # the directory tests' own redis-server fixture
LEASE_S = 1.5  # the shortest the config takes: a fleet settles, a lease lapses, quickly
PEER_SECRET = secrets.token_hex(16)


def fleet_config(
    tmp_path: Path,
    redis: RedisServer,
    router_id: str,
    *,
    key_prefix: bool = False,
    same_host: bool = False,
) -> Config:
    """Router `router_id`'s config: one of two pods (shape A), or with `same_host` two
    routers of one host that forward straight to each other's workers (shape B)."""
    folder = tmp_path / router_id
    folder.mkdir()
    config = router_config(folder)
    return dataclasses.replace(
        config,
        # A lookup deadline a loaded machine meets (the default, 50 ms, is tested apart).
        directory=DirectoryConfig(
            url=redis.url,
            router_id=router_id,
            lease_ttl_s=LEASE_S,
            lookup_timeout_ms=500,
            key_prefix=key_prefix,
        ),
        peer=PeerConfig("127.0.0.1", 0, None, PEER_SECRET, direct=same_host),
    )


def an_episode(ep: str) -> tuple[str, str]:
    """A token for episode `ep` (attempt 0) and the key the router reads from it."""
    return token(ep), episode_key(ep, 0)


class Fleet:
    """Two routers, each with one echo worker, and an HTTP client."""

    def __init__(self, stack: AsyncExitStack, http: aiohttp.ClientSession) -> None:
        self.stack = stack
        self.http = http
        self.routers: dict[str, RouterService] = {}
        self.workers: dict[str, EchoWorker] = {}

    async def start(
        self,
        tmp_path: Path,
        redis: RedisServer,
        router_id: str,
        *,
        key_prefix: bool = False,
        same_host: bool = False,
        **sections: Any,
    ) -> RouterService:
        """Router `router_id` with one echo worker; `sections` replace whole sections
        of its config (`listen`, `sessions`)."""
        config = fleet_config(
            tmp_path, redis, router_id, key_prefix=key_prefix, same_host=same_host
        )
        service = RouterService(dataclasses.replace(config, **sections))
        await service.start()
        self.stack.push_async_callback(self._stop, service)
        assert service.fleet is not None
        assert await service.fleet.wait_registered(5.0)
        worker = EchoWorker(f"{router_id}-w0", service.config.control.socket)
        await worker.serve()
        self.stack.push_async_callback(worker.close)
        await worker.connect()
        self.routers[router_id] = service
        self.workers[router_id] = worker
        return service

    async def _stop(self, service: RouterService) -> None:
        if not service.handler.shutting_down:
            await service.stop()

    async def episode_on(self, router_id: str) -> tuple[str, str]:
        """A new episode claimed by `router_id`'s worker over the control socket (its
        claim acknowledged once the directory holds it): its token and key."""
        tok, key = an_episode(secrets.token_hex(6))
        await self.workers[router_id].claim(key)
        return tok, key

    async def call(self, router_id: str, tok: str | None, path: str = "/tools/get") -> Reply:
        port = self.routers[router_id].public_port
        headers = {TOKEN_HEADER: tok} if tok is not None else {}
        async with self.http.post(f"http://127.0.0.1:{port}{path}", headers=headers) as reply:
            return Reply(reply.status, reply.headers, await reply.read())

    async def call_peer(self, router_id: str, headers: dict[str, str]) -> Reply:
        port = self.routers[router_id].peer_port
        async with self.http.post(f"http://127.0.0.1:{port}/tools/get", headers=headers) as reply:
            return Reply(reply.status, reply.headers, await reply.read())


@contextlib.asynccontextmanager
async def two_routers(
    tmp_path: Path, redis_server: RedisServer, *, key_prefix: bool = False, same_host: bool = False
) -> AsyncIterator[Fleet]:
    async with AsyncExitStack() as stack:
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        stack.push_async_callback(http.close)
        fleet = Fleet(stack, http)
        for router_id in ("r1", "r2"):
            await fleet.start(
                tmp_path, redis_server, router_id, key_prefix=key_prefix, same_host=same_host
            )
        yield fleet


@pytest.fixture
async def fleet(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fleet]:
    async with two_routers(tmp_path, redis_server) as fleet:
        yield fleet


async def settled(fleet: Fleet) -> None:
    """Waits out the fleet's first lease: before it, an absent key is 503 recovering."""
    await asyncio.sleep(LEASE_S + 0.1)


async def test_a_peers_episode_is_forwarded_to_its_worker_and_stripped_of_the_hop(
    fleet: Fleet,
) -> None:
    tok, _ = await fleet.episode_on("r1")
    for router_id in ("r1", "r2", "r2", "r1"):
        reply = await fleet.call(router_id, tok)
        assert reply.status == 200, reply
        assert reply.worker == "r1-w0"
    seen = fleet.workers["r1"].seen[-1]
    # The hop is the routers' own: the worker never sees it, and it is told of the
    # client, not of the router that forwarded the request.
    assert all(name.lower() != PEER_HEADER.lower() for name, _ in seen.headers)
    connector = aiohttp.TCPConnector(local_addr=("127.0.0.5", 0))  # a client of its own address
    async with aiohttp.ClientSession(connector=connector) as client:
        port = fleet.routers["r2"].public_port
        url = f"http://127.0.0.1:{port}/tools/get"
        async with client.post(url, headers={TOKEN_HEADER: tok}) as reply:
            assert reply.status == 200
    seen = fleet.workers["r1"].seen[-1]
    forwarded_for = [value for name, value in seen.headers if name.lower() == "x-forwarded-for"]
    assert forwarded_for == ["127.0.0.5"]  # not the router that forwarded it (127.0.0.1)
    # Nor of the peer listener's address: the Host the client asked for.
    forwarded_host = [value for name, value in seen.headers if name.lower() == "x-forwarded-host"]
    assert forwarded_host == [f"127.0.0.1:{port}"]
    r2 = fleet.routers["r2"].fleet
    assert r2 is not None and r2.counts.peer_forwards == {"forwarded": 3}
    assert r2.counts.lookups == {"peer": 3}  # counted: one lookup, then the cached answer


async def test_a_forwarded_replys_location_names_the_router_the_client_asked(
    fleet: Fleet,
) -> None:
    # The owner's worker redirects to its own (private) address: the client, which
    # asked r2, is sent to r2's origin, never to r1's peer listener nor to the worker.
    tok, _ = await fleet.episode_on("r1")
    for router_id in ("r1", "r2", "r2"):  # the second r2 call from the cached answer
        port = fleet.routers[router_id].public_port
        async with fleet.http.post(
            f"http://127.0.0.1:{port}/redirect",
            headers={TOKEN_HEADER: tok},
            allow_redirects=False,
        ) as reply:
            assert reply.status == 302
            assert reply.headers["Location"] == f"http://127.0.0.1:{port}/next", router_id


async def test_concurrent_first_asks_share_a_lookup_and_are_settled_from_its_reply(
    fleet: Fleet,
) -> None:
    """Concurrent first asks on r2 are settled from the lookup reply's loop callback
    (FirstAsk: no task each) and counted once a key."""
    mine = [await fleet.episode_on("r1") for _ in range(4)]
    await settled(fleet)
    replies = await asyncio.gather(*(fleet.call("r2", tok) for tok, _ in mine))
    assert [(r.status, r.worker) for r in replies] == [(200, "r1-w0")] * 4
    r2 = fleet.routers["r2"].fleet
    assert r2 is not None and r2.counts.lookups == {"peer": 4}


@pytest.mark.skipif(compiled(), reason="patches a method of the handler: interpreted only")
async def test_a_first_ask_whose_settling_fails_fails_its_own_connection_only(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One whose settling raises fails its own connection, as a failed handler would,
    and the other first asks of its batch are answered."""
    mine = [await fleet.episode_on("r1") for _ in range(4)]
    await settled(fleet)
    handler = fleet.routers["r2"].handler
    settle = handler.first_ask_answered
    failing = mine[0][1]

    def first_ask_answered(exchange: Any, kind: str, key: str, found: Any) -> None:
        if key == failing:
            raise RuntimeError("a bug in settling")
        settle(exchange, kind, key, found)

    monkeypatch.setattr(handler, "first_ask_answered", first_ask_answered)
    replies = await asyncio.gather(
        *(fleet.call("r2", tok) for tok, _ in mine), return_exceptions=True
    )
    assert isinstance(replies[0], aiohttp.ClientError)  # its connection was dropped
    assert [r.status for r in replies[1:] if isinstance(r, Reply)] == [200, 200, 200]
    monkeypatch.undo()
    assert (await fleet.call("r2", mine[0][0])).status == 200  # from the cached answer


async def test_an_absent_key_is_503_while_the_fleet_repopulates_then_401(fleet: Fleet) -> None:
    unknown, key = an_episode("never-claimed")
    first = await fleet.call("r2", unknown)
    # The fleet record is younger than a lease: an absent key may be one not written back.
    first.assert_answer(503, "recovering", key)
    assert first.headers["Retry-After"] == "1"
    await settled(fleet)
    later = await fleet.call("r2", unknown)
    later.assert_answer(401, "unknown_episode", key)


async def test_an_episode_released_on_its_router_is_410_ended_on_every_router(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    tok, key = await fleet.episode_on("r1")
    await fleet.workers["r1"].release_key(key)
    (await fleet.call("r1", tok)).assert_answer(410, "episode_ended", key)

    async def ended_in_the_directory() -> bool:
        record = redis_server.client().hget(f"{{episode-router}}:owner:episode:{key}", "s")
        return bool(record == "e")

    await wait_until(ended_in_the_directory, "the release to reach the directory")
    (await fleet.call("r2", tok)).assert_answer(410, "episode_ended", key)


async def test_a_router_that_stops_leaves_its_episodes_410_everywhere_at_once(
    fleet: Fleet,
) -> None:
    tok, key = await fleet.episode_on("r1")
    assert (await fleet.call("r2", tok)).status == 200
    started = time.monotonic()
    await fleet.routers["r1"].stop()  # SIGTERM: the certificate is written first
    reply = await fleet.call("r2", tok)
    reply.assert_answer(410, "worker_exited", key)
    assert time.monotonic() - started < 1.0 + fleet.routers["r1"].config.timeouts.shutdown_grace_s


async def test_a_live_owner_that_cannot_be_reached_is_503_then_410_once_its_lease_lapses(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    # A router registered at an address where nothing listens, then silent: its lease
    # runs for LEASE_S, during which its keys are 503 owner_unreachable.
    ghost = Directory(
        open_redis(redis_server.url),
        DirectorySettings(router_id="ghost", peer_address="127.0.0.1:9", lease_ttl_s=LEASE_S),
    )
    await ghost.register()
    tok, key = an_episode("ghostly")
    (outcome,) = await ghost.claim([("episode", key)])
    assert outcome.verdict.value == "ok"
    (await fleet.call("r2", tok)).assert_answer(503, "owner_unreachable", key)

    async def dead() -> bool:
        return (await fleet.call("r2", tok)).status == 410

    waited = await wait_until(dead, "the ghost's lease to lapse", timeout_s=LEASE_S * 3)
    assert waited <= LEASE_S + 1.0
    (await fleet.call("r1", tok)).assert_answer(410, "worker_exited", key)
    r2 = fleet.routers["r2"].fleet
    assert r2 is not None and r2.counts.peer_forwards.get("owner_unreachable", 0) >= 1


async def test_an_owner_that_retires_between_the_lookup_and_the_hop_is_410_not_503(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    # SIGTERM's certificate can land after another router's lookup (from Redis, not the
    # cache) named the owner, and before that router's hop arrives: the retired owner
    # answers 421. The directory is asked again, and its 410 is the answer.
    hops: list[bytes] = []

    async def retire_then_421(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        hops.append(head)
        length = next(
            (int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
             if line.startswith(b"content-length:")),
            0,
        )  # fmt: skip
        await reader.readexactly(length)
        await ghost.retire("sigterm")  # the certificate, as SIGTERM writes it first
        body = b'{"error":"not_owner","message":"not the incarnation the hop named"}'
        writer.write(
            b"HTTP/1.1 421 Misdirected Request\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(retire_then_421, "127.0.0.1", 0)
    async with server:
        address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        ghost = Directory(
            open_redis(redis_server.url),
            DirectorySettings(router_id="ghost", peer_address=address, lease_ttl_s=LEASE_S),
        )
        await ghost.register()
        tok, key = an_episode("retiring")
        (outcome,) = await ghost.claim([("episode", key)])
        assert outcome.verdict.value == "ok"
        (await fleet.call("r2", tok)).assert_answer(410, "worker_exited", key)
    assert len(hops) == 1  # never sent again
    r2 = fleet.routers["r2"].fleet
    assert r2 is not None and r2.counts.peer_forwards.get("not_owner", 0) == 0  # no 503


async def test_the_peer_listener_takes_only_signed_hops_for_this_incarnation(
    fleet: Fleet,
) -> None:
    tok, key = await fleet.episode_on("r1")
    r1 = fleet.routers["r1"].fleet
    assert r1 is not None
    base = {TOKEN_HEADER: tok}
    (await fleet.call_peer("r1", base)).assert_answer(403, "peer_refused", key)
    now_ms = round(time.time() * 1000)

    def hop(receiver: str, *, secret: str = PEER_SECRET, ts: int = now_ms, k: str = key) -> str:
        return sign(secret.encode(), "POST", "/tools/get", ("episode", k), "r2:1", receiver, ts)

    good = await fleet.call_peer("r1", {**base, PEER_HEADER: hop(r1.incarnation)})
    assert good.status == 200 and good.worker == "r1-w0"
    forged = await fleet.call_peer(
        "r1", {**base, PEER_HEADER: hop(r1.incarnation, secret="x" * 32)}
    )
    forged.assert_answer(403, "peer_refused", key)
    stale = await fleet.call_peer(
        "r1", {**base, PEER_HEADER: hop(r1.incarnation, ts=now_ms - 60_000)}
    )
    stale.assert_answer(403, "peer_refused", key)
    moved = await fleet.call_peer("r1", {**base, PEER_HEADER: hop(r1.incarnation, k="another")})
    moved.assert_answer(403, "peer_refused", key)  # signed for another key
    earlier = await fleet.call_peer("r1", {**base, PEER_HEADER: hop("r1:1")})
    earlier.assert_answer(421, "not_owner", key)
    assert r1.counts.peer_refused == {"signature": 4, "not_owner": 1}


async def test_a_paused_directory_keeps_local_hits_and_answers_misses_503(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    tok, key = await fleet.episode_on("r1")
    await settled(fleet)
    redis_server.pause()
    try:
        local = await fleet.call("r1", tok)
        assert local.status == 200 and local.worker == "r1-w0"
        started = time.monotonic()
        miss = await fleet.call("r2", tok)
        miss.assert_answer(503, "recovering", key)
        assert time.monotonic() - started < 1.5  # the lookup's own deadline (500 ms here)
    finally:
        redis_server.resume()

    async def forwarded_again() -> bool:
        return (await fleet.call("r2", tok)).status == 200

    await wait_until(forwarded_again, "the directory to answer again", timeout_s=5.0)


async def test_admin_routers_and_the_metrics_show_the_fleet(fleet: Fleet) -> None:
    service = fleet.routers["r2"]
    port = service.admin_port
    async with fleet.http.get(f"http://127.0.0.1:{port}/admin/routers") as reply:
        assert reply.status == 200
        view = await reply.json()
    assert view["router_id"] == "r2" and view["registered"] is True
    assert {m["router_id"] for m in view["members"]} == {"r1", "r2"}
    assert all(m["alive"] for m in view["members"])
    r1_peer = f"127.0.0.1:{fleet.routers['r1'].peer_port}"
    assert {m["peer"] for m in view["members"] if m["router_id"] == "r1"} == {r1_peer}
    tok, _ = await fleet.episode_on("r1")
    assert (await fleet.call("r2", tok)).status == 200
    async with fleet.http.get(f"http://127.0.0.1:{port}/metrics") as reply:
        text = await reply.text()
    assert 'episode_router_directory_lookups_total{result="peer"} 1.0' in text
    assert 'episode_router_peer_forwards_total{outcome="forwarded"} 1.0' in text
    assert "episode_router_directory_registered 1.0" in text
    assert "episode_router_directory_lookup_seconds_count 1.0" in text


async def test_a_router_paused_past_its_lease_is_fenced_and_never_serves_a_key_answered_410(
    fleet: Fleet,
) -> None:
    tok, key = await fleet.episode_on("r1")
    r1 = fleet.routers["r1"].fleet
    assert r1 is not None
    epoch = r1.directory.epoch
    await r1.heartbeat.stop()  # as if paused: its lease lapses, r2's sweep certifies it

    async def dead_elsewhere() -> bool:
        return (await fleet.call("r2", tok)).status == 410

    await wait_until(dead_elsewhere, "r1's lease to lapse", timeout_s=LEASE_S * 4)
    (await fleet.call("r2", tok)).assert_answer(410, "worker_exited", key)
    # Back from its pause, its next beat is answered FENCED: its claims turn 410 here too.
    assert await r1.heartbeat.beat_once() is False
    (await fleet.call("r1", tok)).assert_answer(410, "worker_exited", key)
    assert r1.counts.fenced == 1 and r1.counts.declared_exited == 1

    async def registered_again() -> bool:
        return r1.registered and r1.directory.epoch != epoch

    await wait_until(registered_again, "r1 to register under a new epoch")
    # Its workers run on: a new episode is served through either router.
    fresh, _ = await fleet.episode_on("r1")
    assert (await fleet.call("r2", fresh)).worker == "r1-w0"
    (await fleet.call("r1", tok)).assert_answer(410, "worker_exited", key)


async def test_a_peers_episode_is_forwarded_from_the_cached_answer_until_its_record_changes(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    tok, key = await fleet.episode_on("r1")
    assert (await fleet.call("r2", tok)).worker == "r1-w0"  # looked up once
    calls = redis_server.script_calls()
    relay = fleet.routers["r2"].forwarder
    on_the_lane = relay.lane_started
    for _ in range(5):
        assert (await fleet.call("r2", tok)).worker == "r1-w0"
    # Each hop from the cached answer went on the relay's lane (a pooled connection
    # to r1's peer listener was idle), its reply relayed from the callback.
    assert relay.lane_started - on_the_lane == 5
    # The owner's lease runs: no lookup for these (the heartbeats' and sweeps' calls
    # are the only scripts meanwhile, two a beat per router at most).
    lookups = fleet.routers["r2"].fleet
    assert lookups is not None
    assert lookups.counts.lookup_seconds_count == 1
    assert lookups.counts.lookups == {"peer": 6}
    assert redis_server.script_calls() - calls <= 8
    await fleet.workers["r1"].release_key(key)

    async def ended_there() -> bool:
        return (await fleet.call("r2", tok)).status == 410

    await wait_until(ended_there, "r2 to hear the release")
    (await fleet.call("r2", tok)).assert_answer(410, "episode_ended", key)


async def test_a_cached_peer_answer_whose_owner_stopped_is_dropped_and_asked_again(
    fleet: Fleet,
) -> None:
    tok, key = await fleet.episode_on("r1")
    assert (await fleet.call("r2", tok)).worker == "r1-w0"
    await fleet.routers["r1"].stop()  # SIGTERM: its certificate, its records' TTL
    statuses: list[int] = []

    async def exited_there() -> bool:
        reply = await fleet.call("r2", tok)
        statuses.append(reply.status)
        return reply.status == 410

    await wait_until(exited_there, "r2 to answer 410 for the stopped router's key")
    (await fleet.call("r2", tok)).assert_answer(410, "worker_exited", key)
    assert set(statuses) <= {410, 503}, statuses  # never a 401, never another worker


async def test_a_cached_peer_answer_whose_owner_retired_but_still_listens_is_410_at_once(
    fleet: Fleet,
) -> None:
    # SIGTERM's first step: the certificate, while the router drains with its listeners
    # up (its peer listener answers 421 now: it is no incarnation any more).
    tok, key = await fleet.episode_on("r1")
    r1, r2 = fleet.routers["r1"].fleet, fleet.routers["r2"].fleet
    assert r1 is not None and r2 is not None and r2.tracking is not None
    cache = r2.tracking.cache
    owner_key = r2.directory.layout.owner("episode", key)

    async def cached_there() -> bool:
        # r2 caches r1's answer from a call's lookup, unless an invalidation crossed
        # it or the channel was slow to be heard (a loaded machine): called again.
        assert (await fleet.call("r2", tok)).worker == "r1-w0"
        return cache.get(owner_key, asyncio.get_running_loop().time()) is not None

    await wait_until(cached_there, "r2 to cache r1's answer")
    held = cache.get(owner_key, asyncio.get_running_loop().time())
    assert held is not None and held.result.state.value == "held"
    await r1.stop()
    # Between processes, the request can come before r2 reads Redis's invalidation of
    # the record: its cached answer is put back as it was, to stand for that.
    cache.store([owner_key], [held], cache.generation, asyncio.get_running_loop().time())
    relay = fleet.routers["r2"].forwarder
    on_the_lane, handed_over = relay.lane_started, relay.lane_handovers
    (await fleet.call("r2", tok)).assert_answer(410, "worker_exited", key)
    assert r2.counts.peer_forwards.get("not_owner", 0) == 0  # no 503 on the way
    # The hop went on the lane, which handed r1's 421 over to be held back, unrelayed.
    assert (relay.lane_started - on_the_lane, relay.lane_handovers - handed_over) == (1, 1)


@contextlib.asynccontextmanager
async def unanswering_server() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A server on 127.0.0.1 that reads a request's head and closes the connection
    without a byte of reply: its host:port, and the heads it read."""
    heads: list[bytes] = []

    async def close_unanswered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            heads.append(await reader.readuntil(b"\r\n\r\n"))
        writer.close()

    server = await asyncio.start_server(close_unanswered, "127.0.0.1", 0)
    async with server:
        yield f"127.0.0.1:{server.sockets[0].getsockname()[1]}", heads


async def unanswered_then_410(
    fleet: Fleet, tok: str, key: str, heads: list[bytes], moved: Callable[[Any], Any]
) -> None:
    """r2's cached answer for r1's `key` made (by `moved`) to name a server that closes
    unanswered (`unanswering_server`, its `heads`): 502 while r1 lives, since the request
    may have run there; once r1 retired (its certificate, as SIGTERM writes it first),
    the directory's 410. Never sent again. Between processes a request can come before
    r2 reads Redis's invalidation: the moved answer is put back to stand for that."""
    r1, r2 = fleet.routers["r1"].fleet, fleet.routers["r2"].fleet
    assert r1 is not None and r2 is not None and r2.tracking is not None
    cache = r2.tracking.cache
    owner_key = r2.directory.layout.owner("episode", key)

    def store(answer: Any) -> None:
        cache.store([owner_key], [answer], cache.generation, asyncio.get_running_loop().time())

    store(moved(await r2.directory.lookup_one("episode", key)))
    (await fleet.call("r2", tok)).assert_answer(502, "upstream_error", key)
    assert len(heads) == 1
    stale = moved(await r2.directory.lookup_one("episode", key))
    await r1.stop()
    store(stale)
    (await fleet.call("r2", tok)).assert_answer(410, "worker_exited", key)
    assert len(heads) == 2


async def test_a_hop_whose_owner_closes_before_replying_is_502_or_410_once_the_owner_retired(
    fleet: Fleet,
) -> None:
    # A router that stops closes its idle peer connections after its certificate: a hop
    # decided from r2's cache just before the invalidation may meet that close, unread.
    tok, key = await fleet.episode_on("r1")
    assert (await fleet.call("r2", tok)).worker == "r1-w0"  # r2 looked it up
    async with unanswering_server() as (address, heads):

        def to_the_closer(found: Any) -> Any:
            assert found.result.state.value == "held" and found.result.peer is not None
            return dataclasses.replace(
                found, result=dataclasses.replace(found.result, peer=address)
            )

        await unanswered_then_410(fleet, tok, key, heads, to_the_closer)
    r2 = fleet.routers["r2"].fleet
    # The 502 is a failed hop; the 410 is the directory's answer, counted apart.
    assert r2 is not None
    assert (r2.counts.peer_forwards.get("failed"), r2.counts.peer_forwards.get("owner_gone")) == (
        1,
        1,
    )


@pytest.mark.parametrize("ending", ["close", "reset"])
async def test_a_hop_whose_owner_dies_as_it_reads_it_is_503_owner_unreachable_not_502(
    fleet: Fleet, ending: str
) -> None:
    # kill -9 of the owner as a hop reaches it: its kernel closes the peer connection
    # unanswered, or resets it (the request unread: the one a full bench.fleet run met),
    # its listener is gone, and the directory still names it live until its lease lapses.
    # The request may have run, so it is not sent again; the answer is the one every
    # request gets while that lease runs (503, then 410), not 502.
    tok, key = await fleet.episode_on("r1")
    assert (await fleet.call("r2", tok)).worker == "r1-w0"  # r2 looked it up
    heads: list[bytes] = []
    listening: list[asyncio.Server] = []

    async def dies_reading(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            heads.append(await reader.readuntil(b"\r\n\r\n"))
        listening[0].close()  # nothing listens any more, then the connection ends
        if ending == "reset":
            linger = struct.pack("ii", 1, 0)  # a close that sends RST
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        writer.close()

    server = await asyncio.start_server(dies_reading, "127.0.0.1", 0)
    listening.append(server)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    r2 = fleet.routers["r2"].fleet
    assert r2 is not None and r2.tracking is not None
    cache = r2.tracking.cache
    found = await r2.directory.lookup_one("episode", key)
    assert found.result.state.value == "held"
    moved = dataclasses.replace(found, result=dataclasses.replace(found.result, peer=address))
    owner_key = r2.directory.layout.owner("episode", key)
    cache.store([owner_key], [moved], cache.generation, asyncio.get_running_loop().time())
    (await fleet.call("r2", tok)).assert_answer(503, "owner_unreachable", key)
    assert len(heads) == 1  # sent once, never again
    counts = r2.counts.peer_forwards
    assert (counts.get("owner_unreachable"), counts.get("failed")) == (1, None)
    await server.wait_closed()
    assert (await fleet.call("r2", tok)).worker == "r1-w0"  # the directory's own answer


async def test_a_directory_that_lost_its_data_is_repopulated_from_the_routers_tables(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    tok, key = await fleet.episode_on("r1")
    await settled(fleet)
    assert (await fleet.call("r2", tok)).worker == "r1-w0"
    r1 = fleet.routers["r1"].fleet
    assert r1 is not None
    written_back = r1.counts.written_back
    redis_server.client().flushall()  # a restart without persistence, as the routers see it
    answers: list[int] = []

    async def forwarded_again() -> bool:
        # Until r1's next heartbeat finds itself lost and writes its table back, r2 may
        # still forward from the answer it had (r1 holds the key all along) or say 503.
        reply = await fleet.call("r2", tok)
        answers.append(reply.status)
        if reply.status == 503:
            reply.assert_answer(503, "recovering", key)  # never a wrong 401
        else:
            assert reply.status == 200 and reply.worker == "r1-w0"
        done = r1.counts.lost == 1 and r1.counts.written_back > written_back
        return done and reply.status == 200

    await wait_until(forwarded_again, "r1 to write its table back", timeout_s=LEASE_S * 4)
    assert set(answers) <= {200, 503}, answers
    assert (await fleet.call("r1", tok)).worker == "r1-w0"


async def test_a_router_starts_while_its_directory_is_down_and_registers_once_it_is_up(
    tmp_path: Path,
) -> None:
    redis = RedisServer(Path(tempfile.mkdtemp(prefix="er-redis-")))  # not started yet
    try:
        service = RouterService(fleet_config(tmp_path, redis, "r1"))
        await service.start()
        try:
            assert service.fleet is not None and not service.fleet.registered
            worker = EchoWorker("r1-w0", service.config.control.socket)
            await worker.serve()
            try:
                await worker.connect()
                async with aiohttp.ClientSession() as http:
                    port = service.public_port
                    unknown, _ = an_episode("early")
                    async with http.post(
                        f"http://127.0.0.1:{port}/tools/get", headers={TOKEN_HEADER: unknown}
                    ) as reply:
                        assert reply.status == 503  # recovering: never a wrong 401
                redis.start()
                assert await service.fleet.wait_registered(5.0)
                _, key = an_episode("later")
                await worker.claim(key)  # through the directory now
                record = redis.client().hget(f"{{episode-router}}:owner:episode:{key}", "r")
                assert record == "r1"
            finally:
                await worker.close()
        finally:
            await service.stop()
    finally:
        redis.stop()
        shutil.rmtree(redis.folder, ignore_errors=True)


async def test_a_router_restarted_within_its_lease_keeps_its_episodes_fleet_wide(
    fleet: Fleet, tmp_path: Path, redis_server: RedisServer
) -> None:
    tok, _ = await fleet.episode_on("r1")
    crashed = fleet.routers["r1"]
    assert crashed.fleet is not None
    # A crash, as the directory sees it: no certificate written (SIGTERM would write
    # one, and its episodes would be 410 at once). Its worker runs on and reconnects.
    crashed.fleet.directory.epoch = None
    await crashed.stop()
    # The default recovery window (the rig's routers have none): unknown keys are 503
    # while the workers reconnect and sync.
    claims = dataclasses.replace(crashed.config.claims, recovery_window_s=30.0)
    restarted = RouterService(dataclasses.replace(crashed.config, claims=claims))
    await restarted.start()
    fleet.stack.push_async_callback(restarted.stop)
    fleet.routers["r1"] = restarted
    assert restarted.fleet is not None and await restarted.fleet.wait_registered(5.0)
    answers: list[int] = []

    async def served_again() -> bool:
        reply = await fleet.call("r2", tok)
        answers.append(reply.status)
        return reply.status == 200 and reply.worker == "r1-w0"

    # Until the worker syncs with the restarted router, its episodes are 503 recovering
    # there (and on r2, forwarded to it): never 410, never 401.
    await wait_until(served_again, "the worker to sync with the restarted router", 10.0)
    assert set(answers) <= {200, 503}, answers
    assert (await fleet.call("r1", tok)).worker == "r1-w0"


@pytest.fixture
async def prefixed_fleet(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fleet]:
    """Two routers with `directory.key_prefix: true`."""
    async with two_routers(tmp_path, redis_server, key_prefix=True) as fleet:
        for service in fleet.routers.values():
            assert service.fleet is not None
            await service.fleet.refresh_members()  # each sees the other (a beat would)
        yield fleet


async def test_a_key_that_names_its_router_is_forwarded_with_no_lookup(
    prefixed_fleet: Fleet, redis_server: RedisServer
) -> None:
    fleet = prefixed_fleet
    r1, r2 = fleet.routers["r1"].fleet, fleet.routers["r2"].fleet
    assert r1 is not None and r2 is not None
    client = fleet.workers["r1"].client
    assert client is not None
    # The hello reply offered r1's incarnation; the bundled client mints keys with it.
    assert client.key_prefix == f"r1:{r1.directory.epoch}:"
    ep = client.mint_key()
    assert ep.startswith(client.key_prefix) and len(ep) == len(client.key_prefix) + 32
    tok, key = an_episode(ep)
    await fleet.workers["r1"].claim(key)
    calls = redis_server.script_calls()
    for _ in range(3):
        reply = await fleet.call("r2", tok)
        assert reply.status == 200, reply
        assert reply.worker == "r1-w0"
    # From the membership alone: no lookup, the hop as any other.
    assert r2.counts.lookup_seconds_count == 0 and r2.counts.lookups == {}
    assert r2.counts.prefix_routes == 3
    assert r2.counts.peer_forwards == {"forwarded": 3}
    assert redis_server.script_calls() - calls <= 8  # the heartbeats' and sweeps' only
    admin = fleet.routers["r2"].admin_port
    async with fleet.http.get(f"http://127.0.0.1:{admin}/metrics") as metrics:
        assert "episode_router_directory_prefix_routes_total 3.0" in await metrics.text()


async def test_a_worker_may_not_claim_a_key_that_names_another_router(
    prefixed_fleet: Fleet,
) -> None:
    fleet = prefixed_fleet
    r1 = fleet.routers["r1"].fleet
    assert r1 is not None
    client = fleet.workers["r2"].client
    assert client is not None
    key = episode_key(f"r1:{r1.directory.epoch}:{secrets.token_hex(8)}", 0)
    with pytest.raises(ControlError) as refused:
        await client.claim(key)
    assert refused.value.error == "conflict"
    assert refused.value.reply.get("holder") == "r1"
    # A key that merely looks prefixed (no member of that name) is claimed as any other.
    await client.claim(episode_key(f"user:42:{secrets.token_hex(8)}", 0))


async def test_a_prefixed_key_whose_router_stopped_is_410_at_once(prefixed_fleet: Fleet) -> None:
    fleet = prefixed_fleet
    client = fleet.workers["r1"].client
    assert client is not None
    tok, key = an_episode(client.mint_key())
    await fleet.workers["r1"].claim(key)
    assert (await fleet.call("r2", tok)).status == 200
    await fleet.routers["r1"].stop()  # its certificate is written, its listener closed
    # The hop from the prefix cannot reach r1: the directory is asked, and says dead.
    (await fleet.call("r2", tok)).assert_answer(410, "worker_exited", key)
    r2 = fleet.routers["r2"].fleet
    assert r2 is not None
    assert r2.counts.lookups == {"worker_exited": 1}
    # The incarnation was dropped from the prefix routes: the next call is looked up
    # (and answered from the cached dead answer), with no hop.
    (await fleet.call("r2", tok)).assert_answer(410, "worker_exited", key)
    assert r2.counts.prefix_routes == 2
