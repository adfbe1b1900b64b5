"""Attack: hold one worker's pooled connections with slow uploads and clients that never read.

A router process stands in front of one demo worker (every request aims at it). A steady
client runs one episode and calls it in turn (`POST /tools/add`), timing each call, while
the attack runs, one phase after another, in one run:

- baseline: the steady client alone;
- slow uploads: ATTACKERS clients each announce a 1 MiB body for the worker's episodes
  and send one byte every TRICKLE_S (under `limits.body_timeout_s`);
- non-readers, large: ATTACKERS clients each ask for a LARGE_REPLY-byte reply
  (`GET /big`, the one route `attacks/big_worker.py` adds to the demo worker) and never
  read a byte of it, with the smallest receive buffer;
- non-readers, chunked: the same with a chunked reply of LARGE_REPLY bytes (no
  Content-Length: the router cannot know its size until it ends);
- non-readers, small: the same with a reply of SMALL_REPLY bytes.

Before the pools were guarded, each of these held one of the worker's connections (256
of them), so once ATTACKERS passed the pool, the steady calls got 504 after
`timeouts.connect_s` and the worker was counted as failing. Now a slow client costs its
own bytes, and every steady call must be a 200 within STEADY_BOUND_MS: the run
prints each phase's answers by status and p50/p99 latency, the attackers' answers by
status, and the router's resident memory (from /proc/<pid>/status) at the phase's end.

    EPISODE_ROUTER_ATTACK=1 python attacks/pools.py [--scale 1.0]

The variable keeps it from being started by accident; `--scale` multiplies the attacker
count and the phase length (300 attackers and 8 s a phase at 1.0); `--unguarded` turns
the buffers and the paced share off (`limits.`), to watch the attack land. Everything is on
loopback; every socket has a deadline and the whole run one too; the router and worker
are started here and stopped by their pids at the end, pass or fail.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP_DIR = ROOT / "tests"  # the e2e helpers are imported as the suite imports them
for folder in (ROOT, APP_DIR):  # and `bench`, whose port picker the e2e helpers use
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from e2e.conftest import LOOPBACK, Launcher, Router  # noqa: E402

from bench.launch import free_port  # noqa: E402

GATE_ENV = "EPISODE_ROUTER_ATTACK"
PHASES = (
    "baseline",
    "slow uploads",
    "non-readers, large",
    "non-readers, chunked",
    "non-readers, small",
)
ATTACKERS = 300  # past the pool of 256 a worker has by default
PHASE_S = 8.0  # the steady client's calls per phase, at scale 1.0
SLOW_BODY = 1 << 20  # what a slow upload announces
TRICKLE_S = 2.0  # a slow upload sends a byte this often (body_timeout_s is 60 s)
# Over what the kernel's socket buffers take on loopback (so an unread reply stays
# upstream) and over the 1 MiB reply buffer: the worst case, relayed at the client's pace.
LARGE_REPLY = 2 << 20
SMALL_REPLY = 64
CLIENT_RCVBUF = 1024  # a non-reader's receive buffer: what it does not read stays upstream
SOCKET_TIMEOUT_S = 10.0  # any one read or write of the steady client
# A steady call slower than this fails the phase: a loopback tool call takes milliseconds,
# and a call queued for a pooled connection waits timeouts.connect_s (2 s) before its 503.
STEADY_BOUND_MS = 500.0
# The attackers' time to be in place before the steady client starts: 300 replies of
# 2 MiB are 600 MiB to move over loopback first, on a machine of two cores.
SETTLE_S = 3.0
RUN_DEADLINE_S = 600.0
TOKEN_HEADER = "X-NeMo-Gym-Episode-Token"
WORKER_ID = "w0"


@dataclass(slots=True)
class Phase:
    """One phase's figures: the steady calls, the attackers' answers, the router's memory."""

    name: str
    statuses: Counter[int] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)
    attackers: Counter[str] = field(default_factory=Counter)
    router_rss_kib: int = 0

    @property
    def steady_ok(self) -> bool:
        """Every steady call a 200, each within STEADY_BOUND_MS."""
        return (
            bool(self.latencies_ms)
            and set(self.statuses) == {200}
            and max(self.latencies_ms) <= STEADY_BOUND_MS
        )

    def percentile(self, share: float) -> float:
        ordered = sorted(self.latencies_ms)
        if not ordered:
            return 0.0
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))]

    def render(self) -> str:
        p50 = statistics.median(self.latencies_ms) if self.latencies_ms else 0.0
        statuses = ", ".join(f"{code}: {n}" for code, n in sorted(self.statuses.items()))
        attackers = ", ".join(f"{what}: {n}" for what, n in sorted(self.attackers.items()))
        return (
            f"{self.name}: steady {len(self.latencies_ms)} calls ({statuses}),"
            f" p50 {p50:.1f} ms, p99 {self.percentile(0.99):.1f} ms,"
            f" max {max(self.latencies_ms, default=0.0):.1f} ms;"
            f" attackers ({attackers or 'none'}); router RSS {self.router_rss_kib / 1024:.0f} MiB"
        )


