"""The lookup cache: its rules without a loop, and its invalidation by a real redis-server
through client tracking (absent, ended and dead answers kept only while Redis can say
they changed; held ones besides only while the owner's lease runs)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from router.directory import (
    Directory,
    DirectoryTimeout,
    FleetView,
    KeyLookup,
    LookupResult,
    LookupState,
    open_redis,
)
from router.directory.cache import LookupCache
from router.directory.keys import KeyLayout
from router.directory.records import ABSENT, Owner, OwnerState, OwnerWorker
from router.directory.scripts import ScriptRunner
from router.directory.tracking import TrackedLookups
from tests.directory.conftest import RedisServer, directory_for, settings

SETTLED = FleetView(now_ms=50_000, since_ms=0, grace_until_ms=0)
YOUNG = FleetView(now_ms=50_000, since_ms=45_000, grace_until_ms=55_000)
HELD = LookupResult(LookupState.HELD, Owner("r2", 1, OwnerState.HELD), "peer", 5_000)
ENDED = LookupResult(LookupState.ENDED, Owner("r2", 1, OwnerState.ENDED))
DEAD = LookupResult(LookupState.DEAD, Owner("r2", 1, OwnerState.HELD))


def held(lease_left_ms: int) -> KeyLookup:
    owner = Owner("r2", 1, OwnerState.HELD)
    return KeyLookup(LookupResult(LookupState.HELD, owner, "peer", lease_left_ms), SETTLED)


def test_the_cache_keeps_absent_ended_and_dead_answers_until_they_change() -> None:
    cache = LookupCache(lease_ms=10_000)
    cache.switch_on()
    cache.heard(1e6)
    answers = [KeyLookup(ABSENT, SETTLED), KeyLookup(ENDED, SETTLED), KeyLookup(DEAD, SETTLED)]
    assert cache.store(["a", "e", "x"], answers, cache.generation, sent_at=0.0) == 3
    for owner_key, answer in zip(["a", "e", "x"], answers, strict=True):
        assert cache.get(owner_key, 1e6) == answer  # no lease bounds them
    # An absent record in a fleet still repopulating proves nothing: not kept.
    assert cache.store(["y"], [KeyLookup(ABSENT, YOUNG)], cache.generation, 0.0) == 0


def test_a_held_answer_is_kept_only_while_its_owners_lease_surely_runs() -> None:
    cache = LookupCache(lease_ms=10_000)
    cache.switch_on()
    cache.heard(100.0)
    assert cache.store(["h"], [held(5_000)], cache.generation, sent_at=100.0) == 1
    assert cache.get("h", 100.0) == held(5_000)
    cache.heard(104.7)  # the channel is pinged: heard all along
    assert cache.get("h", 104.79) == held(5_000)  # the lease less the 0.2 s margin
    cache.heard(104.8)
    assert cache.get("h", 104.8) is None  # past it: asked again, and dropped
    assert "h" not in cache
    # Nothing left of the lease past the margin (a grace keeps a lapsed one alive: 0):
    # asked every time.
    assert cache.store(["g", "s"], [held(0), held(150)], cache.generation, 104.8) == 0


def test_a_held_answer_is_dropped_when_its_hop_fails_or_its_record_changes() -> None:
    cache = LookupCache(lease_ms=10_000)
    cache.switch_on()
    cache.heard(0)
    cache.store(["h1", "h2"], [held(5_000), held(5_000)], cache.generation, 0.0)
    cache.forget("h1")
    cache.invalidate(["h2"])
    assert cache.get("h1", 0) is None and cache.get("h2", 0) is None and len(cache) == 0


def test_a_short_lease_keeps_a_tenth_of_itself_as_the_margin() -> None:
    cache = LookupCache(lease_ms=1_500)
    cache.switch_on()
    cache.store(["h"], [held(1_500)], cache.generation, 0.0)
    cache.heard(1.3)
    assert cache.get("h", 1.34) is not None and cache.get("h", 1.36) is None


def test_a_lookup_that_saw_an_invalidation_in_flight_stores_nothing() -> None:
    cache = LookupCache(lease_ms=10_000)
    cache.switch_on()
    cache.heard(0)
    sent_at = cache.generation
    cache.invalidate(["other"])  # arrived while the lookup was in flight
    assert cache.store(["a"], [KeyLookup(ABSENT, SETTLED)], sent_at, 0.0) == 0
    assert cache.get("a", 0) is None


def test_only_an_owner_records_invalidation_in_flight_keeps_a_lookup_from_being_stored() -> None:
    # The lookup script reads the membership and the fleet record too: every heartbeat
    # of every router rewrites them, and Redis says so. Those do not make an answer in
    # flight stale; an owner record's change does.
    layout = KeyLayout("fleet")
    cache = LookupCache(lease_ms=10_000, owner_prefix=layout.owner_prefix)
    cache.switch_on()
    cache.heard(0)
    a, b = layout.owner("episode", "a"), layout.owner("episode", "b")
    sent_at = cache.generation
    cache.invalidate([layout.members(), layout.fleet()])  # a heartbeat, in flight
    assert cache.store([a], [KeyLookup(ABSENT, SETTLED)], sent_at, 0.0) == 1
    assert cache.get(a, 0) is not None
    sent_at = cache.generation
    cache.invalidate([layout.members(), b])  # an owner record changed, in flight
    assert cache.store([b], [KeyLookup(ABSENT, SETTLED)], sent_at, 0.0) == 0
    cache.invalidate([layout.members()])
    assert cache.get(a, 0) is not None  # kept: only its own record's change drops it


def test_a_worker_tables_change_drops_the_answers_that_name_its_workers() -> None:
    # A held answer that names the owner's worker (shape B) depends on that router's
    # worker table: a worker lost or exited there must not be forwarded to straight.
    layout = KeyLayout("fleet")
    cache = LookupCache(
        lease_ms=10_000, owner_prefix=layout.owner_prefix, workers_prefix=layout.workers_prefix
    )
    cache.switch_on()
    cache.heard(0)
    worker = OwnerWorker("http://127.0.0.1:9001", "b0")
    r2_held = LookupResult(LookupState.HELD, Owner("r2", 1, OwnerState.HELD), "peer", 5_000)
    named = {
        "a": KeyLookup(dataclasses.replace(r2_held, worker=worker), SETTLED),  # r2:1's worker
        "b": KeyLookup(r2_held, SETTLED),  # r2:1's, no worker: through its router
        "c": KeyLookup(
            LookupResult(LookupState.HELD, Owner("r3", 1, OwnerState.HELD), "peer", 5_000, worker),
            SETTLED,
        ),
    }
    keys = {name: layout.owner("episode", name) for name in named}
    assert cache.store(list(keys.values()), list(named.values()), cache.generation, 0.0) == 3
    sent_at = cache.generation
    cache.invalidate([layout.workers("r2", 1)])
    assert cache.get(keys["a"], 0) is None
    assert cache.get(keys["b"], 0) is not None and cache.get(keys["c"], 0) is not None
    # And a lookup in flight across it stores nothing: it may have read the old table.
    assert cache.store([keys["a"]], [named["a"]], sent_at, 0.0) == 0


def test_the_cache_forgets_invalidated_keys_a_flush_and_everything_when_switched_off() -> None:
    cache = LookupCache(lease_ms=10_000)
    assert cache.store(["a"], [KeyLookup(ABSENT, SETTLED)], cache.generation, 0.0) == 0  # off
    cache.switch_on()
    cache.heard(0)
    cache.store(["a", "b"], [KeyLookup(ABSENT, SETTLED)] * 2, cache.generation, 0.0)
    cache.invalidate(["a"])
    assert cache.get("a", 0) is None and cache.get("b", 0) is not None
    cache.invalidate(None)
    assert len(cache) == 0
    cache.store(["b"], [KeyLookup(ABSENT, SETTLED)], cache.generation, 0.0)
    cache.switch_off()
    assert cache.get("b", 0) is None and len(cache) == 0


def test_the_cache_answers_only_while_its_channel_was_heard_lately() -> None:
    cache = LookupCache(lease_ms=10_000, max_silence_s=0.3)
    cache.switch_on()
    cache.heard(10.0)
    cache.store(["a"], [KeyLookup(ABSENT, SETTLED)], cache.generation, 0.0)
    assert cache.get("a", 10.29) is not None
    assert cache.get("a", 10.31) is None  # silent too long: a cut link, perhaps
    cache.heard(10.4)
    assert cache.get("a", 10.5) is not None


def test_the_cache_is_bounded() -> None:
    cache = LookupCache(lease_ms=10_000, max_entries=2)
    cache.switch_on()
    cache.heard(0)
    kept = cache.store(["a", "b", "c"], [KeyLookup(ABSENT, SETTLED)] * 3, cache.generation, 0.0)
    assert kept == 2 and cache.get("c", 0) is None


@pytest.fixture
async def tracked(
    redis_client: Redis, redis_server: RedisServer
) -> AsyncIterator[tuple[Directory, TrackedLookups]]:
    tracking = TrackedLookups(redis_server.url, LookupCache(lease_ms=0), ScriptRunner())
    directory = Directory(redis_client, settings("r1"), tracking=tracking)
    await directory.load_scripts()
    await directory.register()
    tracking.start()
    try:
        async with asyncio.timeout(10):
            await tracking.connected.wait()
        yield directory, tracking
    finally:
        await tracking.stop()


async def until(check: object, seconds: float = 5.0) -> bool:
    assert callable(check)
    for _ in range(int(seconds / 0.02)):
        if check():
            return True
        await asyncio.sleep(0.02)
    return False


async def test_an_absent_answer_is_served_from_the_cache_until_a_claim_invalidates_it(
    tracked: tuple[Directory, TrackedLookups], redis_client: Redis, redis_server: RedisServer
) -> None:
    directory, tracking = tracked
    first = await directory.lookup_one("episode", "k1")
    assert first.result.state is LookupState.ABSENT
    calls = redis_server.script_calls()
    again = await directory.lookup_one("episode", "k1")
    assert again == first and redis_server.script_calls() == calls  # no Redis command
    other = await directory_for(redis_client, "r2")
    await other.claim([("episode", "k1")])
    assert await until(lambda: "{episode-router}:owner:episode:k1" not in tracking.cache)
    assert (await directory.lookup_one("episode", "k1")).result.state is LookupState.HELD


async def test_held_and_ended_answers_are_kept_and_a_release_invalidates_the_held_one(
    tracked: tuple[Directory, TrackedLookups], redis_client: Redis, redis_server: RedisServer
) -> None:
    directory, tracking = tracked
    other = await directory_for(redis_client, "r2")
    await other.claim([("episode", "held"), ("episode", "ended")])
    await other.release([("episode", "ended")])
    first = await directory.lookup_one("episode", "held")
    assert first.result.state is LookupState.HELD
    # The owner's lease as the directory saw it: registered a moment ago.
    lease_ms = directory.settings.lease_ms
    assert lease_ms - 1_000 < first.result.lease_left_ms <= lease_ms
    assert (await directory.lookup_one("episode", "ended")).result.state is LookupState.ENDED
    calls = redis_server.script_calls()
    assert await directory.lookup_one("episode", "held") == first
    await directory.lookup_one("episode", "ended")
    assert redis_server.script_calls() == calls  # both from the cache
    await other.release([("episode", "held")])
    assert await until(lambda: "{episode-router}:owner:episode:held" not in tracking.cache)
    assert (await directory.lookup_one("episode", "held")).result.state is LookupState.ENDED


async def test_a_held_answer_of_a_retired_owner_is_invalidated_and_then_dead(
    tracked: tuple[Directory, TrackedLookups], redis_client: Redis
) -> None:
    directory, tracking = tracked
    other = await directory_for(redis_client, "r2")
    await other.claim([("episode", "k")])
    assert (await directory.lookup_one("episode", "k")).result.state is LookupState.HELD
    await other.retire("sigterm")  # its records get their tombstone TTL: a change
    assert await until(lambda: "{episode-router}:owner:episode:k" not in tracking.cache)
    assert (await directory.lookup_one("episode", "k")).result.state is LookupState.DEAD


async def test_losing_the_invalidation_channel_empties_the_cache_until_it_is_back(
    tracked: tuple[Directory, TrackedLookups], redis_server: RedisServer
) -> None:
    directory, tracking = tracked
    await directory.lookup_one("episode", "k1")
    assert len(tracking.cache) == 1
    redis_server.client().client_kill_filter(_type="pubsub")  # the channel, by Redis
    assert await until(lambda: not tracking.cache.on)
    assert len(tracking.cache) == 0
    async with asyncio.timeout(10):
        await tracking.connected.wait()  # reconnected, tracking on again
    assert tracking.cache.on
    await directory.lookup_one("episode", "k1")
    assert len(tracking.cache) == 1


async def test_a_redis_restart_empties_the_cache(
    tracked: tuple[Directory, TrackedLookups], redis_server: RedisServer
) -> None:
    directory, tracking = tracked
    await directory.lookup_one("episode", "k1")
    assert len(tracking.cache) == 1
    redis_server.restart()
    assert await until(lambda: len(tracking.cache) == 0)


async def test_losing_the_tracked_lookup_connection_empties_the_cache_too(
    tracked: tuple[Directory, TrackedLookups], redis_server: RedisServer
) -> None:
    directory, tracking = tracked
    await directory.lookup_one("episode", "k1")
    assert len(tracking.cache) == 1
    killer = redis_server.client()
    tracked_ids = [c["id"] for c in killer.client_list() if "t" in c["flags"]]  # t: tracking
    assert len(tracked_ids) == 1
    killer.client_kill_filter(_id=tracked_ids[0])
    assert await until(lambda: not tracking.cache.on)
    async with asyncio.timeout(10):
        await tracking.connected.wait()
    assert (await directory.lookup_one("episode", "k1")).result.state is LookupState.ABSENT


async def test_tracked_lookups_work_over_a_unix_socket(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    tracking = TrackedLookups(
        f"unix:{redis_server.socket}", LookupCache(lease_ms=0), ScriptRunner()
    )
    directory = Directory(redis_client, settings("r1"), tracking=tracking)
    await directory.register()
    tracking.start()
    try:
        async with asyncio.timeout(10):
            await tracking.connected.wait()
        await directory.lookup_one("episode", "k1")
        assert len(tracking.cache) == 1  # looked up on the tracked connection: kept
    finally:
        await tracking.stop()


async def test_one_loop_turns_lookups_go_out_as_one_call_on_the_tracked_connection(
    tracked: tuple[Directory, TrackedLookups], redis_server: RedisServer
) -> None:
    directory, tracking = tracked
    calls = redis_server.script_calls()
    keys = [f"turn-{n}" for n in range(50)]
    found = await asyncio.gather(*(directory.lookup_one("episode", key) for key in keys))
    assert [f.result.state for f in found] == [LookupState.ABSENT] * 50
    assert redis_server.script_calls() == calls + 1
    assert len(tracking.cache) == 50


async def test_a_tracked_lookup_after_a_script_flush_loads_the_script_and_answers(
    tracked: tuple[Directory, TrackedLookups], redis_client: Redis
) -> None:
    directory, tracking = tracked
    await redis_client.script_flush()
    found = await directory.lookup_one("episode", "after-flush")
    assert found.result.state is LookupState.ABSENT
    assert len(tracking.cache) == 1  # on the tracked connection, not the pooled client


def test_tracked_lookups_work_on_uvloop(redis_server: RedisServer) -> None:
    """The router runs on uvloop, whose transports are not asyncio.Transport's."""
    uvloop = pytest.importorskip("uvloop")

    async def body() -> None:
        client = open_redis(redis_server.url)
        tracking = TrackedLookups(redis_server.url, LookupCache(lease_ms=0), ScriptRunner())
        directory = Directory(client, settings("r1"), tracking=tracking)
        try:
            await directory.load_scripts()
            await directory.register()
            tracking.start()
            async with asyncio.timeout(10):
                await tracking.connected.wait()
            calls = redis_server.script_calls()
            first = await directory.lookup_one("episode", "on-uvloop")
            assert first.result.state is LookupState.ABSENT
            assert len(tracking.cache) == 1 and tracking.sessions == 1
            assert await directory.lookup_one("episode", "on-uvloop") == first
            assert redis_server.script_calls() == calls + 1  # the second from the cache
        finally:
            await tracking.stop()
            await client.aclose()

    uvloop.run(body())


