"""A router that falls off the network (design §10): each router in a network namespace
of its own on a bridge, Redis on the bridge's address, and the link of one router taken
down for real (`ip link set down`: its packets are dropped, no connection is closed or
refused). Every answer the other router gives is judged by `FleetClient`.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.directory.conftest import RedisServer
from tests.e2e.conftest import Launcher, wait_until
from tests.fleet.netns import Network
from tests.fleet.rig import (
    HEARTBEAT_S,
    LEASE_S,
    OWNER_UNREACHABLE,
    RECOVERING,
    WORKER_EXITED,
    Fleet,
    FleetClient,
    TrackedEpisode,
    unexpected,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

EPISODES = 12
ROUND_PAUSE_S = 0.1
SLACK_S = 1.5


@pytest.fixture
def network() -> Iterator[Network]:
    net = Network()
    try:
        net.create()
        yield net
    finally:
        net.remove()


@pytest.fixture
def bridged_redis(network: Network) -> Iterator[RedisServer]:
    """A redis-server on the bridge's address too, where the namespaces reach it."""
    folder = Path(tempfile.mkdtemp(prefix="er-part-"))
    extra = ("--bind", f"127.0.0.1 {network.gateway}", "--protected-mode", "no")
    server = RedisServer(folder, extra)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def bridged_fleet(
    network: Network, bridged_redis: RedisServer, launcher: Launcher
) -> Iterator[Fleet]:
    # Teardown in reverse: the routers stop (launcher), then Redis, then the namespaces.
    fleet = Fleet(launcher, bridged_redis)
    fleet.placement = network.add
    try:
        yield fleet
    finally:
        fleet.stop()


async def test_a_router_that_falls_off_the_network_is_410_on_the_others_and_comes_back_fenced(
    network: Network, bridged_fleet: Fleet, session: aiohttp.ClientSession
) -> None:
    fleet = bridged_fleet
    url = f"redis://{network.gateway}:{fleet.redis.port}/0"
    fleet.start(2, directory_urls={"r1": url, "r2": url})
    client = FleetClient(fleet, session, seed=11)
    await client.create_many(EPISODES)
    for _ in range(2):
        await client.round()
    assert client.problems() == [], client.problems()
    r1, r2 = fleet.routers["r1"], fleet.routers["r2"]
    victims, others = client.of("r1"), client.of("r2")
    epoch = r1.epoch()
    r1.in_service = False  # the client cannot reach it either
    cut_at = time.monotonic()
    network.cut(0)
    # Calls of r1's episodes on r2: a hop on a connection r2 keeps to r1 waits (nothing
    # is refused); none is awaited, so the rounds go on past r1's lease.
    held: list[asyncio.Task[object]] = []
    deadline = cut_at + LEASE_S + HEARTBEAT_S + SLACK_S
    while not all(e.gone for e in victims) and time.monotonic() < deadline:
        held += [asyncio.create_task(client.call(e, r2)) for e in victims if not e.gone]
        await client.round(others)
        await asyncio.sleep(0.25)
    missing = [e.key for e in victims if not e.gone]
    assert not missing, f"not 410 on r2 within {deadline - cut_at:.1f} s: {missing}"
    gone_after = max(first_410(e) for e in victims) - cut_at
    mended_at = time.monotonic()
    network.mend(0)
    for task in held:  # what r1 answers the hops held over the cut is not judged here
        task.cancel()
    await asyncio.gather(*held, return_exceptions=True)
    for episode in victims:
        episode.answers = [a for a in episode.answers if a.at < mended_at]

    def registered_again() -> bool:
        view = r1.admin("/admin/routers")
        now = view[1].get("epoch") if view is not None else None
        return isinstance(now, int) and now > epoch

    await asyncio.to_thread(wait_until, "r1 fenced and registered again", registered_again, 15.0)
    r1.in_service = True
    newcomer = await client.create(r1)
    for _ in range(4):
        await asyncio.gather(*(client.call(e, r) for e in victims for r in (r1, r2)))
        await client.round([*others, newcomer])
    print("\n" + client.summary(f"r1 off the network: 410 on r2 after {gone_after:.2f} s"))
    assert client.problems() == [], "\n".join(client.problems())
    assert unexpected(victims, {OWNER_UNREACHABLE, WORKER_EXITED}) == []
    assert unexpected(others, {RECOVERING}) == []
    assert all(e.answers[-1].code == WORKER_EXITED for e in victims)
    assert all(e.answers[-1].status == 200 for e in others)
    assert newcomer.codes() == {(200, None): 4}
    reasons = {value.split(" ")[0] for value in fleet.certificates("r1").values()}
    assert reasons & {"lapsed", "fenced"}, reasons


def first_410(episode: TrackedEpisode) -> float:
    answer = episode.first(WORKER_EXITED)
    assert answer is not None, episode.answers
    return answer.at