@dataclass(slots=True)
class Report:
    scale: float
    attackers: int
    phases: list[Phase]
    worker_state: str = ""
    upstream_failures: float = 0.0

    @property
    def passed(self) -> bool:
        return (
            all(phase.steady_ok for phase in self.phases)
            and self.worker_state == "live"
            and self.upstream_failures == 0
        )

    def render(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        lines = [f"pools attack at scale {self.scale:g} ({self.attackers} attackers): {verdict}"]
        lines += [f"  {phase.render()}" for phase in self.phases]
        lines.append(
            f"  worker {WORKER_ID}: {self.worker_state or 'unknown'},"
            f" upstream failures counted: {self.upstream_failures:g}"
        )
        return "\n".join(lines)


# --- raw HTTP on loopback ---------------------------------------------------------------------


def request(path: str, token: str | None, body: bytes = b"", length: int | None = None) -> bytes:
    """A POST to the router with the episode's token (None: no session); `length`
    announces more than `body`."""
    announced = len(body) if length is None else length
    session = "" if token is None else f"{TOKEN_HEADER}: {token}\r\n"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {LOOPBACK}\r\n{session}"
        f"Content-Type: application/json\r\nContent-Length: {announced}\r\n\r\n"
    )
    return head.encode() + body


async def read_reply(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One reply framed by its Content-Length (the router's and the demo's are)."""
    async with asyncio.timeout(SOCKET_TIMEOUT_S):
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return status, await reader.readexactly(length)


async def start_episode(port: int) -> str:
    """A new episode's token (balanced: to the only worker)."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(request("/episodes", None, b"{}"))
        status, body = await read_reply(reader)
        if status != 200:
            raise RuntimeError(f"POST /episodes: {status} {body[:200]!r}")
        return str(json.loads(body)["token"])
    finally:
        writer.close()


async def steady(port: int, token: str, phase: Phase, stop: asyncio.Event) -> None:
    """Calls the episode in turn on one keep-alive connection until `stop`."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        while not stop.is_set():
            started = time.perf_counter()
            writer.write(request("/tools/add", token, b'{"value":1}'))
            try:
                status, _ = await read_reply(reader)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                phase.statuses[0] += 1  # no answer at all
                writer.close()
                reader, writer = await asyncio.open_connection(LOOPBACK, port)
                continue
            phase.latencies_ms.append((time.perf_counter() - started) * 1000)
            phase.statuses[status] += 1
            await asyncio.sleep(0.01)
    finally:
        writer.close()


async def slow_upload(port: int, token: str, phase: Phase, stop: asyncio.Event) -> None:
    """Announces SLOW_BODY bytes and sends one every TRICKLE_S until `stop`."""
    reader, writer = await asyncio.open_connection(LOOPBACK, port)
    try:
        writer.write(request("/tools/echo", token, b"{", SLOW_BODY))
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TRICKLE_S):
                    status, _ = await read_reply(reader)  # the router gave up on it
                    phase.attackers[f"answered {status}"] += 1
                    return
            writer.write(b" ")
        phase.attackers["still uploading"] += 1
    except (asyncio.IncompleteReadError, ConnectionError):
        phase.attackers["dropped"] += 1
    finally:
        writer.close()


async def non_reader(
    port: int, token: str, size: int, phase: Phase, stop: asyncio.Event, *, chunked: bool = False
) -> None:
    """Asks for a reply of `size` bytes (`chunked`: of unknown length) and never reads it,
    until `stop`."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, CLIENT_RCVBUF)
    sock.setblocking(False)
    target = f"/big?bytes={size}" + ("&chunked=1" if chunked else "")
    ask = f"GET {target} HTTP/1.1\r\nHost: {LOOPBACK}\r\n{TOKEN_HEADER}: {token}\r\n\r\n"
    try:
        async with asyncio.timeout(SOCKET_TIMEOUT_S):
            await loop.sock_connect(sock, (LOOPBACK, port))
            await loop.sock_sendall(sock, ask.encode())
        phase.attackers["not reading"] += 1
        await stop.wait()
    except (TimeoutError, ConnectionError) as exc:
        phase.attackers[type(exc).__name__] += 1
    finally:
        sock.close()


# --- the run ----------------------------------------------------------------------------------


def router_rss_kib(pid: int) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@dataclass(frozen=True, slots=True)
class Attack:
    """What every phase of one run shares."""

    router: Router
    steady_token: str
    attack_token: str
    attackers: int
    phase_s: float
    large_reply: int


async def run_phase(attack: Attack, name: str) -> Phase:
    """One phase: its attackers in place, then the steady client for `phase_s`."""
    router, attackers, phase_s = attack.router, attack.attackers, attack.phase_s
    steady_token, attack_token = attack.steady_token, attack.attack_token
    large_reply = attack.large_reply
    if name == "baseline":
        attackers = 0
    phase = Phase(name)
    stop = asyncio.Event()
    port = router.public_port
    tasks: list[asyncio.Task[None]] = []
    for index in range(attackers):
        if name == "slow uploads":
            attacker = slow_upload(port, attack_token, phase, stop)
        else:
            size = SMALL_REPLY if name == "non-readers, small" else large_reply
            chunked = name == "non-readers, chunked"
            attacker = non_reader(port, attack_token, size, phase, stop, chunked=chunked)
        tasks.append(asyncio.create_task(attacker, name=f"attacker {index}"))
    if attackers:
        await asyncio.sleep(min(SETTLE_S, phase_s / 2))  # the attack is in place first
    measuring = asyncio.create_task(steady(port, steady_token, phase, stop), name="steady")
    await asyncio.sleep(phase_s)
    phase.router_rss_kib = router_rss_kib(router.process.pid)
    stop.set()
    done, _ = await asyncio.wait({measuring}, timeout=STEADY_BOUND_MS / 1000)
    if not done:  # a call still unanswered when the phase ended: no answer in time
        phase.statuses[0] += 1
        measuring.cancel()
    await asyncio.gather(measuring, *tasks, return_exceptions=True)
    return phase


def upstream_failures(router: Router) -> float:
    """The upstream failures the router counted, all workers and kinds together."""
    with urllib.request.urlopen(router.admin_url + "/metrics", timeout=5) as reply:
        text = reply.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("episode_router_upstream_failures_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# `--unguarded`: the buffers and the paced share off, as the router was before them.
UNGUARDED = {
    "body_buffer_bytes": 0,
    "reply_buffer_bytes": 0,
    "buffer_budget_bytes": 0,
    "paced_share_percent": 100,
}


def start_rig(launcher: Launcher, pool: int | None, unguarded: bool) -> Router:
    """A router and its one worker (`attacks/big_worker.py`), live and recovered."""
    limits: dict[str, int] = dict(UNGUARDED) if unguarded else {}
    if pool is not None:
        limits["worker_connections"] = pool
    router = launcher.router("pools", limits=limits, log={"level": "warning"})
    port = free_port()
    argv = [sys.executable, str(ROOT / "attacks" / "big_worker.py"), "--port", str(port)]
    argv += ["--worker-id", WORKER_ID, "--control", f"unix:{router.socket_path}"]
    launcher.start(f"pools-{WORKER_ID}", argv)
    router.wait_live([WORKER_ID])
    router.wait_ready(recovered=True)
    return router


async def run_attack(
    launcher: Launcher,
    *,
    scale: float,
    pool: int | None = None,
    phase_s: float | None = None,
    unguarded: bool = False,
    large_reply: int = LARGE_REPLY,
) -> Report:
    """Starts the rig with `launcher` (which stops it), runs every phase and reports.
    `pool`: the worker's pool size (None: the router's default, 256); `unguarded`: the
    buffers and the paced share turned off, to see the attack land."""
    if not 0 < scale <= 10:
        raise ValueError(f"scale must be in (0, 10], not {scale}")
    attackers = max(1, round(ATTACKERS * scale))
    seconds = phase_s if phase_s is not None else max(1.0, PHASE_S * scale)
    router = await asyncio.to_thread(start_rig, launcher, pool, unguarded)
    phases = []
    async with asyncio.timeout(RUN_DEADLINE_S):
        steady_token = await start_episode(router.public_port)
        attack_token = await start_episode(router.public_port)
        attack = Attack(router, steady_token, attack_token, attackers, seconds, large_reply)
        for name in PHASES:
            phases.append(await run_phase(attack, name))
    report = Report(scale, attackers, phases)
    workers = await asyncio.to_thread(router.workers)
    report.worker_state = str(workers.get(WORKER_ID, {}).get("state", ""))
    report.upstream_failures = await asyncio.to_thread(upstream_failures, router)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies attackers and time")
    parser.add_argument(
        "--unguarded", action="store_true", help="buffers and paced share off (the attack lands)"
    )
    parser.add_argument("--large-bytes", type=int, default=LARGE_REPLY, help="the large reply")
    args = parser.parse_args(argv)
    if os.environ.get(GATE_ENV) != "1":
        print(f"set {GATE_ENV}=1 to run the attack (it starts two processes)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="episode-router-attack-"))
    launcher = Launcher(root)
    try:
        run = run_attack(
            launcher, scale=args.scale, unguarded=args.unguarded, large_reply=args.large_bytes
        )
        report = asyncio.run(run)
    finally:
        launcher.stop_all()
    print(report.render())
    if report.passed:
        shutil.rmtree(root, ignore_errors=True)
        return 0
    print(f"process logs: {root}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
