"""The directory through Sentinel: a primary, a replica and a sentinel, all redis-server
processes started here on loopback. The client finds the primary through the sentinel,
and after a failover finds the new one, with the directory's records intact."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from bench.launch import free_port
from router.directory import (
    ClaimOutcome,
    ClaimVerdict,
    Directory,
    DirectoryError,
    LookupState,
    SentinelTarget,
    Standing,
    open_redis,
)
from tests.directory.conftest import (
    START_TIMEOUT_S,
    RedisServer,
    redis_server_binary,
    settings,
)

MASTER = "directory"


class SentinelProcess:
    """`redis-server <conf> --sentinel`, watching one primary."""

    def __init__(self, folder: Path, primary_port: int) -> None:
        self.port = free_port()
        conf = folder / "sentinel.conf"  # the sentinel rewrites it: a file of its own
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {folder}\n"
            f"logfile {folder / 'sentinel.log'}\n"
            f"sentinel monitor {MASTER} 127.0.0.1 {primary_port} 1\n"
            f"sentinel down-after-milliseconds {MASTER} 1000\n"
            f"sentinel failover-timeout {MASTER} 5000\n"
        )
        self.process = subprocess.Popen(
            [redis_server_binary(), str(conf), "--sentinel"], stdin=subprocess.DEVNULL
        )
        self.client = redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        pytest.fail(f"the sentinel did not answer within {START_TIMEOUT_S}s")

    def primary_port(self) -> int:
        _, port = self.client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
        return int(port)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@pytest.fixture
def sentinel_setup() -> Iterator[tuple[RedisServer, RedisServer, SentinelProcess]]:
    folder = Path(tempfile.mkdtemp(prefix="er-sentinel-"))
    (folder / "p").mkdir()
    (folder / "r").mkdir()
    primary = RedisServer(folder / "p")
    replica = RedisServer(folder / "r", extra=())
    sentinel: SentinelProcess | None = None
    try:
        primary.start()
        primary.client().config_set("repl-diskless-sync-delay", 0)  # sync at once
        replica.extra = ("--replicaof", "127.0.0.1", str(primary.port))
        replica.start()
        sentinel = SentinelProcess(folder, primary.port)
        yield primary, replica, sentinel
    finally:
        if sentinel is not None:
            sentinel.stop()
        replica.stop()
        primary.stop()
        shutil.rmtree(folder, ignore_errors=True)


def wait_until(check: object, seconds: float) -> bool:
    assert callable(check)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


async def test_the_directory_follows_the_primary_through_a_sentinel_failover(
    sentinel_setup: tuple[RedisServer, RedisServer, SentinelProcess],
) -> None:
    primary, replica, sentinel = sentinel_setup
    # The sentinel learns of the replica from the primary's INFO, every 10 s at most.
    replicas = f"SENTINEL REPLICAS {MASTER}"
    assert await asyncio.to_thread(
        wait_until, lambda: sentinel.client.execute_command(*replicas.split()), 15
    ), "the sentinel never saw the replica"
    client = open_redis(SentinelTarget(MASTER, (("127.0.0.1", sentinel.port),)))
    try:
        directory = Directory(client, settings(claim_timeout_s=5, min_replicas=1))
        await directory.register()
        assert await directory.claim([("episode", "k1")]) == (ClaimOutcome(ClaimVerdict.CLAIMED),)
        assert primary.client().hgetall("{episode-router}:owner:episode:k1")["r"] == "r1"
        primary.client().wait(1, 5000)  # the replica has every write
        # A replica the sentinel has just seen may not be "good" yet (NOGOODSLAVE).
        for _ in range(100):  # up to 20 s
            try:
                sentinel.client.execute_command("SENTINEL", "FAILOVER", MASTER)
                break
            except redis.ResponseError as refused:
                assert "NOGOODSLAVE" in str(refused), refused
                await asyncio.sleep(0.2)
        assert await asyncio.to_thread(
            wait_until, lambda: sentinel.primary_port() == replica.port, 20
        ), "the failover did not happen"
        # The first calls may meet the old primary (now a replica) or a closed connection.
        for _ in range(50):
            try:
                beat = await directory.heartbeat()
                if beat.standing is Standing.OK:
                    break
            except DirectoryError:
                pass
            await asyncio.sleep(0.2)
        assert beat.standing is Standing.OK
        looked = await directory.lookup(
            [("episode", "k1")]
        )  # read from the new primary, records intact
        assert looked.results[0].state is LookupState.HELD
        # A claim is acknowledged only once a replica holds it: one that reached the old
        # primary, left behind with no replica, is refused and sent again.
        for _ in range(50):
            try:
                claimed = await directory.claim([("episode", "k2")])
                break
            except DirectoryError:
                await asyncio.sleep(0.2)
        assert claimed == (ClaimOutcome(ClaimVerdict.CLAIMED),)
        assert replica.client().hgetall("{episode-router}:owner:episode:k2")["r"] == "r1"
    finally:
        await client.aclose()
