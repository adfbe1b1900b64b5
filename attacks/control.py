"""Attacks on the control socket: what a peer that may connect can make the router hold.

Three attacks, each against a router process of its own starting (loopback and a Unix
socket under a temporary folder only), each measuring the router's resident memory
(VmRSS, from /proc/<pid>/status) before and at the attack's height (sampled as it goes):

- claims flood: one connection says hello and pipelines claims of new keys, far more
  than `control.max_claims_per_worker`: every claim past it must be `too_many_claims`;
- endless sync: one connection sends `sync` messages with `"more": true` and never a
  last one: the message that passes the cap must be refused, and what it listed
  dropped;
- many connections before hello: hundreds of connections that each send a partial
  line of 1 MiB and never a newline: each must be closed once its line passes the
  bound before hello (64 KiB), and what they make the router hold stay small.

After each, a worker that behaves must still get its ping answered (the latency is
printed). The full run:

    EPISODE_ROUTER_ATTACK=1 python attacks/control.py [--scale 1.0]

`--scale` multiplies the counts (600,000 claims, 600 sync messages of 1,000 keys, 300
connections with 1 MiB each at 1.0; the claim cap is scaled with it so that every
scale goes past it). Every loop is bounded in count and time, and the router is
stopped by its pid at the end, pass or fail.
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
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
APP_DIR = ROOT / "tests"  # the e2e helpers are imported as the suite imports them
for folder in (ROOT, APP_DIR):  # and `bench`, whose port picker the e2e helpers use
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from e2e.conftest import Launcher, Router  # noqa: E402

GATE_ENV = "EPISODE_ROUTER_ATTACK"
CLAIMS = 600_000  # the flood on one connection
SYNC_MESSAGES = 600  # of SYNC_BATCH keys each: 600,000 keys in a sync that never ends
SYNC_BATCH = 1000
PARTIAL_CONNECTIONS = 300  # the connections before hello
PARTIAL_LINE_BYTES = 1 << 20  # each sends this much of a line, never its newline
CLAIM_CAP = 100_000  # control.max_claims_per_worker's default, scaled with the run
PIPELINE = 2000  # claims written before their replies are read
STEP_TIMEOUT_S = 120.0  # any one read or write of an attack
RUN_DEADLINE_S = 900.0  # the whole run, at any scale
PINGS = 20  # a behaving worker's pings after each attack
MiB = 1 << 20


@dataclass
class Attack:
    """What one attack made the router hold and answer."""

    name: str
    rss_before: int = 0
    rss_peak: int = 0
    answers: Counter[str] = field(default_factory=Counter)
    ping_ms: list[float] = field(default_factory=list)

    def render(self) -> str:
        growth = (self.rss_peak - self.rss_before) / MiB
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(self.answers.items()))
        ping = f"{statistics.median(self.ping_ms):.2f} ms" if self.ping_ms else "none"
        return (
            f"{self.name}: router RSS {self.rss_before / MiB:.1f} MiB before, "
            f"{self.rss_peak / MiB:.1f} MiB at peak (+{growth:.1f} MiB); "
            f"answers {{{answers}}}; a worker's ping after it: median {ping}"
        )


def router_rss(pid: int) -> int:
    """The resident set of `pid`, in bytes (VmRSS)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Lease:
    """One raw control connection to the router's Unix socket."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, path: Path) -> Lease:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(path), limit=4 * MiB), STEP_TIMEOUT_S
        )
        return cls(reader, writer)

    async def call(self, message: dict[str, object]) -> dict[str, object]:
        self.writer.write(json.dumps(message).encode() + b"\n")
        return await self.reply()

    async def reply(self) -> dict[str, object]:
        line = await asyncio.wait_for(self.reader.readline(), STEP_TIMEOUT_S)
        if not line:
            raise ConnectionError("the router closed the connection")
        reply = json.loads(line)
        assert isinstance(reply, dict)
        return reply

    async def hello(self, worker_id: str, port: int) -> None:
        url = f"http://127.0.0.1:{port}"
        message = {"op": "hello", "id": 0, "v": 1, "worker": worker_id, "url": url, "boot": "b0"}
        reply = await self.call(message)
        if reply.get("ok") is not True:
            raise RuntimeError(f"hello refused: {reply}")

    def close(self) -> None:
        self.writer.transport.abort()


def _result(reply: dict[str, object]) -> str:
    return "ok" if reply.get("ok") is True else str(reply.get("error"))


async def _pings(router: Router, attack: Attack) -> None:
    """A worker that behaves: hello, then PINGS pings, each timed."""
    lease = await Lease.open(router.socket_path)
    try:
        await lease.hello("good-" + attack.name.replace(" ", "-")[:20], 9)
        for i in range(PINGS):
            started = time.perf_counter()
            reply = await lease.call({"op": "ping", "id": i})
            attack.ping_ms.append((time.perf_counter() - started) * 1000)
            if reply.get("ok") is not True:
                raise RuntimeError(f"a behaving worker's ping was refused: {reply}")
    finally:
        lease.close()


async def claims_flood(router: Router, claims: int) -> Attack:
    attack = Attack("claims flood")
    pid = router.process.pid
    attack.rss_before = router_rss(pid)
    lease = await Lease.open(router.socket_path)
    try:
        await lease.hello("flood", 10)
        for start in range(0, claims, PIPELINE):
            batch = range(start, min(start + PIPELINE, claims))
            lease.writer.write(
                b"".join(b'{"op":"claim","id":%d,"key":"k%d"}\n' % (i, i) for i in batch)
            )
            for _ in batch:
                attack.answers[_result(await lease.reply())] += 1
            if start % (50 * PIPELINE) == 0:
                attack.rss_peak = max(attack.rss_peak, router_rss(pid))
        attack.rss_peak = max(attack.rss_before, attack.rss_peak, router_rss(pid))
    finally:
        lease.close()
    await _pings(router, attack)
    return attack


async def endless_sync(router: Router, messages: int) -> Attack:
    attack = Attack("endless sync")
    pid = router.process.pid
    attack.rss_before = router_rss(pid)
    lease = await Lease.open(router.socket_path)
    try:
        await lease.hello("syncer", 11)
        peak = attack.rss_before
        for m in range(messages):
            claims = [{"kind": "episode", "key": f"s{m}-{i}"} for i in range(SYNC_BATCH)]
            reply = await lease.call({"op": "sync", "id": m, "claims": claims, "more": True})
            attack.answers[_result(reply)] += 1
            if m % 50 == 0:
                peak = max(peak, router_rss(pid))
        attack.rss_peak = max(peak, router_rss(pid))
    finally:
        lease.close()
    await _pings(router, attack)
    return attack


async def partial_lines(router: Router, connections: int, line_bytes: int) -> Attack:
    attack = Attack("connections before hello")
    pid = router.process.pid
    attack.rss_before = router_rss(pid)
    loop = asyncio.get_running_loop()
    # Raw sockets, read apart from the writes: a write after the router's close fails
    # (EPIPE), and a stream reader would then raise that failure instead of handing over
    # the answer it had already received.
    socks = [await _connect(loop, router.socket_path) for _ in range(connections)]
    answers = [
        asyncio.create_task(_answer_on(loop, sock), name=f"answer-{i}")
        for i, sock in enumerate(socks)
    ]
    chunk = b'{"op":"hello","pad":"' + b"x" * (64 << 10)
    try:
        sent = 0
        while sent < line_bytes:  # each round, every connection sends one more chunk
            data = chunk if sent == 0 else b"x" * len(chunk)
            await asyncio.gather(*(_send(loop, sock, data) for sock in socks))
            sent += len(chunk)
            attack.rss_peak = max(attack.rss_before, attack.rss_peak, router_rss(pid))
        for result in await asyncio.gather(*answers):
            attack.answers[result] += 1
    finally:
        for sock in socks:
            sock.close()
        for task in answers:
            task.cancel()
    await _pings(router, attack)
    return attack


async def _connect(loop: asyncio.AbstractEventLoop, path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.wait_for(loop.sock_connect(sock, str(path)), STEP_TIMEOUT_S)
    except BaseException:
        sock.close()
        raise
    return sock


async def _send(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError, TimeoutError):  # the router closed it: as it must
        await asyncio.wait_for(loop.sock_sendall(sock, data), STEP_TIMEOUT_S)


async def _answer_on(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> str:
    """The router's answer on a connection it should have closed, and `closed` after it."""
    received = b""
    with contextlib.suppress(OSError, TimeoutError):
        while b"\n" not in received:
            data = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), STEP_TIMEOUT_S)
            if not data:
                break
            received += data
    line, newline, rest = received.partition(b"\n")
    if not newline:
        return "closed without an answer"
    reply = json.loads(line)
    assert isinstance(reply, dict)
    try:
        more = rest or await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), STEP_TIMEOUT_S)
        closed = more == b""
    except TimeoutError:
        closed = False  # still open after the answer
    except OSError:
        closed = True  # a reset after the answer is a close too
    return _result(reply) + (", then closed" if closed else ", left open")