async def test_a_silent_channel_stops_cached_answers_within_the_silence_bound(
    tracked: tuple[Directory, TrackedLookups], redis_server: RedisServer
) -> None:
    """A paused Redis stands in for a cut link: nothing closes, nothing arrives."""
    directory, tracking = tracked
    await directory.lookup_one("episode", "k1")
    assert len(tracking.cache) == 1
    redis_server.pause()
    try:
        await asyncio.sleep(0.6)  # twice the silence bound
        with pytest.raises(DirectoryTimeout):  # asked of Redis, not answered from the cache
            await directory.lookup_one("episode", "k1")
    finally:
        redis_server.resume()
    assert await until(lambda: directory_cache_answers(directory, tracking))


def directory_cache_answers(directory: Directory, tracking: TrackedLookups) -> bool:
    now = asyncio.get_running_loop().time()
    return tracking.cache.get("{episode-router}:owner:episode:k1", now) is not None


async def test_a_channel_silent_past_its_bound_is_made_again(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    tracking = TrackedLookups(
        redis_server.url, LookupCache(lease_ms=0), ScriptRunner(), reconnect_after_s=0.5
    )
    directory = Directory(redis_client, settings("r1"), tracking=tracking)
    await directory.register()
    tracking.start()
    try:
        async with asyncio.timeout(10):
            await tracking.connected.wait()
        assert tracking.sessions == 1
        redis_server.pause()  # the link goes silent; nothing closes
        try:
            assert await until(lambda: not tracking.connected.is_set(), 5)
        finally:
            redis_server.resume()
        assert await until(lambda: tracking.sessions == 2 and tracking.connected.is_set(), 10)
        await directory.lookup_one("episode", "k1")
        assert len(tracking.cache) == 1
    finally:
        await tracking.stop()
