"""The directory client's own behaviour against a real redis-server: batching (counted by
Redis itself), deadlines on a paused server, NOSCRIPT after a flush or a restart, the
circuit breaker, the Unix socket, and the heartbeat loop."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from bench.launch import free_port
from router.directory import (
    BreakerState,
    CircuitBreaker,
    ClaimOutcome,
    ClaimVerdict,
    Directory,
    DirectoryTimeout,
    DirectoryUnavailable,
    HeartbeatLoop,
    LookupState,
    ReleaseVerdict,
    Standing,
    open_redis,
)
from tests.directory.conftest import RedisServer, directory_for, settings


async def test_concurrent_lookups_of_one_loop_turn_are_one_script_call(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    directory = await directory_for(redis_client)
    await directory.claim([("episode", "k3")])
    before = redis_server.script_calls()
    keys = [f"k{i}" for i in range(50)] + ["k3", "k3"]  # a key asked thrice is sent once
    looked = await asyncio.gather(*(directory.lookup_one("episode", k) for k in keys))
    assert redis_server.script_calls() - before == 1
    states = [each.result.state for each in looked]
    assert states.count(LookupState.HELD) == 3
    assert states[3] is LookupState.HELD and states[4] is LookupState.ABSENT


async def test_a_burst_past_the_batch_limit_is_cut_into_several_calls(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    # A deadline that a loaded machine meets: this is about the batches, not the time.
    directory = await directory_for(redis_client, batch_limit=100, lookup_timeout_ms=5000)
    before = redis_server.script_calls()
    await asyncio.gather(*(directory.lookup_one("episode", f"k{i}") for i in range(250)))
    assert redis_server.script_calls() - before == 3


async def test_concurrent_claims_and_releases_are_batched_the_same_way(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    directory = await directory_for(redis_client)
    other = await directory_for(redis_client, "r2")
    await other.claim([("episode", "taken")])
    keys = [f"k{i}" for i in range(40)] + ["taken"]
    before = redis_server.script_calls()
    outcomes = await asyncio.gather(*(directory.claim_one("episode", k) for k in keys))
    assert redis_server.script_calls() - before == 1
    assert outcomes[:40] == [ClaimOutcome(ClaimVerdict.CLAIMED)] * 40
    assert outcomes[40] == ClaimOutcome(ClaimVerdict.CONFLICT, "r2")
    before = redis_server.script_calls()
    verdicts = await asyncio.gather(*(directory.release_one("episode", k) for k in keys))
    assert redis_server.script_calls() - before == 1
    assert verdicts == [ReleaseVerdict.RELEASED] * 40 + [ReleaseVerdict.NOT_HOLDER]


async def test_a_paused_redis_fails_each_call_within_its_deadline_and_serves_again_after(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    directory = await directory_for(redis_client, claim_timeout_s=0.3)
    await directory.claim([("episode", "k1")])
    redis_server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(DirectoryTimeout):
            await directory.lookup_one("episode", "k1")  # 50 ms of its own
        lookup_took = time.monotonic() - started
        started = time.monotonic()
        with pytest.raises(DirectoryTimeout):
            await directory.heartbeat()
        heartbeat_took = time.monotonic() - started
        started = time.monotonic()
        claims = [directory.claim_one("episode", f"new{i}") for i in range(5)]
        for failed in await asyncio.gather(*claims, return_exceptions=True):
            assert isinstance(failed, DirectoryTimeout)
        claims_took = time.monotonic() - started
    finally:
        redis_server.resume()
    assert lookup_took < 1.0, lookup_took  # 50 ms asked; generous on a shared machine
    assert heartbeat_took < 1.5, heartbeat_took  # 300 ms asked
    assert claims_took < 1.5, claims_took  # 300 ms asked, one deadline for the batch
    looked = await directory.lookup_one("episode", "k1")
    assert looked.result.state is LookupState.HELD
    assert (await directory.heartbeat()).standing is Standing.OK


async def test_one_caller_past_its_deadline_leaves_the_others_of_its_batch_alone(
    redis_client: Redis,
) -> None:
    directory = await directory_for(redis_client)
    await directory.claim([("episode", "k1")])

    async def impatient() -> None:
        async with asyncio.timeout(0):  # gives up before the batch is even sent
            await directory.lookup_one("episode", "k1")

    patient = asyncio.ensure_future(directory.lookup_one("episode", "k1"))
    with pytest.raises(TimeoutError):
        await impatient()
    assert (await patient).result.state is LookupState.HELD


async def test_a_batch_cancelled_at_shutdown_still_answers_every_caller(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    directory = await directory_for(redis_client)
    redis_server.pause()  # the batch hangs in flight
    try:
        callers = [asyncio.ensure_future(directory.lookup_one("episode", "k1")) for _ in range(3)]
        await asyncio.sleep(0)  # the callers ask
        await asyncio.sleep(0)  # the flush sends the batch
        assert directory._lookups._tasks
        for task in list(directory._lookups._tasks):
            task.cancel()
        async with asyncio.timeout(10):
            answers = await asyncio.gather(*callers, return_exceptions=True)
        for failed in answers:
            assert isinstance(failed, DirectoryUnavailable), failed
    finally:
        redis_server.resume()


async def test_scripts_come_back_after_script_flush(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    directory = Directory(redis_client, settings())
    await directory.load_scripts()
    assert all(await redis_client.script_exists(*directory._scripts.sha_all()))
    await directory.register()
    await redis_client.script_flush()
    assert not any(await redis_client.script_exists(*directory._scripts.sha_all()))
    assert (await directory.heartbeat()).standing is Standing.OK  # NOSCRIPT, loaded, sent again
    assert await directory.claim([("episode", "k1")]) == (ClaimOutcome(ClaimVerdict.CLAIMED),)


async def test_scripts_come_back_after_a_restart_and_the_router_learns_it_was_lost(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    directory = await directory_for(redis_client)
    redis_server.restart()  # same port, nothing kept
    # The first call after a restart may find the old connection closed: one error, then
    # the client reconnects.
    for _ in range(3):
        try:
            beat = await directory.heartbeat()
            break
        except DirectoryUnavailable:
            continue
    assert beat.standing is Standing.LOST
    await directory.register()
    assert (await directory.heartbeat()).standing is Standing.OK


async def test_the_breaker_opens_on_an_unreachable_redis_and_refuses_at_once() -> None:
    now = [0.0]
    client = open_redis(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    directory = Directory(
        client, settings(), breaker=CircuitBreaker(failures=2, open_s=5), clock=lambda: now[0]
    )
    try:
        for _ in range(2):
            with pytest.raises(DirectoryUnavailable, match="cannot be reached"):
                await directory.register()
        assert directory.breaker.state(now[0]) is BreakerState.OPEN
        with pytest.raises(DirectoryUnavailable, match="circuit breaker is open"):
            await directory.register()
        now[0] = 5.0  # half-open: one trial goes out, fails, and opens it again
        with pytest.raises(DirectoryUnavailable, match="cannot be reached"):
            await directory.register()
        assert directory.breaker.state(now[0]) is BreakerState.OPEN
    finally:
        await client.aclose()


async def test_the_breaker_closes_again_once_redis_answers(redis_server: RedisServer) -> None:
    now = [0.0]
    redis_server.stop()
    client = open_redis(redis_server.url)
    directory = Directory(
        client, settings(), breaker=CircuitBreaker(failures=1, open_s=5), clock=lambda: now[0]
    )
    try:
        with pytest.raises(DirectoryUnavailable):
            await directory.register()
        assert directory.breaker.state(now[0]) is BreakerState.OPEN
        redis_server.start()
        with pytest.raises(DirectoryUnavailable, match="circuit breaker is open"):
            await directory.register()
        now[0] = 5.0
        await directory.register()  # the trial succeeds
        assert directory.breaker.state(now[0]) is BreakerState.CLOSED
    finally:
        await client.aclose()


async def test_a_claim_that_must_reach_a_replica_is_refused_by_a_primary_without_one(
    redis_client: Redis,
) -> None:
    directory = await directory_for(redis_client, min_replicas=1, claim_timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(DirectoryUnavailable, match="0 of 1 replicas"):
        await directory.claim([("episode", "k1")])
    assert time.monotonic() - started < 1.5  # WAIT gave up within the claim's deadline
    assert directory.breaker.failures_in_a_row == 1


async def test_a_claim_that_must_reach_a_replica_is_acknowledged_once_it_did(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    redis_server.client().config_set("repl-diskless-sync-delay", 0)  # sync at once
    folder = Path(tempfile.mkdtemp(prefix="er-replica-"))
    replica = RedisServer(folder, extra=("--replicaof", "127.0.0.1", str(redis_server.port)))
    try:
        replica.start()
        sync = replica.client()
        for _ in range(100):  # up to 10 s for the first sync
            if sync.info("replication").get("master_link_status") == "up":
                break
            await asyncio.sleep(0.1)
        directory = await directory_for(redis_client, min_replicas=1)
        assert await directory.claim([("episode", "k1")]) == (ClaimOutcome(ClaimVerdict.CLAIMED),)
        assert sync.hget("{episode-router}:owner:episode:k1", "r") == "r1"  # already there
    finally:
        replica.stop()
        shutil.rmtree(folder, ignore_errors=True)


async def test_the_directory_is_reached_over_a_unix_socket(redis_server: RedisServer) -> None:
    client = open_redis(f"unix:{redis_server.socket}")
    try:
        directory = await directory_for(client)
        assert await directory.claim([("episode", "k1")]) == (ClaimOutcome(ClaimVerdict.CLAIMED),)
    finally:
        await client.aclose()


async def test_the_heartbeat_loop_keeps_the_lease_and_calls_back_once_fenced(
    redis_client: Redis,
) -> None:
    directory = await directory_for(redis_client, lease_ttl_s=0.6)
    fenced: asyncio.Queue[Standing] = asyncio.Queue()

    async def on_fenced(standing: Standing) -> None:
        await fenced.put(standing)

    loop = HeartbeatLoop(directory, on_fenced, interval_s=0.05)
    loop.start()
    try:
        for _ in range(500):  # up to 10 s
            if loop.beats >= 3:
                break
            await asyncio.sleep(0.02)
        assert loop.beats >= 3
        assert fenced.empty()
        await directory_for(redis_client)  # another incarnation of r1 takes over
        async with asyncio.timeout(10):
            assert await fenced.get() is Standing.FENCED
    finally:
        await loop.stop()


def test_a_heartbeat_slower_than_half_a_lease_is_refused() -> None:
    directory = Directory(open_redis("redis://127.0.0.1:1/0"), settings(lease_ttl_s=10))

    async def on_fenced(standing: Standing) -> None:
        raise AssertionError(standing)

    with pytest.raises(ValueError, match="half a lease"):
        HeartbeatLoop(directory, on_fenced, interval_s=5)
    assert HeartbeatLoop(directory, on_fenced)._interval_s == pytest.approx(10 / 3)
