"""The fleet stress run of `stress/fleet.py`, scaled down to fit CI: three real routers on
one redis-server, 60 episodes of 4 calls, each call on a router picked at random, nothing
misrouted and every answer the episode's own worker's 200 (or, for a lookup past its
deadline on a busy machine, a 503 `recovering`: a few at most). The full run (2,000 episodes
of 8 calls) is `EPISODE_ROUTER_STRESS=1 python stress/fleet.py`.
"""

from __future__ import annotations

import pytest

from stress.fleet import run_fleet_stress
from tests.fleet.rig import Fleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

EPISODES, CALLS = 60, 4


async def test_a_small_fleet_stress_run_misroutes_nothing(fleet: Fleet) -> None:
    fleet.start(3)
    report = await run_fleet_stress(fleet, episodes=EPISODES, calls=CALLS, concurrency=16)
    print("\n" + report.render())
    assert report.passed, report.render()
    assert report.misrouted == 0
    # A lookup past its deadline on a busy CI machine is 503 recovering: a few at most.
    assert report.codes["200"] >= EPISODES * CALLS * 0.98, report.render()
    assert report.hops > EPISODES * CALLS // 3  # two thirds of them, about: hops happened
