"""Two routers of one host (design §10, shape B) on a real redis-server: a key the other
router holds goes straight to its worker, with that worker's boot, and through that
router whenever the worker is not published (lost, exited) or is another process now.

The two routers share this machine's host and namespaces, as two router processes of
one container do, so each hands the other its workers (`peer.direct`, on by default;
this folder's pod-like tests turn it off).
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.config import Config, ListenConfig
from router.directory import OwnerWorker
from router.fleet import PEER_HEADER
from tests.app.test_learning import KINDS
from tests.directory import conftest as directory_fixtures
from tests.directory.conftest import RedisServer
from tests.fleet.test_request_path import (
    Fleet,
    an_episode,
    two_routers,
    unanswered_then_410,
    unanswering_server,
)
from tests.router_fixtures import BOOT_HEADER, TOKEN_HEADER, EchoWorker, wait_until

redis_server = directory_fixtures.redis_server  # the directory tests' own redis-server fixture


@pytest.fixture
async def fleet(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Fleet]:
    async with two_routers(tmp_path, redis_server, same_host=True) as fleet:
        yield fleet


def forwards(fleet: Fleet, router_id: str) -> dict[str, int]:
    link = fleet.routers[router_id].fleet
    assert link is not None
    return link.counts.peer_forwards


def worker_table(fleet: Fleet, redis: RedisServer, router_id: str) -> dict[str, str]:
    link = fleet.routers[router_id].fleet
    assert link is not None
    key = f"{{episode-router}}:workers:{router_id}:{link.directory.epoch}"
    table: dict[str, str] = redis.client().hgetall(key)
    return table


async def published(
    fleet: Fleet, redis: RedisServer, worker: EchoWorker, value: str, router_id: str = "r1"
) -> None:
    """Waits until `router_id`'s worker table holds `value` for `worker` ("": withdrawn)."""
    reference = f"0/{worker.id}"

    async def there() -> bool:
        return worker_table(fleet, redis, router_id).get(reference, "") == value

    await wait_until(there, f"{router_id}'s worker table to hold {value!r} for {worker.id}")


async def published_by(fleet: Fleet, redis: RedisServer, worker: EchoWorker) -> None:
    """Waits until `worker`'s router published it (its id starts with the router's)."""
    router_id = worker.id.split("-")[0]
    await published(fleet, redis, worker, f"{worker.url} {worker.boot}", router_id)


async def reached_straight(fleet: Fleet, redis: RedisServer) -> tuple[EchoWorker, str, str]:
    """An episode of r1's worker, once r1 published it, that r2 reached straight: the
    worker, the episode's token and its key."""
    worker = fleet.workers["r1"]
    await published(fleet, redis, worker, f"{worker.url} {worker.boot}")
    tok, key = await fleet.episode_on("r1")
    assert (await fleet.call("r2", tok)).status == 200
    assert forwards(fleet, "r2") == {"direct": 1}
    return worker, tok, key


async def not_straight(fleet: Fleet, key: str) -> None:
    """Waits until r2 has no answer for `key` that names r1's worker (Redis told it of
    the change to r1's worker table, or the answer is gone)."""
    link = fleet.routers["r2"].fleet
    assert link is not None

    async def dropped() -> bool:
        found = link.cached("episode", key)
        return found is None or found.result is None or found.result.worker is None

    await wait_until(dropped, "r2's cached answer naming the withdrawn worker to go")


