"""The router process an attack script runs against: started here, measured here.

`start_router` writes a config (loopback only; `limits` as the attack asks) and starts
`episode-router run` as a process of its own through the suite's `Launcher`, which stops
it by its pid; with `open_files`, the process runs with that soft and hard open-file
limit (set in the child before the router starts). `rss_bytes` reads its resident set
from /proc, `cpu_seconds` its user and system time. `raw_hello` says hello on the
control socket and returns the reply, `get` makes one request and returns its status.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"  # the e2e helpers are imported as the suite imports them
for folder in (ROOT, TESTS):  # and `bench`, whose port picker the e2e helpers use
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from e2e.conftest import LOOPBACK, Launcher, Router  # noqa: E402

from bench.launch import free_port  # noqa: E402

__all__ = ["LOOPBACK", "Launcher", "Router"]

GATE_ENV = "EPISODE_ROUTER_ATTACK"
REPLY_TIMEOUT_S = 5.0

# Sets the open-file limit, then runs the router's CLI in the same process.
_LIMITED = (
    "import resource, runpy, sys; n = int(sys.argv.pop(1)); "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
    "sys.argv[0] = 'episode-router'; runpy.run_module('router.cli', run_name='__main__')"
)


def start_router(
    launcher: Launcher,
    name: str,
    *,
    limits: dict[str, Any],
    open_files: int | None = None,
    workers: list[dict[str, str]] | None = None,
) -> Router:
    """A router process on loopback with these `limits` (and static `workers`), ready."""
    folder = launcher.root / name
    folder.mkdir()
    config: dict[str, Any] = {
        "listen": {"host": LOOPBACK, "port": free_port()},
        "admin": {"host": LOOPBACK, "port": free_port()},
        "control": {"socket": f"unix:{folder / 'control.sock'}"},
        "claims": {"recovery_window_s": 1},
        "timeouts": {"shutdown_grace_s": 2},
        "limits": limits,
        "log": {"format": "json", "level": "warning"},
    }
    if workers:
        config["workers"] = workers
    config_path = folder / "router.yaml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    cli = ["run", "--config", str(config_path)]
    if open_files is None:
        argv = [sys.executable, "-m", "router.cli", *cli]
    else:
        argv = [sys.executable, "-c", _LIMITED, str(open_files), *cli]
    router = Router(
        launcher=launcher,
        name=name,
        folder=folder,
        config=config,
        config_path=config_path,
        socket_path=folder / "control.sock",
        public_port=config["listen"]["port"],
        admin_port=config["admin"]["port"],
        process=launcher.start(name, argv),
    )
    router.wait_ready()
    return router


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", "rb") as stat:
        fields = stat.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def raise_own_open_file_limit() -> int:
    """This process's soft open-file limit lifted to its hard one (the attacks hold
    thousands of sockets); returns it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connect(port: int, timeout_s: float = REPLY_TIMEOUT_S) -> socket.socket:
    sock = socket.create_connection((LOOPBACK, port), timeout=timeout_s)
    sock.settimeout(timeout_s)
    return sock


def read_status(sock: socket.socket) -> int:
    """The status of the next reply on `sock` (reading its head; 0 when it closed first)."""
    data = b""
    while b"\r\n" not in data:
        try:
            chunk = sock.recv(65536)
        except (ConnectionError, TimeoutError):
            return 0
        if not chunk:
            return 0
        data += chunk
    return int(data.split(b" ", 2)[1])


def get(port: int, path: str = "/attack") -> tuple[int, float]:
    """One GET on a fresh connection: its status (0: no reply) and seconds taken."""
    started = time.monotonic()
    try:
        with connect(port) as sock:
            sock.sendall(b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode())
            return read_status(sock), time.monotonic() - started
    except OSError:
        return 0, time.monotonic() - started


def raw_hello(socket_path: Path, worker: str) -> dict[str, Any] | None:
    """A hello on the control socket, the reply (None: no reply)."""
    hello = {"op": "hello", "id": 1, "v": 1, "worker": worker, "url": "http://127.0.0.1:9"}
    hello["boot"] = f"attack-{os.getpid()}-{time.monotonic_ns()}"
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(REPLY_TIMEOUT_S)
            sock.connect(str(socket_path))
            sock.sendall(json.dumps(hello).encode() + b"\n")
            line = b""
            while not line.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    return None
                line += chunk
            reply = json.loads(line)
            sock.sendall(b'{"op":"bye","id":2}\n')
            return reply if isinstance(reply, dict) else None
    except OSError:
        return None


def admin_status(router: Router, path: str) -> int:
    reply = router.admin(path)
    return 0 if reply is None else int(reply[0])


def metric(router: Router, name: str) -> float:
    """One sample of the router's metrics, by its name with labels as exposed (0 if absent)."""
    import urllib.request

    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{router.admin_url}/metrics", timeout=REPLY_TIMEOUT_S) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
    return 0.0
