"""Micro-benchmarks: claim table, token parsing, control socket, streaming, idle connections.

`python -m bench.micro [--quick] [--only NAME,...] [--json FILE]`

Each prints the figure the issue's targets name:

- claims: RSS of 1,000,000 live claims (the key strings included) and the lookup
  time at 1,000 and at 1,000,000 claims (O(1): the two stay close);
- tokens: microseconds per `parse_token`, without and with HS256 verification;
- control: claim+release pairs per second over one pipelined control connection
  to a real `RouterService` in this process (the client's own work is counted
  in: a conservative figure);
- streaming: a 1 GiB request and a 1 GiB reply through a real router process,
  with the router's peak RSS growth over its RSS before the transfer;
- idle: 10,000 idle keep-alive client connections held by a real router
  process, with its RSS per connection.

`--quick` shrinks every size (100,000 claims, 64 MiB streams, 500 connections)
for CI and says so; the targets are only judged at full size. All traffic is on
127.0.0.1 and Unix sockets in a temporary folder.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.figures import Figure, GiB, MiB, judge
from bench.launch import free_port, quiet_router_warnings
from bench.load import run_async
from bench.peers import router_config
from bench.procstat import rss_bytes
from router.core.claims import ClaimTable
from router.tokens import SigningKey, mint_token, new_nonce, parse_token
from router.tokens.cache import TokenCache

__all__ = ["Figure", "bench_claims", "bench_control", "bench_tokens", "judge", "main"]

CLAIMS_TARGET_BYTES = 250 * 1000 * 1000  # "1,000,000 live claims in <= 250 MB RSS"
CONTROL_TARGET_PAIRS_S = 50_000.0
# 10x the claims, under 5x the lookup time: not O(n). A dict probe is O(1); what growth
# remains from 100,000 to 1,000,000 claims is cache and TLB misses, not more probes.
LOOKUP_SPREAD_MAX = 5.0
WORKER_IDS = ("w0", "w1", "w2", "w3")
CONTROL_TIMEOUT_S = 120.0  # a bound on the whole pipelined run


# --- the claim table ---------------------------------------------------------------------------


def _fill(table: ClaimTable, count: int) -> None:
    # Each claim gets its own `now` float, as in the router, where claims arrive over time.
    for i in range(count):
        table.claim("episode", f"ep-{i:016x}-a0", WORKER_IDS[i & 3], 1000.0 + i * 1e-3)


def _filled(count: int) -> ClaimTable:
    table = ClaimTable(tombstone_ttl_s=3600.0, max_tombstones=1_000_000)
    _fill(table, count)
    return table


def _lookup_ns(table: ClaimTable, count: int, lookups: int) -> float:
    """ns per lookup of fresh key strings (their hash not cached, as for a parsed token)."""
    rng = random.Random(7)
    keys = [f"ep-{rng.randrange(count):016x}-a0" for _ in range(lookups)]
    lookup = table.lookup
    started = time.perf_counter_ns()
    for key in keys:
        if lookup("episode", key) is None:
            raise AssertionError(f"claim {key} missing")
    return (time.perf_counter_ns() - started) / lookups


def bench_claims(count: int, full: bool) -> list[Figure]:
    """RSS of `count` live claims, and the lookup time at 1,000, count/10 and count claims.

    A lookup is one dict probe; it slows as the table outgrows the CPU caches and
    the TLB, but 10x the claims must not come near 10x the time: the O(1) check.
    """
    gc.collect()
    before = rss_bytes(os.getpid())
    started = time.perf_counter()
    table = _filled(count)
    fill_s = time.perf_counter() - started
    gc.collect()
    grown = rss_bytes(os.getpid()) - before
    lookups = min(count, 200_000)
    large_ns = min(_lookup_ns(table, count, lookups) for _ in range(3))
    scrape_us = min(_scrape_counts_us(table) for _ in range(3))
    del table
    tenth = count // 10
    tenth_ns = min(_lookup_ns(_filled(tenth), tenth, lookups) for _ in range(3))
    small_ns = min(_lookup_ns(_filled(1000), 1000, lookups) for _ in range(3))
    scale = f"{count:,} claims"
    return [
        Figure(
            "claims",
            f"RSS of {scale}",
            grown / MiB,
            "MiB",
            "<= 250 MB for 1,000,000",
            judge(full, grown <= CLAIMS_TARGET_BYTES),
            f"{grown / count:.0f} bytes per claim, key included; filled in {fill_s:.1f} s",
        ),
        Figure("claims", "lookup at 1,000 claims", small_ns, "ns"),
        Figure("claims", f"lookup at {tenth:,} claims", tenth_ns, "ns"),
        Figure(
            "claims",
            f"lookup at {scale}",
            large_ns,
            "ns",
            "O(1)",
            judge(full, large_ns <= LOOKUP_SPREAD_MAX * tenth_ns),
            f"{large_ns / tenth_ns:.2f}x the lookup at {tenth:,}",
        ),
        Figure("claims", "claim (insert)", fill_s / count * 1e6, "us"),
        Figure(
            "claims",
            f"held counts for a metrics scrape at {scale}",
            scrape_us,
            "us",
            note="kept as claims change; a count over the claims took ~70 ms",
        ),
    ]


def _scrape_counts_us(table: ClaimTable) -> float:
    """µs to read the (worker, kind) claim counts a metrics scrape renders."""
    started = time.perf_counter_ns()
    table.held_counts_by_kind()
    return (time.perf_counter_ns() - started) / 1000


# --- token parsing -----------------------------------------------------------------------------


def bench_tokens(parses: int) -> list[Figure]:
    """Microseconds per parse of a typical episode token, without and with HS256
    verification, and per lookup of a token already seen (the cache)."""
    key = SigningKey.generate("HS256")
    now = int(time.time())
    tokens = [
        mint_token(ep=f"ep-{i:016x}", att=0, nonce=new_nonce(), key=key, iat=now)
        for i in range(1000)
    ]
    figures = []
    for label, verifier in (("parse", None), ("parse + HS256 verify", key.verifier())):
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter_ns()
            for i in range(parses):
                parse_token(tokens[i % 1000], now=now, verifier=verifier)
            best = min(best, (time.perf_counter_ns() - started) / parses / 1000)
        figures.append(Figure("tokens", label, best, "us", note=f"{len(tokens[0])}-byte token"))
    # What the hot path pays for a token it has seen before: every call of an episode
    # carries the same one (router.tokens.TokenCache, primed with the 1,000 tokens).
    cache = TokenCache(key.verifier())
    for token in tokens:
        cache.key(token, now)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter_ns()
        for i in range(parses):
            cache.key(tokens[i % 1000], now)
        best = min(best, (time.perf_counter_ns() - started) / parses / 1000)
    figures.append(Figure("tokens", "cached (seen before, HS256)", best, "us"))
    return figures


# --- the control socket ------------------------------------------------------------------------


async def _pipelined_pairs(path: str, pairs: int, window: int) -> tuple[float, int]:
    """Seconds for `pairs` claim+release pairs on one connection (at most `window`
    pairs unanswered), and how many replies were ok."""
    reader, writer = await asyncio.open_unix_connection(path, limit=4 * MiB)
    hello = {"op": "hello", "id": 0, "v": 1, "worker": "bench", "url": "http://127.0.0.1:9"}
    hello["boot"] = new_nonce()
    writer.write(json.dumps(hello).encode() + b"\n")
    writer.write(b'{"op":"sync","id":1,"claims":[],"more":false}\n')
    await writer.drain()
    for _ in range(2):
        if b'"ok":true' not in await reader.readline():
            raise RuntimeError("the router refused the benchmark's hello")
    lines = [
        b'{"op":"claim","id":%d,"key":"ep%d-a0"}\n{"op":"release","id":%d,"key":"ep%d-a0"}\n'
        % (2 * i + 2, i, 2 * i + 3, i)
        for i in range(pairs)
    ]
    expected = 2 * pairs
    received = ok = 0
    progress = asyncio.Event()
    started = time.perf_counter()

    async def send() -> None:
        step = window // 2
        for start in range(0, pairs, step):
            while start - received // 2 > window:  # at most `window` pairs unanswered
                progress.clear()
                await progress.wait()
            writer.write(b"".join(lines[start : start + step]))
            await writer.drain()

    sender = asyncio.create_task(send(), name="control-bench-send")
    while received < expected:
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


async def _control_in_process(pairs: int, folder: Path) -> tuple[float, int]:
    from router.config import parse_config
    from router.service.router_service import RouterService

    socket_path = folder / "control.sock"
    config = parse_config(router_config(free_port(), free_port(), socket_path))
    service = RouterService(config)
    with quiet_router_warnings():
        await service.start()
        try:
            async with asyncio.timeout(CONTROL_TIMEOUT_S):
                return await _pipelined_pairs(str(socket_path), pairs, window=2000)
        finally:
            await service.stop()


def bench_control(pairs: int, full: bool) -> list[Figure]:
    """claim+release pairs per second over one pipelined connection to an in-process router."""
    with tempfile.TemporaryDirectory(prefix="episode-router-micro-") as scratch:
        elapsed, ok = run_async(_control_in_process(pairs, Path(scratch)))
    rate = pairs / elapsed
    note = f"{pairs:,} pairs in {elapsed:.2f} s, client in the same process"
    if ok != 2 * pairs:
        note += f"; only {ok} of {2 * pairs} replies were ok"
    return [
        Figure(
            "control",
            "claim+release pairs",
            rate,
            "pairs/s",
            ">= 50,000 pairs/s",
            judge(full, rate >= CONTROL_TARGET_PAIRS_S and ok == 2 * pairs),
            note,
        )
    ]


# --- running -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizes:
    claims: int
    parses: int
    pairs: int
    stream_bytes: int
    idle_connections: int


FULL = Sizes(1_000_000, 200_000, 200_000, GiB, 10_000)
QUICK = Sizes(100_000, 20_000, 10_000, 64 * MiB, 500)


def benches(sizes: Sizes, full: bool) -> dict[str, Callable[[], list[Figure]]]:
    from bench import netmicro

    return {
        "claims": lambda: bench_claims(sizes.claims, full),
        "tokens": lambda: bench_tokens(sizes.parses),
        "control": lambda: bench_control(sizes.pairs, full),
        "streaming": lambda: netmicro.bench_streaming(sizes.stream_bytes, full),
        "idle": lambda: netmicro.bench_idle(sizes.idle_connections),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the micro-benchmarks; 0 when all ran, 1 when one failed."""
    parser = argparse.ArgumentParser(prog="python -m bench.micro", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small sizes, a few seconds each")
    parser.add_argument("--only", default="", help="comma-separated: claims,tokens,control,...")
    parser.add_argument("--json", default=None, help="also write the figures to this file")
    args = parser.parse_args(argv)
    sizes, full = (QUICK, False) if args.quick else (FULL, True)
    chosen = benches(sizes, full)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in only if name not in chosen]
    if unknown:
        parser.error(f"unknown benchmarks {unknown}; choose from {', '.join(chosen)}")
    figures: list[Figure] = []
    failures: dict[str, str] = {}
    for name, bench in chosen.items():
        if only and name not in only:
            continue
        try:
            found = bench()
        except (OSError, RuntimeError, ValueError) as exc:
            failures[name] = f"{type(exc).__name__}: {exc}"
            print(f"{name:9} FAILED: {failures[name]}", flush=True)
            continue
        figures.extend(found)
        for figure in found:
            print(figure.line(), flush=True)
    if not full:
        print("(quick sizes: the targets are judged only at full size)")
    if args.json:
        data = {"quick": not full, "sizes": asdict(sizes), "failures": failures}
        data["figures"] = [asdict(f) for f in figures]
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
