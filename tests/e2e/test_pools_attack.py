"""The pools attack of `attacks/pools.py`, scaled down to fit CI: one worker's pool of 8
held by 30 slow uploads, then 30 clients that never read a 2 MiB reply, then 30 that
never read a chunked one (its length unknown), then 30 that never read a small one,
while a steady client calls the worker's episodes on real router and worker processes.
Every steady call must be a 200, the worker live and never counted as failing. The full
run (300 attackers against the default pool of 256) is
`EPISODE_ROUTER_ATTACK=1 python attacks/pools.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .conftest import Launcher

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attacks.pools import run_attack  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CI_SCALE = 0.1  # 30 attackers
CI_POOL = 8  # well under the attackers, so an unguarded pool would be full


async def test_slow_clients_aimed_at_one_worker_leave_its_other_calls_answered(
    launcher: Launcher,
) -> None:
    report = await run_attack(launcher, scale=CI_SCALE, pool=CI_POOL, phase_s=1.5)

    print("\n" + report.render())
    assert report.passed, report.render()
    _, uploads, large, chunked, small = report.phases
    assert uploads.attackers == {"still uploading": 30}, report.render()
    assert large.attackers == {"not reading": 30}, report.render()
    assert chunked.attackers == {"not reading": 30}, report.render()
    assert small.attackers == {"not reading": 30}, report.render()


async def test_the_same_attack_lands_when_the_buffers_and_the_share_are_off(
    launcher: Launcher,
) -> None:
    # The attack is real: unguarded, the steady calls stop being 200s.
    report = await run_attack(launcher, scale=CI_SCALE, pool=CI_POOL, phase_s=1.5, unguarded=True)

    print("\n" + report.render())
    _, uploads, large, chunked, _ = report.phases
    assert not uploads.steady_ok, report.render()
    assert not large.steady_ok, report.render()
    assert not chunked.steady_ok, report.render()
