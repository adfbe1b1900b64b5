"""Real Redis servers for the directory's tests: Debian's `redis-server`, started here.

Each `redis_server` is a process of its own on a free loopback port (below the
ephemeral range: `bench.launch.free_port`) and a Unix socket,
with nothing persisted (`--save '' --appendonly no`), stopped by its pid at the end of
the test (resumed first if a test paused it). Without `redis-server` the tests fail
and name the Debian package; they never skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis
from redis.asyncio import Redis

from bench.launch import free_port
from router.directory import Directory, DirectorySettings, open_redis

START_TIMEOUT_S = 10.0  # a loaded 2-core machine starts redis-server in well under a second


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        pytest.fail(
            "redis-server is not installed: install Debian's `redis-server` package "
            "(`apt-get install redis-server`; scripts/test does it) to run the directory's tests"
        )
    return found


class RedisServer:
    """One redis-server process this test started, on 127.0.0.1:`port` and `socket`."""

    def __init__(self, folder: Path, extra: tuple[str, ...] = ()) -> None:
        self.folder = folder
        self.port = free_port()
        self.socket = folder / "redis.sock"
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def start(self) -> None:
        argv = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.folder),
            "--unixsocket", str(self.socket),
            "--unixsocketperm", "700",
            "--logfile", str(self.folder / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                log = (self.folder / "redis.log").read_text(errors="replace")
                pytest.fail(f"redis-server exited at start ({self.process.returncode}):\n{log}")
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.02)
        pytest.fail(f"redis-server did not answer PING within {START_TIMEOUT_S}s")

    def client(self) -> redis.Redis:
        """A plain synchronous client, for the tests' own checks."""
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)

    def script_calls(self) -> int:
        """EVALSHA calls the server has counted (INFO commandstats)."""
        stats = self.client().info("commandstats")
        entry = stats.get("cmdstat_evalsha", {"calls": 0})
        return int(entry["calls"])

    def pause(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)
        self.paused = False

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if self.paused:
            self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> None:
        """Stop and start again on the same port, with nothing kept (no persistence)."""
        self.stop()
        self.start()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    # A short folder of its own: a Unix socket path must fit in 108 bytes.
    folder = Path(tempfile.mkdtemp(prefix="er-redis-"))
    server = RedisServer(folder)
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def settings(router_id: str = "r1", **overrides: object) -> DirectorySettings:
    """Test settings: a short tombstone, and `overrides` on top."""
    values: dict[str, object] = {"peer_address": f"http://127.0.0.1:1/{router_id}"}
    values.update(overrides)
    return DirectorySettings(router_id, **values)  # type: ignore[arg-type]


@pytest.fixture
async def redis_client(redis_server: RedisServer) -> AsyncIterator[Redis]:
    client = open_redis(redis_server.url)
    try:
        yield client
    finally:
        await client.aclose()


async def directory_for(client: Redis, router_id: str = "r1", **overrides: object) -> Directory:
    """A registered `Directory` for `router_id` on `client`, its scripts loaded (as a
    router does at start: no NOSCRIPT retry lands in the counts of script calls)."""
    directory = Directory(client, settings(router_id, **overrides))
    await directory.load_scripts()
    await directory.register()
    return directory
