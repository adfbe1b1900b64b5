"""The directory's benchmark at a small scale: it runs end to end and its figures are sane.

Nothing here asserts a rate: the machine is shared, and the figures only mean
something in a full run (`python -m bench.directory`)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a folder of the repository, not a package

from bench.directory import measure  # noqa: E402
from tests.directory.conftest import redis_server_binary  # noqa: E402


async def test_the_directory_benchmark_measures_claims_and_lookups() -> None:
    redis_server_binary()  # fails with the package to install when it is missing
    figures = await measure(pairs=500, concurrency=32, rounds=5)
    assert figures.pairs == 500
    assert figures.pairs_per_s > 0
    assert figures.cpu_us_per_pair > 0
    assert set(figures.lookup_us) == {"1", "16", "256"}
    for latency in figures.lookup_us.values():
        assert 0 < latency["p50"] <= latency["p99"]
