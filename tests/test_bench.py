"""The benchmarks: their pure parts, and quick runs that must produce sane, positive figures.

Nothing here asserts a time or a ratio: the machine running the suite is shared
and the figures are only meaningful side by side in a full run. The quick
harness compares the router with nginx when nginx is installed, and runs the
router alone otherwise. `EPISODE_ROUTER_BENCH=1` adds the full-size runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is a folder of the repository, not an installed package

from bench.episodes import balanced_tokens, mint_episodes  # noqa: E402
from bench.floor import Floor, floor_protocol  # noqa: E402
from bench.launch import quiet_router_warnings  # noqa: E402
from bench.load import (  # noqa: E402
    LoadResult,
    ReplyParser,
    build_request,
    paced_wrk_script,
    parse_wrk,
    percentile,
    wrk_delay_ms,
    wrk_script,
)
from bench.peers import envoy_config, haproxy_config, nginx_config  # noqa: E402
from bench.procstat import parse_stat, parse_status_kib  # noqa: E402
from bench.profile import by_package, top_functions  # noqa: E402
from bench.report import (  # noqa: E402
    Figures,
    Run,
    check_targets,
    fill_ratios,
    format_table,
    legend,
    to_json,
)
from bench.run import (  # noqa: E402
    Settings,
    add_direct_paced,
    add_serial_round,
    build_parser,
    settings_from_args,
)
from bench.worker import spin  # noqa: E402

FULL = os.environ.get("EPISODE_ROUTER_BENCH") == "1"
QUICK_TIMEOUT_S = 120


# --- pure parts --------------------------------------------------------------------------------


def test_reply_parser_counts_replies_split_anywhere_with_length_or_chunks() -> None:
    stream = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
        b"HTTP/1.1 410 Gone\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
        b"HTTP/1.1 204 No Content\r\n\r\n"
    )
    whole = ReplyParser()
    assert whole.feed(stream) == 3
    assert whole.statuses == [200, 410, 204]
    bytewise = ReplyParser()
    ends = [bytewise.feed(stream[i : i + 1]) for i in range(len(stream))]
    assert sum(ends) == 3
    assert bytewise.statuses == [200, 410, 204]
    # Each reply ends exactly on its last byte.
    assert [i for i, n in enumerate(ends) if n] == [
        stream.index(b"hello") + 4,
        stream.index(b"0\r\n\r\n") + 4,
        len(stream) - 1,
    ]


def test_reply_parser_refuses_what_is_not_http() -> None:
    with pytest.raises(ValueError, match="not an HTTP"):
        ReplyParser().feed(b"SSH-2.0-OpenSSH\r\n\r\n")


def test_a_request_carries_the_token_and_its_exact_body_length() -> None:
    request = build_request("a.b.c", 8080, b"{}")
    assert request == (
        b"POST /tools/echo HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
        b"X-NeMo-Gym-Episode-Token: a.b.c\r\nContent-Type: application/json\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 0.5) == 50
    assert percentile(values, 0.99) == 99
    assert percentile([7], 0.99) == 7
    assert percentile([], 0.5) == 0.0


WRK_REPORT = """Running 1s test @ http://127.0.0.1:18777/tools/echo
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.08ms    2.09ms  16.90ms   88.78%
    Req/Sec    11.93k     7.45k   19.34k    80.00%
  Latency Distribution
     50%  206.00us
     75%  596.00us
     90%    3.46ms
     99%   11.11ms
  11885 requests in 1.00s, 1.81MB read
  Socket errors: connect 0, read 2, write 0, timeout 1
  Non-2xx or 3xx responses: 4
