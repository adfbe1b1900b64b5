"""A client's Connection options never remove what the router routed by (design §8).

`Connection` names hop-by-hop headers, which a proxy drops (RFC 9110 §7.6.1). A client
that lists its session header there would have the router route by the header and then
strip it, so the worker would run the call without the session it was routed for. The
session kinds' headers, Cookie, Authorization, Content-Type and Content-Length are never
removed by a Connection option; any other name it lists still is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from router.config import McpSourceConfig, SessionKindConfig
from router.relay.contract import end_to_end_headers, request_headers_for_worker
from tests.app.test_faults import ScriptedWorker, exchange_until_closed, request_bytes
from tests.router_fixtures import TOKEN_HEADER, Rig, open_rig, router_config, token

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


async def test_a_session_header_named_in_connection_still_reaches_the_worker(rig: Rig) -> None:
    router = await rig.start_router()
    worker = await ScriptedWorker("w0").start(rig)
    await worker.claim("ep-a0")
    value = token("ep")
    request = request_bytes(
        "POST",
        "/tool",
        [
            (TOKEN_HEADER, value),
            ("Cookie", "theme=dark"),
            ("Content-Type", "application/json"),
            ("X-Hop", "dropped"),
            ("Connection", f"close, {TOKEN_HEADER.lower()}, cookie, Content-Type, x-hop"),
        ],
        b"{}",
    )

    everything = await exchange_until_closed(router.public_port, request)

    assert everything.startswith(b"HTTP/1.1 200 ")
    (arrived,) = worker.arrived
    assert arrived.values(TOKEN_HEADER) == [value]  # routed by it, and the worker has it
    assert arrived.values("cookie") == ["theme=dark"]
    assert arrived.values("content-type") == ["application/json"]
    assert arrived.values("x-hop") == []  # any other name Connection lists is dropped
    assert arrived.decoded == b"{}"


async def test_an_mcp_session_header_named_in_connection_still_reaches_the_worker(
    rig: Rig, tmp_path: Path
) -> None:
    mcp = SessionKindConfig(name="mcp", mcp=McpSourceConfig(), unclaimed="forward")
    router = await rig.start_router(router_config(tmp_path, sessions=(mcp,)))
    worker = await ScriptedWorker("w0").start(rig)
    request = request_bytes(
        "GET",
        "/mcp",
        [("Mcp-Session-Id", "s-1"), ("Connection", "close, mcp-session-id")],
    )

    everything = await exchange_until_closed(router.public_port, request)

    assert everything.startswith(b"HTTP/1.1 200 ")
    (arrived,) = worker.arrived
    assert arrived.values("mcp-session-id") == ["s-1"]


def test_the_headers_a_connection_option_never_removes() -> None:
    kept = end_to_end_headers(["X-NeMo-Gym-Episode-Token", "Mcp-Session-Id"])
    headers = request_headers_for_worker(
        [
            ("X-NeMo-Gym-Episode-Token", "t"),
            ("Mcp-Session-Id", "m"),
            ("Authorization", "Bearer x"),
            ("Keep-Alive", "timeout=5"),
            ("X-Named", "y"),
            ("Connection", "X-NeMo-Gym-Episode-Token, mcp-session-id, authorization, x-named"),
        ],
        worker_host="127.0.0.1:1",
        client_ip="127.0.0.1",
        scheme="http",
        kept=kept,
    )
    assert headers.getall("X-NeMo-Gym-Episode-Token") == ["t"]
    assert headers.getall("Mcp-Session-Id") == ["m"]
    assert headers.getall("Authorization") == ["Bearer x"]
    assert "X-Named" not in headers and "Keep-Alive" not in headers and "Connection" not in headers