def start_router(launcher: Launcher, name: str, cap: int) -> Router:
    control: dict[str, object] = {"lease_timeout_s": 60}
    if cap != CLAIM_CAP:  # at full scale, the router's own default
        control["max_claims_per_worker"] = cap
    return launcher.router(name, control=control)


async def run_attacks(launcher: Launcher, *, scale: float) -> list[Attack]:
    """Each attack against a router of its own, at `scale` times the issue's counts."""
    cap = max(100, int(CLAIM_CAP * scale))
    attacks: list[Attack] = []
    async with asyncio.timeout(RUN_DEADLINE_S):
        claims = max(1, int(CLAIMS * scale))
        attacks.append(await claims_flood(start_router(launcher, "flood", cap), claims))
        messages = max(2, int(SYNC_MESSAGES * scale))
        attacks.append(await endless_sync(start_router(launcher, "sync", cap), messages))
        connections = max(2, int(PARTIAL_CONNECTIONS * scale))
        line = max(128 << 10, int(PARTIAL_LINE_BYTES * min(1.0, scale * 4)))
        router = start_router(launcher, "partial", cap)
        attacks.append(await partial_lines(router, connections, line))
    return attacks


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the counts")
    args = parser.parse_args(argv)
    if os.environ.get(GATE_ENV) != "1":
        print(f"set {GATE_ENV}=1 to run the attacks (they start router processes)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="episode-router-attack-"))
    launcher = Launcher(root)
    try:
        attacks = asyncio.run(run_attacks(launcher, scale=args.scale))
    finally:
        launcher.stop_all()
    for attack in attacks:
        print(attack.render())
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
