"""The fleet benchmark: routers sharing one claims directory on Redis (design §10), measured.

`python -m bench.fleet [--quick] [--episodes N] [--rounds R] [--lease S] [--no-wrk]`

It starts a `redis-server` of its own on a free loopback port (nothing persisted), three
routers (`python -m router.cli run`) on 127.0.0.1, each with W bench.worker processes
that claim their episodes over that router's control socket, and stops every process by
its pid at the end:

- L: no `directory:`, its workers claiming the hit set H (the single router as before);
- A: `directory:` and `peer:`, its workers claiming the same set H (so A and L route the
  same tokens), plus an ended set E claimed and released over its control socket by
  this process (their owner records ended in Redis);
- B: `directory:` and `peer:`, its workers claiming a set H_B of its own; it forwards
  through peer listeners only (`peer.direct: false`), as a router of another pod does;
- C: `directory:` and `peer:`, no workers: a router of A's host (`peer.direct`, as A),
  which sends A's episodes straight to A's workers (shape B).

An absent set X is never claimed. The default workload is 4,096 live episodes in each
set, requests rotating over all of them. In interleaved rounds (every figure once a
round, medians over the rounds) it measures:

1. local hits: A's and L's CPU per request (schedstat, from /proc) under the same
   closed-loop load on H, and the Redis commands sent meanwhile;
2. misses: A's CPU per request on X (401 after a lookup) and on E (410) minus L's per
   local 401 on the same tokens, warm (the lookup cache answers) and cold (fresh absent
   tokens, one serial request each: every one a lookup), and Redis lookups per request;
   beside them, two bench.roundtrip servers driven the same way, one answering at once
   and one after a PING to the same Redis: the difference is what one round trip costs
   a process here: the part of a serial first ask that is the round trip's;
3. peer-forwarded against direct: serial p50 through B (forwarded to A) and through A,
   each minus the worker's own p50, and the CPU per request of A + B against A's,
   serially and under the same closed-loop load; the direct requests once more at the
   forwarded pace (the client pausing, after each reply, the forwarded request's extra
   latency), so that A idles as long between requests as the chain's routers do; and
   the same through C (straight to A's worker), with the CPU of A + C;
4. two routers on one host against one: the closed loop split over A (on H) and B (on
   H_B) against all of it on A: requests per second and CPU per request;
5. from `kill -9` of a router, and from its SIGTERM, to a 410 for its key on A (polled
   every 50 ms), one fresh victim router per measurement, with every answer's status
   and the router's error code on the way (the "answers:" line).

Redis commands are counted with MONITOR (a connection of this process), by command and,
for EVALSHA, by the directory's script; the heartbeat, the sweep, the membership read
and the invalidation channel's PING are background, counted apart. Traffic stays on
127.0.0.1. Other processes on the machine move every figure: read the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from bench import load
from bench.directory import redis_server
from bench.episodes import Episode, mint_episodes
from bench.launch import (
    Child,
    free_port,
    raise_fd_limit,
    start_router,
    start_server,
    start_worker,
)
from bench.procstat import run_seconds
from router.directory.scripts import Script, script_source
from router.worker.client import ControlClient

__all__ = [
    "BACKGROUND",
    "Row",
    "Settings",
    "classify_monitor_line",
    "format_rows",
    "main",
    "median",
    "run_fleet",
    "script_names",
]

POLL_S = 0.05  # item 5: a key of the killed router asked for every 50 ms
KILL_TIMEOUT_FACTOR = 3.0  # a 410 later than three leases after the kill is a failure
# Sent on timers whatever the traffic (they come as often during L's runs, when the
# directory's routers get no request): the heartbeat, the sweep of lapsed records, the
# membership read (HGETALL, with TIME in its pipeline) and the invalidation channel's
# PING. Counted apart.
BACKGROUND = frozenset({"PING", "heartbeat", "sweep", "HGETALL", "TIME"})
PEER_SECRET = "bench-fleet-peer-secret-0123456789"  # loopback only; at least 16 bytes


@dataclass(frozen=True, slots=True)
class Settings:
    """What one run does; `quick()` is the CI size."""

    episodes: int = 4096  # in each of H, H_B, X and E
    workers: int = 2  # per router
    connections: int = 32
    load_s: float = 5.0
    rounds: int = 3
    serial_requests: int = 3000
    serial_warmup: int = 300
    cold_requests: int = 2000  # fresh absent tokens per cold-miss sample
    # Fresh absent tokens for the cold misses under load (each asked once: more than the
    # closed-loop run answers, else the load wraps onto cached answers, which is counted).
    cold_load_tokens: int = 40_000
    cold_load_s: float = 1.5  # 40,000 tokens outlast 1.5 s at up to 26,000 requests/s
    # A's episodes the forwarded requests rotate over: a pass over them takes well under
    # a lease (about 1.5 ms a forwarded serial request here), so an episode's later
    # calls find its owner's answer cached, as a rollout's calls do.
    forward_tokens: int = 1024
    lease_s: float = 10.0
    lookup_timeout_ms: int = 50
    kill_rounds: int = 1
    use_wrk: bool = True

    @classmethod
    def quick(cls, **changes: Any) -> Settings:
        base = cls(
            episodes=128,
            connections=8,
            load_s=1.0,
            rounds=1,
            serial_requests=200,
            serial_warmup=20,
            cold_requests=100,
            cold_load_tokens=3000,
            cold_load_s=1.0,
            forward_tokens=64,
            lease_s=2.0,
            lookup_timeout_ms=500,
        )
        return dataclasses.replace(base, **changes)


# --- pure parts ------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


def script_names() -> dict[str, str]:
    """The directory's scripts by the SHA-1 EVALSHA names them with."""
    names = {}
    for script in Script:
        text = script_source(script).encode()
        names[hashlib.sha1(text, usedforsecurity=False).hexdigest()] = script.value
    return names


