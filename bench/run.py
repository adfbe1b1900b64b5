"""The benchmark harness: the router against nginx, HAProxy and Envoy, side by side.

`python -m bench.run [--quick] [--peers nginx,haproxy,envoy] [--install] [--profile]
[--work-us N] [--episodes N]`

It starts W trivial workers (bench.worker) that claim a fixed set of episodes
over the router's control socket, W busy workers (each spinning --work-us per
request) that claim a second set the same way, the router (`python -m
router.cli run`), and each peer it finds installed, configured for stickiness
on the episode-token header. For each proxy in turn it checks that every token
is routed (to its claiming worker, for the router; to one worker consistently,
for the peers), then measures:

- serial latency: N requests one after another on one keep-alive connection;
  the added latency is the proxy's p50 minus the direct-to-worker p50 measured
  just before it; measured every round, the columns are the rounds' medians;
- proxy-bound throughput and CPU: wrk (or the bundled generator) at C
  connections to the trivial workers, where the proxy is the bottleneck; the
  proxy's CPU time is read from /proc (utime + stime of all its processes)
  before and after, and divided by the requests it forwarded;
- latency at half of saturation: wrk with a think time per connection (or,
  without wrk, the bundled generator) paced at half the router's proxy-bound
  rate. The router is measured first, and every peer is then paced at that
  same rate, so the latencies compare at one offered load. The direct row's
  paced figures are the machine's own floor: every worker driven at once,
  straight, at rate / W on C / W connections (p50, p99: the worst worker's);
- worker-bound throughput: the same closed loop at C connections to the busy
  workers, which are then the bottleneck (what the issue's throughput target
  is about). A peer is started a second time, on the busy workers' ports, for
  it; the tokens sent are the largest subset that this proxy spreads evenly
  over the workers, so an uneven hash does not make one worker the limit.

It prints a table with ratios to nginx and the issue's targets, and writes
`bench.json`, `bench.png` (with matplotlib) and, with --profile, the router's
py-spy profile into --out. Other processes on the machine skew every figure:
ratios measured in one run are the thing to read, never absolute times.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path
from subprocess import SubprocessError
from typing import Any

from bench import load, profile
from bench.episodes import Episode, balanced_tokens, check_routing, mint_episodes
from bench.launch import (
    ROOT,
    Child,
    StartFailure,
    free_port,
    raise_fd_limit,
    start_router,
    start_server,
    start_worker,
)
from bench.peers import PEERS, find_peer, install_missing, proxy_spec, router_config
from bench.report import (
    DIRECT,
    Figures,
    Run,
    check_targets,
    fill_ratios,
    format_table,
    to_json,
    write_chart,
)
from router.build import build_name

__all__ = [
    "Settings",
    "add_direct_paced",
    "add_serial_round",
    "build_parser",
    "main",
    "run_benchmark",
    "settings_from_args",
]


@dataclass(frozen=True, slots=True)
class Settings:
    """What one run does; `quick()` is the CI size."""

    workers: int = 2
    episodes: int = 64
    connections: int = 32
    wrk_threads: int = 1
    peer_threads: int = 1  # nginx worker_processes, HAProxy nbthread, Envoy --concurrency
    load_s: float = 10.0
    paced_s: float = 5.0
    work_us: float = 400.0  # the busy workers' spin per request; 0: no worker-bound run
    # Rounds of serial latency and proxy-bound load: every proxy once a round, rounds one
    # after another; serial latency, CPU per request and rps are the medians (one shared VM
    # moves a single run by ±15% or more, a serial p50's added part by far more: nginx's
    # own moved from 63 to 112 us between two runs, so the median is of five).
    rounds: int = 5
    bound_s: float = 5.0  # the worker-bound run's length
    serial_requests: int = 5000
    serial_warmup: int = 500
    peers: tuple[str, ...] = PEERS
    use_wrk: bool = True
    profile_s: float = 0.0  # 0: no profile
    native_profile: bool = True

    @classmethod
    def quick(cls, **changes: Any) -> Settings:
        base = cls(
            episodes=16,
            connections=8,
            load_s=1.0,
            paced_s=1.0,
            bound_s=1.0,
            rounds=1,
            serial_requests=300,
            serial_warmup=50,
        )
        return _replace(base, **changes)


def _replace(settings: Settings, **changes: Any) -> Settings:
    return dataclasses.replace(settings, **changes)


# --- one proxy ---------------------------------------------------------------------------------


class Bench:
    """One run's processes and measurements."""

    def __init__(self, settings: Settings, folder: Path) -> None:
        self.settings = settings
        self.folder = folder
        self.episodes = mint_episodes(settings.episodes, settings.workers)
        # The busy workers' episodes: twice as many, so a balanced subset stays large.
        self.bound_episodes = (
            mint_episodes(2 * settings.episodes, settings.workers, "b", "bound")
            if settings.work_us > 0
            else []
        )
        self.router: Child | None = None
        self.workers: list[Child] = []
        self.busy: list[Child] = []  # the workers that spin work_us per request
        self.wrk = shutil.which("wrk") if settings.use_wrk else None
        self.paced_rate: float | None = None  # half the router's saturation, once measured
        self.direct_p50s: list[float] = []
        self.direct_p99s: list[float] = []

    # -- processes --

    def start(self) -> None:
        folder = self.folder
        control = folder / "control.sock"
        port = free_port()
        config = folder / "router.yaml"
        config.write_text(router_config(port, free_port(), control))
        self.router = start_router(config, port, folder / "router.log")
        for w in range(self.settings.workers):
            self.workers.append(self._start_worker(f"w{w}", self.episodes, 0.0))
            if self.bound_episodes:
                busy = self._start_worker(f"b{w}", self.bound_episodes, self.settings.work_us)
                self.busy.append(busy)

    def _start_worker(self, worker_id: str, episodes: list[Episode], work_us: float) -> Child:
        """A worker that claims its share of `episodes` over the router's control socket."""
        keys = [e.key for e in episodes if e.worker == worker_id]
        keys_path = self.folder / f"{worker_id}.keys.json"
        keys_path.write_text(json.dumps(keys))
        log_path = self.folder / f"{worker_id}.log"
        control = f"unix:{self.folder / 'control.sock'}"
        return start_worker(worker_id, control, keys_path, log_path, work_us)

    def stop(self) -> None:
        for child in [*self.workers, *self.busy, *([self.router] if self.router else [])]:
            child.stop()

    def start_peer(self, name: str, binary: str, busy: bool = False) -> Child:
        """Peer `name` forwarding to the trivial workers, or to the busy ones."""
        port = free_port()
        folder = self.folder / (f"{name}-bound" if busy else name)
        folder.mkdir(exist_ok=True)
        ports = [w.port for w in (self.busy if busy else self.workers)]
        spec = proxy_spec(name, binary, port, ports, folder, self.settings.peer_threads)
        spec.config_path.write_text(spec.config_text)
        return start_server(name, spec.argv, folder / f"{name}.log", port)

    # -- measurements --

    def requests_for(self, port: int) -> list[bytes]:
        return [load.build_request(e.token, port) for e in self.episodes]

    def serial(self, port: int) -> tuple[float, float]:
        s = self.settings
        ns = sorted(
            load.serial_latencies(port, self.requests_for(port), s.serial_requests, s.serial_warmup)
        )
        return load.percentile(ns, 0.5) / 1000, load.percentile(ns, 0.99) / 1000

    def direct(self) -> tuple[float, float]:
        """The serial p50 and p99 straight to the first worker, measured now."""
        p50, p99 = self.serial(self.workers[0].port)
        self.direct_p50s.append(p50)
        self.direct_p99s.append(p99)
        return p50, p99

    def saturate(self, port: int) -> load.LoadResult:
        s = self.settings
        if self.wrk is not None:
            script = self.folder / "tokens.lua"
            script.write_text(load.wrk_script([e.token for e in self.episodes]))
            return load.run_wrk(self.wrk, port, str(script), s.connections, s.wrk_threads, s.load_s)
        return load.run_async(
            load.closed_loop(port, self.requests_for(port), s.connections, s.load_s)
        )

    def serial_round(self, proxy: Child, figures: Figures) -> None:
        """One round's serial latency: direct to the first worker, then through `proxy`;
        joins `figures`' rounds, and the serial columns become the medians. The proxy's
        CPU time over its serial requests (warm-up included) joins them too, all of it
        and its user part: at one request at a time, the CPU a proxy spends per request
        is mostly on every request's path (what it does after its last write is not).
        All of it is read from schedstat, to the nanosecond: a few hundred serial
        requests can take less than one of /proc's clock ticks (10 ms), which read 0.
        The user part has only the ticks, so it is capped at the whole."""
        direct = self.direct()
        run_before = proxy.run_seconds()
        user_before, _ = proxy.cpu_split_seconds()
        through = self.serial(proxy.port)
        user_after, _ = proxy.cpu_split_seconds()
        run_after = proxy.run_seconds()
        add_serial_round(figures, direct, through)
        per_request = 1e6 / (self.settings.serial_requests + self.settings.serial_warmup)
        whole = (run_after - run_before) * per_request
        user = min((user_after - user_before) * per_request, whole)
        figures.serial_cpu_rounds.append(whole)
        figures.serial_user_rounds.append(user)
        figures.serial_cpu_us_per_request = _median(figures.serial_cpu_rounds)
        figures.serial_user_us_per_request = _median(figures.serial_user_rounds)

    def measure(self, name: str, proxy: Child) -> Figures:
        """Every figure of one proxy, already started on `proxy.port` (its first round)."""
        port = proxy.port
        check_routing(name, port, self.episodes)
        figures = Figures(name=name)
        self.serial_round(proxy, figures)
        figures.processes = len(proxy.pids())
        result = self.load_round(proxy, figures)
        figures.load_tool = result.tool
        figures.load_requests = result.requests
        figures.load_errors = result.errors
        figures.load_p50_us, figures.load_p99_us = result.p50_us, result.p99_us
        rate = self.paced_rate or result.rps / 2
        if rate > 0:
            self._paced(port, rate, figures)
        figures.rss_mib = proxy.rss_bytes() / (1 << 20)
        return figures

    def load_round(self, proxy: Child, figures: Figures) -> load.LoadResult:
        """One proxy-bound load run: its CPU per request and rps join `figures`' rounds,
        and the columns become the medians so far."""
        before = proxy.cpu_seconds()
        result = self.saturate(proxy.port)
        used = proxy.cpu_seconds() - before
        if result.requests:
            figures.cpu_rounds.append(used / result.requests * 1e6)
            figures.rps_rounds.append(result.rps)
            figures.cpu_us_per_request = _median(figures.cpu_rounds)
            figures.rps = _median(figures.rps_rounds)
        return result

    def _paced(self, port: int, rate: float, figures: Figures) -> None:
        """Latency at about `rate` requests a second: wrk with a think time per
        connection (closed loop: see load.wrk_delay_ms), else the bundled generator."""
        s = self.settings
        if self.wrk is not None:
            script = self.folder / "paced.lua"
            per_thread = max(1, s.connections // s.wrk_threads)  # wrk splits them so
            delay_ms = load.wrk_delay_ms(s.connections, rate)
            tokens = [e.token for e in self.episodes]
            script.write_text(load.paced_wrk_script(tokens, per_thread, delay_ms))
            paced = load.run_wrk(
                self.wrk, port, str(script), s.connections, s.wrk_threads, s.paced_s, rate
            )
        else:
            paced = load.run_async(
                load.paced(port, self.requests_for(port), s.connections, s.paced_s, rate)
            )
        figures.paced_tool = paced.tool
        figures.paced_rate_asked = rate
        figures.paced_errors = paced.errors
        if paced.requests:
            figures.paced_rps = paced.rps
            figures.paced_p50_us, figures.paced_p99_us = paced.p50_us, paced.p99_us

    def paced_direct(self, rate: float, figures: Figures) -> None:
        """The machine's own p99 floor at `rate`: every trivial worker driven at once,
        straight, at rate / W on C / W connections (a wrk each, concurrently, else the
        bundled generator for all on one loop); fills `figures`' paced columns."""
        s = self.settings
        ports = [w.port for w in self.workers]
        count = len(ports)
        if count == 0:
            raise RuntimeError("no workers to pace")
        each_rate = rate / count
        connections = max(1, s.connections // count)
        results: list[load.LoadResult]
        if self.wrk is not None:
            wrk = self.wrk
            script = self.folder / "paced-direct.lua"
            delay_ms = load.wrk_delay_ms(connections, each_rate)
            tokens = [e.token for e in self.episodes]
            script.write_text(load.paced_wrk_script(tokens, connections, delay_ms))

            def drive(port: int) -> load.LoadResult:
                return load.run_wrk(wrk, port, str(script), connections, 1, s.paced_s, each_rate)

            with ThreadPoolExecutor(max_workers=count) as pool:
                results = list(pool.map(drive, ports))
        else:
            runs = [
                load.paced(port, self.requests_for(port), connections, s.paced_s, each_rate)
                for port in ports
            ]
            results = load.run_async(_gathered(runs))
        add_direct_paced(figures, rate, results)

    def bound(self, name: str, proxy: Child, figures: Figures) -> None:
        """The worker-bound run: C connections through `proxy`, already started on the
        busy workers, with the tokens it spreads evenly over them; fills `figures`."""
        s = self.settings
        port = proxy.port
        answered = check_routing(name, port, self.bound_episodes)
        tokens = balanced_tokens([e.token for e in self.bound_episodes], answered, s.workers)
        figures.bound_tokens = len(tokens)
        before = proxy.cpu_seconds()
        busy_before = sum(w.cpu_seconds() for w in self.busy)
        if self.wrk is not None:
            script = self.folder / "bound.lua"
            script.write_text(load.wrk_script(tokens))
            result = load.run_wrk(
                self.wrk, port, str(script), s.connections, s.wrk_threads, s.bound_s
            )
        else:
            requests = [load.build_request(token, port) for token in tokens]
            result = load.run_async(load.closed_loop(port, requests, s.connections, s.bound_s))
        figures.bound_proxy_cores = (proxy.cpu_seconds() - before) / result.seconds
        busy_used = sum(w.cpu_seconds() for w in self.busy) - busy_before
        figures.bound_worker_cores = busy_used / result.seconds
        figures.bound_requests = result.requests
        figures.bound_errors = result.errors
        figures.bound_rps = result.rps

    def profile_router(self, out: Path) -> str:
        """Samples the router with py-spy under load; returns the hotspot table or why not."""
        binary = profile.find_py_spy()
        if binary is None or self.router is None:
            return "no profile: py-spy is not installed (pip install py-spy)"
        seconds = self.settings.profile_s
        output = out / "router-profile.txt"
        spy = profile.record(
            binary, self.router.pid, seconds, output, native=self.settings.native_profile
        )
        time.sleep(0.5)  # py-spy attaches before the load starts
        s = self.settings
        port = self.router.port
        load.run_async(load.closed_loop(port, self.requests_for(port), s.connections, seconds + 1))
        _, stderr = spy.communicate(timeout=seconds + 60)
        if spy.returncode != 0 or not output.exists():
            return f"no profile: py-spy failed: {stderr.decode(errors='replace').strip()[-500:]}"
        collapsed = output.read_text()
        hotspots = profile.format_hotspots(profile.top_functions(collapsed, 25))
        packages = profile.format_packages(profile.by_package(collapsed))
        return f"router profile ({output}):\n{packages}\n{hotspots}"


# --- the run -----------------------------------------------------------------------------------


def machine_facts() -> dict[str, Any]:
    try:
        load_average = list(os.getloadavg())
    except OSError:
        load_average = []
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "router_build": build_name(),  # compiled (mypyc) or pure-python: setup.py
        "load_average_at_start": load_average,
    }


_FAILURES = (RuntimeError, OSError, ValueError, KeyError, SubprocessError, HTTPException)


def _measure_target(
    bench: Bench,
    name: str,
    start: Callable[[bool], Child],
    stop: bool,
    say: Callable[[str], None],
) -> Figures:
    """Every figure of one proxy: `start(busy)` starts it on the trivial workers
    (False) or on the busy ones (True); `stop`: whether it is stopped after each."""
    say(f"measuring {name} ...")
    try:
        proxy = start(False)
    except (StartFailure, OSError) as exc:
        return Figures(name=name, status="failed", reason=f"did not start: {exc}")
    try:
        figures = bench.measure(name, proxy)
    except _FAILURES as exc:
        return Figures(name=name, status="failed", reason=f"{type(exc).__name__}: {exc}")
    finally:
        if stop:
            proxy.stop()
    if bench.busy:
        say(f"measuring {name}, worker-bound ...")
        figures.bound_problem = _measure_bound(bench, name, start, stop, figures)
    return figures


def _load_round(
    bench: Bench,
    measured: Sequence[Figures],
    starts: Mapping[str, Callable[[bool], Child]],
    round_number: int,
) -> None:
    """One more round of every proxy measured so far, in the same order: its serial
    latency (direct just before), then its proxy-bound load run, on one start of it."""
    for figures in measured:
        start = starts.get(figures.name)
        if figures.status != "ok" or start is None:
            continue
        try:
            proxy = start(False)
        except (StartFailure, OSError) as exc:
            figures.reason = f"a later round did not start: {exc}"
            figures.failed_rounds.append(round_number)
            continue
        try:
            bench.serial_round(proxy, figures)
            bench.load_round(proxy, figures)
        except _FAILURES as exc:
            figures.reason = f"a later round failed: {type(exc).__name__}: {exc}"
            figures.failed_rounds.append(round_number)
        finally:
            if proxy is not bench.router:
                proxy.stop()


def _measure_bound(
    bench: Bench, name: str, start: Callable[[bool], Child], stop: bool, figures: Figures
) -> str:
    """Runs `bench.bound`; returns "" or why it failed (the other figures stand)."""
    try:
        proxy = start(True)
    except (StartFailure, OSError) as exc:
        return f"did not start: {exc}"
    try:
        bench.bound(name, proxy, figures)
    except _FAILURES as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        if stop:
            proxy.stop()
    return ""


def run_benchmark(settings: Settings, out: Path, say: Callable[[str], None] = print) -> Run:
    """Runs everything and returns the figures (also written into `out`)."""
    out.mkdir(parents=True, exist_ok=True)
    raise_fd_limit(65536)
    run = Run(settings=_settings_json(settings), machine=machine_facts(), figures=[])
    direct = Figures(name=DIRECT)
    with tempfile.TemporaryDirectory(prefix="episode-router-bench-") as scratch:
        bench = Bench(settings, Path(scratch))
        try:
            bench.start()
            run.settings["load_tool"] = "wrk" if bench.wrk else "bundled"
            router = bench.router
            assert router is not None
            measured = _measure_target(bench, "router", lambda _busy: router, False, say)
            bench.paced_rate = measured.rps / 2 if measured.rps else None
            if bench.paced_rate is not None:
                say("measuring the workers directly, paced ...")
                _measure_direct_paced(bench, bench.paced_rate, direct, run)
            found = {name: find_peer(name) for name in settings.peers}
            starts: dict[str, Callable[[bool], Child]] = {"router": lambda _busy: router}
            for name in settings.peers:
                peer = found[name]
                if peer.binary is None:
                    run.figures.append(Figures(name=name, status="skipped", reason=peer.reason))
                    say(f"skipping {name}: {peer.reason}")
                    continue
                start = functools.partial(bench.start_peer, name, peer.binary)
                run.figures.append(_measure_target(bench, name, start, True, say))
                starts[name] = start
            run.figures.append(measured)
            for round_number in range(2, settings.rounds + 1):
                say(f"round {round_number} of {settings.rounds}: serial, proxy-bound load ...")
                _load_round(bench, run.figures, starts, round_number)
            if settings.profile_s > 0:
                say("profiling the router ...")
                run.notes.append(bench.profile_router(out))
        finally:
            bench.stop()
        direct.serial_p50_us = _median(bench.direct_p50s)
        direct.serial_p99_us = _median(bench.direct_p99s)
        run.figures.insert(0, direct)
    fill_ratios(run)
    run.targets = check_targets(run)
    if not bench.wrk:
        why = "--no-wrk" if not settings.use_wrk else "wrk not found: apt-get install wrk"
        run.notes.append(f"load: the bundled generator ({why})")
    _write(run, out, say)
    return run


def _measure_direct_paced(bench: Bench, rate: float, direct: Figures, run: Run) -> None:
    """Runs `bench.paced_direct` into `direct`; a failure goes to the notes (the other
    figures stand)."""
    try:
        bench.paced_direct(rate, direct)
    except _FAILURES as exc:
        run.notes.append(f"direct paced run failed: {type(exc).__name__}: {exc}")


async def _gathered(runs: Sequence[Coroutine[Any, Any, load.LoadResult]]) -> list[load.LoadResult]:
    return list(await asyncio.gather(*runs))


def _median(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def add_serial_round(
    figures: Figures, direct: tuple[float, float], proxy: tuple[float, float]
) -> None:
    """Adds one round's serial (p50, p99) through the proxy and the direct (p50, p99)
    measured just before it to `figures`' rounds; the serial and added figures become the
    medians of the rounds so far (the added ones: of each round's difference)."""
    (direct_p50, direct_p99), (p50, p99) = direct, proxy
    figures.serial_p50_rounds.append(p50)
    figures.serial_p99_rounds.append(p99)
    figures.added_p50_rounds.append(p50 - direct_p50)
    figures.added_p99_rounds.append(p99 - direct_p99)
    figures.serial_p50_us = _median(figures.serial_p50_rounds)
    figures.serial_p99_us = _median(figures.serial_p99_rounds)
    figures.added_p50_us = _median(figures.added_p50_rounds)
    figures.added_p99_us = _median(figures.added_p99_rounds)


def add_direct_paced(figures: Figures, rate: float, results: Sequence[load.LoadResult]) -> None:
    """The paced columns of the workers driven directly, each by its own generator, at
    once: `rate` in all. paced rps is the sum; p50 and p99 are the worst worker's, an upper
    bound on those of all the requests together (the p99 of a union of samples lies
    between the samples' p99s, each kept in `paced_p99_each`). Latencies only when every
    worker answered something."""
    figures.paced_rate_asked = rate
    figures.paced_tool = results[0].tool if results else None
    figures.paced_errors = sum(r.errors for r in results)
    if results and all(r.requests for r in results):
        figures.paced_rps = sum(r.rps for r in results)
        figures.paced_p50_us = max(r.p50_us for r in results)
        figures.paced_p99_us = max(r.p99_us for r in results)
        figures.paced_p99_each = [r.p99_us for r in results]


def _settings_json(settings: Settings) -> dict[str, Any]:
    data = dataclasses.asdict(settings)
    data["peers"] = list(settings.peers)
    return data


def _write(run: Run, out: Path, say: Callable[[str], None]) -> None:
    problem = write_chart(run, out / "bench.png")
    if problem is not None:
        run.notes.append(problem)
    (out / "bench.json").write_text(to_json(run))
    table = format_table(run)
    (out / "bench.txt").write_text(table + "\n")
    say(table)
    say(f"written: {out / 'bench.json'}" + ("" if problem else f", {out / 'bench.png'}"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run",
        description="The router against nginx, HAProxy and Envoy: CPU per request, "
        "throughput, added latency. Traffic stays on 127.0.0.1.",
    )
    parser.add_argument("--quick", action="store_true", help="a run of a few seconds per proxy")
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help="comma-separated peers to compare with (default: %(default)s; '' for none)",
    )
    parser.add_argument("--install", action="store_true", help="install missing peers and wrk")
    parser.add_argument("--workers", type=int, default=None, help="worker processes (default 2)")
    parser.add_argument(
        "--episodes",
        type=int,
        default=None,
        help="live episodes the trivial workers claim and the load rotates over (default 64, "
        "16 with --quick; the busy workers claim twice as many)",
    )
    parser.add_argument("--connections", type=int, default=None, help="load connections (32)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of load (10)")
    parser.add_argument("--serial", type=int, default=None, help="serial requests (5000)")
    parser.add_argument("--peer-threads", type=int, default=None, help="threads per peer (1)")
    parser.add_argument("--no-wrk", action="store_true", help="use the bundled load generator")
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="serial and proxy-bound load runs per proxy, interleaved; serial latency, CPU "
        "and rps are their medians (default 5, 1 with --quick)",
    )
    parser.add_argument(
        "--work-us",
        type=float,
        default=None,
        help="the busy workers' spin per request, for the worker-bound throughput "
        "(default 400; 0: no worker-bound run)",
    )
    parser.add_argument(
        "--profile", type=float, default=0.0, metavar="SECONDS", help="py-spy the router"
    )
    parser.add_argument("--no-native", action="store_true", help="profile Python frames only")
    parser.add_argument(
        "--out", default=str(ROOT / "bench" / "results"), help="where results are written"
    )
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peers {unknown}; choose from {', '.join(PEERS)}")
    changes: dict[str, Any] = {
        "peers": peers,
        "use_wrk": not args.no_wrk,
        "profile_s": args.profile,
        "native_profile": not args.no_native,
    }
    if args.rounds is not None:
        if args.rounds < 1:
            raise ValueError("--rounds must be at least 1")
        changes["rounds"] = args.rounds
    if args.work_us is not None:
        if args.work_us < 0:
            raise ValueError("--work-us must not be negative")
        changes["work_us"] = args.work_us
    for option, name in (
        ("workers", "workers"),
        ("episodes", "episodes"),
        ("connections", "connections"),
        ("duration", "load_s"),
        ("serial", "serial_requests"),
        ("peer_threads", "peer_threads"),
    ):
        value = getattr(args, option)
        if value is not None:
            if value <= 0:
                raise ValueError(f"--{option.replace('_', '-')} must be positive")
            changes[name] = value
    return Settings.quick(**changes) if args.quick else _replace(Settings(), **changes)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; 0 when the router was measured, 1 when it failed."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.install:
        install_missing(settings.peers, print)
    run = run_benchmark(settings, Path(args.out))
    return 0 if run.by_name("router") is not None else 1


if __name__ == "__main__":
    sys.exit(main())