async def test_a_peers_episode_goes_straight_to_its_worker_with_its_boot(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    worker = fleet.workers["r1"]
    await published(fleet, redis_server, worker, f"{worker.url} {worker.boot}")
    tok, key = await fleet.episode_on("r1")
    record = redis_server.client().hgetall(f"{{episode-router}}:owner:episode:{key}")
    assert record["w"] == "0/r1-w0"  # the claim names the process that holds it
    for router_id in ("r2", "r2", "r1", "r2"):
        reply = await fleet.call(router_id, tok)
        assert reply.status == 200, reply
        assert reply.worker == "r1-w0"
    # r2 forwarded its three itself (a lookup, then the cached answer): r1's peer
    # listener was never asked.
    assert forwards(fleet, "r2") == {"direct": 3}
    headers = {name.lower(): value for name, value in worker.seen[-1].headers}
    assert headers[BOOT_HEADER.lower()] == worker.boot
    assert PEER_HEADER.lower() not in headers
    port = fleet.routers["r2"].public_port
    assert headers["x-forwarded-host"] == f"127.0.0.1:{port}"  # the Host the client asked
    # A redirect to the worker's private address names the router the client asked.
    async with fleet.http.post(
        f"http://127.0.0.1:{port}/redirect", headers={TOKEN_HEADER: tok}, allow_redirects=False
    ) as redirected:
        assert redirected.status == 302
        assert redirected.headers["Location"] == f"http://127.0.0.1:{port}/next"


async def test_a_worker_its_router_lost_is_withdrawn_and_reached_through_that_router(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    # A second worker on r1 with a raw lease, which the test drops without a goodbye.
    r1 = fleet.routers["r1"]
    lost = EchoWorker("r1-w1", r1.config.control.socket)
    await lost.serve()
    try:
        await lost.connect("raw")
        await published(fleet, redis_server, lost, f"{lost.url} {lost.boot}")
        tok, key = an_episode(secrets.token_hex(6))
        await lost.claim(key)
        assert (await fleet.call("r2", tok)).worker == "r1-w1"
        assert forwards(fleet, "r2") == {"direct": 1}
        assert lost.lease is not None
        lost.lease.abort()  # its process lives on: lost, within the reconnect grace
        await published(fleet, redis_server, lost, "")
        await not_straight(fleet, key)  # r2 heard of it: its cached answer dropped
        # Not straight any more: r1, whose table still forwards to it within the grace.
        reply = await fleet.call("r2", tok)
        assert reply.status == 200 and reply.worker == "r1-w1"
        assert forwards(fleet, "r2") == {"direct": 1, "forwarded": 1}
        # Once the grace is over, r1 answers 410, and so does every router.

        async def exited() -> bool:
            return (await fleet.call("r2", tok)).status == 410

        await wait_until(exited, "the lost worker's episode to be 410", timeout_s=15)
        (await fleet.call("r2", tok)).assert_answer(410, "worker_exited", key)
        assert forwards(fleet, "r2")["direct"] == 1
    finally:
        await lost.close()


async def test_a_worker_that_exited_is_answered_by_its_router_not_blamed_on_another(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    worker, tok, key = await reached_straight(fleet, redis_server)
    await worker.close_http()  # its address refuses now; its control connection stays
    # Nothing reached a worker: r2 asks r1, whose forward is refused too (it retires
    # the worker): 410, never a 502 and never another worker.
    (await fleet.call("r2", tok)).assert_answer(410, "worker_exited", key)
    assert forwards(fleet, "r2") == {"direct": 1, "forwarded": 1}
    await published(fleet, redis_server, worker, "")  # and r1 withdrew it
    (await fleet.call("r2", tok)).assert_answer(410, "worker_exited", key)


async def test_another_process_at_the_workers_address_refuses_a_straight_forward(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    worker, tok, _ = await reached_straight(fleet, redis_server)
    # A new process took the address over before r1 heard of it (no hello yet): the
    # old boot r2 sends is not its own, and it refuses before running anything.
    await worker.close_http()
    worker.boot = secrets.token_hex(8)
    await worker.serve()
    handled = len(worker.seen)
    refused = await fleet.call("r2", tok)  # the bundled boot check's own answer
    assert refused.status == 410 and refused.json()["error"] == "worker_exited", refused
    assert len(worker.seen) == handled


async def test_routers_sharing_one_public_port_serve_every_episode_from_its_worker(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # Shape B whole: two router processes' listeners on one port (SO_REUSEPORT), the
    # kernel spreading new connections over them, as a client of the host sees it.
    async with AsyncExitStack() as stack:
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        stack.push_async_callback(http.close)
        fleet = Fleet(stack, http)
        first = await fleet.start(
            tmp_path, redis_server, "r1", same_host=True, listen=ListenConfig("127.0.0.1", 0, True)
        )
        shared = ListenConfig("127.0.0.1", first.public_port, True)
        second = await fleet.start(tmp_path, redis_server, "r2", same_host=True, listen=shared)
        assert second.public_port == first.public_port
        for worker in fleet.workers.values():
            await published_by(fleet, redis_server, worker)
        episodes = [await fleet.episode_on(router_id) for router_id in ("r1", "r2") * 4]
        url = f"http://127.0.0.1:{first.public_port}/tools/get"
        for round_ in range(5):
            for index, (tok, _key) in enumerate(episodes):
                # A connection of its own each: the kernel picks the listener anew.
                async with http.post(
                    url, headers={TOKEN_HEADER: tok, "Connection": "close"}
                ) as reply:
                    assert reply.status == 200, (round_, index, await reply.text())
                    assert (await reply.json())["worker"] == ("r1-w0", "r2-w0")[index % 2]
        # Both listeners took connections, and each sent its peer's episodes straight.
        assert forwards(fleet, "r1").get("direct", 0) > 0
        assert forwards(fleet, "r2").get("direct", 0) > 0
        assert "forwarded" not in forwards(fleet, "r1") | forwards(fleet, "r2")


async def test_a_request_whose_reply_teaches_the_owners_table_goes_through_the_owner(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    # With a cookie kind that learns from its seed and close routes, a request whose
    # reply may teach a claim or end one goes through the owner's peer listener: only
    # the owner's table may learn it. Every other request goes straight.
    episode_kind = Config().sessions[0]
    sessions = (episode_kind, KINDS["resources"])
    async with AsyncExitStack() as stack:
        http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        stack.push_async_callback(http.close)
        fleet = Fleet(stack, http)
        for router_id in ("r1", "r2"):
            await fleet.start(tmp_path, redis_server, router_id, same_host=True, sessions=sessions)
        await published_by(fleet, redis_server, fleet.workers["r1"])
        tok, _ = await fleet.episode_on("r1")
        assert (await fleet.call("r2", tok, "/tools/get")).worker == "r1-w0"
        assert forwards(fleet, "r2") == {"direct": 1}
        # A seed route: its reply may set a cookie the owner's table must learn.
        assert (await fleet.call("r2", tok, "/seed_session")).worker == "r1-w0"
        assert forwards(fleet, "r2") == {"direct": 1, "forwarded": 1}
        # A close route naming no session of its kind (no cookie) ends nothing: straight.
        assert (await fleet.call("r2", tok, "/close_session")).worker == "r1-w0"
        assert forwards(fleet, "r2") == {"direct": 2, "forwarded": 1}


async def test_a_worker_that_closes_unanswered_is_502_or_410_once_its_router_retired(
    fleet: Fleet, redis_server: RedisServer
) -> None:
    # A router that stops stops its workers after its certificate; a straight forward
    # decided from the other router's cache just before the invalidation may meet a
    # worker's close of its idle connection.
    _, tok, key = await reached_straight(fleet, redis_server)
    async with unanswering_server() as (address, heads):

        def to_the_closer(found: Any) -> Any:
            assert found.result.worker is not None
            closer = OwnerWorker(f"http://{address}", found.result.worker.boot)
            return dataclasses.replace(
                found, result=dataclasses.replace(found.result, worker=closer)
            )

        await unanswered_then_410(fleet, tok, key, heads, to_the_closer)
    assert forwards(fleet, "r2") == {"direct": 1, "failed": 1, "owner_gone": 1}
