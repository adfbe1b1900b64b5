"""Every path of the directory's scripts, against a real redis-server this test started.

Leases are short here (a few hundred milliseconds) so that lapses happen within a
test; the bounds on time are generous, as the machine is shared.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.asyncio import Redis

from router.directory import (
    ClaimOutcome,
    ClaimVerdict,
    Directory,
    DirectoryFenced,
    LookupState,
    Owner,
    OwnerState,
    OwnerWorker,
    ReleaseVerdict,
    Standing,
)
from router.directory.records import encode_worker
from tests.directory.conftest import RedisServer, directory_for, settings

EP = ("episode", "ep7-a0")


async def keep_beating(directory: Directory, seconds: float) -> None:
    """Heartbeats every 50 ms for `seconds`: the fleet stays heard, so no grace starts."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert (await directory.heartbeat()).standing is Standing.OK
        await asyncio.sleep(0.05)


async def test_register_bumps_the_epoch_and_certifies_the_one_it_replaces(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    first = Directory(redis_client, settings("r1"))
    one = await first.register()
    assert one.epoch >= one.fleet.now_ms  # a new counter starts from the directory's clock
    assert one.lease_deadline_ms == one.fleet.now_ms + 10_000
    second = Directory(redis_client, settings("r1", peer_address="http://127.0.0.1:2"))
    two = await second.register()
    assert two.epoch == one.epoch + 1
    sync = redis_server.client()
    assert sync.get(
        f"{{episode-router}}:dead:r1:{one.epoch}",
    ).startswith("replaced ")
    assert 0 < sync.pttl(f"{{episode-router}}:dead:r1:{one.epoch}") <= 3_600_000
    assert (await first.heartbeat()).standing is Standing.FENCED
    assert (await second.heartbeat()).standing is Standing.OK
    [member] = await second.members()
    assert (member.router_id, member.epoch, member.peer) == ("r1", two.epoch, "http://127.0.0.1:2")


async def test_heartbeat_extends_the_lease_of_the_current_epoch_only(redis_client: Redis) -> None:
    directory = await directory_for(redis_client)
    registered = await redis_client.hget("{episode-router}:members", "r1")
    await asyncio.sleep(0.01)
    beat = await directory.heartbeat()
    assert beat.standing is Standing.OK
    assert beat.lease_deadline_ms == beat.now_ms + 10_000
    assert int(str(registered).split()[1]) < beat.lease_deadline_ms
    directory.epoch = (directory.epoch or 0) - 1  # a stale epoch: never extended
    stale = await directory.heartbeat()
    assert (stale.standing, stale.lease_deadline_ms) == (Standing.FENCED, 0)


async def test_a_lease_that_lapsed_while_the_fleet_beat_is_fenced_and_swept(
    redis_client: Redis,
) -> None:
    paused = await directory_for(redis_client, "r1", lease_ttl_s=0.4)
    other = await directory_for(redis_client, "r2", lease_ttl_s=0.4)
    assert await paused.claim([EP]) == (ClaimOutcome(ClaimVerdict.CLAIMED),)
    await keep_beating(other, 0.8)  # r1 is silent for two of its leases
    assert (await other.lookup_one(*EP)).result.state is LookupState.DEAD
    assert (await paused.heartbeat()).standing is Standing.FENCED
    with pytest.raises(DirectoryFenced, match="fenced"):
        await paused.claim([("episode", "new-a0")])
    report = await other.sweep()
    assert (report.declared_dead, report.expired) == (1, 1)
    assert [m.router_id for m in await other.members()] == ["r2"]
    ttl = await redis_client.pttl("{episode-router}:owner:episode:ep7-a0")
    assert 0 < ttl <= 3_600_000  # the record stays, dead, for the tombstone TTL
    assert (await other.lookup_one(*EP)).result.state is LookupState.DEAD


async def test_a_fleet_nobody_could_reach_for_a_lease_fences_nobody(redis_client: Redis) -> None:
    """An outage (every router's heartbeat missing): every lease lapsed, and each router
    gets a whole lease to check in once the directory answers again."""
    one = await directory_for(redis_client, "r1", lease_ttl_s=0.3)
    two = await directory_for(redis_client, "r2", lease_ttl_s=0.3)
    await one.claim([EP])
    await asyncio.sleep(0.7)  # nobody beats
    looked = await two.lookup_one(*EP)
    assert looked.result.state is LookupState.HELD  # not declared dead: the grace
    assert looked.fleet.grace_until_ms > looked.fleet.now_ms
    assert (await two.sweep()).declared_dead == 0
    assert (await one.heartbeat()).standing is Standing.OK
    assert (await two.heartbeat()).standing is Standing.OK


async def test_claims_are_written_once_and_another_live_router_gets_conflict(
    redis_client: Redis,
) -> None:
    one = await directory_for(redis_client, "r1")
    two = await directory_for(redis_client, "r2")
    assert await one.claim([EP, ("episode", "ep8-a0")]) == (
        ClaimOutcome(ClaimVerdict.CLAIMED),
        ClaimOutcome(ClaimVerdict.CLAIMED),
    )
    assert await one.claim([EP]) == (ClaimOutcome(ClaimVerdict.CLAIMED),)  # idempotent
    assert await two.claim([EP, ("episode", "ep9-a0")]) == (
        ClaimOutcome(ClaimVerdict.CONFLICT, "r1"),
        ClaimOutcome(ClaimVerdict.CLAIMED),
    )
    record = await redis_client.hgetall("{episode-router}:owner:episode:ep7-a0")
    assert record == {"r": "r1", "e": str(one.epoch), "s": "h"}
    assert await redis_client.pttl("{episode-router}:owner:episode:ep7-a0") == -1  # held: no TTL
    assert await redis_client.smembers(f"{{episode-router}}:held:r1:{one.epoch}") == {
        "{episode-router}:owner:episode:ep7-a0",
        "{episode-router}:owner:episode:ep8-a0",
    }


async def test_a_fenced_router_writes_nothing(redis_client: Redis) -> None:
    old = await directory_for(redis_client, "r1")
    await directory_for(redis_client, "r1")  # a new incarnation of r1
    with pytest.raises(DirectoryFenced, match="fenced"):
        await old.claim([EP])
    with pytest.raises(DirectoryFenced, match="fenced"):
        await old.release([EP])
    assert await redis_client.exists("{episode-router}:owner:episode:ep7-a0") == 0


async def test_release_ends_the_record_for_the_tombstone_ttl_and_it_is_never_claimed_again(
    redis_client: Redis,
) -> None:
    one = await directory_for(redis_client, "r1", tombstone_ttl_s=60)
    two = await directory_for(redis_client, "r2")
    await one.claim([EP])
    assert await two.release([EP]) == (ReleaseVerdict.NOT_HOLDER,)
    assert await one.release([EP, ("episode", "never-a0")]) == (
        ReleaseVerdict.RELEASED,
        ReleaseVerdict.RELEASED,
    )
    assert await one.release([EP]) == (ReleaseVerdict.RELEASED,)  # idempotent
    assert 0 < await redis_client.pttl("{episode-router}:owner:episode:ep7-a0") <= 60_000
    assert await redis_client.exists("{episode-router}:owner:episode:never-a0") == 0
    looked = await two.lookup_one(*EP)
    assert looked.result.state is LookupState.ENDED
    assert looked.result.owner == Owner("r1", one.epoch or 0, OwnerState.ENDED)
    assert await one.claim([EP]) == (ClaimOutcome(ClaimVerdict.ENDED),)
    assert await two.claim([EP]) == (ClaimOutcome(ClaimVerdict.ENDED),)
    assert await redis_client.scard(f"{{episode-router}}:held:r1:{one.epoch}") == 0


async def test_retire_certifies_the_router_dead_and_its_keys_stay_exited(
    redis_client: Redis,
) -> None:
    leaving = await directory_for(redis_client, "r1", tombstone_ttl_s=60, reap_chunk=10)
    staying = await directory_for(redis_client, "r2")
    keys = [("episode", f"ep{i}-a0") for i in range(25)]
    await leaving.claim(keys)
    epoch = leaving.epoch
    await leaving.retire("sigterm")  # 25 records, 10 a call: the loop runs three calls
    assert leaving.epoch is None
    cert = await redis_client.get(f"{{episode-router}}:dead:r1:{epoch}")
    assert str(cert).startswith("sigterm ")
    assert 0 < await redis_client.pttl(f"{{episode-router}}:dead:r1:{epoch}") <= 60_000
    for kind, key in keys:
        assert 0 < await redis_client.pttl(f"{{episode-router}}:owner:{kind}:{key}") <= 60_000
    assert await redis_client.exists(f"{{episode-router}}:held:r1:{epoch}") == 0
    assert await redis_client.smembers("{episode-router}:reap") == set()
    batch = await staying.lookup(keys[:2])
    assert [r.state for r in batch.results] == [LookupState.DEAD, LookupState.DEAD]
    assert await staying.claim([keys[0]]) == (ClaimOutcome(ClaimVerdict.EXITED),)
    assert [m.router_id for m in await staying.members()] == ["r2"]
    with pytest.raises(DirectoryFenced):
        await leaving.heartbeat()  # retired: no epoch to beat for


async def test_one_lookup_answers_every_state_with_the_live_owners_peer(
    redis_client: Redis,
) -> None:
    one = await directory_for(redis_client, "r1")
    two = await directory_for(redis_client, "r2")
    dead = await directory_for(redis_client, "r3")
    await one.claim([("episode", "held"), ("episode", "ended")])
    await one.release([("episode", "ended")])
    await dead.claim([("episode", "orphan")])
    await dead.retire()
    keys = [("episode", k) for k in ("held", "ended", "orphan", "absent")]
    batch = await two.lookup(keys)
    assert [r.state for r in batch.results] == [
        LookupState.HELD,
        LookupState.ENDED,
        LookupState.DEAD,
        LookupState.ABSENT,
    ]
    assert batch.results[0].peer == "http://127.0.0.1:1/r1"
    assert batch.results[0].owner == Owner("r1", one.epoch or 0, OwnerState.HELD)
    assert batch.results[3].owner is None
    # The fleet record is younger than a lease: absent keys may not be written back yet.
    assert batch.fleet.repopulating(two.settings.lease_ms)
    assert not batch.fleet.repopulating(0)


async def test_a_directory_that_lost_its_data_answers_lost_and_epochs_keep_growing(
    redis_client: Redis,
) -> None:
    directory = await directory_for(redis_client, "r1")
    await directory.claim([EP])
    before = directory.epoch or 0
    await redis_client.flushall()  # what a restart without persistence leaves
    assert (await directory.heartbeat()).standing is Standing.LOST
    with pytest.raises(DirectoryFenced, match="lost"):
        await directory.claim([EP])
    looked = await directory.lookup_one(*EP)
    assert looked.result.state is LookupState.ABSENT
    assert looked.fleet.repopulating(directory.settings.lease_ms)  # 503, not 401
    again = await directory.register()
    assert again.epoch > before  # seeded from the directory's clock, not from 0
    assert await directory.claim([EP]) == (ClaimOutcome(ClaimVerdict.CLAIMED),)


async def test_a_router_restarted_within_its_lease_claims_its_keys_back(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    before = await directory_for(redis_client, "r1")
    other = await directory_for(redis_client, "r2")
    assert await before.claim([EP]) == (ClaimOutcome(ClaimVerdict.CLAIMED),)
    old_epoch = before.epoch
    after = await directory_for(redis_client, "r1", peer_address="http://127.0.0.1:3")  # restart
    assert (
        redis_server.client().get(f"{{episode-router}}:dead:r1:{old_epoch}").startswith("replaced ")
    )
    # Before the restarted router writes its table back, the key is its successor's:
    # forwarded there (never 410), and answered from its table.
    seen = (await other.lookup_one(*EP)).result
    assert seen.state is LookupState.HELD
    assert seen.owner == Owner("r1", after.epoch or 0, OwnerState.HELD)
    assert seen.peer == "http://127.0.0.1:3"
    await other.sweep()  # the replaced incarnation's records are given their TTL
    assert await after.claim([EP]) == (ClaimOutcome(ClaimVerdict.CLAIMED),)
    assert await redis_client.pttl("{episode-router}:owner:episode:ep7-a0") == -1  # kept
    assert await other.claim([EP]) == (ClaimOutcome(ClaimVerdict.CONFLICT, "r1"),)
    assert (await before.heartbeat()).standing is Standing.FENCED


async def test_a_router_restarted_after_its_lease_lapsed_does_not_get_its_keys_back(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    before = await directory_for(redis_client, "r1", lease_ttl_s=0.4)
    other = await directory_for(redis_client, "r2", lease_ttl_s=0.4)
    assert await before.claim([EP]) == (ClaimOutcome(ClaimVerdict.CLAIMED),)
    old_epoch = before.epoch
    await keep_beating(other, 0.8)  # r1 silent past its lease: anyone may have said 410
    after = await directory_for(redis_client, "r1", lease_ttl_s=0.4)
    certificate = redis_server.client().get(f"{{episode-router}}:dead:r1:{old_epoch}")
    assert certificate.startswith("lapsed ")
    assert (await other.lookup_one(*EP)).result.state is LookupState.DEAD
    assert await after.claim([EP]) == (ClaimOutcome(ClaimVerdict.EXITED),)


async def test_a_published_worker_is_handed_only_to_routers_of_the_same_host(
    redis_client: Redis, redis_server: RedisServer
) -> None:
    owner = await directory_for(redis_client, "r1", host="host-a")
    neighbour = await directory_for(redis_client, "r2", host="host-a")
    elsewhere = await directory_for(redis_client, "r3", host="host-b")
    unplaced = await directory_for(redis_client, "r4")  # no host named: never handed one
    await owner.publish_workers([("0/w0", encode_worker("http://127.0.0.1:9001", "b0"))])
    await owner.claim([EP, ("episode", "plain")], ["0/w0", ""])
    assert redis_server.client().hget("{episode-router}:owner:episode:ep7-a0", "w") == "0/w0"
    found = (await neighbour.lookup([EP, ("episode", "plain")])).results
    assert found[0].worker == OwnerWorker("http://127.0.0.1:9001", "b0")
    assert found[0].peer == "http://127.0.0.1:1/r1"  # its router's listener still named
    assert found[1].state is LookupState.HELD and found[1].worker is None  # names no worker
    for other in (elsewhere, unplaced):
        seen = (await other.lookup_one(*EP)).result
        assert seen.state is LookupState.HELD and seen.worker is None
    # Withdrawn (the worker was lost): the key goes through its router again.
    await owner.publish_workers([("0/w0", "")])
    assert (await neighbour.lookup([EP])).results[0].worker is None
    await owner.publish_workers([("0/w0", encode_worker("http://127.0.0.1:9001", "b0"))])
    assert (await neighbour.lookup([EP])).results[0].worker is not None
    # Its router's certificate deletes the whole table: nothing to hand out, ever.
    epoch = owner.epoch
    assert redis_server.client().exists(f"{{episode-router}}:workers:r1:{epoch}") == 1
    await owner.retire()
    assert redis_server.client().exists(f"{{episode-router}}:workers:r1:{epoch}") == 0
    assert (await neighbour.lookup([EP])).results[0].state is LookupState.DEAD
    owner.epoch = epoch  # as a router that has not heard of its certificate yet
    with pytest.raises(DirectoryFenced, match="fenced"):  # a dead one publishes nothing
        await owner.publish_workers([("0/w0", encode_worker("http://127.0.0.1:9001", "b0"))])
    assert redis_server.client().exists(f"{{episode-router}}:workers:r1:{epoch}") == 0


async def test_a_restarted_routers_keys_name_no_worker_until_it_claims_them_back(
    redis_client: Redis,
) -> None:
    # The successor's workers are other processes, even under the same references.
    before = await directory_for(redis_client, "r1", host="host-a")
    other = await directory_for(redis_client, "r2", host="host-a")
    await before.publish_workers([("0/w0", encode_worker("http://127.0.0.1:9001", "old"))])
    await before.claim([EP], ["0/w0"])
    after = await directory_for(redis_client, "r1", host="host-a")  # a restart
    await after.publish_workers([("0/w0", encode_worker("http://127.0.0.1:9001", "new"))])
    seen = (await other.lookup_one(*EP)).result
    assert seen.owner == Owner("r1", after.epoch or 0, OwnerState.HELD)
    assert seen.worker is None  # through the successor, whose table answers
    await after.claim([EP], ["0/w0"])  # claimed back by its new process
    assert (await other.lookup([EP])).results[0].worker == OwnerWorker(
        "http://127.0.0.1:9001", "new"
    )
