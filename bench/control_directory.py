"""Claim+release pairs through the control socket and the claims directory (design §10).

`python -m bench.control_directory [--quick] [--pairs N] [--rounds R] [--collector C]
[--json FILE]`

It starts its own `redis-server` (Debian's package) on a free loopback port with
nothing persisted, and stops it by its pid at the end. In this process, a
`ControlServer` on a Unix socket in a temporary folder answers one pipelined
control connection (`bench.micro`'s client: at most 2,000 pairs unanswered, replies
counted, not decoded), `R` rounds of `N` pairs each, in turn:

- directory: the server's claim gate is a `FleetLink` on a real `Directory`, as in
  a router with `directory:` (each claim acknowledged once Redis holds its record,
  each release written in the background);
- local: no gate (the claims are the local table's alone), the same server
  otherwise: what the directory costs on top.

The garbage collector runs as in a router process (`--collector router`, the default:
`router.service.process.tune_gc` once everything is set up, so startup's objects are
frozen and gen 0 runs at GC_GEN0_THRESHOLD) or with CPython's defaults
(`--collector default`). The collector's passes were most of the CPU per pair with
the defaults, and each full pass walks the claim table, whose tombstones grow by one
a pair (every key claimed ends): with the defaults, the rate falls round by round.

Printed: the median pairs per second of each, and of the directory's rounds this
process's CPU per pair and redis-server's. The issue's target is 20,000 pairs/s
through the directory over one control connection. `--quick` shrinks the counts
(CI; the figures are then only a smoke check).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.directory import redis_server, wait_for_ping
from bench.figures import MiB
from bench.load import run_async
from bench.procstat import cpu_seconds
from router.control.server import ControlServer
from router.control.session import ControlPolicy
from router.core.machine import CoreSettings, RouterCore
from router.directory import Directory, DirectorySettings, open_redis
from router.fleet.link import FleetLink
from router.service.process import tune_gc
from router.tokens import new_nonce

RUN_TIMEOUT_S = 300.0  # the whole run's deadline
WINDOW_PAIRS = 2000  # pairs unanswered at most, as bench.micro's control figure
COLLECTORS = ("router", "default")


@dataclass(frozen=True)
class ControlDirectoryFigures:
    pairs: int
    rounds: int
    directory_pairs_per_s: float  # median of the rounds
    local_pairs_per_s: float  # median of the rounds, no gate
    cpu_us_per_pair: float  # this process (server and client), directory rounds, median
    redis_cpu_us_per_pair: float  # redis-server's, directory rounds, median
    directory_rounds: tuple[float, ...]
    local_rounds: tuple[float, ...]
    collector: str = "router"  # the garbage collector's settings (COLLECTORS)
    cpu_us_rounds: tuple[float, ...] = ()  # this process's CPU per pair, directory rounds


@contextlib.contextmanager
def collector_as(collector: str) -> Iterator[None]:
    """The garbage collector as `collector` says while the block runs; then as it was."""
    if collector not in COLLECTORS:
        raise ValueError(f"collector is one of {COLLECTORS}, not {collector!r}")
    if collector == "default":
        yield
        return
    thresholds, frozen = gc.get_threshold(), gc.get_freeze_count()
    tune_gc()
    try:
        yield
    finally:
        if not frozen:  # else what was frozen before stays so, with what this froze
            gc.unfreeze()
        gc.set_threshold(*thresholds)


def _policy() -> ControlPolicy:
    return ControlPolicy(
        own_uid=os.getuid(),
        allowed_uids=frozenset(),
        allowed_upstreams=frozenset(),
        secret=None,
        router_boot="bench-router",
    )


async def pipelined_pairs(path: str, pairs: int, label: str) -> tuple[float, int]:
    """Seconds for `pairs` claim+release pairs of new keys (`label` tells them apart
    from other rounds': the directory remembers an ended key) on one connection, at
    most WINDOW_PAIRS unanswered; and how many replies were ok. `bench.micro`'s client,
    but for the keys."""
    reader, writer = await asyncio.open_unix_connection(path, limit=4 * MiB)
    hello = {"op": "hello", "id": 0, "v": 1, "worker": "bench", "url": "http://127.0.0.1:9"}
    hello["boot"] = new_nonce()
    writer.write(json.dumps(hello).encode() + b"\n")
    await writer.drain()
    if b'"ok":true' not in await reader.readline():
        raise RuntimeError("the router refused the benchmark's hello")
    tag = label.encode()
    lines = [
        b'{"op":"claim","id":%d,"key":"%s-%d"}\n{"op":"release","id":%d,"key":"%s-%d"}\n'
        % (2 * i + 1, tag, i, 2 * i + 2, tag, i)
        for i in range(pairs)
    ]
    received = ok = 0
    progress = asyncio.Event()
    started = time.perf_counter()

    async def send() -> None:
        step = WINDOW_PAIRS // 2
        for start in range(0, pairs, step):
            while start - received // 2 > WINDOW_PAIRS:
                progress.clear()
                await progress.wait()
            writer.write(b"".join(lines[start : start + step]))
            await writer.drain()

    sender = asyncio.create_task(send(), name="control-directory-bench-send")
    while received < 2 * pairs:
        data = await reader.read(1 << 20)
        if not data:
            raise RuntimeError("the router closed the control connection")
        received += data.count(b"\n")
        ok += data.count(b'"ok":true')
        progress.set()
    elapsed = time.perf_counter() - started
    await sender
    writer.close()
    await writer.wait_closed()
    return elapsed, ok


async def one_round(
    folder: Path, pairs: int, link: FleetLink | None, core: RouterCore
) -> tuple[float, int]:
    """Seconds for `pairs` pairs over one new connection, and how many replies were ok."""
    server = ControlServer(core, _policy(), on_lease_lost=lambda worker: None, claim_gate=link)
    path = folder / f"control-{time.monotonic_ns()}.sock"
    await server.start(f"unix:{path}")
    try:
        return await pipelined_pairs(str(path), pairs, path.stem)
    finally:
        await server.close()


async def measure(pairs: int, rounds: int, collector: str = "router") -> ControlDirectoryFigures:
    directory_rates: list[float] = []
    local_rates: list[float] = []
    cpus: list[float] = []
    redis_cpus: list[float] = []
    with (
        redis_server() as (port, pid),
        tempfile.TemporaryDirectory(prefix="episode-router-ctl-dir-") as scratch,
    ):
        folder = Path(scratch)
        client = open_redis(f"redis://127.0.0.1:{port}/0")
        try:
            await wait_for_ping(client)
            # Deadlines for a benchmark on a shared machine: a late answer is a figure,
            # not a failure.
            settings = DirectorySettings("bench", lookup_timeout_ms=2000, claim_timeout_s=10)
            directory = Directory(client, settings)
            await directory.load_scripts()
            await directory.register()
            core = RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic())
            link = FleetLink(directory, core)
            await one_round(folder, min(pairs, 2000), link, core)  # warm up
            with collector_as(collector):  # as a router sets it once it is up
                for _ in range(rounds):  # interleaved: a slower stretch hits both
                    cpu, redis_cpu = time.process_time(), cpu_seconds(pid)
                    seconds, ok = await one_round(folder, pairs, link, core)
                    await asyncio.sleep(0)  # the releases of the last loop turn go out
                    await asyncio.gather(*link._tasks, return_exceptions=True)  # written
                    cpus.append(time.process_time() - cpu)
                    redis_cpus.append(cpu_seconds(pid) - redis_cpu)
                    if ok != 2 * pairs:
                        raise RuntimeError(f"only {ok} of {2 * pairs} replies were ok")
                    directory_rates.append(pairs / seconds)
                    seconds, ok = await one_round(folder, pairs, None, core)
                    if ok != 2 * pairs:
                        raise RuntimeError(f"only {ok} of {2 * pairs} replies were ok (local)")
                    local_rates.append(pairs / seconds)
            await directory.close()
        finally:
            await client.aclose()
    per_pair = 1e6 / pairs
    return ControlDirectoryFigures(
        pairs,
        rounds,
        statistics.median(directory_rates),
        statistics.median(local_rates),
        statistics.median(cpus) * per_pair,
        statistics.median(redis_cpus) * per_pair,
        tuple(directory_rates),
        tuple(local_rates),
        collector,
        tuple(cpu * per_pair for cpu in cpus),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, for CI")
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--collector", choices=COLLECTORS, default="router", help="the GC's settings"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    pairs, rounds = (2_000, 1) if args.quick else (args.pairs, args.rounds)
    figures = run_async(asyncio.wait_for(measure(pairs, rounds, args.collector), RUN_TIMEOUT_S))
    print(
        f"control socket + directory: {figures.directory_pairs_per_s:,.0f} claim+release "
        f"pairs/s over one connection (median of {rounds} x {pairs:,} pairs; CPU per pair "
        f"{figures.cpu_us_per_pair:.1f} us here, client included, "
        f"{figures.redis_cpu_us_per_pair:.1f} us in redis-server; collector: {args.collector})"
        + (" [quick]" if args.quick else "")
    )
    print(f"control socket, no directory: {figures.local_pairs_per_s:,.0f} pairs/s (same server)")
    print("rounds:", " ".join(f"{r:,.0f}" for r in figures.directory_rounds), "/",
          " ".join(f"{r:,.0f}" for r in figures.local_rounds))  # fmt: skip
    print("CPU us a pair, directory rounds:", " ".join(f"{c:.1f}" for c in figures.cpu_us_rounds))
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(figures), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
