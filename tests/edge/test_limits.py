"""The public edge's connection limit and the limits' config keys: pure parts first, then
an edge on loopback at its limit."""

from __future__ import annotations

import asyncio
import dataclasses
import resource
from typing import cast

import pytest

from router.config import ConfigError, parse_config
from router.core.answers import Answer
from router.edge.request import PublicRequest
from router.edge.server import EdgeConnection, EdgeLimits, EdgeServer
from router.metrics import EdgeCounts, RouterMetrics
from router.service.listeners import (
    MIN_CONNECTIONS,
    RESERVED_FILES,
    connection_limit,
    open_file_limit,
)
from router.service.settings import edge_limits
from tests.metrics.test_registry import scrape
from tests.router_fixtures import RawHttp, wait_until

# --- pure -----------------------------------------------------------------------------------


def config_with(limits: str) -> str:
    return f"control: {{socket: 'unix:/run/r.sock'}}\nlimits: {{{limits}}}\n"


def test_the_head_and_connection_limits_have_their_defaults() -> None:
    limits = parse_config(config_with("")).limits
    assert limits.max_head_bytes == 65536
    assert limits.max_held_head_bytes == 64 * 1024 * 1024
    assert limits.max_connections is None


def test_the_head_and_connection_limits_are_read() -> None:
    text = config_with("max_head_bytes: 4096, max_held_head_bytes: 1048576, max_connections: 9")
    limits = parse_config(text).limits
    assert (limits.max_head_bytes, limits.max_held_head_bytes, limits.max_connections) == (
        4096,
        1048576,
        9,
    )


@pytest.mark.parametrize(
    "limits", ["max_head_bytes: 100", "max_held_head_bytes: 0", "max_connections: 0"]
)
def test_a_head_or_connection_limit_too_low_is_refused_with_its_key(limits: str) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config(config_with(limits))
    assert limits.split(":")[0] in str(refused.value)


def test_the_connection_limit_is_half_of_what_the_reserve_leaves() -> None:
    assert connection_limit(1024) == (1024 - RESERVED_FILES) // 2 == 384
    assert connection_limit(1 << 20) == ((1 << 20) - RESERVED_FILES) // 2
    assert connection_limit(100) == MIN_CONNECTIONS  # below the reserve: a few all the same


def test_the_edge_limit_comes_from_the_open_file_limit_unless_the_config_sets_one() -> None:
    config = parse_config(config_with(""))
    assert edge_limits(config).max_connections == connection_limit(open_file_limit())
    assert open_file_limit() == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    limited = dataclasses.replace(
        config, limits=dataclasses.replace(config.limits, max_connections=7)
    )
    assert edge_limits(limited).max_connections == 7


def test_the_edge_counts_are_shown_at_scrape_time() -> None:
    metrics = RouterMetrics(
        claims_by_worker_kind=dict,
        tombstones=lambda: 0,
        workers=list,
        control_connections=lambda: 0,
        recovery_remaining=lambda: None,
    )
    counts = EdgeCounts(
        open_connections=5,
        refused_at_limit=3,
        idle_closed_for_room=2,
        head_bytes_held=4096,
        heads_over_budget=1,
    )
    metrics.watch_edge(lambda: counts)
    metrics.watch_edge(lambda: counts)  # a service started again: shown once
    samples = scrape(metrics)
    assert samples["episode_router_public_connections", ""] == 5
    assert samples["episode_router_connections_refused_total", "reason=limit"] == 3
    assert samples["episode_router_idle_connections_closed_total", ""] == 2
    assert samples["episode_router_head_bytes_held", ""] == 4096
    assert samples["episode_router_heads_over_budget_total", ""] == 1


# --- an edge at its connection limit ----------------------------------------------------------


def answer_at_once(request: PublicRequest) -> None:
    request.client.answer(request, Answer("no_worker", "answered"))
    request.client.finished(request)


