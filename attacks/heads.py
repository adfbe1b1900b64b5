"""Attack: request heads that hold the router's memory, from clients with no token at all.

Against a router process with the default limits:

1. waves of unfinished heads: each of `--connections` clients sends a maximal head (just
   under `limits.max_head_bytes`, in lines of 8 KiB, each line within its own bound)
   and never ends it; the router's RSS is read once all are in, the clients close, and
   it is read again once the router closed them. Two waves: the second must add
   nothing, and the end must be back near the start (closed connections freed at once,
   not when the collector runs);
2. oversized heads: clients that send, all at once, far more than `max_head_bytes`
   (99 lines of 16 KiB, the head that held 1.6 MB each before) get 431
   `headers_too_large`, and the router's peak RSS meanwhile is sampled;
3. pipelined heads behind a slow request: each client sends a request its worker (a
   static one run here, which parks it) holds, then 16 large complete heads behind it;
   the router stops reading past its pipelined byte bound, so the memory they hold is
   bounded per connection, and every request is answered once the worker lets go.

    EPISODE_ROUTER_ATTACK=1 python attacks/heads.py [--scale 1.0]

At scale 1.0: 1,000 connections per wave, 300 oversized, 30 pipelining; the CI run
(tests/e2e/test_attacks_edge.py) uses a few dozen. Loopback only, every socket has a
timeout, and the router is stopped by its pid at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attacks.target import (  # noqa: E402
    GATE_ENV,
    LOOPBACK,
    Launcher,
    Router,
    connect,
    metric,
    raise_own_open_file_limit,
    read_status,
    rss_bytes,
    start_router,
)

MAX_HEAD_BYTES = 65536  # the default limits.max_head_bytes
LINE = b"X-Filler: " + b"f" * 8170 + b"\r\n"  # 8 KiB: a header line within its bound
BIG_LINE = b"X-Filler: " + b"f" * 16360 + b"\r\n"  # 16 KiB: the old attack's lines
CONNECTIONS = 1000
OVERSIZED = 300  # the wave of 1.6 MB heads
PIPELINING = 30
PIPELINED = 16  # heads behind each slow request
SETTLE_S = 1.0  # after a wave is sent or closed, before RSS is read
PARK_S = 20.0  # the longest the worker holds a request
MIB = 1 << 20


def maximal_head() -> bytes:
    """An unfinished head a few bytes under MAX_HEAD_BYTES."""
    start = b"GET /attack HTTP/1.1\r\nHost: x\r\n"
    lines = (MAX_HEAD_BYTES - 64 - len(start)) // len(LINE)
    head = start + LINE * lines
    return head + b"X-Last: " + b"l" * (MAX_HEAD_BYTES - 64 - len(head))


@dataclass(slots=True)
class HeadsReport:
    connections: int
    rss_start: int = 0
    wave_held: list[int] = field(default_factory=list)  # RSS with each wave's heads in
    wave_closed: list[int] = field(default_factory=list)  # RSS once each wave closed
    held_metric: list[float] = field(default_factory=list)
    oversized: Counter[int] = field(default_factory=Counter)
    oversized_s: list[float] = field(default_factory=list)  # from the first send to each 431
    oversized_peak: int = 0  # the router's peak RSS while they came
    pipelining: int = 0
    pipelined_rss: int = 0  # RSS with every pipelining client parked
    pipelined_answers: Counter[int] = field(default_factory=Counter)

    def growth(self, rss: int) -> float:
        return (rss - self.rss_start) / MIB

    @property
    def passed(self) -> bool:
        return (
            len(self.wave_held) == 2
            and self.growth(max(self.wave_held)) <= 100
            and (self.wave_held[1] - self.wave_held[0]) / MIB <= 16
            and self.growth(self.wave_closed[-1]) <= 60
            and set(self.oversized) == {431}
            and self.growth(self.oversized_peak) <= 100
            and set(self.pipelined_answers) == {200}
            and self.pipelined_answers[200] == self.pipelining * (PIPELINED + 1)
        )

    def render(self) -> str:
        lines = [f"router RSS at start {self.rss_start / MIB:.1f} MiB"]
        for wave, (held, closed) in enumerate(zip(self.wave_held, self.wave_closed, strict=True)):
            lines.append(
                f"wave {wave + 1}: {self.connections} unfinished {MAX_HEAD_BYTES // 1024} KiB "
                f"heads held: +{self.growth(held):.1f} MiB "
                f"(head bytes held {self.held_metric[wave] / MIB:.1f} MiB); "
                f"closed: +{self.growth(closed):.1f} MiB"
            )
        median = sorted(self.oversized_s)[len(self.oversized_s) // 2] if self.oversized_s else 0
        lines.append(
            f"oversized heads ({len(self.oversized_s)} at once, 1.6 MB each): "
            f"{dict(self.oversized)}, median answer {median * 1000:.1f} ms, "
            f"peak +{self.growth(self.oversized_peak):.1f} MiB"
        )
        lines.append(
            f"pipelined: {self.pipelining} connections x {PIPELINED} heads behind a slow "
            f"request: +{self.growth(self.pipelined_rss):.1f} MiB while parked; "
            f"answers {dict(self.pipelined_answers)}"
        )
        lines.append("PASSED" if self.passed else "FAILED")
        return "\n".join(lines)


class ParkingWorker:
    """A static worker on loopback: answers its health probe at once, and every other
    request once `release` is set (PARK_S at most). One thread per connection."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self._listener = socket.create_server((LOOPBACK, 0), backlog=256)
        self.port = int(self._listener.getsockname()[1])
        self._closing = False
        self._thread = threading.Thread(target=self._accept, name="parking-worker", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closing:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(PARK_S + 5)
        data = b""
        with contextlib.suppress(OSError), conn:
            while True:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        return
                    data += chunk
                head, _, data = data.partition(b"\r\n\r\n")
                if not head.startswith(b"GET /health "):
                    self.release.wait(PARK_S)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")

    def close(self) -> None:
        self._closing = True
        self.release.set()
        self._listener.close()


def settled_rss(pid: int) -> int:
    time.sleep(SETTLE_S)
    return rss_bytes(pid)


def send_all(socks: list[socket.socket], data: bytes) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.sendall(data)


@contextlib.contextmanager
def connections(port: int, count: int) -> Iterator[list[socket.socket]]:
    socks = [connect(port) for _ in range(count)]
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def run_waves(report: HeadsReport, router: Router) -> None:
    router_pid, port = router.process.pid, router.public_port
    head = maximal_head()
    for _ in range(2):
        with connections(port, report.connections) as socks:
            send_all(socks, head)
            report.wave_held.append(settled_rss(router_pid))
            report.held_metric.append(metric(router, "episode_router_head_bytes_held"))
        report.wave_closed.append(settled_rss(router_pid))


def run_oversized(report: HeadsReport, router_pid: int, port: int, count: int) -> None:
    """`count` clients at once, each sending the old attack's 1.6 MB head; the router's
    peak RSS is sampled meanwhile."""
    head = b"GET /attack HTTP/1.1\r\nHost: x\r\n" + BIG_LINE * 99
    peak = PeakSampler(router_pid)
    with peak, connections(port, count) as socks:
        started = time.monotonic()
        senders = [
            threading.Thread(target=send_all, args=([sock], head), daemon=True) for sock in socks
        ]
        for sender in senders:
            sender.start()
        for sock in socks:
            report.oversized[read_status(sock)] += 1
            report.oversized_s.append(time.monotonic() - started)
        for sender in senders:
            sender.join(5)
    report.oversized_peak = peak.peak


class PeakSampler:
    """The highest RSS of a process, sampled every few milliseconds from a thread."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            with contextlib.suppress(OSError):
                self.peak = max(self.peak, rss_bytes(self.pid))


def run_pipelined(report: HeadsReport, router_pid: int, port: int, worker: ParkingWorker) -> None:
    head = b"GET /behind HTTP/1.1\r\nHost: x\r\n" + LINE * 6 + b"\r\n"  # 48 KiB, complete
    data = b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n" + head * PIPELINED
    with connections(port, report.pipelining) as socks:
        senders = [
            threading.Thread(target=send_all, args=([sock], data), daemon=True) for sock in socks
        ]
        for sender in senders:
            sender.start()
        report.pipelined_rss = settled_rss(router_pid)
        worker.release.set()
        for sock in socks:
            for _ in range(PIPELINED + 1):
                report.pipelined_answers[read_reply_status(sock)] += 1
        for sender in senders:
            sender.join(5)


def read_reply_status(sock: socket.socket) -> int:
    """Reads one whole reply, framed by its Content-Length: its status (0: none). The head
    a byte at a time, so no byte of the next reply is taken with it."""
    data = b""
    while b"\r\n\r\n" not in data:
        try:
            chunk = sock.recv(1)
        except OSError:
            return 0
        if not chunk:
            return 0
        data += chunk
    head = data.decode("latin-1")
    length = 0
    for line in head.split("\r\n")[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    body = b""
    while len(body) < length:
        try:
            chunk = sock.recv(length - len(body))
        except OSError:
            return 0
        if not chunk:
            return 0
        body += chunk
    return int(head.split(" ", 2)[1])


def run_heads(
    launcher: Launcher, *, connections: int, oversized: int, pipelining: int
) -> HeadsReport:
    raise_own_open_file_limit()
    worker = ParkingWorker()
    try:
        router = start_router(
            launcher,
            "heads",
            limits={"header_timeout_s": 30},
            workers=[{"id": "w0", "url": f"http://{LOOPBACK}:{worker.port}"}],
        )
        pid = router.process.pid
        report = HeadsReport(connections=connections, pipelining=pipelining)
        report.rss_start = settled_rss(pid)
        router.wait_live(["w0"])
        run_waves(report, router)
        run_oversized(report, pid, router.public_port, oversized)
        run_pipelined(report, pid, router.public_port, worker)
        return report
    finally:
        worker.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the counts")
    args = parser.parse_args(argv)
    if os.environ.get(GATE_ENV) != "1":
        print(f"set {GATE_ENV}=1 to run the attack (it starts a router process)", file=sys.stderr)
        return 2
    if not 0 < args.scale <= 4:
        parser.error("--scale must be above 0 and at most 4")
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="episode-router-attack-")))
    try:
        report = run_heads(
            launcher,
            connections=max(1, int(CONNECTIONS * args.scale)),
            oversized=max(1, int(OVERSIZED * args.scale)),
            pipelining=max(1, int(PIPELINING * args.scale)),
        )
    finally:
        launcher.stop_all()
    print(report.render())
    if not report.passed:
        print(f"the router's logs: {launcher.root}")
        return 1
    shutil.rmtree(launcher.root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
