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


async def test_the_control_socket_benchmark_measures_pairs_through_the_directory() -> None:
    from bench.control_directory import measure as measure_through_the_socket

    redis_server_binary()
    figures = await measure_through_the_socket(pairs=500, rounds=1)
    assert (figures.pairs, figures.rounds) == (500, 1)
    assert figures.directory_pairs_per_s > 0 and figures.local_pairs_per_s > 0
    # redis-server's CPU is read in clock ticks: 500 pairs may take less than one.
    assert figures.cpu_us_per_pair > 0 and figures.redis_cpu_us_per_pair >= 0
    assert len(figures.directory_rounds) == len(figures.local_rounds) == 1
    assert figures.collector == "router" and len(figures.cpu_us_rounds) == 1


def test_the_control_socket_benchmark_puts_the_collector_back_as_it_was() -> None:
    import gc

    from bench.control_directory import collector_as
    from router.service.process import GC_GEN0_THRESHOLD

    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    with collector_as("router"):
        assert gc.get_threshold()[0] == GC_GEN0_THRESHOLD
        assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == before
    if not frozen:
        assert gc.get_freeze_count() == 0
    with collector_as("default"):
        assert gc.get_threshold() == before
