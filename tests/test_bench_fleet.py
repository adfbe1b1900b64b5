"""The fleet benchmark (bench.fleet): its pure parts, and a quick run that prints every row.

Nothing here asserts a time or a ratio: the machine running the suite is shared, and the
figures only mean something in a full run (`python -m bench.fleet`). The quick run
asserts that every row was measured, with sane numbers.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a folder of the repository, not a package

from bench.fleet import (  # noqa: E402
    BACKGROUND,
    Row,
    Settings,
    classify_monitor_line,
    format_rows,
    median,
    run_fleet,
    script_names,
    sent,
)
from tests.directory.conftest import redis_server_binary  # noqa: E402


def test_monitor_lines_are_counted_by_command_and_by_script() -> None:
    scripts = script_names()
    lookup = next(sha for sha, name in scripts.items() if name == "lookup")
    assert classify_monitor_line(f'+1.5 [0 127.0.0.1:4000] "EVALSHA" "{lookup}" "1"', scripts) == (
        "lookup"
    )
    assert classify_monitor_line('+1.5 [0 127.0.0.1:4000] "ping"', scripts) == "PING"
    assert classify_monitor_line('+1.5 [0 lua] "HGET" "k" "s"', scripts) is None  # a script's
    assert classify_monitor_line("+OK", scripts) is None
    unknown = classify_monitor_line('+1.5 [0 127.0.0.1:4000] "EVALSHA" "00ff" "0"', scripts)
    assert unknown == "EVALSHA"


def test_background_commands_are_not_counted_as_sent() -> None:
    # The membership read is HGETALL and TIME in one pipeline, on a timer.
    counts = Counter({"PING": 30, "heartbeat": 2, "lookup": 3, "HGETALL": 1, "TIME": 1})
    assert sent(counts) == 3
    assert "lookup" not in BACKGROUND


def test_median_and_rows() -> None:
    assert median([]) is None
    assert median([3.0, 1.0, 2.0]) == 2.0
    text = format_rows([Row("1", "a figure", 1.5, "us", "<= 2", True), Row("2", "b", None, "")])
    assert "1.50 us" in text and "[met]" in text and "failed" in text


def test_quick_settings_are_small() -> None:
    quick = Settings.quick()
    assert quick.episodes < Settings().episodes
    assert quick.lease_s < Settings().lease_s
    assert Settings().episodes == 4096  # the default workload the contract quotes


def test_a_quick_run_prints_every_row_with_sane_figures() -> None:
    redis_server_binary()  # fails with the package to install when it is missing
    printed: list[str] = []
    rows = run_fleet(Settings.quick(episodes=32, cold_requests=50), printed.append)
    assert len(rows) == 50
    for row in rows:
        assert row.value is not None and math.isfinite(row.value), row
        assert row.met is None or row.name.startswith("Redis commands") or row.item == "2"
    by_name = {row.name: row.value for row in rows}
    for name, value in by_name.items():
        if name.endswith(("requests/s", "CPU per local hit", "request (A)", "under load (A)")):
            assert value is not None and value > 0, name
    assert by_name["absent key, first ask: lookups (EVALSHA) per request"] == 1.0
    per_call = by_name["absent key, first ask under load: requests per lookup call"]
    assert per_call is not None and per_call >= 1.0
    # An episode's first call on B looks its owner up; its later calls find it cached
    # (without the cache: 1.00 a request; a slow machine may let a few entries lapse).
    assert by_name["an episode's first call via B: lookups per request"] == 1.0
    assert by_name["forwarded under load: non-2xx replies and errors"] == 0
    later = by_name["forwarded: Redis lookups per request (on B)"]
    assert later is not None and later < 0.5
    # C, of A's host, sent A's episodes straight to A's workers: served, and mostly
    # from its lookup cache too.
    assert by_name["straight under load: non-2xx replies and errors"] == 0
    straight = by_name["straight: Redis lookups per request (on C)"]
    assert straight is not None and straight < 0.5
    assert by_name["straight: share of C's forwards that went straight (not hopped)"] == 1.0
    lease = Settings.quick().lease_s
    kill = by_name["kill -9 to 410 on the other router"]
    assert kill is not None and 0 < kill < 3 * lease + 5
    statuses = next(line for line in printed if line.startswith("statuses: "))
    assert "A absent: {401: 32}" in statuses and "A ended: {410: 32}" in statuses
    assert "C held: {200: 32}" in statuses
    # After each death the last answer is the router's own 410, read with its code.
    answers = next(line for line in printed if line.startswith("answers: "))
    assert answers.count("'410 worker_exited': 1") == 2, answers
    assert any("item figure" in line for line in printed)
