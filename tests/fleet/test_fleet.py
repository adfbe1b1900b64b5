"""Several real router processes on one redis-server (design §10), with no fault.

The fleet comes up (every router registered, its workers live, the membership shown by
`/admin/routers`), a client that picks a router at random for every call gets every
episode served by its own worker, and a SIGTERM writes the router's certificate.
"""

from __future__ import annotations

import signal
import time

import aiohttp
import pytest

from tests.fleet.rig import PREFIX, Fleet, FleetClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def test_the_fleet_comes_up_registered_and_every_router_sees_every_member(fleet: Fleet) -> None:
    routers = fleet.start(2)
    members = fleet.members()
    assert set(members) == {"r1", "r2"}
    for router in routers:
        epoch, _deadline, peer = members[router.router_id].split(" ")
        assert peer == f"{router.host}:{router.peer_port}"
        view = router.routers_view()
        assert (view["router_id"], view["registered"], view["epoch"]) == (
            router.router_id,
            True,
            int(epoch),
        )
        assert {m["router_id"]: m["alive"] for m in view["members"]} == {"r1": True, "r2": True}


async def test_a_sigterm_writes_the_routers_certificate_before_it_drains(fleet: Fleet) -> None:
    r1, _ = fleet.start(2)
    epoch = r1.epoch()
    assert fleet.certificates("r1") == {}
    r1.signal(signal.SIGTERM)
    assert r1.process.wait(10.0) == 0, r1.process.tail()
    (value,) = fleet.certificates("r1").values()
    assert list(fleet.certificates("r1")) == [epoch]
    assert value.split(" ")[0] == "sigterm"
    client = fleet.redis.client()
    assert client.ttl(f"{{{PREFIX}}}:dead:r1:{epoch}") > 0  # kept tombstone_ttl_s, not forever


async def test_every_episode_is_served_by_its_own_worker_from_any_router(
    fleet: Fleet, session: aiohttp.ClientSession
) -> None:
    fleet.start(2)
    client = FleetClient(fleet, session, seed=1)
    await client.create_many(16)
    started = time.monotonic()
    for _ in range(6):
        await client.round()
    print("\n" + client.summary(f"no fault, {time.monotonic() - started:.1f} s"))
    assert client.problems() == []
    assert {e.router for e in client.episodes} == {"r1", "r2"}
    for episode in client.episodes:
        assert episode.codes() == {(200, None): 6}, episode.answers
    hops = [a for e in client.episodes for a in e.answers if a.router != e.router]
    assert {a.router for a in hops} == {"r1", "r2"}  # each router forwarded its peer's
