"""Starting and stopping the benchmark's processes: workers, the router and peer proxies.

This module owns the child processes a benchmark run starts: each runs in its
own session with its output in a log file, is waited for until it serves, and
is stopped by its own pid (SIGTERM, then SIGKILL to its process group after a
bound). It never touches a process it did not start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from bench.procstat import (
    descendants,
    rss_bytes,
    tree_cpu_seconds,
    tree_cpu_split_seconds,
    tree_run_seconds,
)

__all__ = [
    "ROOT",
    "Child",
    "StartFailure",
    "free_port",
    "free_port_range",
    "quiet_router_warnings",
    "raise_fd_limit",
    "start_child",
    "start_router",
    "start_server",
    "start_worker",
]

ROOT = Path(__file__).resolve().parent.parent  # the repository: `bench` and `router` import
START_TIMEOUT_S = 30.0  # a proxy or worker that does not serve by then failed to start
STOP_TIMEOUT_S = 10.0  # SIGTERM, then SIGKILL after this long
_POLL_S = 0.05


class StartFailure(RuntimeError):
    """A child process exited or did not serve in time; the message ends with its log tail."""


@contextlib.contextmanager
def quiet_router_warnings() -> Iterator[None]:
    """Keeps an in-process router's warnings out of a benchmark's output meanwhile: its
    benchmark worker leaves when the figures are in, and the router says "worker exited"
    at warning level, a bare line among them. Errors still show."""
    router_log = logging.getLogger("episode_router")
    level = router_log.level
    router_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        router_log.setLevel(level)


# Listening ports come from below the kernel's range for outgoing connections, and none
# is handed out twice by one process. A port found by binding port 0 comes from that
# range: a test's or a run's own connections (thousands) can take it between the check
# and the server's bind, or while a killed server is about to come back on it, and two
# probes in a row can be handed the same port (a run met it: a router's peer listener
# and its admin port named one port).
PORTS_FROM = 20000  # the first port handed out


def _ephemeral_low() -> int:
    """Where the kernel's range for outgoing connections starts."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORTS_TO = max(_ephemeral_low(), PORTS_FROM + 10000)  # a range starting low: share it
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback TCP port nothing listens on, outside the ephemeral range, not handed
    out before by this process."""
    return free_port_range(1)


def free_port_range(count: int) -> int:
    """The first of `count` consecutive loopback ports nothing listens on (each is bound
    once to check it, then released), outside the ephemeral range, none handed out
    before by this process."""
    for _ in range(200):
        base = random.randrange(PORTS_FROM, PORTS_TO - count)
        ports = range(base, base + count)
        if _handed_out.isdisjoint(ports) and all(_bindable(port) for port in ports):
            _handed_out.update(ports)
            return base
    raise AssertionError(f"no {count} consecutive free loopback ports found")


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def raise_fd_limit(wanted: int) -> int:
    """Raises this process's open-file limit towards `wanted` (children inherit it);
    returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"
    return env


class Child:
    """A process this run started (and, through it, the processes it starts itself)."""

    def __init__(self, name: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
        self.name = name
        self.process = process
        self.log_path = log_path
        self.port = 0

    @property
    def pid(self) -> int:
        return self.process.pid

    def pids(self) -> list[int]:
        """Its pid and those of its live descendants (nginx's master and workers)."""
        return descendants(self.process.pid)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) used so far by it and its descendants."""
        return tree_cpu_seconds(self.pids())

    def run_seconds(self) -> float:
        """CPU time it and its descendants have run so far, to the nanosecond: for
        spans too short for /proc's clock ticks (a few hundred serial requests)."""
        return tree_run_seconds(self.pids())

    def cpu_split_seconds(self) -> tuple[float, float]:
        """User and system time used so far by it and its descendants."""
        return tree_cpu_split_seconds(self.pids())

    def rss_bytes(self) -> int:
        """Resident memory of it and its descendants now."""
        return sum(rss_bytes(pid) for pid in self.pids())

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_for_port(self, port: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Returns once `port` accepts a connection; raises StartFailure if it exits first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise self._failure(f"exited with status {self.process.returncode}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                self.port = port
                return
            time.sleep(_POLL_S)
        raise self._failure(f"did not serve on port {port} within {timeout_s:g} s")

    def _failure(self, what: str) -> StartFailure:
        return StartFailure(f"{self.name} {what}; its log ({self.log_path}):\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM; after STOP_TIMEOUT_S, SIGKILL to its process group (its own session)."""
        if self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)  # its own group: start_new_session
            self.process.wait(STOP_TIMEOUT_S)


def start_child(
    name: str, argv: Sequence[str], log_path: Path, *, stdout_pipe: bool = False
) -> Child:
    """Starts `argv` in its own session, stderr (and stdout unless piped) to `log_path`."""
    log = log_path.open("ab")
    try:
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE if stdout_pipe else log,
            stderr=log,
            cwd=ROOT,
            env=_child_env(),
            start_new_session=True,
        )
    finally:
        log.close()  # the child holds its own descriptor
    return Child(name, process, log_path)


def start_server(name: str, argv: Sequence[str], log_path: Path, port: int) -> Child:
    """`start_child`, waited for until `port` serves (stopped, and StartFailure raised,
    if it exits or never does)."""
    child = start_child(name, argv, log_path)
    try:
        child.wait_for_port(port)
    except StartFailure:
        child.stop()
        raise
    return child


def start_router(config_path: Path, port: int, log_path: Path) -> Child:
    """`python -m router.cli run --config FILE`, waited for until its public port serves."""
    argv = (sys.executable, "-m", "router.cli", "run", "--config", str(config_path))
    return start_server("router", argv, log_path, port)


def start_worker(
    worker_id: str,
    control: str | None,
    keys_path: Path | None,
    log_path: Path,
    work_us: float = 0.0,
) -> Child:
    """A bench.worker process; returns once it has claimed its keys and serves.
    `work_us`: microseconds it busy-spins per tool call (0: a trivial worker)."""
    argv = [sys.executable, "-m", "bench.worker", "--port", "0", "--worker-id", worker_id]
    if control is not None:
        argv += ["--control", control]
    if keys_path is not None:
        argv += ["--keys", str(keys_path)]
    if work_us > 0:
        argv += ["--work-us", f"{work_us:g}"]
    child = start_child(f"worker {worker_id}", argv, log_path, stdout_pipe=True)
    try:
        child.port = _read_ready_port(child)
    except StartFailure:
        child.stop()
        raise
    return child


def _read_ready_port(child: Child) -> int:
    """The port in the worker's `READY <port>` line."""
    stdout = child.process.stdout
    assert stdout is not None
    deadline = time.monotonic() + START_TIMEOUT_S
    buffered = b""
    while b"\n" not in buffered:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise child._failure(f"did not report ready within {START_TIMEOUT_S:g} s")
        ready, _, _ = select.select([stdout], [], [], min(remaining, 0.5))
        if ready:
            data = os.read(stdout.fileno(), 4096)
            if not data:
                child.process.wait(STOP_TIMEOUT_S)
                raise child._failure(f"exited with status {child.process.returncode}")
            buffered += data
    line = buffered.split(b"\n", 1)[0].decode(errors="replace").split()
    if len(line) != 2 or line[0] != "READY" or not line[1].isdigit():
        raise child._failure(f"reported {line!r} instead of READY <port>")
    return int(line[1])