Requests/sec:  11839.25
Transfer/sec:      1.81MB
"""


def test_wrk_report_gives_requests_seconds_percentiles_and_errors() -> None:
    result = parse_wrk(WRK_REPORT)
    assert (result.tool, result.requests, result.seconds) == ("wrk", 11885, 1.0)
    assert (result.p50_us, result.p99_us) == (206.0, 11110.0)
    assert result.errors == 7
    assert result.rps == 11885.0
    with pytest.raises(ValueError, match="lacks its figures"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused")


def test_wrk_script_cycles_through_every_token() -> None:
    script = wrk_script(["t1", "t2"], b'{"a": 1}')
    assert '  "t1",\n  "t2"\n' in script
    assert '["X-NeMo-Gym-Episode-Token"] = token' in script
    assert 'local body = [[{"a": 1}]]' in script


def test_paced_wrk_think_time_is_connections_over_rate_in_milliseconds() -> None:
    assert wrk_delay_ms(32, 4000.0) == 8.0
    assert wrk_delay_ms(8, 3200.0) == 2.5
    assert wrk_delay_ms(1, 1000.0) == 1.0
    with pytest.raises(ValueError, match="must be positive"):
        wrk_delay_ms(8, 0.0)
    with pytest.raises(ValueError, match="must be positive"):
        wrk_delay_ms(0, 100.0)


def test_paced_wrk_script_staggers_first_requests_and_carries_the_fraction() -> None:
    base = wrk_script(["t1", "t2"], b'{"a": 1}')
    script = paced_wrk_script(["t1", "t2"], 4, 2.5, b'{"a": 1}')
    assert script.startswith(base)
    assert script[len(base) :] == (
        "local delay_ms = 2.500000\n"
        "local connections = 4\n"
        "local started = 0\n"
        "local owed = 0.0\n"
        "function delay()\n"
        "  if started < connections then\n"
        "    started = started + 1\n"
        "    return math.floor((started - 1) * delay_ms / connections)\n"
        "  end\n"
        "  owed = owed + delay_ms\n"
        "  local whole = math.floor(owed)\n"
        "  owed = owed - whole\n"
        "  return whole\n"
        "end\n"
    )
    assert "function delay()" not in base  # the saturation script never waits
    with pytest.raises(ValueError, match="bad pacing"):
        paced_wrk_script(["t1"], 0, 2.5)


def test_a_paced_wrk_report_keeps_the_rate_asked_beside_the_rate_achieved() -> None:
    # The parse is the saturation run's; run_wrk only records the rate asked.
    result = parse_wrk(WRK_REPORT)
    assert result.rate_asked is None
    assert dataclasses.replace(result, rate_asked=2500.0).rps == 11885.0


def test_two_episode_sets_claim_different_keys_for_different_workers() -> None:
    trivial = mint_episodes(4, 2)
    busy = mint_episodes(4, 2, "b", "bound")
    assert [e.worker for e in trivial] == ["w0", "w1", "w0", "w1"]
    assert [e.worker for e in busy] == ["b0", "b1", "b0", "b1"]
    assert not {e.key for e in trivial} & {e.key for e in busy}
    assert len({e.token for e in [*trivial, *busy]}) == 8


def test_balanced_tokens_keep_as_many_per_worker_in_their_order() -> None:
    tokens = ["a", "b", "c", "d", "e", "f", "g"]
    answered = ["w0", "w0", "w1", "w0", "w1", "w0", "w0"]
    assert balanced_tokens(tokens, answered, 2) == ["a", "b", "c", "e"]
    assert balanced_tokens(["a", "b"], ["w1", "w0"], 2) == ["a", "b"]
    with pytest.raises(RuntimeError, match="reach 1 of 2 workers"):
        balanced_tokens(["a", "b"], ["w0", "w0"], 2)
    with pytest.raises(ValueError, match="2 tokens but 1 answers"):
        balanced_tokens(["a", "b"], ["w0"], 2)


def test_a_busy_worker_spins_at_least_the_time_asked() -> None:
    started = time.perf_counter()
    spin(0.002)
    assert time.perf_counter() - started >= 0.002
    spin(0.0)  # returns at once


def test_work_us_option_sets_the_worker_bound_run_or_turns_it_off() -> None:
    assert Settings().work_us == 400.0 and Settings().bound_s == 5.0
    assert Settings.quick().bound_s == 1.0
    quick = settings_from_args(build_parser().parse_args(["--quick", "--work-us", "250"]))
    assert (quick.work_us, quick.bound_s, quick.connections) == (250.0, 1.0, 8)
    assert settings_from_args(build_parser().parse_args(["--work-us", "0"])).work_us == 0.0
    with pytest.raises(ValueError, match="--work-us must not be negative"):
        settings_from_args(build_parser().parse_args(["--work-us", "-1"]))


def test_an_in_process_router_s_warnings_are_quieted_meanwhile_and_its_errors_are_not() -> None:
    router_log = logging.getLogger("episode_router")
    control_log = logging.getLogger("episode_router.control")
    before = router_log.level
    assert control_log.isEnabledFor(logging.WARNING)
    with quiet_router_warnings():
        assert not control_log.isEnabledFor(logging.WARNING)  # "worker exited"
        assert control_log.isEnabledFor(logging.ERROR)
    assert router_log.level == before
    assert control_log.isEnabledFor(logging.WARNING)


def test_proc_stat_is_read_past_a_command_name_with_spaces_and_parentheses() -> None:
    fields = " ".join(str(n) for n in range(5, 53))  # field n holds n: utime is 14, stime 15
    stat = parse_stat(f"4242 (nginx: worker (x)) S 17 {fields}")
    assert (stat.pid, stat.ppid) == (4242, 17)
    assert (stat.utime_ticks, stat.stime_ticks) == (14, 15)
    with pytest.raises(ValueError):
        parse_stat("4242 nginx S 1")
    status = "Name:\tpython\nVmHWM:\t  52000 kB\nVmRSS:\t  51234 kB\n"
    assert parse_status_kib(status, "VmRSS") == 51234
    assert parse_status_kib(status, "VmHWM") == 52000
    with pytest.raises(KeyError):
        parse_status_kib("Name:\tzombie\n", "VmRSS")


def test_peers_are_configured_sticky_on_the_token_header() -> None:
    nginx = nginx_config(8081, [9001, 9002], Path("/tmp/x"), 1)
    assert "hash $http_x_nemo_gym_episode_token consistent;" in nginx
    assert "server 127.0.0.1:9001;" in nginx and "server 127.0.0.1:9002;" in nginx
    assert "listen 127.0.0.1:8081" in nginx
    haproxy = haproxy_config(8082, [9001], 1)
    assert "balance hdr(X-NeMo-Gym-Episode-Token)" in haproxy
    assert "bind 127.0.0.1:8082" in haproxy
    envoy = json.loads(envoy_config(8083, [9001, 9002]))
    resources = envoy["static_resources"]
    cluster = resources["clusters"][0]
    assert cluster["lb_policy"] == "RING_HASH"
    assert [
        e["endpoint"]["address"]["socket_address"]["port_value"]
        for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ] == [9001, 9002]
    manager = resources["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route = manager["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["hash_policy"] == [{"header": {"header_name": "x-nemo-gym-episode-token"}}]


def test_top_functions_sum_self_and_total_samples_per_function() -> None:
    collapsed = (
        "main (a.py:1);handle (app.py:10);parse (t.py:5) 6\n"
        "main (a.py:1);handle (app.py:12) 3\n"
        "main (a.py:2);write (w.py:7) 1\n"
        "garbage line\n"
    )
    spots = {h.function: h for h in top_functions(collapsed)}
    assert set(spots) == {"parse (t.py)", "handle (app.py)", "write (w.py)"}
    assert spots["parse (t.py)"].self_share == pytest.approx(0.6)
    assert spots["handle (app.py)"].self_share == pytest.approx(0.3)
    assert spots["handle (app.py)"].total_share == pytest.approx(0.9)
    assert top_functions("") == []


def test_samples_are_charged_to_gc_epoll_libc_or_the_innermost_python_package() -> None:
    collapsed = (
        "run (asyncio/runners.py:1);send (aiohttp/http_writer.py:9);write (libc.so.6) 4\n"
        "run (asyncio/runners.py:1);handle (router/app/handler.py:3);Py_DECREF (object.h:5) 3\n"
        "run (asyncio/runners.py:1);handle (router/app/handler.py:3);"
        "gc_collect_main (libpython3.11.so) 2\n"
        "run (asyncio/runners.py:1);epoll_pwait (libc.so.6) 1\n"
    )
    shares = by_package(collapsed)
    assert [name for name, _ in shares] == [
        "libc (system calls)",
        "router",
        "garbage collector",
        "waiting in epoll",
    ]
    assert [share for _, share in shares] == pytest.approx([0.4, 0.3, 0.2, 0.1])
    assert by_package("") == []


def _figures(
    name: str, cpu: float, rps: float, added: float, half_p99: float, bound: float | None = None
) -> Figures:
    return Figures(
        name=name,
        cpu_us_per_request=cpu,
        rps=rps,
        added_p50_us=added,
        paced_p99_us=half_p99,
        bound_rps=bound,
    )


def test_rounds_option_sets_the_interleaved_load_runs() -> None:
    assert (Settings().rounds, Settings.quick().rounds) == (5, 1)
    assert settings_from_args(build_parser().parse_args(["--rounds", "5"])).rounds == 5
    assert settings_from_args(build_parser().parse_args(["--quick", "--rounds", "2"])).rounds == 2
    with pytest.raises(ValueError, match="--rounds must be at least 1"):
        settings_from_args(build_parser().parse_args(["--rounds", "0"]))


def test_cpu_ratios_are_kept_round_by_round_and_the_legend_shows_them() -> None:
    nginx = _figures("nginx", 20.0, 20000.0, 90.0, 900.0, 3500.0)
    router = _figures("router", 50.0, 12000.0, 150.0, 1500.0, 3300.0)
    floor = _figures("floor", 24.0, 19000.0, 100.0, 950.0, 3400.0)
    nginx.cpu_rounds, router.cpu_rounds = [20.0, 25.0, 22.0], [50.0, 45.0, 66.0]
    floor.cpu_rounds = [24.0, 30.0]  # a round missing: no round-by-round ratios
    run = Run(settings={}, machine={"cpus": 2}, figures=[nginx, router, floor])
    fill_ratios(run)
    assert router.cpu_ratio_rounds == pytest.approx([2.5, 1.8, 3.0])
    assert nginx.cpu_ratio_rounds == pytest.approx([1.0, 1.0, 1.0])
    assert floor.cpu_ratio_rounds == []
    lines = legend({"connections": 32, "work_us": 0, "rounds": 3}, [nginx, router, floor])
    assert lines[2:5] == [
        " CPU us/req, proxy-bound rps, serial p50/p99 and added p50: medians of 3 rounds, every",
        "   proxy once a round (each round's added p50 against the direct p50 just before it);",
        "   CPU x nginx round by round: router 2.50 1.80 3.00;",
    ]
    assert not any("added p50 x nginx" in line for line in lines)  # no serial rounds given
    assert not any("round" in line for line in legend({"rounds": 1}, [nginx, router]))


def test_rounds_are_not_paired_with_nginx_s_when_either_proxy_failed_one() -> None:
    nginx = _figures("nginx", 20.0, 20000.0, 90.0, 900.0)
    router = _figures("router", 50.0, 12000.0, 150.0, 1500.0)
    # nginx failed round 2 and the router round 3: two rounds each, not the same two.
    nginx.cpu_rounds, nginx.failed_rounds = [20.0, 25.0], [2]
    router.cpu_rounds, router.failed_rounds = [50.0, 45.0], [3]
    nginx.added_p50_rounds, router.added_p50_rounds = [100.0, 80.0], [120.0, 90.0]
    run = Run(settings={}, machine={}, figures=[nginx, router])
    fill_ratios(run)
    assert (router.cpu_ratio_rounds, router.added_ratio_rounds) == ([], [])
    assert router.ratios["cpu"] == pytest.approx(50.0 / 20.0)  # the medians still compare
    router.failed_rounds = []  # only nginx failed one: still not paired
    fill_ratios(run)
    assert (router.cpu_ratio_rounds, router.added_ratio_rounds) == ([], [])


def test_serial_figures_are_the_medians_of_the_rounds_added_of_each_rounds_difference() -> None:
    figures = Figures(name="router")
    add_serial_round(figures, (50.0, 90.0), (150.0, 400.0))
    assert (figures.serial_p50_us, figures.added_p50_us) == (150.0, 100.0)
    assert (figures.serial_p99_us, figures.added_p99_us) == (400.0, 310.0)
    add_serial_round(figures, (80.0, 100.0), (130.0, 300.0))
    add_serial_round(figures, (40.0, 95.0), (200.0, 500.0))
    assert figures.serial_p50_rounds == [150.0, 130.0, 200.0]
    assert figures.serial_p99_rounds == [400.0, 300.0, 500.0]
    assert figures.added_p50_rounds == [100.0, 50.0, 160.0]
    assert figures.added_p99_rounds == [310.0, 200.0, 405.0]
    assert (figures.serial_p50_us, figures.serial_p99_us) == (150.0, 400.0)
    # The median of the differences (100), not median proxy - median direct (150 - 50).
    assert (figures.added_p50_us, figures.added_p99_us) == (100.0, 310.0)
    add_serial_round(figures, (60.0, 90.0), (180.0, 350.0))
    assert figures.added_p50_us == 120.0  # of 50, 100, 120, 160: the upper middle
    assert figures.serial_p50_us == 180.0


def test_added_latency_ratios_are_kept_round_by_round_and_the_legend_shows_them() -> None:
    nginx = _figures("nginx", 20.0, 20000.0, 100.0, 900.0)
    router = _figures("router", 50.0, 12000.0, 150.0, 1500.0)
    haproxy = _figures("haproxy", 20.0, 20000.0, 90.0, 900.0)
    floor = _figures("floor", 24.0, 19000.0, 100.0, 950.0)
    nginx.added_p50_rounds = [100.0, 80.0, 0.0]
    router.added_p50_rounds = [110.0, 108.0, 95.0]
    haproxy.added_p50_rounds = [90.0, 40.0, 70.0]
    floor.added_p50_rounds = [100.0]  # rounds missing: no round-by-round ratios
    run = Run(settings={}, machine={}, figures=[nginx, router, haproxy, floor])
    fill_ratios(run)
    # nginx's third round added nothing measurable: that round has no ratio.
    assert router.added_ratio_rounds == pytest.approx([1.1, 1.35])
    assert haproxy.added_ratio_rounds == pytest.approx([0.9, 0.5])
    assert floor.added_ratio_rounds == []
    assert router.ratios["added_p50"] == pytest.approx(1.5)  # the medians' ratio: 150 / 100
    lines = legend({"rounds": 3}, [nginx, router, haproxy, floor])
    assert "   serial added p50 x nginx round by round: router 1.10 1.35, haproxy 0.90 0.50;" in (
        lines
    )
    assert not any("serial CPU" in line for line in lines)  # none measured
    router.serial_cpu_us_per_request, router.serial_user_us_per_request = 81.84, 33.06
    nginx.serial_cpu_us_per_request = 60.0
    lines = legend({"rounds": 3}, [nginx, router, haproxy, floor])
    assert (
        " serial CPU us/req (user + system, while serial): nginx 60.0, router 81.8 (33.1 user);"
        in lines
    )
    data = json.loads(to_json(run))
    assert data["proxies"][1]["added_ratio_rounds"] == pytest.approx([1.1, 1.35])
    assert data["proxies"][1]["added_p50_rounds"] == [110.0, 108.0, 95.0]


def test_ratios_and_targets_against_nginx_in_the_same_run() -> None:
    run = Run(
        settings={},
        machine={"cpus": 2, "router_build": "compiled"},
        figures=[
            _figures("nginx", 50.0, 10000.0, 100.0, 900.0, 4000.0),
            _figures("router", 70.0, 5000.0, 130.0, 1200.0, 3800.0),
            Figures(name="envoy", status="skipped", reason="not installed"),
        ],
    )
    fill_ratios(run)
    run.targets = check_targets(run)
    router = run.figures[1]
    assert router.ratios == {
        "cpu": pytest.approx(1.4),
        "rps": pytest.approx(0.5),
        "bound_rps": pytest.approx(0.95),
        "added_p50": pytest.approx(1.3),
    }
    # The throughput target reads the worker-bound ratio (95%), not the proxy-bound one (50%).
    assert [check.met for check in run.targets] == [True, False, False, True]
    table = format_table(run)
    assert "skipped: envoy: not installed" in table
    assert "router build: compiled (episode-router --version)" in table
    assert "NOT met  serial added latency p50 <= 1.2x nginx: 1.30x" in table
    assert (
        "met      throughput >= 90% of nginx, workers the bottleneck: 95.0% (worker-bound rps)"
        in table
    )
    data = json.loads(to_json(run))
    assert data["skipped"] == {"envoy": "not installed"}
    assert [p["name"] for p in data["proxies"]] == ["nginx", "router", "envoy"]
    assert data["proxies"][1]["ratios"]["bound_rps"] == pytest.approx(0.95)


def test_a_proxy_fast_alone_but_slow_with_busy_workers_misses_the_throughput_target() -> None:
    run = Run(
        settings={},
        machine={},
        figures=[
            _figures("nginx", 50.0, 10000.0, 100.0, 900.0, 4000.0),
            _figures("router", 50.0, 12000.0, 100.0, 900.0, 3000.0),
        ],
    )
    fill_ratios(run)
    [throughput] = [c for c in check_targets(run) if c.target.startswith("throughput")]
    assert (throughput.met, throughput.measured) == (False, "75.0% (worker-bound rps)")


def test_the_paced_target_says_the_rate_achieved_and_the_tool() -> None:
    router = _figures("router", 70.0, 9000.0, 130.0, 812.4)
    router.paced_rps, router.paced_tool = 4321.0, "wrk"
    checks = check_targets(Run(settings={}, machine={}, figures=[router]))
    assert (checks[2].met, checks[2].measured) == (True, "812 us at 4,321 rps (wrk)")


def test_the_paced_target_shows_the_direct_floor_but_is_judged_on_the_router_alone() -> None:
    router = _figures("router", 70.0, 9000.0, 130.0, 1840.0)
    router.paced_rps, router.paced_tool = 3205.0, "wrk"
    direct = Figures(name="direct", paced_p99_us=810.4, paced_rps=3190.0, paced_tool="wrk")
    run = Run(settings={}, machine={}, figures=[direct, router])
    run.targets = check_targets(run)
    assert (run.targets[2].met, run.targets[2].measured) == (
        False,
        "1840 us at 3,205 rps (wrk); direct to the workers: 810 us",
    )
    assert (
        "NOT met  p99 <= 1000 us at half of saturation: 1840 us at 3,205 rps (wrk);"
        " direct to the workers: 810 us" in format_table(run)
    )
    # With each worker's p99 known, the line gives their range: the combined p99 is in it.
    direct.paced_p99_each = [640.2, 810.4]
    assert check_targets(run)[2].measured == (
        "1840 us at 3,205 rps (wrk); direct to the workers: 640-810 us (each worker's p99)"
    )
    # A direct floor above the bound does not fail a router under it.
    router.paced_p99_us, direct.paced_p99_us, direct.paced_p99_each = 900.0, 1200.0, []
    assert check_targets(run)[2].met is True
    # No direct paced figure (its run failed): the line is the router's alone.
    direct.paced_p99_us = None
    assert check_targets(run)[2].measured == "900 us at 3,205 rps (wrk)"


def test_direct_paced_sums_the_workers_rates_and_keeps_the_worst_latencies() -> None:
    results = [
        LoadResult("wrk", 8000, 1, 5.0, 210.0, 640.0, 1600.0),
        LoadResult("wrk", 7900, 2, 5.0, 190.0, 870.0, 1600.0),
    ]
    direct = Figures(name="direct")
    add_direct_paced(direct, 3200.0, results)
    assert (direct.paced_rps, direct.paced_rate_asked) == (pytest.approx(3180.0), 3200.0)
    assert (direct.paced_p50_us, direct.paced_p99_us) == (210.0, 870.0)
    assert direct.paced_p99_each == [640.0, 870.0]
    assert (direct.paced_errors, direct.paced_tool) == (3, "wrk")
    starved = Figures(name="direct")
    add_direct_paced(starved, 3200.0, [results[0], LoadResult("bundled", 0, 16, 5.0, 0.0, 0.0)])
    # A worker that answered nothing has no p99: no latency is claimed for the floor.
    assert (starved.paced_p99_us, starved.paced_rps, starved.paced_errors) == (None, None, 17)


def test_the_legend_says_how_the_direct_paced_floor_is_measured() -> None:
    nginx = _figures("nginx", 20.0, 20000.0, 90.0, 900.0)
    nginx.paced_tool, nginx.paced_rate_asked = "wrk", 3200.0
    direct = Figures(name="direct", paced_p99_us=810.0, paced_tool="wrk")
    settings = {"connections": 32, "workers": 2, "work_us": 0, "load_tool": "wrk"}
    assert legend(settings, [direct, nginx])[-3:] == [
        "   by wrk, each connection waiting C/rate before each request (closed loop);",
        " paced, direct row: the 2 workers at once, each straight at rate/2 on 16 connections,"
        " a wrk each;",
        "   paced rps: their sum; p50, p99: the worst worker's (an upper bound on the combined"
        " p99))",
    ]
    direct.paced_p99_us = None
    assert legend(settings, [direct, nginx])[-1].endswith("(closed loop))")


def test_without_nginx_the_ratio_targets_are_not_measured() -> None:
    run = Run(
        settings={},
        machine={},
        figures=[_figures("router", 70.0, 9500.0, 130.0, 800.0, 3000.0)],
    )
    fill_ratios(run)
    checks = check_targets(run)
    assert [check.met for check in checks] == [None, None, True, None]
    assert checks[0].measured == "not measured (nginx skipped)"
    assert checks[3].measured == "not measured (nginx skipped)"
    no_bound = Run(
        settings={}, machine={}, figures=[_figures("router", 70.0, 9500.0, 130.0, 800.0)]
    )
    assert check_targets(no_bound)[3].measured == "not measured (no worker-bound run)"


def test_the_legend_says_which_rps_is_proxy_bound_and_which_worker_bound() -> None:
    nginx = _figures("nginx", 20.0, 20000.0, 90.0, 900.0, 3500.0)
    nginx.bound_proxy_cores, nginx.bound_worker_cores = 0.19, 1.67
    nginx.paced_tool, nginx.paced_rate_asked = "wrk", 4896.9
    settings = {"connections": 32, "workers": 2, "work_us": 400.0, "load_tool": "wrk"}
    assert legend(settings, [nginx]) == [
        "(latencies in microseconds; added = proxy p50 - the direct-to-worker p50 just before it;",
        " rps: proxy-bound: wrk at 32 connections to trivial workers, how fast the proxy alone is;",
        " worker-bound rps: the same to 2 workers that spin 400 us per request (at most 5,000 rps",
        "   in all), so the workers are the bottleneck: the throughput target's figure;",
        "   cores used meanwhile (proxy / workers): nginx 0.19 / 1.67;",
        " paced: every proxy asked for half the router's proxy-bound rps (4,897), paced rps"
        " achieved;",
        "   by wrk, each connection waiting C/rate before each request (closed loop))",
    ]
    others = [dataclasses.replace(nginx, name=name) for name in ("haproxy", "envoy", "router")]
    assert legend(settings, [nginx, *others])[4:6] == [
        "   cores used meanwhile (proxy / workers): nginx 0.19 / 1.67, haproxy 0.19 / 1.67,",
        "     envoy 0.19 / 1.67, router 0.19 / 1.67;",
    ]
    nginx.paced_tool = "bundled"
    off = legend({"connections": 8, "work_us": 0}, [nginx])
    assert " worker-bound rps: not measured (--work-us 0);" in off
    assert off[-1] == "   by the bundled generator, each connection on a fixed schedule)"


# --- the floor ------------------------------------------------------------------------------


def _header(head: bytes, name: bytes) -> bytes:
    found = re.search(rb"\r\n" + name + rb": *([^\r]*)", head, re.IGNORECASE)
    assert found is not None, (name, head)
    return found[1]


async def _tagging_worker(tag: bytes) -> asyncio.Server:
    """A worker answering each request with `tag`, the request line and its body length."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return  # the floor closed its connection
            body = await reader.readexactly(int(_header(head, b"Content-Length")))
            line = head.split(b"\r\n", 1)[0]
            reply = b"%b %b %d %b" % (tag, line, len(body), _header(head, b"Host"))
            writer.write(
                b"HTTP/1.1 200 OK\r\nX-Tag: %b\r\nContent-Length: %d\r\n\r\n%b"
                % (tag, len(reply), reply)
            )
            await writer.drain()

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def test_the_floor_relays_each_token_to_one_worker_and_refuses_chunked() -> None:
    workers = [await _tagging_worker(tag) for tag in (b"w0", b"w1")]
    addresses = [w.sockets[0].getsockname()[:2] for w in workers]
    floor = Floor([(str(host), int(port)) for host, port in addresses])
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: floor_protocol(floor), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    seen: dict[str, set[bytes]] = {}
    try:
        for i in range(12):
            token = f"token-{i % 3}"
            writer.write(build_request(token, port, body=b"x" * i))
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            body = await reader.readexactly(int(_header(head, b"Content-Length")))
            tag, line = body.split(b" ", 1)
            assert line.startswith(b"POST /tools/echo HTTP/1.1 %d worker" % i), body
            assert b"X-Tag: " + tag in head
            seen.setdefault(token, set()).add(tag)
        assert all(len(tags) == 1 for tags in seen.values()), seen  # sticky
        writer.write(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 501 ")
    finally:
        writer.close()
        await writer.wait_closed()
        floor.close()
        server.close()
        await server.wait_closed()
        for worker in workers:
            worker.close()
            await worker.wait_closed()


# --- quick runs ------------------------------------------------------------------------------


def _module(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _nginx_installed() -> bool:
    return any(Path(folder, "nginx").is_file() for folder in ("/usr/sbin", "/usr/local/sbin")) or (
        shutil.which("nginx") is not None
    )


def _positive(figures: dict[str, Any], *names: str) -> None:
    for name in names:
        value = figures[name]
        assert isinstance(value, int | float) and value > 0, f"{figures['name']}.{name} = {value}"


def test_quick_harness_measures_the_router_and_nginx_when_installed(tmp_path: Path) -> None:
    peers = "nginx" if _nginx_installed() else ""
    argv = ["bench.run", "--quick", "--peers", peers, "--duration", "1", "--serial", "200"]
    argv += ["--rounds", "2"]
    done = _module(*argv, "--out", str(tmp_path), timeout=QUICK_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads((tmp_path / "bench.json").read_text())
    proxies = {p["name"]: p for p in data["proxies"]}
    assert set(proxies) == ({"direct", "router", "nginx"} if peers else {"direct", "router"})
    router = proxies["router"]
    assert router["status"] == "ok", router["reason"]
    _positive(router, "cpu_us_per_request", "rps", "serial_p50_us", "serial_p99_us", "processes")
    _positive(router, "load_requests", "paced_rps", "paced_p50_us", "paced_p99_us", "rss_mib")
    assert router["load_errors"] == 0 and router["paced_errors"] == 0
    # Two interleaved load rounds; the CPU column is a median of them (the upper one of two).
    assert len(router["cpu_rounds"]) == len(router["rps_rounds"]) == 2
    assert router["cpu_us_per_request"] == max(router["cpu_rounds"])
    assert router["serial_p50_us"] <= router["serial_p99_us"]
    # Serial latency is measured every round too: the columns are medians of the rounds.
    assert len(router["serial_p50_rounds"]) == len(router["added_p50_rounds"]) == 2
    assert router["serial_p50_us"] == max(router["serial_p50_rounds"])
    assert router["added_p50_us"] == max(router["added_p50_rounds"])
    assert len(router["serial_cpu_rounds"]) == 2
    assert all(cpu > 0 for cpu in router["serial_cpu_rounds"])
    assert router["serial_cpu_us_per_request"] == max(router["serial_cpu_rounds"])
    assert len(router["serial_user_rounds"]) == 2
    assert all(
        0 <= user <= cpu
        for user, cpu in zip(router["serial_user_rounds"], router["serial_cpu_rounds"], strict=True)
    )
    direct = proxies["direct"]
    _positive(direct, "serial_p50_us")
    targets = [t["target"] for t in data["targets"]]
    assert targets[2].startswith("p99 <= 1000 us")
    assert targets[3] == "throughput >= 90% of nginx, workers the bottleneck"
    for name in proxies.keys() - {"direct"}:
        figures = proxies[name]
        assert figures["bound_problem"] == "", figures["bound_problem"]
        _positive(figures, "bound_rps", "bound_requests", "bound_tokens", "bound_worker_cores")
        assert figures["bound_errors"] == 0
    assert router["bound_tokens"] == 32  # 2 x 16 episodes, dealt evenly: all of them
    if shutil.which("wrk"):
        assert router["paced_tool"] == "wrk"
        # The think time holds wrk under the rate asked (without it wrk would saturate).
        assert router["paced_rps"] <= 1.1 * router["paced_rate_asked"]
        # The workers driven directly at the same rate: the machine's own p99 floor.
        assert direct["paced_tool"] == "wrk" and direct["paced_errors"] == 0
        assert direct["paced_rate_asked"] == router["paced_rate_asked"]
        _positive(direct, "paced_rps", "paced_p50_us", "paced_p99_us")
        assert direct["paced_rps"] <= 1.1 * direct["paced_rate_asked"]
        assert "direct to the workers: " in data["targets"][2]["measured"]
        assert len(direct["paced_p99_each"]) == 2
        assert max(direct["paced_p99_each"]) == direct["paced_p99_us"]
    if peers:
        nginx = proxies["nginx"]
        assert nginx["status"] == "ok", nginx["reason"]
        _positive(nginx, "cpu_us_per_request", "rps", "serial_p50_us")
        assert nginx["processes"] >= 2  # the master and its worker, summed
        assert router["ratios"]["cpu"] > 0 and router["ratios"]["rps"] > 0
        assert router["ratios"]["bound_rps"] > 0
        assert len(router["cpu_ratio_rounds"]) == 2
        assert len(nginx["added_p50_rounds"]) == 2
    assert "router" in done.stdout and "targets (router):" in done.stdout


def test_quick_micro_benchmarks_run_and_give_positive_figures(tmp_path: Path) -> None:
    out = tmp_path / "micro.json"
    done = _module("bench.micro", "--quick", "--json", str(out), timeout=QUICK_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["failures"] == {}
    figures = data["figures"]
    assert {f["bench"] for f in figures} == {"claims", "tokens", "control", "streaming", "idle"}
    for figure in figures:
        assert figure["value"] > 0 or figure["bench"] == "streaming", figure
        assert figure["value"] >= 0, figure
        assert figure["met"] is None  # quick sizes are never judged against the targets
    streams = [f["name"] for f in figures if f["bench"] == "streaming"]
    assert streams == [
        "64 MiB request: router RSS growth",
        "64 MiB reply: router RSS growth",
    ]


def test_the_in_process_hot_path_run_forwards_every_request_and_reports_its_cost() -> None:
    done = _module(
        "bench.hotpath",
        "--requests",
        "400",
        "--connections",
        "4",
        "--runs",
        "1",
        "--episodes",
        "600",
        timeout=QUICK_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr  # a non-200 reply fails the run
    [line] = [line for line in done.stdout.splitlines() if line.startswith("run 1:")]
    found = re.fullmatch(r"run 1: direct ([\d.]+) us/request, routed ([\d.]+), .*", line)
    assert found is not None, line
    direct, routed = float(found[1]), float(found[2])
    assert 0 < direct < routed, line  # routing costs more CPU than the worker alone
    assert "(400 requests, 4 connections)" in done.stdout
    # More episodes than requests: the connections share one rotation, as wrk's do.
    assert "over 600 episodes" in done.stdout


# --- full runs (EPISODE_ROUTER_BENCH=1) -------------------------------------------------------


@pytest.mark.skipif(not FULL, reason="full benchmarks run with EPISODE_ROUTER_BENCH=1")
@pytest.mark.timeout(3600)
def test_full_benchmark_and_micro_benchmarks(tmp_path: Path) -> None:
    done = _module("bench.run", "--out", str(tmp_path), timeout=3000)
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)
    micro = _module("bench.micro", "--json", str(tmp_path / "micro.json"), timeout=3000)
    assert micro.returncode == 0, micro.stdout + micro.stderr
    print(micro.stdout)
