"""The stress run of `stress/stress.py`, scaled down to fit CI: nothing misrouted under load.

Two rigs at once on real processes: a router with four demo workers claiming episodes
over the control socket, and a router with four unmodified Starlette workers whose
cookie sessions it learns from seed replies. At CI_SCALE, 1,000 episodes make eight
calls each and 250 cookie sessions are verified, closed and refused after their close,
32 clients per rig at a time; every reply must be exactly the expected one, and both
routers must end with no claims and every worker live. The full run (4,000 episodes,
1,000 sessions) is `EPISODE_ROUTER_STRESS=1 python stress/stress.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .conftest import Launcher

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from stress.stress import expected_requests, run_stress  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CI_SCALE = 0.25  # about 12,000 requests: a quarter of the full run's counts


async def test_a_scaled_down_stress_run_misroutes_nothing(launcher: Launcher) -> None:
    report = await run_stress(launcher, scale=CI_SCALE)

    print("\n" + report.render())
    assert report.passed, report.render()
    made = (report.episodes.requests, report.sessions.requests)
    assert made == expected_requests(CI_SCALE), report.render()
