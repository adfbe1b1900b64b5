"""Fixtures of the fleet tests: a redis-server and a launcher per test, the fleet on them.

The processes are the e2e `Launcher`'s (stopped by pid, pass or fail; a failing test's
report carries their stderr tails), the redis-server the directory tests' `RedisServer`
on a port outside the ephemeral range, so that a restart finds it free.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.directory.conftest import RedisServer
from tests.e2e.conftest import (  # the e2e fixture and the hook that adds stderr tails
    Launcher,
    launcher,
    pytest_runtest_makereport,
)
from tests.fleet.rig import Fleet

__all__ = ["launcher", "pytest_runtest_makereport"]


@pytest.fixture
def fleet_redis() -> Iterator[RedisServer]:
    # A short folder of its own: a Unix socket path must fit in 108 bytes.
    folder = Path(tempfile.mkdtemp(prefix="er-fleet-"))
    server = RedisServer(folder)  # below the ephemeral range: a restart gets its port back
    try:
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def fleet(fleet_redis: RedisServer, launcher: Launcher) -> Iterator[Fleet]:
    # Redis first, so it outlives the routers: their SIGTERM writes a certificate there.
    rig = Fleet(launcher, fleet_redis)
    try:
        yield rig
    finally:
        rig.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    """HTTP with a new connection per request: each may land on any router."""
    connector = aiohttp.TCPConnector(force_close=True, limit=512)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http:
        yield http
