"""The control socket attacks of `attacks/control.py`, scaled down to fit CI.

A claims flood, a sync that never ends and connections that never finish a line before
hello, each against a router process of its own: the router must refuse past each
bound with the documented answer, stay within a small memory growth, and go on
answering a worker that behaves. The full run is
`EPISODE_ROUTER_ATTACK=1 python attacks/control.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .conftest import Launcher

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attacks.control import PINGS, run_attacks  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

CI_SCALE = 0.02  # 12,000 claims past a cap of 2,000; 12 sync messages; 6 connections
MiB = 1 << 20


async def test_the_control_socket_attacks_are_refused_at_their_bounds(launcher: Launcher) -> None:
    flood, sync, partial = await run_attacks(launcher, scale=CI_SCALE)
    print("\n" + "\n".join(attack.render() for attack in (flood, sync, partial)))

    assert flood.answers == {"ok": 2000, "too_many_claims": 10_000}
    # 12 messages of 1,000 keys against a cap of 2,000: every third one passes it, and
    # what the sync listed is dropped each time.
    assert sync.answers == {"ok": 8, "too_many_claims": 4}
    assert partial.answers == {"bad_request, then closed": 6}
    for attack in (flood, sync, partial):
        assert len(attack.ping_ms) == PINGS
        assert attack.rss_peak - attack.rss_before < 64 * MiB, attack.render()
