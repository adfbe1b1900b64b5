"""A router whose lease lapsed never serves a key another router answered 410 (design §10).

A router paused past its lease, or cut off from Redis, stops serving the claims of its
own table once its lease, on its own clock, may have lapsed (503 `recovering`), also for
requests that waited in its listener's backlog, and is fenced when it reaches Redis
again: so the same key is never 200 on it after 410 on another. A peer's 421
`not_owner` (a hop that waited while it registered again) never reaches the client.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import aiohttp
import pytest

from tests.fleet.rig import (
    HEARTBEAT_S,
    LEASE_S,
    OWNER_UNREACHABLE,
    RECOVERING,
    WORKER_EXITED,
    Answer,
    Fleet,
    unexpected,
)
from tests.fleet.test_directory_faults import rounds_for
from tests.fleet.test_router_faults import (
    PAUSED_ROUND_S,
    ROUND_PAUSE_S,
    SLACK_S,
    first_410,
    warmed,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


async def test_a_router_paused_past_its_lease_keeps_its_episodes_410_after_it_resumes(
    fleet: Fleet, session: aiohttp.ClientSession
) -> None:
    fleet.start(2)
    client = await warmed(fleet, session, seed=4)
    victims, others = client.of("r1"), client.not_of("r1")
    r1, r2 = fleet.routers["r1"], fleet.routers["r2"]
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
    await asyncio.sleep(max(0.0, paused_at + 2 * LEASE_S - time.monotonic()))
    r1.resume()
    r1.in_service = True
    # Straight after SIGCONT, on the router that was paused as on the other.
    for _ in range(4):
        await asyncio.gather(*(client.call(e, r) for e in victims for r in (r1, r2)))
        await client.round(others)
        await asyncio.sleep(ROUND_PAUSE_S)
    held_back = await asyncio.gather(*in_flight)
    await asyncio.to_thread(fleet.wait_ready, r1)
    assert r1.routers_view()["registered"]
    newcomer = await client.create(r1)  # it serves new episodes under its new epoch
    for _ in range(3):
        await client.round()
    late = Counter(a.error or str(a.status) for a in held_back if a.at > paused_at + 2 * LEASE_S)
    print("\n" + client.summary(f"SIGSTOP of r1 past its lease: 410 after {took:.2f} s"))
    print(f"  calls held in its backlog, answered after SIGCONT: {dict(late)}")
    assert not late.get("not_owner")
    assert client.problems() == [], "\n".join(client.problems())
    assert unexpected(victims, {OWNER_UNREACHABLE, WORKER_EXITED, RECOVERING}) == []
    assert not any(a.status == 421 for e in victims for a in e.answers)
    # Straight after SIGCONT r1 is not registered yet: what it looks up is 503 recovering.
    assert unexpected([*others, newcomer], {RECOVERING}) == []
    assert took <= bound
    assert newcomer.codes() == {(200, None): 3}
    reasons = {value.split(" ")[0] for value in fleet.certificates("r1").values()}
    assert reasons & {"lapsed", "fenced"}, reasons


async def test_a_router_cut_off_from_redis_past_its_lease_never_serves_after_a_410(
    fleet: Fleet, session: aiohttp.ClientSession
) -> None:
    relay = fleet.relay("127.0.0.1", fleet.redis.port)
    fleet.start(2, directory_urls={"r1": f"redis://{relay.address}/0"})
    client = await warmed(fleet, session, seed=8)
    cut_at = time.monotonic()
    relay.cut()
    await rounds_for(client, 2 * LEASE_S + HEARTBEAT_S)
    mended_at = time.monotonic()
    relay.mend()
    await rounds_for(client, 2 * LEASE_S)
    print("\n" + client.summary(f"r1's link to redis cut {mended_at - cut_at:.1f} s"))
    for e in client.of("r1"):
        gone = e.first((410, "worker_exited"))
        last = max((a.at for a in e.answers if a.status == 200), default=0.0)
        if gone is not None:
            print(
                f"  {e.key}: first 410 at +{gone.at - cut_at:.2f} s via {gone.router},"
                f" last 200 at +{last - cut_at:.2f} s (mended at +{mended_at - cut_at:.2f} s)"
            )
    assert client.problems() == [], "\n".join(client.problems())
    assert (
        unexpected(client.of("r1"), {OWNER_UNREACHABLE, RECOVERING, (410, "worker_exited")}) == []
    )
    assert unexpected(client.of("r2"), {RECOVERING}) == []
