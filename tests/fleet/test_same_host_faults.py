"""Faults of one router of a host (design §10, shape B) in a fleet of real processes:
the routers forward straight to each other's workers, and every answer is judged as in
test_router_faults.py (own worker's 200s, or what the fault allows; never a 200 after a
410, never a 401 for a live episode).

The routers share this machine's host and namespaces (`peer.direct` on): a straight
forward reaches the faulted router's workers, which are processes of their own and
outlive a pause of their router (and, as its orphans, a `kill -9` of it).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest

from tests.fleet.rig import (
    HEARTBEAT_S,
    LEASE_S,
    OWNER_UNREACHABLE,
    WORKER_EXITED,
    Answer,
    Fleet,
    unexpected,
)
from tests.fleet.test_router_faults import (
    PAUSED_ROUND_S,
    SLACK_S,
    first_410,
    only_410_after_the_first,
    rounds_until,
    warmed,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def straight(fleet: Fleet, router_id: str) -> float:
    """How many requests `router_id` forwarded straight to another router's worker."""
    return fleet.routers[router_id].sample("episode_router_peer_forwards_total", outcome="direct")


async def test_a_killed_routers_episodes_are_410_on_the_others_within_its_lease(
    fleet: Fleet, session: aiohttp.ClientSession
) -> None:
    fleet.same_host = True
    fleet.start(3)
    client = await warmed(fleet, session, seed=12)
    victims, others = client.of("r1"), client.not_of("r1")
    assert victims and others
    killed_at = time.monotonic()
    fleet.routers["r1"].kill9()
    bound = LEASE_S + HEARTBEAT_S + SLACK_S
    took = await rounds_until(client, victims, bound, killed_at)
    for _ in range(3):  # and they stay 410
        await client.round()
    print("\n" + client.summary(f"kill -9 of r1 (one host): all 410 after {took:.2f} s"))
    assert client.problems() == []
    # While its lease ran, its workers (its orphans now) answered straight, or their
    # address was gone and the hop to r1 found nobody: 503. Then 410, and only 410.
    assert unexpected(victims, {OWNER_UNREACHABLE, WORKER_EXITED}) == []
    assert unexpected(others, ()) == []
    assert all(only_410_after_the_first(e) for e in victims)
    assert took <= bound
    assert straight(fleet, "r2") + straight(fleet, "r3") > 0  # one host: no hop taken


async def test_a_router_paused_past_its_lease_has_its_episodes_410_never_a_200_after(
    fleet: Fleet, session: aiohttp.ClientSession
) -> None:
    # Its workers run on while it is paused: straight forwards reach them until its
    # lease may lapse, and never after; from then on, 410 everywhere, for good.
    fleet.same_host = True
    fleet.start(2)
    client = await warmed(fleet, session, seed=14)
    victims, others = client.of("r1"), client.not_of("r1")
    r1, r2 = fleet.routers["r1"], fleet.routers["r2"]
    r1.in_service = False
    paused_at = time.monotonic()
    r1.pause()
    in_flight: list[asyncio.Task[Answer]] = []
    bound = LEASE_S + HEARTBEAT_S + SLACK_S
    while not all(e.gone for e in victims) and time.monotonic() < paused_at + bound:
        in_flight += [asyncio.create_task(client.call(e, r2)) for e in victims if not e.gone]
        await client.round(others)
        await asyncio.sleep(PAUSED_ROUND_S)
    took = max(first_410(e) for e in victims) - paused_at
    assert took <= bound, took
    for _ in range(3):
        await asyncio.gather(*(client.call(e, r2) for e in victims))
    r1.resume()
    for task in in_flight:
        task.cancel()
    await asyncio.gather(*in_flight, return_exceptions=True)
    print("\n" + client.summary(f"SIGSTOP of r1 (one host): 410 after {took:.2f} s"))
    assert client.problems() == [], "\n".join(client.problems())
    assert unexpected(victims, {OWNER_UNREACHABLE, WORKER_EXITED}) == []
    assert unexpected(others, ()) == []
    assert all(only_410_after_the_first(e) for e in victims)
    # Straight while its lease ran: its workers answered r2's calls themselves.
    served = [a for e in victims for a in e.answers if a.status == 200 and a.at > paused_at]
    assert served, "no straight forward reached a paused router's worker"
    assert straight(fleet, "r2") > 0
