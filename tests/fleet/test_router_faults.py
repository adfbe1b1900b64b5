"""Faults of one router in a fleet of real processes (design §10), every answer judged.

A client picks a router at random for every call, as a Kubernetes Service does; the
faulted router leaves the Service when it is faulted (its endpoint removed). Each test
asserts every episode's answers: its own worker's 200s, or what the fault allows, and
never a 200 after a 410 nor a 401 for a live episode (`FleetClient` judges each).
"""

from __future__ import annotations

import asyncio
import signal
import time

import aiohttp
import pytest

from tests.e2e.conftest import wait_until
from tests.fleet.rig import (
    HEARTBEAT_S,
    LEASE_S,
    OWNER_UNREACHABLE,
    WORKER_EXITED,
    Answer,
    Fleet,
    FleetClient,
    TrackedEpisode,
    unexpected,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

EPISODES = 12
SLACK_S = 1.5  # a loaded 2-core machine: scheduling, the lookup, the client's own round
ROUND_PAUSE_S = 0.1
PAUSED_ROUND_S = 0.25  # calls to a paused owner wait: a few, not hundreds


async def warmed(fleet: Fleet, session: aiohttp.ClientSession, seed: int) -> FleetClient:
    """A client with EPISODES episodes on random routers, each served twice already."""
    client = FleetClient(fleet, session, seed=seed)
    await client.create_many(EPISODES)
    for _ in range(2):
        await client.round()
    assert client.problems() == [], client.problems()
    return client


async def rounds_until(
    client: FleetClient, done: list[TrackedEpisode], within_s: float, since: float
) -> float:
    """Rounds of calls (every episode, random routers) until every one of `done` was
    answered 410; the seconds from `since` to the last of them."""
    deadline = since + within_s
    while not all(e.gone for e in done) and time.monotonic() < deadline:
        await client.round()
        await asyncio.sleep(ROUND_PAUSE_S)
    missing = [e.key for e in done if not e.gone]
    assert not missing, f"not 410 within {within_s:g} s: {missing}"
    return max(first_410(e) for e in done) - since


def first_410(episode: TrackedEpisode) -> float:
    answer = episode.first(WORKER_EXITED)
    assert answer is not None, episode.answers
    return answer.at


def only_410_after_the_first(episode: TrackedEpisode) -> bool:
    at = first_410(episode)
    return all(a.code == WORKER_EXITED for a in episode.answers if a.at >= at)


async def test_a_killed_routers_episodes_are_503_then_410_and_the_others_untouched(
    fleet: Fleet, session: aiohttp.ClientSession
) -> None:
    fleet.start(3)
    client = await warmed(fleet, session, seed=2)
    victims, others = client.of("r1"), client.not_of("r1")
    assert victims and others
    killed_at = time.monotonic()
    fleet.routers["r1"].kill9()
    bound = LEASE_S + HEARTBEAT_S + SLACK_S
    took = await rounds_until(client, victims, bound, killed_at)
    for _ in range(3):  # and they stay 410
        await client.round()
    print("\n" + client.summary(f"kill -9 of r1: its episodes all 410 after {took:.2f} s"))
    assert client.problems() == []
    assert unexpected(victims, {OWNER_UNREACHABLE, WORKER_EXITED}) == []
    assert unexpected(others, ()) == []
    assert all(only_410_after_the_first(e) for e in victims)
    # Its lease had not lapsed at the first calls: the peer refused, 503 with Retry-After.
    assert sum(e.codes()[OWNER_UNREACHABLE] for e in victims) >= len(victims)
    # The lease ran from its last renewal, at most a heartbeat before the kill.
    assert LEASE_S - HEARTBEAT_S - 0.2 < took <= bound


async def test_a_sigterm_makes_the_routers_episodes_410_on_the_others_within_a_second(
    fleet: Fleet, session: aiohttp.ClientSession
) -> None:
    fleet.start(2)
    client = await warmed(fleet, session, seed=3)
    victims, others = client.of("r1"), client.not_of("r1")
    r1 = fleet.routers["r1"]
    r1.in_service = False  # the endpoint leaves the Service as the pod terminates
    stopped_at = time.monotonic()
    r1.signal(signal.SIGTERM)
    took = await rounds_until(client, victims, 1.0, stopped_at)
    for _ in range(3):
        await client.round()
    assert await asyncio.to_thread(r1.process.wait, 10.0) == 0, r1.process.tail()
    await client.round()  # and after it exited
    print("\n" + client.summary(f"SIGTERM of r1: its episodes all 410 after {took:.2f} s"))
    assert client.problems() == []
    assert unexpected(victims, {WORKER_EXITED}) == []
    assert unexpected(others, ()) == []
    assert all(only_410_after_the_first(e) for e in victims)
    assert took < 1.0


async def test_a_router_paused_past_its_lease_is_410_on_the_others_and_comes_back_fenced(
    fleet: Fleet, session: aiohttp.ClientSession
) -> None:
    fleet.start(2)
    client = await warmed(fleet, session, seed=4)
    victims, others = client.of("r1"), client.not_of("r1")
    r1, r2 = fleet.routers["r1"], fleet.routers["r2"]
    epoch = r1.epoch()
    r1.in_service = False
    paused_at = time.monotonic()
    r1.pause()
    # Calls of its episodes through r2: those forwarded before its lease lapsed wait in
    # its listener's backlog until it resumes, so none is awaited here; a round of the
    # others' calls paces them.
    in_flight: list[asyncio.Task[Answer]] = []
    bound = LEASE_S + HEARTBEAT_S + SLACK_S
    while not all(e.gone for e in victims) and time.monotonic() < paused_at + bound:
        in_flight += [asyncio.create_task(client.call(e, r2)) for e in victims if not e.gone]
        await client.round(others)
        await asyncio.sleep(PAUSED_ROUND_S)
    took = max(first_410(e) for e in victims) - paused_at
    assert took <= bound, took
    await asyncio.sleep(max(0.0, paused_at + 2 * LEASE_S - time.monotonic()))
    r1.resume()
    # What r1 answers before its first heartbeat after SIGCONT is not judged here (see
    # the fault matrix); from its fencing on, its old episodes are 410 everywhere.
    for task in in_flight:
        task.cancel()
    await asyncio.gather(*in_flight, return_exceptions=True)
    for episode in victims:
        episode.answers = [a for a in episode.answers if a.at < paused_at + 2 * LEASE_S]

    def registered_again() -> bool:
        view = r1.admin("/admin/routers")
        now = view[1].get("epoch") if view is not None else None
        return isinstance(now, int) and now > epoch  # None while it registers

    await asyncio.to_thread(wait_until, "r1 registered again", registered_again, 10.0)
    # Its workers' control leases went silent while it was paused: they reconnect.
    await asyncio.to_thread(fleet.wait_ready, r1)
    r1.in_service = True
    newcomer = await client.create(r1)  # it serves new episodes under its new epoch
    for _ in range(4):
        await asyncio.gather(*(client.call(e, r) for e in victims for r in (r1, r2)))
        await client.round([*others, newcomer])
    print("\n" + client.summary(f"SIGSTOP of r1 past its lease: 410 after {took:.2f} s"))
    assert client.problems() == [], "\n".join(client.problems())
    assert unexpected(victims, {OWNER_UNREACHABLE, WORKER_EXITED}) == []
    assert unexpected([*others, newcomer], ()) == []
    assert all(e.answers[-1].code == WORKER_EXITED for e in victims)
    assert newcomer.codes() == {(200, None): 4}
    reasons = {value.split(" ")[0] for value in fleet.certificates("r1").values()}
    assert reasons & {"lapsed", "fenced"}, reasons
