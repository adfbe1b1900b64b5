"""The public edge's attack scripts (`attacks/heads.py`, `attacks/connections.py`), scaled
down to fit CI, against real router processes.

Heads: two waves of unfinished maximal heads hold a bounded amount of the router's memory,
the second adds nothing and the memory is back near the start once they close; oversized
heads get 431; pipelined heads behind a slow request are all answered. Connections: a
router with a low open-file limit, flooded with more connections than it has
descriptors, keeps its control socket and admin listener working, drops idle
keep-alive connections first, refuses the rest, and does not spin at EMFILE. The full
runs are `EPISODE_ROUTER_ATTACK=1 python attacks/<name>.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from .conftest import Launcher

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attacks.connections import run_connections  # noqa: E402
from attacks.heads import run_heads  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def test_unfinished_heads_in_waves_hold_bounded_memory_that_is_given_back(
    launcher: Launcher,
) -> None:
    report = run_heads(launcher, connections=100, oversized=10, pipelining=3)

    print("\n" + report.render())
    assert report.passed, report.render()
    assert report.held_metric[0] > 100 * 60_000  # every head was held, none refused


def test_more_connections_than_descriptors_leave_the_control_socket_and_admin_working(
    launcher: Launcher,
) -> None:
    report = run_connections(launcher, open_files=400, flood=600)

    print("\n" + report.render())
    assert report.passed, report.render()
    assert report.metrics_open <= report.limit
