"""Claims learned from unmodified servers' replies, shared by two routers (design §10).

Two real `RouterService`s on one real redis-server, each in front of its own static
`GymWorker` (an unmodified NeMo Gym-style server that never speaks on the control socket:
tests/app/test_learning.py). A seed reply's session is written into the directory before
the reply is relayed, so the other router forwards the session's calls to its holder; a
directory that does not take it in time gets the client 503, never a session nobody can
route.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from router.config import ClaimsConfig, DirectoryConfig, PeerConfig, StaticWorkerConfig
from tests.app.test_learning import FAST_PROBES, NEMO, GymWorker, Seeded, assert_tool_reply, seed
from tests.directory import conftest as directory_fixtures
from tests.directory.conftest import RedisServer
from tests.router_fixtures import Rig, open_rig, router_config, wait_until

pytestmark = pytest.mark.timeout(60)
redis_server = directory_fixtures.redis_server  # the directory tests' own redis-server fixture
LEASE_S = 1.5
PEER_SECRET = secrets.token_hex(16)


@asynccontextmanager
async def gym_router(
    tmp_path: Path,
    redis: RedisServer,
    router_id: str,
    claim_timeout_s: float = 2.0,
    learned_idle_ttl_s: float = 3600.0,
) -> AsyncIterator[tuple[Rig, GymWorker]]:
    folder = tmp_path / router_id
    folder.mkdir()
    async with open_rig(folder) as rig:
        worker = GymWorker(f"{router_id}-w0")
        await worker.serve()
        rig.stack.push_async_callback(worker.stop)
        config = router_config(
            folder,
            workers=(StaticWorkerConfig(worker.id, worker.url),),
            health=FAST_PROBES,
            sessions=NEMO,
            claims=ClaimsConfig(recovery_window_s=0.0, learned_idle_ttl_s=learned_idle_ttl_s),
            directory=DirectoryConfig(
                url=redis.url,
                router_id=router_id,
                lease_ttl_s=LEASE_S,
                lookup_timeout_ms=500,  # a deadline a loaded machine meets
                claim_timeout_s=claim_timeout_s,
            ),
            peer=PeerConfig("127.0.0.1", 0, None, PEER_SECRET),
        )
        service = await rig.start_router(config)
        assert service.fleet is not None and await service.fleet.wait_registered(5.0)
        await rig.wait_worker_state(worker.id, "live")
        yield rig, worker


async def test_a_seeded_cookie_session_is_routed_to_its_holder_through_the_other_router(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with (
        gym_router(tmp_path, redis_server, "r1") as (r1, w1),
        gym_router(tmp_path, redis_server, "r2") as (r2, _),
    ):
        seeded: Seeded = await seed(r1)
        assert seeded.worker == "r1-w0"
        owner = redis_server.client().hgetall(f"{{episode-router}}:owner:resources:{seeded.sid}")
        assert owner.get("r") == "r1" and owner.get("s") == "h"  # written before the reply
        for calls, rig in enumerate((r2, r1, r2), 1):
            reply = await rig.request("POST", "/tools/add", headers=seeded.with_cookie)
            assert_tool_reply(reply, seeded, calls)
        assert w1.sessions[seeded.sid] == 3
        closed = await r2.request("POST", "/close_session", headers=seeded.with_cookie)
        assert closed.status == 200  # forwarded to its holder, which ends it there

        async def ended_everywhere() -> bool:
            reply = await r2.request("POST", "/tools/add", headers=seeded.with_cookie)
            return reply.status == 410

        await wait_until(ended_everywhere, "the close to reach the directory")
        again = await r1.request("POST", "/tools/add", headers=seeded.with_cookie)
        again.assert_answer(410, "episode_ended", seeded.sid)


async def test_a_seed_whose_session_the_directory_cannot_take_is_503_not_relayed(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with gym_router(tmp_path, redis_server, "r1", claim_timeout_s=0.5) as (r1, w1):
        redis_server.pause()
        try:
            reply = await r1.request("POST", "/seed_session", data=b"{}")
        finally:
            redis_server.resume()
        reply.assert_answer(503, "recovering", None)
        assert reply.headers["Retry-After"] == "1"
        assert "Set-Cookie" not in reply.headers  # the session nobody could route stays unknown
        assert len(w1.sessions) == 1  # the worker ran the seed once: it was not tried again
        views = await r1.worker_views()
        assert views["r1-w0"]["state"] == "live"  # the worker is not blamed
        fresh = await seed(r1)  # the directory answers again: seeds work
        assert fresh.worker == "r1-w0"


async def test_a_learned_session_unused_for_the_idle_ttl_ends_on_every_router(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    async with (
        gym_router(tmp_path, redis_server, "r1", learned_idle_ttl_s=0.5) as (r1, _),
        gym_router(tmp_path, redis_server, "r2") as (r2, _),
    ):
        seeded = await seed(r1)
        assert (await r2.request("POST", "/tools/add", headers=seeded.with_cookie)).status == 200

        record = f"{{episode-router}}:owner:resources:{seeded.sid}"

        async def ended_in_the_directory() -> bool:  # read there: a call would use it
            return bool(redis_server.client().hget(record, "s") == "e")

        # Ended on r1 by its idle TTL, then in the directory: r2 answers it from there.
        await wait_until(ended_in_the_directory, "the idle session to end fleet-wide", 10.0)
        again = await r2.request("POST", "/tools/add", headers=seeded.with_cookie)
        again.assert_answer(410, "episode_ended", seeded.sid)
