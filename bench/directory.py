"""The claims directory's micro-benchmark: batched claims and lookups against a real Redis.

`python -m bench.directory [--quick] [--pairs N] [--concurrency C] [--json FILE]`

It starts its own `redis-server` (Debian's package) on a free loopback port with
nothing persisted, and stops it by its pid at the end. Through one `Directory`:

- claims: `C` tasks each claim a new key and release it (`claim_one` then
  `release_one`, batched per loop turn as the control socket will call them) until
  `N` pairs are done: pairs per second, this process's CPU per pair and
  redis-server's;
- lookups: `lookup` of 1, 16 and 256 keys (half held, half absent), one call after
  another: p50 and p99 latency in microseconds.

`--quick` shrinks the counts (CI; the figures are then only a smoke check). The
issue's target for claims is 20,000 pairs/s over one control connection.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from bench.launch import free_port
from bench.load import percentile, run_async
from bench.procstat import cpu_seconds
from router.directory import Directory, DirectorySettings, open_redis

START_TIMEOUT_S = 10.0  # redis-server answers PING well within this on a loaded machine
RUN_TIMEOUT_S = 120.0  # the whole run's deadline


@dataclass(frozen=True)
class DirectoryFigures:
    pairs: int
    concurrency: int
    pairs_per_s: float
    cpu_us_per_pair: float  # this process's user+system CPU: the router's side of it
    redis_cpu_us_per_pair: float  # redis-server's, from /proc/<pid>/stat
    lookup_us: dict[str, dict[str, float]]  # batch size -> p50, p99


@contextmanager
def redis_server() -> Iterator[tuple[int, int]]:
    """A redis-server of our own on a free loopback port; yields its port and pid."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench.directory needs Debian's `redis-server` package")
    folder = Path(tempfile.mkdtemp(prefix="er-bench-redis-"))
    port = free_port()
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(folder), "--logfile", str(folder / "redis.log")]
    process = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        yield port, process.pid
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


async def wait_for_ping(client: Redis) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            await client.ping()
            return
        except RedisConnectionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


async def claim_pairs(directory: Directory, pairs: int, concurrency: int) -> float:
    """Claim and release `pairs` new keys from `concurrency` tasks; seconds taken."""
    counter = iter(range(pairs))

    async def one_client(worker: int) -> None:
        for n in counter:  # shared: the tasks together take exactly `pairs` keys
            key = f"bench-{worker}-{n}-a0"
            await directory.claim_one("episode", key)
            await directory.release_one("episode", key)

    started = time.perf_counter()
    await asyncio.gather(*(one_client(w) for w in range(concurrency)))
    return time.perf_counter() - started


async def lookup_latencies(directory: Directory, size: int, rounds: int) -> dict[str, float]:
    keys = [("episode", f"look-{size}-{i}") for i in range(size)]
    await directory.claim(keys[::2])  # half held, half absent
    took: list[float] = []
    for _ in range(rounds):
        started = time.perf_counter()
        await directory.lookup(keys)
        took.append((time.perf_counter() - started) * 1e6)
    took.sort()
    return {"p50": percentile(took, 0.5), "p99": percentile(took, 0.99)}


async def measure(pairs: int, concurrency: int, rounds: int) -> DirectoryFigures:
    with redis_server() as (port, pid):
        client = open_redis(f"redis://127.0.0.1:{port}/0")
        try:
            await wait_for_ping(client)
            # Deadlines for a benchmark on a shared machine: a late answer is a figure,
            # not a failure.
            settings = DirectorySettings("bench", lookup_timeout_ms=2000, claim_timeout_s=10)
            directory = Directory(client, settings)
            await directory.load_scripts()
            await directory.register()
            await claim_pairs(directory, min(pairs, 2000), concurrency)  # warm up
            cpu, redis_cpu = time.process_time(), cpu_seconds(pid)
            seconds = await claim_pairs(directory, pairs, concurrency)
            cpu, redis_cpu = time.process_time() - cpu, cpu_seconds(pid) - redis_cpu
            lookups = {str(n): await lookup_latencies(directory, n, rounds) for n in (1, 16, 256)}
            await directory.close()
        finally:
            await client.aclose()
    per_pair = 1e6 / pairs
    return DirectoryFigures(
        pairs, concurrency, pairs / seconds, cpu * per_pair, redis_cpu * per_pair, lookups
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small counts, for CI")
    parser.add_argument("--pairs", type=int, default=100_000)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    pairs, rounds = (2_000, 50) if args.quick else (args.pairs, 2_000)
    figures = run_async(asyncio.wait_for(measure(pairs, args.concurrency, rounds), RUN_TIMEOUT_S))
    print(
        f"claims: {figures.pairs_per_s:,.0f} claim+release pairs/s over one Directory "
        f"({figures.pairs:,} pairs, {figures.concurrency} concurrent callers; "
        f"CPU per pair: {figures.cpu_us_per_pair:.1f} us here, "
        f"{figures.redis_cpu_us_per_pair:.1f} us in redis-server)"
        + (" [quick]" if args.quick else "")
    )
    for size, latency in figures.lookup_us.items():
        print(f"lookup of {size:>3} keys: p50 {latency['p50']:.0f} us, p99 {latency['p99']:.0f} us")
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(figures), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
