"""Attack: more public connections than the router has file descriptors.

A router process runs with a low open-file limit (`--open-files`, set in the child), so
its connection limit is `(open_files - 256) // 2` (router.service.listeners). Then:

1. silent connections (they never send a byte) fill the limit but two, and two
   keep-alive clients make a request each and stay, idle;
2. a fresh connection's request arrives at the limit: the longest-idle keep-alive
   connection is closed to make room, and the request is answered;
3. a flood of silent connections, more than the open-file limit in all, arrives: one
   more idle connection makes room, the rest are accepted and closed at once;
4. meanwhile a control hello, `GET /healthz` and `/metrics` are answered (the reserve
   kept for them), and once the flood closes, fresh requests are answered again;
5. with `limits.max_connections` set above the open-file limit, the same flood makes
   accept fail with EMFILE: the router must not spin (its CPU time is measured) and
   must serve again once the flood closes.

    EPISODE_ROUTER_ATTACK=1 python attacks/connections.py [--scale 1.0]

At scale 1.0 the router has 4,096 descriptors (a limit of 1,920) and 6,000 connections
arrive; the CI run (tests/e2e/test_attacks_edge.py) uses 400 and 600. Loopback only;
every socket has a timeout and the router is stopped by its pid at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from attacks.target import (  # noqa: E402
    GATE_ENV,
    Launcher,
    admin_status,
    connect,
    cpu_seconds,
    get,
    metric,
    raise_own_open_file_limit,
    raw_hello,
    read_status,
    rss_bytes,
    start_router,
)

RESERVED_FILES = 256  # as router.service.listeners.RESERVED_FILES
OPEN_FILES = 4096
FLOOD = 6000
EMFILE_WATCH_S = 2.0  # the window the router's CPU time is measured in while at EMFILE
HEADER_TIMEOUT_S = 30.0  # longer than the run: the silent connections stay


@dataclass(slots=True)
class ConnectionsReport:
    open_files: int
    limit: int
    flood: int
    idle_dropped: list[bool] = field(default_factory=list)  # per keep-alive client
    fresh_status_at_limit: int = 0
    flood_closed_by_router: int = 0
    hello_ok: bool = False
    healthz: int = 0
    metrics_refused: float = 0.0
    metrics_idle_closed: float = 0.0
    metrics_open: float = 0.0
    after_flood_status: int = 0
    emfile_cpu_s: float = 0.0
    emfile_after_status: int = 0
    emfile_hello_after: bool = False
    rss_start: int = 0
    rss_peak: int = 0
    latencies_s: list[float] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (
            all(self.idle_dropped)
            and len(self.idle_dropped) == 2
            and self.fresh_status_at_limit == 503  # the router's no_worker: it was served
            and self.flood_closed_by_router > 0
            and self.hello_ok
            and self.healthz == 200
            and self.metrics_refused > 0
            and self.metrics_idle_closed == 2
            and self.after_flood_status == 503
            and self.emfile_after_status == 503
            and self.emfile_hello_after
            and self.emfile_cpu_s < EMFILE_WATCH_S / 2
        )

    def render(self) -> str:
        mib = 1 << 20
        return "\n".join(
            [
                f"open files {self.open_files}, connection limit {self.limit}, "
                f"flood {self.flood} connections",
                f"idle keep-alive clients dropped for room: {self.idle_dropped}",
                f"fresh request at the limit: {self.fresh_status_at_limit}",
                f"flood connections the router closed at once: {self.flood_closed_by_router}",
                f"during the flood: hello ok {self.hello_ok}, /healthz {self.healthz}, "
                f"open {self.metrics_open:.0f}, refused {self.metrics_refused:.0f}, "
                f"idle closed {self.metrics_idle_closed:.0f}",
                f"after the flood: {self.after_flood_status}",
                f"at EMFILE: router CPU {self.emfile_cpu_s:.2f} s in {EMFILE_WATCH_S:.0f} s; "
                f"after: status {self.emfile_after_status}, hello {self.emfile_hello_after}",
                f"router RSS start {self.rss_start / mib:.1f} MiB, "
                f"peak {self.rss_peak / mib:.1f} MiB",
                "fresh-request latencies (s): "
                + ", ".join(f"{s:.3f}" for s in sorted(self.latencies_s)),
                "PASSED" if self.passed else "FAILED",
            ]
        )


def open_silent(port: int, count: int) -> list[socket.socket]:
    """`count` connections that send nothing (fewer if connects fail)."""
    opened = []
    for _ in range(count):
        try:
            opened.append(connect(port, 2.0))
        except OSError:
            break
    return opened


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the router closed `sock` (EOF or reset), without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
    finally:
        sock.settimeout(2.0)


def close_all(socks: list[socket.socket]) -> None:
    for sock in socks:
        sock.close()
    socks.clear()


def run_connections(launcher: Launcher, *, open_files: int, flood: int) -> ConnectionsReport:
    raise_own_open_file_limit()
    limit = max(16, (open_files - RESERVED_FILES) // 2)
    report = ConnectionsReport(open_files=open_files, limit=limit, flood=flood)
    limits = {"header_timeout_s": HEADER_TIMEOUT_S}
    router = start_router(launcher, "limited", limits=limits, open_files=open_files)
    pid = router.process.pid
    report.rss_start = rss_bytes(pid)
    silent = open_silent(router.public_port, limit - 2)
    kept = []
    for _ in range(2):
        sock = connect(router.public_port)
        sock.sendall(b"GET /kept HTTP/1.1\r\nHost: x\r\n\r\n")
        read_status(sock)
        kept.append(sock)
    time.sleep(0.3)
    report.fresh_status_at_limit, took = get(router.public_port)
    report.latencies_s.append(took)
    flood_socks = open_silent(router.public_port, flood - limit)
    time.sleep(0.5)
    report.idle_dropped = [closed_by_peer(sock) for sock in kept]
    report.flood_closed_by_router = sum(closed_by_peer(sock) for sock in flood_socks)
    report.hello_ok = (raw_hello(router.socket_path, "attack-w") or {}).get("ok") is True
    report.healthz = admin_status(router, "/healthz")
    report.metrics_open = metric(router, "episode_router_public_connections")
    report.metrics_refused = metric(
        router, 'episode_router_connections_refused_total{reason="limit"}'
    )
    report.metrics_idle_closed = metric(router, "episode_router_idle_connections_closed_total")
    report.rss_peak = rss_bytes(pid)
    close_all(flood_socks)
    close_all(silent)
    close_all(kept)
    time.sleep(0.5)
    report.after_flood_status, took = get(router.public_port)
    report.latencies_s.append(took)
    run_at_emfile(launcher, report, open_files=open_files, flood=flood)
    return report


def run_at_emfile(
    launcher: Launcher, report: ConnectionsReport, *, open_files: int, flood: int
) -> None:
    """A router whose connection limit is above its open-file limit, flooded past it."""
    limits = {"header_timeout_s": HEADER_TIMEOUT_S, "max_connections": open_files * 4}
    router = start_router(launcher, "emfile", limits=limits, open_files=open_files)
    pid = router.process.pid
    flood_socks = open_silent(router.public_port, min(flood, open_files + 200))
    time.sleep(0.5)
    before = cpu_seconds(pid)
    time.sleep(EMFILE_WATCH_S)
    report.emfile_cpu_s = cpu_seconds(pid) - before
    report.rss_peak = max(report.rss_peak, rss_bytes(pid))
    close_all(flood_socks)
    time.sleep(1.5)  # the router accepts again (it pauses accepting at EMFILE)
    report.emfile_after_status, took = get(router.public_port)
    report.latencies_s.append(took)
    report.emfile_hello_after = (raw_hello(router.socket_path, "attack-e") or {}).get("ok") is True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the counts")
    args = parser.parse_args(argv)
    if os.environ.get(GATE_ENV) != "1":
        print(f"set {GATE_ENV}=1 to run the attack (it starts router processes)", file=sys.stderr)
        return 2
    if not 0 < args.scale <= 4:
        parser.error("--scale must be above 0 and at most 4")
    launcher = Launcher(Path(tempfile.mkdtemp(prefix="episode-router-attack-")))
    try:
        report = run_connections(
            launcher,
            open_files=max(400, int(OPEN_FILES * args.scale)),
            flood=max(600, int(FLOOD * args.scale)),
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