async def test_at_the_limit_the_longest_idle_connection_makes_room_then_new_ones_are_refused() -> (
    None
):
    loop = asyncio.get_running_loop()
    edge = EdgeServer(answer_at_once, EdgeLimits(max_connections=3), loop)
    listener = await loop.create_server(edge, "127.0.0.1", 0)
    port = int(listener.sockets[0].getsockname()[1])
    opened: list[RawHttp] = []
    try:
        silent = await RawHttp.open(port)  # never sends: not idle, never closed for room
        opened.append(silent)
        idle = []
        for _ in range(2):
            conn = await RawHttp.open(port)
            opened.append(conn)
            conn.send(b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await conn.read_reply())[0] == 503
            idle.append(conn)
            await asyncio.sleep(0.05)  # the first one idle the longest
        fresh = await RawHttp.open(port)
        opened.append(fresh)
        fresh.send(b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await fresh.read_reply())[0] == 503  # served
        assert await idle[0].read_to_end() == b""  # the longest idle made room
        assert edge.idle_closed_for_room == 1
        second = await RawHttp.open(port)
        opened.append(second)
        assert await idle[1].read_to_end() == b""
        fresh.send(b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await fresh.read_reply())[0] == 503
        await asyncio.sleep(0.1)  # fresh is idle again, and the newest idle
        refused = await RawHttp.open(port)  # fresh makes room
        opened.append(refused)
        assert await fresh.read_to_end() == b""
        last = await RawHttp.open(port)  # none idle now: accepted and closed at once
        opened.append(last)
        assert await last.read_to_end() == b""
        assert edge.refused_at_limit == 1
        assert edge.idle_closed_for_room == 3

        async def three_left() -> bool:
            return len(edge.connections) == 3

        await wait_until(three_left, "the closed ones to go", 5)
        assert not silent.reader.at_eof()  # the silent one was never closed for room
    finally:
        for conn in opened:
            conn.close()
        listener.close()
        await edge.shutdown(0.5)


async def test_refusals_at_the_limit_are_logged_once_a_minute_not_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    loop = asyncio.get_running_loop()
    edge = EdgeServer(answer_at_once, EdgeLimits(max_connections=1), loop)
    listener = await loop.create_server(edge, "127.0.0.1", 0)
    port = int(listener.sockets[0].getsockname()[1])
    held = await RawHttp.open(port)  # silent: nothing to close for room
    refused = [await RawHttp.open(port) for _ in range(5)]
    try:
        for conn in refused:
            assert await conn.read_to_end() == b""
        assert edge.refused_at_limit == 5
        warnings = [r for r in caplog.records if "max_connections" in r.getMessage()]
        assert len(warnings) == 1
        assert warnings[0].levelname == "WARNING"
    finally:
        for conn in (held, *refused):
            conn.close()
        listener.close()
        await edge.shutdown(0.5)


class _Busy:
    """A connection that is never idle, and fails the test if it is looked at."""

    @property
    def idle_until(self) -> float | None:
        raise AssertionError("a busy connection was scanned for the longest idle")


async def test_the_longest_idle_is_found_without_scanning_the_busy_connections() -> None:
    loop = asyncio.get_running_loop()
    edge = EdgeServer(answer_at_once, EdgeLimits(max_connections=10_002), loop)
    listener = await loop.create_server(edge, "127.0.0.1", 0)
    port = int(listener.sockets[0].getsockname()[1])
    opened: list[RawHttp] = []
    try:
        for _ in range(2):
            conn = await RawHttp.open(port)
            opened.append(conn)
            conn.send(b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n")
            assert (await conn.read_reply())[0] == 503
        first, second = opened
        first.send(b"GET /p HTTP/1.1\r\nHost: x\r\n\r\n")  # idle again: now the newest
        assert (await first.read_reply())[0] == 503
        busy = [_Busy() for _ in range(10_000)]
        edge.connections.update(cast("list[EdgeConnection]", busy))
        fresh = await RawHttp.open(port)  # at the limit: the longest idle makes room
        opened.append(fresh)
        assert await second.read_to_end() == b""
        assert not first.reader.at_eof()
        assert edge.idle_closed_for_room == 1
        edge.connections.difference_update(cast("list[EdgeConnection]", busy))
    finally:
        for conn in opened:
            conn.close()
        listener.close()
        await edge.shutdown(0.5)