# `+1733089123.456789 [0 127.0.0.1:43210] "EVALSHA" "3f2a..." "1" ...`; the client is
# `lua` for a command a script ran (not sent by a router: not counted).
_MONITOR_LINE = re.compile(r'^\+?[\d.]+ \[\d+ ([^\]]+)\] "([^"]*)"(?: "([^"]*)")?')


def classify_monitor_line(line: str, scripts: dict[str, str]) -> str | None:
    """What one MONITOR line counts as: the command's name, or for EVALSHA the script's
    name (`lookup`, `heartbeat`, ...); None for a script's own commands or a line that
    is not a command."""
    match = _MONITOR_LINE.match(line)
    if match is None or match.group(1) == "lua":
        return None
    command = match.group(2).upper()
    if command == "EVALSHA" and match.group(3) is not None:
        return scripts.get(match.group(3).lower(), "EVALSHA")
    return command


def sent(counts: Counter[str]) -> int:
    """Commands in `counts` other than the background ones."""
    return sum(n for name, n in counts.items() if name not in BACKGROUND)


@dataclass(slots=True)
class Row:
    """One printed figure against its target."""

    item: str
    name: str
    value: float | None
    unit: str
    target: str = ""
    met: bool | None = None  # None: no target, or not judged (a quick run)
    note: str = ""


def format_rows(rows: Sequence[Row]) -> str:
    lines = [f"{'item':4} {'figure':58} {'value':>12}  target / verdict"]
    for row in rows:
        value = "failed" if row.value is None else f"{row.value:,.2f} {row.unit}"
        verdict = {True: " [met]", False: " [NOT met]", None: ""}[row.met]
        target = f"{row.target}{verdict}" if row.target else ""
        note = f"  ({row.note})" if row.note else ""
        lines.append(f"{row.item:4} {row.name:58} {value:>12}  {target}{note}")
    return "\n".join(lines)


def ratio(top: float | None, bottom: float | None) -> float | None:
    if top is None or bottom is None or bottom <= 0:
        return None
    return top / bottom


# --- Redis's side ------------------------------------------------------------------------------


class CommandLog:
    """Every command Redis receives from a router, counted by name (MONITOR, in a thread)."""

    def __init__(self, port: int) -> None:
        self._scripts = script_names()
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self._sock.sendall(b"MONITOR\r\n")
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        buffered = b""
        self._sock.settimeout(0.2)
        while not self._stopped.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            buffered += data
            *lines, buffered = buffered.split(b"\r\n")
            names = [
                classify_monitor_line(x.decode(errors="replace"), self._scripts) for x in lines
            ]
            with self._lock:
                self._counts.update(name for name in names if name is not None)

    def snapshot(self) -> Counter[str]:
        time.sleep(0.2)  # commands already sent reach the log first
        with self._lock:
            return Counter(self._counts)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=2)
        self._sock.close()


# --- the processes -----------------------------------------------------------------------------


@dataclass(slots=True)
class RouterSet:
    """One router process and its workers."""

    name: str
    router: Child
    admin_port: int
    workers: list[Child] = field(default_factory=list)

    def forwards(self) -> dict[str, float]:
        """Its `episode_router_peer_forwards_total` by outcome, from its admin /metrics."""
        url = f"http://127.0.0.1:{self.admin_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as reply:
            text = reply.read().decode()
        found = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "episode_router_peer_forwards_total":
                    found[sample.labels["outcome"]] = sample.value
        return found

    def stop(self, how: signal.Signals = signal.SIGTERM) -> None:
        if how is signal.SIGKILL and self.router.process.poll() is None:
            self.router.process.kill()
            self.router.process.wait(10)
        self.router.stop()
        for worker in self.workers:
            worker.stop()


def router_config(
    folder: Path,
    port: int,
    directory_url: str | None,
    router_id: str,
    settings: Settings,
    direct: bool = False,
    admin_port: int = 0,
) -> str:
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": admin_port or free_port()},
        "control": {"socket": f"unix:{folder / 'control.sock'}"},
        "log": {"level": "warning"},
        # Unknown keys are 503 while a started router waits for its workers' syncs
        # (design §3); the benchmark's workers claim before it measures.
        "claims": {"recovery_window_s": 1},
    }
    if directory_url is not None:
        secret = folder / "peer.secret"
        secret.write_text(PEER_SECRET)
        secret.chmod(0o600)
        config["directory"] = {
            "url": directory_url,
            "router_id": router_id,
            "lease_ttl_s": settings.lease_s,
            "lookup_timeout_ms": settings.lookup_timeout_ms,
        }
        config["peer"] = {
            "listen": f"127.0.0.1:{free_port()}",
            "secret_file": str(secret),
            "direct": direct,
        }
    return json.dumps(config, indent=1) + "\n"


