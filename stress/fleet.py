"""Fleet stress: thousands of episodes over three real routers on one redis-server (design §10).

Three router processes on 127.0.0.2-4, each spawning two demo workers, share a real
`redis-server` (started here, nothing persisted). Each episode starts on a router
picked at random (`POST /episodes`: its worker claims it, acknowledged once the
directory holds the owner record), then makes its calls (`add 1`), each on a router
picked at random, as a Kubernetes Service spreads requests: two thirds of them take
the peer hop to the owner's router. Every answer is judged by the fleet tests' client
(`tests/fleet/rig.py`): a 200 must come from the episode's own worker with its counter
exactly one further, and `misrouted` counts those served or refused by a worker that
does not hold the episode. No fault is made: the run passes when every call is its own
worker's 200 or, for at most 1% of them, a 503 `recovering` (a lookup past
`directory.lookup_timeout_ms` on a loaded machine, the contract's answer; counted and
printed with each router's lookup metrics, so a run shows how many).

    EPISODE_ROUTER_STRESS=1 python stress/fleet.py [--episodes 2000] [--calls 8] [--concurrency 64]

The variable keeps it from being started by accident. It prints misrouted (must be 0),
answers by code, the calls' p50/p99 latency and the wall time. Every process is started
here and stopped by its pid at the end (routers SIGTERM then SIGKILL, then the workers
they spawned), pass or fail; the logs stay in the printed folder when the run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from router.directory.settings import DEFAULT_LOOKUP_TIMEOUT_MS  # noqa: E402
from tests.directory.conftest import RedisServer  # noqa: E402
from tests.e2e.conftest import Launcher  # noqa: E402
from tests.fleet.rig import Fleet, FleetClient  # noqa: E402

GATE_ENV = "EPISODE_ROUTER_STRESS"
ROUTERS = 3
EPISODES = 2000
CALLS = 8
CONCURRENCY = 64  # episodes in flight at once
RUN_DEADLINE_S = 1800.0  # the whole run: a wedged fleet fails, it never hangs
SHOWN_PROBLEMS = 10
# At most this share of the calls may be 503 `recovering` (measured here: 0-18 of 16,000
# at 64 in flight with 50 ms lookups on a 2-core machine); past it the run fails.
RECOVERING_SHARE = 0.01
DIRECTORY_METRICS = (
    "episode_router_directory_lookups_total",
    "episode_router_directory_errors_total",
    "episode_router_peer_forwards_total",
)


@dataclass(slots=True)
class FleetReport:
    """What one run saw."""

    episodes: int
    calls: int
    wall_s: float = 0.0
    codes: Counter[str] = field(default_factory=Counter)
    misrouted: int = 0
    problems: list[str] = field(default_factory=list)
    problem_count: int = 0
    latencies_s: list[float] = field(default_factory=list)
    hops: int = 0  # calls answered by a router other than the episode's own
    # Each router's directory lookups and errors at the end: where a 503 came from.
    directory_lines: list[str] = field(default_factory=list)

    @property
    def unexpected(self) -> int:
        """Answers other than a 200 or a 503 `recovering` (a lookup past its deadline on a
        loaded machine: the contract's answer for a directory that did not answer)."""
        return self.codes.total() - self.codes["200"] - self.codes["503 recovering"]

    @property
    def passed(self) -> bool:
        made = self.episodes * self.calls
        recovering_ok = self.codes["503 recovering"] <= made * RECOVERING_SHARE
        fine = self.problem_count == 0 and self.unexpected == 0 and recovering_ok
        return self.codes.total() == made and fine

    def percentile_ms(self, share: float) -> float:
        if len(self.latencies_s) < 2:
            return 1000 * (self.latencies_s[0] if self.latencies_s else 0.0)
        cut = statistics.quantiles(self.latencies_s, n=100, method="inclusive")
        return 1000 * cut[round(share * 100) - 1]

    def render(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        made = self.codes.total()
        rate = made / self.wall_s if self.wall_s else 0.0
        codes = ", ".join(f"{code}: {count}" for code, count in sorted(self.codes.items()))
        lines = [
            f"fleet stress, {ROUTERS} routers: {verdict}",
            f"  {self.episodes} episodes x {self.calls} calls: {made} calls in {self.wall_s:.1f} s"
            f" ({rate:.0f}/s), {self.hops} through a peer hop",
            f"  misrouted: {self.misrouted}, problems: {self.problem_count},"
            f" other than 200 or 503 recovering: {self.unexpected}",
            f"  answers: {codes}",
            f"  latency p50 {self.percentile_ms(0.5):.1f} ms,"
            f" p99 {self.percentile_ms(0.99):.1f} ms",
            *(f"  {problem}" for problem in self.problems),
            *(f"  {line}" for line in self.directory_lines),
        ]
        return "\n".join(lines)


async def run_fleet_stress(
    fleet: Fleet, *, episodes: int, calls: int, concurrency: int = CONCURRENCY
) -> FleetReport:
    """Drives `episodes` episodes of `calls` calls each over the fleet's routers (already
    started), `concurrency` episodes at a time; raises TimeoutError past RUN_DEADLINE_S."""
    report = FleetReport(episodes, calls)
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    timeout = aiohttp.ClientTimeout(total=30)
    started = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        client = FleetClient(fleet, http, seed=int(started))

        async def one() -> None:
            async with gate:
                episode = await client.create()
                for _ in range(calls):
                    await client.call(episode)

        async with asyncio.timeout(RUN_DEADLINE_S):
            await asyncio.gather(*(one() for _ in range(episodes)))
        report.wall_s = time.monotonic() - started
        for router in fleet.routers.values():
            async with http.get(f"{router.admin_url}/metrics") as reply:
                text = await reply.text()
            report.directory_lines += [
                f"{router.router_id} {line}"
                for line in text.splitlines()
                if line.startswith(DIRECTORY_METRICS) and not line.endswith(" 0.0")
            ]
    for episode in client.episodes:
        for answer in episode.answers:
            report.codes[f"{answer.status} {answer.error or ''}".strip()] += 1
            report.latencies_s.append(answer.took_s)
            report.hops += answer.router != episode.router
            report.misrouted += answer.misrouted
            if answer.problem is not None:
                report.problem_count += 1
                if len(report.problems) < SHOWN_PROBLEMS:
                    report.problems.append(answer.problem)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=EPISODES)
    parser.add_argument("--calls", type=int, default=CALLS, help="calls per episode")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument(
        "--lookup-timeout-ms",
        type=int,
        default=DEFAULT_LOOKUP_TIMEOUT_MS,
        help="directory.lookup_timeout_ms (default: the router's own, 50)",
    )
    args = parser.parse_args(argv)
    if os.environ.get(GATE_ENV) != "1":
        print(
            f"set {GATE_ENV}=1 to run the fleet stress (it starts ten processes)", file=sys.stderr
        )
        return 2
    root = Path(tempfile.mkdtemp(prefix="episode-router-fleet-"))
    redis = RedisServer(root)
    launcher = Launcher(root)
    fleet = Fleet(launcher, redis)
    # The router's default, not the fleet tests' roomier one: this run is about the product.
    fleet.directory_settings["lookup_timeout_ms"] = args.lookup_timeout_ms
    try:
        redis.start()
        fleet.start(ROUTERS)
        run = run_fleet_stress(
            fleet, episodes=args.episodes, calls=args.calls, concurrency=args.concurrency
        )
        report = asyncio.run(run)
    finally:
        fleet.stop()
        launcher.stop_all()
        redis.stop()
    print(report.render())
    if report.passed:
        shutil.rmtree(root, ignore_errors=True)
        return 0
    print(f"process logs: {root}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