def start_router_set(
    folder: Path,
    name: str,
    directory_url: str | None,
    episodes: Sequence[Episode],
    settings: Settings,
    workers: int,
    direct: bool = False,
) -> RouterSet:
    """A router named `name` and `workers` bench.workers claiming `episodes` over its
    control socket (returned once every claim is acknowledged: through the directory,
    for a router with one); `direct`: `peer.direct`, straight to (and publishing) the
    workers of the routers of this host."""
    folder.mkdir()
    port, admin_port = free_port(), free_port()
    config = folder / "router.yaml"
    config.write_text(
        router_config(folder, port, directory_url, name, settings, direct, admin_port)
    )
    started = RouterSet(name, start_router(config, port, folder / "router.log"), admin_port)
    try:
        for w in range(workers):
            keys = [e.key for i, e in enumerate(episodes) if i % workers == w]
            keys_path = folder / f"w{w}.keys.json"
            keys_path.write_text(json.dumps(keys))
            control = f"unix:{folder / 'control.sock'}"
            worker = start_worker(f"{name}-w{w}", control, keys_path, folder / f"w{w}.log")
            started.workers.append(worker)
    except BaseException:
        started.stop()
        raise
    return started


async def claim_and_end(control: str, keys: Sequence[str], url: str) -> None:
    """Claims `keys` over a router's control socket and releases them: their owner records
    end in the directory (written after the release, in the background)."""
    client = ControlClient(control, worker_id="bench-ender", url=url)
    await client.start()
    try:
        for key in keys:
            await client.claim(key)
        for key in keys:
            await client.release(key)
    finally:
        await client.stop()


def wait_for_ended(redis_port: int, keys: Sequence[str], timeout_s: float) -> None:
    """Until every owner record of `keys` is ended in Redis (state `e`)."""
    owner = "{episode-router}:owner:episode:"
    deadline = time.monotonic() + timeout_s
    with socket.create_connection(("127.0.0.1", redis_port), timeout=5) as sock:
        reader = sock.makefile("rb")
        for key in keys:
            while True:
                record = owner + key
                sock.sendall(f"HGET {record} s\r\n".encode())
                reply = reader.readline()
                if reply.startswith(b"$1"):
                    value = reader.readline().strip()
                    if value == b"e":
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the record of {key} did not end in {timeout_s:g} s")
                time.sleep(0.05)


# --- load --------------------------------------------------------------------------------------


def serial_statuses(
    port: int, requests: Sequence[bytes], count: int, pause_s: float = 0.0
) -> tuple[list[int], Counter[int]]:
    """`count` requests one after another on one keep-alive connection: each latency (ns)
    and the statuses (a connection the router closes is opened again). With `pause_s`,
    the client spins that long after each reply before the next request (a spin, not a
    sleep: a sleep this short overshoots by the timer's slack, tens of µs)."""
    latencies: list[int] = []
    statuses: Counter[int] = Counter()
    clock = time.perf_counter_ns
    sock: socket.socket | None = None
    parser = load.ReplyParser()
    try:
        for index in range(count):
            if sock is None:
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                parser = load.ReplyParser()
            started = clock()
            sock.sendall(requests[index % len(requests)])
            while True:
                data = sock.recv(65536)
                if not data:
                    raise OSError("the router closed the connection under a request")
                if parser.feed(data):
                    break
            latencies.append(clock() - started)
            statuses[parser.statuses[-1]] += 1
            if pause_s:
                until = time.perf_counter() + pause_s
                while time.perf_counter() < until:
                    pass
    finally:
        if sock is not None:
            sock.close()
    return latencies, statuses


_ERROR_CODE = re.compile(rb'"error":\s*"([a-z_]+)"')


def one_answer(port: int, request: bytes) -> str:
    """One request on a connection of its own: its status, and the router's error code
    for an answer of its own ("503 owner_unreachable"), read from the JSON body."""
    parser = load.ReplyParser()
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError("the router closed the connection under a request")
            data += chunk
            if parser.feed(chunk):
                break
    status = parser.statuses[-1]
    found = _ERROR_CODE.search(data) if status >= 400 else None
    return f"{status} {found.group(1).decode()}" if found else str(status)


def start_reference(folder: Path, mode: str, redis_port: int) -> Child:
    """A bench.roundtrip server (`mode` answer or roundtrip), waited for until it serves."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.roundtrip", "--mode", mode, "--port", str(port)]
    argv += ["--redis-port", str(redis_port)]
    return start_server(f"roundtrip-{mode}", argv, folder / f"roundtrip-{mode}.log", port)


class Loader:
    """Closed-loop load: wrk when installed (and asked for), else the bundled generator."""

    def __init__(self, folder: Path, settings: Settings) -> None:
        self.folder = folder
        self.settings = settings
        self.wrk = shutil.which("wrk") if settings.use_wrk else None
        self._scripts: dict[str, str] = {}

    @property
    def tool(self) -> str:
        return "wrk" if self.wrk else "bundled"

    def closed(
        self,
        port: int,
        name: str,
        tokens: Sequence[str],
        connections: int,
        seconds: float | None = None,
    ) -> load.LoadResult:
        s = self.settings
        seconds = s.load_s if seconds is None else seconds
        if self.wrk is not None:
            script = self._scripts.get(name)
            if script is None:
                path = self.folder / f"{name}.lua"
                path.write_text(load.wrk_script(tokens))
                script = self._scripts[name] = str(path)
            return load.run_wrk(self.wrk, port, script, connections, 1, seconds)
        requests = [load.build_request(token, port) for token in tokens]
        return load.run_async(load.closed_loop(port, requests, connections, seconds))


# --- the benchmark -----------------------------------------------------------------------------


@dataclass(slots=True)
class Samples:
    """Every round's figure, by name."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, name: str, value: float | None) -> None:
        if value is not None:
            self.values.setdefault(name, []).append(value)

    def median(self, name: str) -> float | None:
        return median(self.values.get(name, []))


class FleetBench:
    """One run's processes and measurements."""

    def __init__(self, settings: Settings, folder: Path, redis_port: int, redis_pid: int) -> None:
        self.settings = settings
        self.folder = folder
        self.redis_port = redis_port
        self.redis_pid = redis_pid
        self.url = f"redis://127.0.0.1:{redis_port}/0"
        n = settings.episodes
        self.held = mint_episodes(n, settings.workers, "a", "held")
        self.held_b = mint_episodes(n, settings.workers, "b", "held-b")
        self.absent = mint_episodes(n, 1, "x", "absent")
        self.ended = mint_episodes(n, 1, "e", "ended")
        self.sets: dict[str, RouterSet] = {}
        # Two bench.roundtrip servers: one answers at once, one after a PING to Redis.
        self.references: dict[str, Child] = {}
        self.loader = Loader(folder, settings)
        self.log = CommandLog(redis_port)
        self.samples = Samples()
        self.statuses: dict[str, Counter[int]] = {}
        self.answers: dict[str, Counter[str]] = {}  # by status and error code
        self.commands: Counter[str] = Counter()  # non-background commands during load runs
        self._cold_count = 0
        self.last_requests = 0  # answered in the last closed-loop sample

    def start(self, say: Callable[[str], None]) -> None:
        s = self.settings
        say(f"starting routers L (no directory), A and B, {s.workers} workers each, and C ...")
        self.sets["L"] = start_router_set(self.folder / "L", "L", None, self.held, s, s.workers)
        self.sets["A"] = start_router_set(
            self.folder / "A", "A", self.url, self.held, s, s.workers, direct=True
        )
        self.sets["B"] = start_router_set(
            self.folder / "B", "B", self.url, self.held_b, s, s.workers
        )
        self.sets["C"] = start_router_set(self.folder / "C", "C", self.url, (), s, 0, direct=True)
        for mode in ("answer", "roundtrip"):
            self.references[mode] = start_reference(self.folder, mode, self.redis_port)
        say(f"ending {len(self.ended)} episodes through A ...")
        control = f"unix:{self.folder / 'A' / 'control.sock'}"
        ender_url = f"http://127.0.0.1:{free_port()}"  # never forwarded to: its keys end
        load.run_async(claim_and_end(control, [e.key for e in self.ended], ender_url))
        wait_for_ended(self.redis_port, [e.key for e in self.ended], 60.0)
        # A fleet record younger than one lease answers absent keys 503 (design §10).
        settle = s.lease_s + 0.5
        say(f"waiting {settle:g} s for the fleet to settle (one lease) ...")
        time.sleep(settle)

    def stop(self) -> None:
        self.log.close()
        for router_set in self.sets.values():
            router_set.stop()
        for reference in self.references.values():
            reference.stop()

    def port(self, name: str) -> int:
        return self.sets[name].router.port

    def cpu(self, *names: str) -> float:
        """The CPU time the routers `names` have run, to the nanosecond (schedstat: a
        quick run's serial passes can take less than one of /proc's clock ticks)."""
        return sum(self.sets[name].router.run_seconds() for name in names)

    # -- one closed-loop sample --

    def closed_sample(
        self, router: str, tokens_name: str, tokens: Sequence[str], seconds: float | None = None
    ) -> tuple[float, float, int]:
        """CPU us per request, requests/s and non-background Redis commands of one
        closed-loop run on `router` cycling over `tokens` (for `seconds`, else load_s)."""
        before_cpu, before_log = self.cpu(router), self.log.snapshot()
        result = self.loader.closed(
            self.port(router), tokens_name, tokens, self.settings.connections, seconds
        )
        used = self.cpu(router) - before_cpu
        counts = self.log.snapshot() - before_log
        commands = sent(counts)
        for name, n in counts.items():
            if name not in BACKGROUND:
                self.commands[f"{router} {tokens_name}: {name}"] += n
        if not result.requests:
            raise RuntimeError(f"no request answered by {router} on {tokens_name}")
        self.last_requests = result.requests
        return used / result.requests * 1e6, result.rps, commands

    def check_statuses(self, router: str, name: str, tokens: Sequence[str]) -> Counter[int]:
        """One pass over every token, serially: the statuses the router answers."""
        requests = [load.build_request(t, self.port(router)) for t in tokens]
        _, statuses = serial_statuses(self.port(router), requests, len(requests))
        self.statuses[f"{router} {name}"] = statuses
        return statuses

    # -- the items --

    def hits(self) -> None:
        tokens = [e.token for e in self.held]
        cpu_l, _, _ = self.closed_sample("L", "held", tokens)
        cpu_a, _, commands = self.closed_sample("A", "held", tokens)
        self.samples.add("hit cpu L", cpu_l)
        self.samples.add("hit cpu A", cpu_a)
        self.samples.add("hit ratio", ratio(cpu_a, cpu_l))
        self.samples.add("hit commands", commands)

    def misses(self) -> None:
        for name, episodes in (("absent", self.absent), ("ended", self.ended)):
            tokens = [e.token for e in episodes]
            cpu_l, _, _ = self.closed_sample("L", name, tokens)
            cpu_a, rps_a, commands = self.closed_sample("A", name, tokens)
            self.samples.add(f"{name} warm added", cpu_a - cpu_l)
            self.samples.add(
                f"{name} warm commands", commands / max(1.0, rps_a * self.settings.load_s)
            )
        self.cold_misses()
        self.cold_misses_under_load()

    def cold_misses(self) -> None:
        """Fresh absent tokens, one serial request each: every one a lookup on A; the same
        number of other fresh tokens on L (each router parses each token once); and the
        same requests on the two bench.roundtrip servers, whose difference is one Redis
        round trip's CPU here (the floor of a serial first ask). CPU from schedstat."""
        count = self.settings.cold_requests
        self._cold_count += 1
        figures = {}
        ports = {"L": self.port("L"), "A": self.port("A")}
        pids = {"L": self.sets["L"].router.pid, "A": self.sets["A"].router.pid}
        for mode, reference in self.references.items():
            ports[mode], pids[mode] = reference.port, reference.pid
        for name, port in ports.items():
            fresh = mint_episodes(count, 1, "c", f"cold-{name}-{self._cold_count}")
            requests = [load.build_request(e.token, port) for e in fresh]
            before_cpu, before_log = run_seconds(pids[name]), self.log.snapshot()
            _, statuses = serial_statuses(port, requests, count)
            used = run_seconds(pids[name]) - before_cpu
            counts = self.log.snapshot() - before_log
            if name in self.sets:
                self.statuses[f"{name} cold absent"] = statuses
            figures[name] = (used / count * 1e6, counts)
        added = figures["A"][0] - figures["L"][0]
        round_trip = figures["roundtrip"][0] - figures["answer"][0]
        self.samples.add("cold added", added)
        self.samples.add("round trip cpu", round_trip)
        self.samples.add("cold added less round trip", added - round_trip)
        self.samples.add("cold commands", sent(figures["A"][1]) / count)
        self.samples.add("cold lookups", figures["A"][1]["lookup"] / count)

    def cold_misses_under_load(self) -> None:
        """Fresh absent tokens under closed-loop load: the lookups of one loop turn go
        out in one script call, so the round trip's cost is shared. L gets as many
        fresh tokens of its own (each router checks each token once)."""
        figures = {}
        for router in ("L", "A"):
            self._cold_count += 1
            fresh = mint_episodes(self.settings.cold_load_tokens, 1, "c", f"cl-{self._cold_count}")
            tokens = [e.token for e in fresh]
            name = f"cold-load-{self._cold_count}"
            before_log = self.log.snapshot()
            cpu, _, _ = self.closed_sample(router, name, tokens, self.settings.cold_load_s)
            counts = self.log.snapshot() - before_log
            figures[router] = (cpu, counts)
        answered = self.last_requests
        self.samples.add("cold load added", figures["A"][0] - figures["L"][0])
        lookups = figures["A"][1]["lookup"]
        self.samples.add("cold load keys per lookup", answered / max(1, lookups))
        self.samples.add("cold load wrapped", max(0, answered - len(tokens)) / max(1, answered))

    def forwarded(self) -> None:
        """Serial requests for A's episodes, straight to A's worker, via A, and via B
        (forwarded to A). The episodes are the first `forward_tokens` of A's set, each
        asked once through A and B before the timed requests (an episode's first call
        on a router looks its owner up; its later calls within the owner's lease are
        answered from the lookup cache): `first_forward` times those first calls."""
        s = self.settings
        count = s.serial_requests + s.serial_warmup
        tokens = [e.token for e in self.held[: s.forward_tokens]]
        worker_port = self.sets["A"].workers[0].port
        own = [load.build_request(t, worker_port) for t in tokens]
        p50s = {}
        ns, _ = serial_statuses(worker_port, own, count)
        p50s["worker"] = load.percentile(sorted(ns[s.serial_warmup :]), 0.5) / 1000
        self.first_forward(tokens, p50s["worker"])
        cpu = {}
        for via in ("A", "B", "C"):
            routers = ("A", via if via != "A" else "B")  # the sender's CPU and the owner's
            requests = [load.build_request(t, self.port(via)) for t in tokens]
            before, before_log = self.cpu(*routers), self.log.snapshot()
            ns, statuses = serial_statuses(self.port(via), requests, count)
            cpu[via] = (self.cpu(*routers) - before) / count * 1e6
            lookups = (self.log.snapshot() - before_log)["lookup"]
            self.samples.add(f"{via} serial lookups", lookups / count)
            self.statuses[f"{via} serial held"] = statuses
            p50s[via] = load.percentile(sorted(ns[s.serial_warmup :]), 0.5) / 1000
        direct, hop = p50s["A"] - p50s["worker"], p50s["B"] - p50s["worker"]
        straight = p50s["C"] - p50s["worker"]
        # The direct requests again, the client pausing after each reply for as long as
        # a forwarded request takes longer: each router then idles between its requests
        # as long as A and B do in the chain. A process that idles longer wakes to colder
        # caches and pays more CPU a request for the same work (docs/performance.md,
        # "Serial figures and idle time"); this pass shows that share of the ratio.
        requests = [load.build_request(t, self.port("A")) for t in tokens]
        before = self.cpu("A", "B")
        serial_statuses(self.port("A"), requests, count, max(0.0, hop - direct) / 1e6)
        paced = (self.cpu("A", "B") - before) / count * 1e6
        self.samples.add("direct paced serial cpu", paced)
        self.samples.add("forwarded paced cpu ratio", ratio(cpu["B"], paced))
        self.samples.add("direct added p50", direct)
        self.samples.add("forwarded added p50", hop)
        self.samples.add("forwarded p50 ratio", ratio(hop, direct))
        self.samples.add("straight added p50", straight)
        self.samples.add("straight p50 ratio", ratio(straight, direct))
        self.samples.add("direct serial cpu", cpu["A"])
        self.samples.add("forwarded serial cpu", cpu["B"])
        self.samples.add("forwarded cpu ratio", ratio(cpu["B"], cpu["A"]))
        self.samples.add("straight serial cpu", cpu["C"])
        self.samples.add("straight cpu ratio", ratio(cpu["C"], cpu["A"]))
        # The same episodes under closed-loop load: a serial request's CPU is mostly
        # its routers' wake-ups (two more processes in the chain), a loaded one's their
        # work per request.
        loaded = {}
        for via in ("A", "B", "C"):
            routers = ("A", via if via != "A" else "B")
            before = self.cpu(*routers)
            result = self.loader.closed(self.port(via), "forwarded", tokens, s.connections)
            if not result.requests:
                raise RuntimeError(f"no request answered via {via} under load")
            loaded[via] = (self.cpu(*routers) - before) / result.requests * 1e6
            self.samples.add(f"{via} load errors", result.errors)
        self.samples.add("direct load cpu", loaded["A"])
        self.samples.add("forwarded load cpu", loaded["B"])
        self.samples.add("forwarded load cpu ratio", ratio(loaded["B"], loaded["A"]))
        self.samples.add("straight load cpu", loaded["C"])
        outcomes = self.sets["C"].forwards()
        self.samples.add(
            "straight share", outcomes.get("direct", 0) / max(1, sum(outcomes.values()))
        )
        self.samples.add("straight load cpu ratio", ratio(loaded["C"], loaded["A"]))

    def first_forward(self, tokens: Sequence[str], worker_p50_us: float) -> None:
        """Each episode's first call through B (its owner looked up), one pass over
        `tokens`; the same pass through A first, so A's side is as warm for both, and
        through C after (untimed), so C's timed calls are later calls too."""
        for via in ("A", "B"):
            requests = [load.build_request(t, self.port(via)) for t in tokens]
            before_log = self.log.snapshot()
            ns, statuses = serial_statuses(self.port(via), requests, len(requests))
            self.statuses[f"{via} first call"] = statuses
        lookups = (self.log.snapshot() - before_log)["lookup"]
        self.samples.add("first forward lookups", lookups / len(requests))
        p50 = load.percentile(sorted(ns), 0.5) / 1000
        self.samples.add("first forward added p50", p50 - worker_p50_us)
        requests = [load.build_request(t, self.port("C")) for t in tokens]
        _, self.statuses["C first call"] = serial_statuses(self.port("C"), requests, len(tokens))

    def two_routers(self) -> None:
        s = self.settings
        held = [e.token for e in self.held]
        held_b = [e.token for e in self.held_b]
        cpu_one, rps_one, _ = self.closed_sample("A", "held", held)
        half = max(1, s.connections // 2)
        before = self.cpu("A", "B")
        with ThreadPoolExecutor(2) as pool:
            runs = [
                pool.submit(self.loader.closed, self.port("A"), "held", held, half),
                pool.submit(self.loader.closed, self.port("B"), "held-b", held_b, half),
            ]
            results = [run.result() for run in runs]
        used = self.cpu("A", "B") - before
        requests = sum(r.requests for r in results)
        self.samples.add("one router rps", rps_one)
        self.samples.add("one router cpu", cpu_one)
        self.samples.add("two routers rps", sum(r.rps for r in results))
        self.samples.add("two routers cpu", used / max(1, requests) * 1e6)

    def death(self, how: signal.Signals, number: int) -> float:
        """Seconds from `how` to a router, to a 410 on A for a key it held."""
        s = self.settings
        name = f"V{number}"
        victim_keys = mint_episodes(4, 1, "v", f"victim-{number}")
        victim = start_router_set(self.folder / name, name, self.url, victim_keys, s, 1)
        request = load.build_request(victim_keys[0].token, self.port("A"))
        try:
            _, statuses = serial_statuses(self.port("A"), [request], 1)
            if statuses[200] != 1:
                raise RuntimeError(f"A did not forward the victim's key: {dict(statuses)}")
            killed_at = time.monotonic()
            if how is signal.SIGKILL:
                victim.router.process.kill()
            else:
                victim.router.process.send_signal(how)
            deadline = killed_at + KILL_TIMEOUT_FACTOR * s.lease_s + 5
            seen: Counter[str] = Counter()
            while time.monotonic() < deadline:
                answer = one_answer(self.port("A"), request)
                seen[answer] += 1
                if answer.startswith("410"):
                    self.answers[f"A after {how.name} of {name}"] = seen
                    return time.monotonic() - killed_at
                time.sleep(POLL_S)
            raise RuntimeError(f"no 410 within {deadline - killed_at:.1f} s: {dict(seen)}")
        finally:
            victim.stop(signal.SIGKILL if how is signal.SIGKILL else signal.SIGTERM)

    def round(self, say: Callable[[str], None], number: int) -> None:
        say(f"round {number} of {self.settings.rounds}: hits, misses, forwarded, two routers ...")
        self.hits()
        self.misses()
        self.forwarded()
        self.two_routers()

    def deaths(self, say: Callable[[str], None]) -> None:
        total = self.settings.kill_rounds
        for number in range(total):
            say(f"kill -9 and SIGTERM of a victim router ({number + 1} of {total}) ...")
            self.samples.add("kill -9 to 410", self.death(signal.SIGKILL, 2 * number))
            self.samples.add("SIGTERM to 410", self.death(signal.SIGTERM, 2 * number + 1))


def rows_of(bench: FleetBench, full: bool) -> list[Row]:
    """The printed figures; targets judged only at full size."""
    m = bench.samples.median
    s = bench.settings

    def judged(value: float | None, ok: Callable[[float], bool]) -> bool | None:
        return ok(value) if full and value is not None else None

    hit_ratio, commands = m("hit ratio"), m("hit commands")
    rows = [
        Row("1", "L (no directory): CPU per local hit", m("hit cpu L"), "us"),
        Row("1", "A (directory): CPU per local hit", m("hit cpu A"), "us"),
        Row("1", "A / L, CPU per local hit", hit_ratio, "x", "<= 1.03",
            judged(hit_ratio, lambda v: v <= 1.03)),
        Row("1", "Redis commands sent during A's hits", commands, "", "0",
            commands == 0 if commands is not None else None, "heartbeat and PING apart"),
    ]  # fmt: skip
    for name, answer in (("absent", "401"), ("ended", "410")):
        added = m(f"{name} warm added")
        rows.append(
            Row("2", f"{name} key ({answer}), cached: CPU added over L's local 401", added, "us",
                "<= 10", judged(added, lambda v: v <= 10))
        )  # fmt: skip
        rows.append(Row("2", f"{name} key ({answer}), cached: Redis commands per request",
                        m(f"{name} warm commands"), ""))  # fmt: skip
    cold, beyond = m("cold added"), m("cold added less round trip")
    rows += [
        Row("2", "absent key (401), first ask (serial): CPU added over L's", cold, "us"),
        Row("2", "one Redis round trip, serial: CPU in a minimal server (bench.roundtrip)",
            m("round trip cpu"), "us"),
        Row("2", "absent key, first ask (serial): CPU added less that round trip", beyond, "us",
            "<= 10", judged(beyond, lambda v: v <= 10), "10 us and one round trip"),
        Row("2", "absent key, first ask: lookups (EVALSHA) per request", m("cold lookups"), "",
            "<= 1", judged(m("cold lookups"), lambda v: v <= 1.0)),
        Row("2", "absent key, first ask: Redis commands per request", m("cold commands"), ""),
        Row("2", "absent key, first ask under load (batched): CPU added over L's",
            m("cold load added"), "us", "<= 10", judged(m("cold load added"), lambda v: v <= 10)),
        Row("2", "absent key, first ask under load: requests per lookup call",
            m("cold load keys per lookup"), ""),
        Row("2", "absent key, first ask under load: share of requests on wrapped tokens",
            m("cold load wrapped"), "", "0", None, "cached answers, if the load wrapped"),
        Row("3", "via A (direct hop): added p50", m("direct added p50"), "us"),
        Row("3", "via B (forwarded to A): added p50", m("forwarded added p50"), "us"),
        Row("3", "forwarded / direct, added p50", m("forwarded p50 ratio"), "x", "<= 2.2",
            judged(m("forwarded p50 ratio"), lambda v: v <= 2.2)),
        Row("3", "direct: CPU per serial request (A)", m("direct serial cpu"), "us"),
        Row("3", "forwarded: CPU per serial request (A + B)", m("forwarded serial cpu"), "us"),
        Row("3", "forwarded: Redis lookups per request (on B)", m("B serial lookups"), ""),
        Row("3", "direct: Redis lookups per request (on A)", m("A serial lookups"), ""),
        Row("3", "forwarded / direct, CPU per request", m("forwarded cpu ratio"), "x", "<= 2.2",
            judged(m("forwarded cpu ratio"), lambda v: v <= 2.2)),
        Row("3", "direct at the forwarded pace: CPU per serial request (A)",
            m("direct paced serial cpu"), "us", "", None, "client pauses the hop's extra latency"),
        Row("3", "forwarded / direct at the same pace, CPU per request",
            m("forwarded paced cpu ratio"), "x"),
        Row("3", "direct: CPU per request under load (A)", m("direct load cpu"), "us"),
        Row("3", "forwarded: CPU per request under load (A + B)", m("forwarded load cpu"), "us"),
        Row("3", "forwarded / direct, CPU per request under load", m("forwarded load cpu ratio"),
            "x", "<= 2.2", judged(m("forwarded load cpu ratio"), lambda v: v <= 2.2)),
        Row("3", "direct under load: non-2xx replies and errors", m("A load errors"), ""),
        Row("3", "forwarded under load: non-2xx replies and errors", m("B load errors"), ""),
        Row("3", "via C (straight to A's worker, one host): added p50", m("straight added p50"),
            "us"),
        Row("3", "straight / direct, added p50", m("straight p50 ratio"), "x"),
        Row("3", "straight: CPU per serial request (A + C)", m("straight serial cpu"), "us"),
        Row("3", "straight / direct, CPU per request", m("straight cpu ratio"), "x"),
        Row("3", "straight: CPU per request under load (A + C)", m("straight load cpu"), "us"),
        Row("3", "straight / direct, CPU per request under load",
            m("straight load cpu ratio"), "x"),
        Row("3", "straight: Redis lookups per request (on C)", m("C serial lookups"), ""),
        Row("3", "straight under load: non-2xx replies and errors", m("C load errors"), ""),
        Row("3", "straight: share of C's forwards that went straight (not hopped)",
            m("straight share"), ""),
        Row("3", "an episode's first call via B: lookups per request", m("first forward lookups"),
            ""),
        Row("3", "an episode's first call via B (its owner looked up): added p50",
            m("first forward added p50"), "us"),
        Row("4", "one router (A): requests/s", m("one router rps"), "rps"),
        Row("4", "two routers (A + B, split load): requests/s", m("two routers rps"), "rps"),
        Row("4", "two / one, requests/s", ratio(m("two routers rps"), m("one router rps")), "x"),
        Row("4", "one router: CPU per request", m("one router cpu"), "us"),
        Row("4", "two routers: CPU per request (A + B)", m("two routers cpu"), "us"),
        Row("4", "two / one, CPU per request",
            ratio(m("two routers cpu"), m("one router cpu")), "x"),
        Row("5", "kill -9 to 410 on the other router", m("kill -9 to 410"), "s",
            f"<= lease ({s.lease_s:g} s) + 1", judged(m("kill -9 to 410"),
                                                      lambda v: v <= s.lease_s + 1)),
        Row("5", "SIGTERM to 410 on the other router", m("SIGTERM to 410"), "s"),
    ]  # fmt: skip
    return rows


def run_fleet(settings: Settings, say: Callable[[str], None] = print) -> list[Row]:
    """Runs everything; returns the rows (also printed)."""
    raise_fd_limit(65536)
    with (
        tempfile.TemporaryDirectory(prefix="er-fleet-") as scratch,
        redis_server() as (redis_port, redis_pid),
    ):
        wait_for_redis(redis_port)
        bench = FleetBench(settings, Path(scratch), redis_port, redis_pid)
        try:
            bench.start(say)
            for name, episodes in (
                ("held", bench.held),
                ("absent", bench.absent),
                ("ended", bench.ended),
            ):
                for router in ("L", "A") if name != "held" else ("L", "A", "B", "C"):
                    bench.check_statuses(router, name, [e.token for e in episodes])
            for number in range(1, settings.rounds + 1):
                bench.round(say, number)
            bench.deaths(say)
        finally:
            bench.stop()
    full = settings.episodes >= 4096 and settings.rounds >= 3
    rows = rows_of(bench, full)
    say(format_rows(rows))
    say("statuses: " + "; ".join(f"{k}: {dict(v)}" for k, v in bench.statuses.items()))
    say("answers: " + "; ".join(f"{k}: {dict(v)}" for k, v in bench.answers.items()))
    say("Redis commands during load runs: " + str(dict(bench.commands)))
    say(f"load: {bench.loader.tool}, {settings.connections} connections, {settings.load_s:g} s; "
        f"{settings.episodes} episodes per set; {settings.rounds} rounds (medians); "
        f"lease {settings.lease_s:g} s" + ("" if full else "; targets not judged"))  # fmt: skip
    return rows


def wait_for_redis(port: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1) as sock:
            sock.sendall(b"PING\r\n")
            if sock.recv(64).startswith(b"+PONG"):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis-server did not answer on port {port}")
        time.sleep(0.05)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.fleet", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="a small run (CI): no target judged")
    parser.add_argument("--episodes", type=int, default=None, help="episodes per set (4096)")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (3)")
    parser.add_argument("--duration", type=float, default=None, help="seconds per load run (5)")
    parser.add_argument("--lease", type=float, default=None, help="lease_ttl_s (10; 2 quick)")
    parser.add_argument("--kills", type=int, default=None, help="kill -9 / SIGTERM pairs (1)")
    parser.add_argument("--no-wrk", action="store_true", help="the bundled generator")
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    changes: dict[str, Any] = {"use_wrk": not args.no_wrk}
    for option, name in (
        ("episodes", "episodes"),
        ("rounds", "rounds"),
        ("duration", "load_s"),
        ("lease", "lease_s"),
        ("kills", "kill_rounds"),
    ):
        value = getattr(args, option)
        if value is not None:
            if value <= 0:
                raise ValueError(f"--{option} must be positive")
            changes[name] = value
    if "lease_s" in changes and changes["lease_s"] < 1.5:
        raise ValueError("--lease must be at least 1.5 (the directory's floor)")
    return Settings.quick(**changes) if args.quick else dataclasses.replace(Settings(), **changes)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    rows = run_fleet(settings)
    return 0 if all(row.value is not None for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
