"""The demo environment worker: episodes, tokens and tools over real loopback HTTP.

Runs the app alone (no control socket), with a ControlClient against the
scripted router of tests/scripted_router.py (claims before tokens, releases on
end), and as a real process (`python -m router.demo`) stopped with SIGTERM. Its
MCP endpoint is driven by the real MCP SDK client, and by hand for what an SDK
client never sends.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx2
import pytest
from aiohttp.test_utils import TestClient
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import TextContent

from router.client import BOOT_HEADER, ControlClient
from router.demo import (
    MCP_VERSIONS,
    TOKEN_HEADER,
    build_demo_app,
    mcp_reply_media,
    mcp_version,
    signing_key_from_env,
)
from router.tokens import SigningKey, TokenError, mint_token, parse_token
from tests.scripted_router import ScriptedRouter, eventually

Http = TestClient[Any, Any]
KEY = SigningKey.hs256(b"k" * 32)
OTHER_KEY = SigningKey.hs256(b"o" * 32)


@pytest.fixture
async def http(aiohttp_client: Any) -> Http:
    client: Http = await aiohttp_client(
        build_demo_app(worker_id="w0", client=None, signing_key=KEY)
    )
    return client


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[ScriptedRouter]:
    scripted = ScriptedRouter(tmp_path / "control.sock")
    await scripted.start()
    yield scripted
    await scripted.close()


@pytest.fixture
async def control(router: ScriptedRouter) -> AsyncIterator[ControlClient]:
    client = ControlClient(f"unix:{router.path}", worker_id="w0", url="http://127.0.0.1:9001")
    await client.start()
    yield client
    await client.stop()


async def start(http: Http, body: object = None) -> dict[str, Any]:
    response = await http.post("/episodes", json=body)
    assert response.status == 200, await response.text()
    started: dict[str, Any] = await response.json()
    return started


async def call(http: Http, token: str, tool: str, args: object = None) -> tuple[int, Any]:
    response = await http.post(f"/tools/{tool}", json=args, headers={TOKEN_HEADER: token})
    return response.status, await response.json()


def resign(token: str, key: SigningKey, **changes: Any) -> str:
    """The same claims (with `changes`) signed with `key`."""
    claims = parse_token(token, now=time.time())
    fields: dict[str, Any] = {"ep": claims.ep, "att": claims.att, "nonce": claims.nonce}
    return mint_token(**{**fields, **changes}, key=key, iat=claims.iat)


# --- without a control socket -------------------------------------------------------------------


async def test_health(http: Http) -> None:
    response = await http.get("/health")
    assert (response.status, await response.json()) == (200, {"worker": "w0"})


async def test_start_hands_out_a_token_for_the_attempt(http: Http) -> None:
    started = await start(http, {"ep": "ep7", "att": 2})
    assert set(started) == {"token", "episode", "worker"}
    assert (started["episode"], started["worker"]) == ("ep7-a2", "w0")
    claims = parse_token(started["token"], now=time.time(), verifier=KEY.verifier())
    assert (claims.ep, claims.att, claims.key) == ("ep7", 2, "ep7-a2")
    assert abs(claims.iat - time.time()) < 5


async def test_start_defaults_to_a_random_episode(http: Http) -> None:
    first, second = await start(http), await start(http)
    assert first["episode"].startswith("ep-") and first["episode"].endswith("-a0")
    assert first["episode"] != second["episode"]
    empty = await http.post("/episodes", data=b"")
    assert empty.status == 200


@pytest.mark.parametrize(
    ("body", "status", "error"),
    [
        (b"{not json", 400, "bad_request"),
        (b"[1]", 400, "bad_request"),
        (b'{"ep": "bad ep"}', 400, "bad_request"),
        (b'{"ep": ""}', 400, "bad_request"),
        (b'{"ep": 7}', 400, "bad_request"),
        (b'{"ep": "ep1", "att": -1}', 400, "bad_request"),
        (b'{"ep": "ep1", "att": "1"}', 400, "bad_request"),
        (b'{"ep": "ep1", "att": true}', 400, "bad_request"),
    ],
)
async def test_start_refuses_bad_bodies(http: Http, body: bytes, status: int, error: str) -> None:
    response = await http.post("/episodes", data=body)
    answer = await response.json()
    assert (response.status, answer["error"], answer["worker"]) == (status, error, "w0")
    assert isinstance(answer["detail"], str)


async def test_start_twice_is_a_conflict(http: Http) -> None:
    await start(http, {"ep": "ep1"})
    again = await http.post("/episodes", json={"ep": "ep1"})
    assert (again.status, (await again.json())["error"]) == (409, "episode_exists")


async def test_tools_keep_the_episode_state(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    other = (await start(http, {"ep": "ep2"}))["token"]
    reply = {"worker": "w0", "episode": "ep1-a0"}
    assert await call(http, token, "add", {"value": 5}) == (200, {**reply, "result": 5, "calls": 1})
    assert await call(http, token, "add", {"value": -2}) == (
        200,
        {**reply, "result": 3, "calls": 2},
    )
    assert await call(http, token, "get") == (200, {**reply, "result": 3, "calls": 3})
    assert await call(http, other, "get") == (
        200,
        {"worker": "w0", "episode": "ep2-a0", "result": 0, "calls": 1},
    )
    echoed = {"nested": [1, "two", None]}
    assert await call(http, token, "echo", echoed) == (200, {**reply, "result": echoed, "calls": 4})


@pytest.mark.parametrize(
    ("tool", "args"),
    [
        ("add", {}),
        ("add", {"value": "1"}),
        ("add", {"value": 1.5}),
        ("add", {"value": True}),
        ("add", {"value": 2**60}),
        ("add", [1]),
        ("sleep", {"seconds": 31}),
        ("sleep", {"seconds": -1}),
        ("stream", {"events": 0, "interval_s": 0}),
        ("stream", {"events": 1001, "interval_s": 0}),
        ("stream", {"events": 2, "interval_s": 11}),
    ],
)
async def test_bad_tool_arguments_are_400(http: Http, tool: str, args: object) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    status, answer = await call(http, token, tool, args)
    assert (status, answer["error"]) == (400, "bad_request")
    assert await call(http, token, "get") == (
        200,
        {"worker": "w0", "episode": "ep1-a0", "result": 0, "calls": 2},
    )


async def test_sleep_holds_the_request(http: Http) -> None:
    token = (await start(http))["token"]
    began = time.monotonic()
    status, answer = await call(http, token, "sleep", {"seconds": 0.2})
    assert time.monotonic() - began >= 0.2
    assert (status, answer["result"]) == (200, 0.2)


async def test_stream_sends_events_spaced_in_time(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    response = await http.post(
        "/tools/stream", json={"events": 3, "interval_s": 0.2}, headers={TOKEN_HEADER: token}
    )
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events: list[tuple[float, Any]] = []
    async for line in response.content:
        if line.startswith(b"data: "):
            events.append((time.monotonic(), json.loads(line.removeprefix(b"data: "))))
    assert [data for _, data in events] == [
        {"worker": "w0", "episode": "ep1-a0", "result": {"event": i}, "calls": 1} for i in range(3)
    ]
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(events)]
    assert all(gap >= 0.15 for gap in gaps)


async def test_forged_signature_is_403(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    status, answer = await call(http, resign(token, OTHER_KEY), "get")
    assert (status, answer["error"]) == (403, "bad_signature")


async def test_wrong_nonce_is_403(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    status, answer = await call(http, resign(token, KEY, nonce="guessed-nonce"), "get")
    assert (status, answer["error"]) == (403, "bad_nonce")


async def test_unknown_episode_is_404_naming_the_worker(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    for stranger in (resign(token, KEY, ep="ep9"), resign(token, KEY, att=1)):
        status, answer = await call(http, stranger, "get")
        assert (status, answer["error"], answer["worker"]) == (404, "unknown_episode", "w0")


@pytest.mark.parametrize(
    ("headers", "status", "error"),
    [
        ({}, 401, "invalid_token"),
        ({TOKEN_HEADER: "not-a-token"}, 401, "invalid_token"),
    ],
)
async def test_missing_or_malformed_token(
    http: Http, headers: dict[str, str], status: int, error: str
) -> None:
    response = await http.post("/tools/get", headers=headers)
    assert (response.status, (await response.json())["error"]) == (status, error)


async def test_expired_token_is_401(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    claims = parse_token(token, now=time.time())
    expired = mint_token(ep="ep1", att=0, nonce=claims.nonce, key=KEY, iat=1, exp=2)
    status, answer = await call(http, expired, "get")
    assert (status, answer["error"]) == (401, "invalid_token")


async def test_repeated_token_header_with_different_values_is_400(http: Http) -> None:
    first = (await start(http, {"ep": "ep1"}))["token"]
    second = (await start(http, {"ep": "ep2"}))["token"]
    response = await http.post(
        "/tools/get", headers=[(TOKEN_HEADER, first), (TOKEN_HEADER, second)]
    )
    assert (response.status, (await response.json())["error"]) == (400, "ambiguous_session")


async def test_unknown_tool_is_404(http: Http) -> None:
    token = (await start(http))["token"]
    status, answer = await call(http, token, "launch")
    assert (status, answer["error"]) == (404, "unknown_tool")


async def test_body_over_1_mib_is_413(http: Http) -> None:
    token = (await start(http))["token"]
    response = await http.post(
        "/tools/echo", data=io.BytesIO(b" " * ((1 << 20) + 1)), headers={TOKEN_HEADER: token}
    )
    assert (response.status, (await response.json())["error"]) == (413, "payload_too_large")


async def test_end_forgets_the_episode(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    await call(http, token, "add", {"value": 4})
    ended = await http.post("/episodes/end", headers={TOKEN_HEADER: token})
    assert (ended.status, await ended.json()) == (
        200,
        {"worker": "w0", "episode": "ep1-a0", "result": {"ended": True, "counter": 4}, "calls": 1},
    )
    status, answer = await call(http, token, "get")
    assert (status, answer["error"]) == (404, "unknown_episode")
    again = await http.post("/episodes/end", headers={TOKEN_HEADER: token})
    assert again.status == 404
    # A new start of the same attempt gets a new nonce: the old token stays refused.
    await start(http, {"ep": "ep1"})
    status, answer = await call(http, token, "get")
    assert (status, answer["error"]) == (403, "bad_nonce")


async def test_foreign_boot_header_is_410(http: Http) -> None:
    response = await http.get("/health", headers={BOOT_HEADER: "some-dead-process"})
    assert (response.status, (await response.json())["error"]) == (410, "worker_exited")


def test_signing_key_from_env() -> None:
    shared = signing_key_from_env({"EPISODE_TOKEN_SECRET": "s" * 32})
    token = mint_token(ep="ep1", att=0, nonce="n", key=shared, iat=1)
    assert parse_token(token, now=2, verifier=SigningKey.hs256(b"s" * 32).verifier()).ep == "ep1"
    random = signing_key_from_env({})
    with pytest.raises(TokenError):
        parse_token(token, now=2, verifier=random.verifier())
    with pytest.raises(ValueError, match="32 bytes"):
        signing_key_from_env({"EPISODE_TOKEN_SECRET": "short"})


# --- MCP -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("accept", "streams", "media"),
    [
        ("application/json, text/event-stream", False, "json"),
        ("application/json, text/event-stream", True, "sse"),
        ("text/event-stream", False, "sse"),
        ("application/json", True, "json"),
        ("*/*", True, "json"),
        ("application/*;q=0.9", False, "json"),
        ("TEXT/Event-Stream; charset=utf-8", False, "sse"),
        ("text/html", False, None),
        ("", True, None),
    ],
)
def test_mcp_reply_media(accept: str, streams: bool, media: str | None) -> None:
    assert mcp_reply_media(accept, streams=streams) == media


def test_mcp_version_answers_the_clients_own_when_supported() -> None:
    assert [mcp_version(v) for v in MCP_VERSIONS] == list(MCP_VERSIONS)
    assert [mcp_version(v) for v in ("2026-07-28", "2024-11-05", None, 7)] == [MCP_VERSIONS[0]] * 4


class Wire:
    """What an SDK client's HTTP layer saw: (JSON-RPC method, status, content type) per
    reply, and (arrival, progress) per progress notification."""

    def __init__(self) -> None:
        self.replies: list[tuple[str | None, int, str]] = []
        self.progress: list[tuple[float, float]] = []

    async def record(self, response: httpx2.Response) -> None:
        sent = response.request.content
        method = json.loads(sent).get("method") if sent else None
        content_type = response.headers.get("content-type", "")
        self.replies.append((method, response.status_code, content_type))

    async def on_progress(self, progress: float, total: float | None, message: str | None) -> None:
        self.progress.append((time.monotonic(), progress))


def sdk_client(http: Http, token: str, wire: Wire) -> tuple[httpx2.AsyncClient, Client]:
    """The MCP SDK's client on the demo's /mcp, with the episode token on every request."""
    client = httpx2.AsyncClient(
        headers={TOKEN_HEADER: token}, event_hooks={"response": [wire.record]}, trust_env=False
    )
    transport = streamable_http_client(str(http.make_url("/mcp")), http_client=client)
    return client, Client(transport)


async def test_mcp_sdk_client_lists_and_calls_the_demo_tools(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    wire = Wire()
    client, mcp = sdk_client(http, token, wire)
    async with client, mcp:
        assert mcp.protocol_version == MCP_VERSIONS[0]
        listed = [tool.name for tool in (await mcp.list_tools()).tools]
        added = await mcp.call_tool("add", {"value": 5})
        got = await mcp.call_tool("get", {})
        refused = await mcp.call_tool("add", {"value": "five"})
        echoed = await mcp.call_tool("echo", {"nested": [1, None]})
        with pytest.raises(MCPError, match="Unknown tool"):
            await mcp.call_tool("launch", {})
    assert listed == ["add", "get", "echo", "sleep", "stream"]
    reply = {"worker": "w0", "episode": "ep1-a0"}
    assert added.structured_content == {**reply, "result": 5, "calls": 1}
    assert got.structured_content == {**reply, "result": 5, "calls": 2}
    (refusal,) = refused.content
    assert refused.is_error and isinstance(refusal, TextContent)
    assert json.loads(refusal.text)["error"] == "bad_request"
    assert echoed.structured_content == {**reply, "result": {"nested": [1, None]}, "calls": 4}
    json_type = "application/json; charset=utf-8"
    # The SDK probes the 2026-07-28 protocol first; the demo refuses it (400) and the SDK falls
    # back to the handshake. Every reply is JSON: the client accepts both, nothing streams.
    assert wire.replies == [
        ("server/discover", 400, json_type),
        ("initialize", 200, json_type),
        ("notifications/initialized", 202, ""),
        *[(m, 200, json_type) for m in ("tools/list", *["tools/call"] * 5)],
    ]
    # The plain HTTP tools see the same episode (an unknown tool was not counted as a call).
    assert await call(http, token, "get") == (200, {**reply, "result": 5, "calls": 5})


async def test_mcp_stream_with_progress_is_sse_events_spaced_in_time(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    wire = Wire()
    client, mcp = sdk_client(http, token, wire)
    async with client, mcp:
        args = {"events": 3, "interval_s": 0.2}
        result = await mcp.call_tool("stream", args, progress_callback=wire.on_progress)
        quiet = await mcp.call_tool("stream", {"events": 2, "interval_s": 0})
    assert result.structured_content == {
        "worker": "w0", "episode": "ep1-a0", "result": {"events": 3}, "calls": 1
    }  # fmt: skip
    assert quiet.structured_content == {
        "worker": "w0", "episode": "ep1-a0", "result": {"events": 2}, "calls": 2
    }  # fmt: skip
    assert [progress for _, progress in wire.progress] == [1, 2, 3]
    gaps = [later - earlier for (earlier, _), (later, _) in itertools.pairwise(wire.progress)]
    assert all(gap >= 0.15 for gap in gaps)
    calls = [content_type for method, _, content_type in wire.replies if method == "tools/call"]
    assert calls == ["text/event-stream", "application/json; charset=utf-8"]


async def mcp_post(
    http: Http,
    message: object,
    *,
    token: str | None,
    accept: str = "application/json, text/event-stream",
    version: str | None = None,
) -> tuple[int, str, Any]:
    """One raw POST /mcp: (status, content type, JSON body or the SSE events' data)."""
    headers = {"Accept": accept, **({TOKEN_HEADER: token} if token else {})}
    if version is not None:
        headers["MCP-Protocol-Version"] = version
    data = message if isinstance(message, bytes) else json.dumps(message).encode()
    response = await http.post("/mcp", data=data, headers=headers)
    text = await response.text()
    if response.content_type == "text/event-stream":
        events = [json.loads(line[5:]) for line in text.splitlines() if line.startswith("data:")]
        return response.status, response.content_type, events
    return response.status, response.content_type, json.loads(text) if text else None


def rpc(method: str, params: object = None, message_id: object = 1) -> dict[str, object]:
    message: dict[str, object] = {"jsonrpc": "2.0", "id": message_id, "method": method}
    if params is not None:
        message["params"] = params
    return message


def rpc_error(message_id: object, code: int) -> Any:
    """Matches a JSON-RPC error body by id and code (its message is for people)."""
    return {"jsonrpc": "2.0", "id": message_id, "error": {"code": code, "message": NonEmptyText()}}


class NonEmptyText:
    """Equal to any non-empty string: an error message is for people, not for matching."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and bool(other)


async def test_mcp_answers_sse_to_a_client_that_takes_only_sse(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    status, media, events = await mcp_post(
        http, rpc("tools/list", message_id="a"), token=token, accept="text/event-stream"
    )
    assert (status, media, len(events)) == (200, "text/event-stream", 1)
    assert events[0]["id"] == "a" and len(events[0]["result"]["tools"]) == 5


async def test_mcp_refusals(http: Http) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    json_type = "application/json"
    cases: list[tuple[object, dict[str, Any], int, Any]] = [
        (b"{not json", {}, 400, rpc_error(None, -32700)),
        ([rpc("ping")], {}, 400, rpc_error(None, -32600)),  # no batches
        ({"id": 1, "method": "ping"}, {}, 400, rpc_error(None, -32600)),  # no "jsonrpc"
        (rpc("ping", message_id=True), {}, 400, rpc_error(None, -32600)),
        (rpc("ping", params=[1]), {}, 400, rpc_error(None, -32600)),
        (rpc("ping"), {"accept": "text/html"}, 406, rpc_error(1, -32600)),
        (rpc("ping"), {"version": "2026-07-28"}, 400, rpc_error(1, -32600)),
        (rpc("resources/list"), {}, 200, rpc_error(1, -32601)),
        (rpc("tools/call", {"name": "launch"}), {}, 200, rpc_error(1, -32602)),
    ]
    for message, options, status, body in cases:
        assert await mcp_post(http, message, token=token, **options) == (status, json_type, body)
    assert await mcp_post(http, rpc("ping"), token=token, version=MCP_VERSIONS[-1]) == (
        200, json_type, {"jsonrpc": "2.0", "id": 1, "result": {}}
    )  # fmt: skip
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    status, _, body = await mcp_post(http, note, token=token)
    assert (status, body) == (202, None)  # accepted, nothing to answer
    for method in ("GET", "DELETE"):
        response = await http.request(method, "/mcp", headers={TOKEN_HEADER: token})
        assert (response.status, response.headers["Allow"]) == (405, "POST")


@pytest.mark.parametrize(
    ("forge", "status", "error"),
    [
        (lambda token: None, 401, "invalid_token"),
        (lambda token: resign(token, KEY, ep="ep9"), 404, "unknown_episode"),
        (lambda token: resign(token, KEY, nonce="guessed"), 403, "bad_nonce"),
        (lambda token: resign(token, OTHER_KEY), 403, "bad_signature"),
    ],
)
async def test_mcp_serves_only_the_episodes_it_holds(
    http: Http, forge: Any, status: int, error: str
) -> None:
    token = (await start(http, {"ep": "ep1"}))["token"]
    answer = await mcp_post(http, rpc("tools/list"), token=forge(token))
    assert answer == (
        status,
        "application/json",
        {
            "jsonrpc": "2.0",
            "id": 1,
            "error": {
                "code": -32001,
                "message": NonEmptyText(),
                "data": {"error": error, "worker": "w0"},
            },
        },
    )


# --- with the control socket --------------------------------------------------------------------


async def test_start_claims_before_the_token_and_end_releases(
    aiohttp_client: Any, router: ScriptedRouter, control: ControlClient
) -> None:
    http: Http = await aiohttp_client(
        build_demo_app(worker_id="w0", client=control, signing_key=KEY)
    )
    started = await start(http, {"ep": "ep1"})
    assert router.holders == {("episode", "ep1-a0"): "w0"}
    assert control.held == {("episode", "ep1-a0")}
    status, _ = await call(http, started["token"], "add", {"value": 1})
    assert status == 200
    ended = await http.post("/episodes/end", headers={TOKEN_HEADER: started["token"]})
    assert ended.status == 200
    assert router.holders == {}
    assert router.tombstones == {("episode", "ep1-a0"): "ended"}
    assert control.held == frozenset()
    assert router.ops() == ["hello", "sync", "claim", "release"]
    # The boot check knows this process's boot.
    mine = await http.get("/health", headers={BOOT_HEADER: control.boot})
    assert mine.status == 200


async def test_refused_claim_is_409_and_keeps_no_state(
    aiohttp_client: Any, router: ScriptedRouter, control: ControlClient
) -> None:
    http: Http = await aiohttp_client(
        build_demo_app(worker_id="w0", client=control, signing_key=KEY)
    )
    router.holders[("episode", "taken-a0")] = "w9"
    response = await http.post("/episodes", json={"ep": "taken"})
    answer = await response.json()
    assert (response.status, answer["error"], answer["worker"]) == (409, "conflict", "w0")
    forged = mint_token(ep="taken", att=0, nonce="n", key=KEY, iat=int(time.time()))
    status, answer = await call(http, forged, "get")
    assert (status, answer["error"]) == (404, "unknown_episode")
    retry = await http.post("/episodes", json={"ep": "taken", "att": 1})
    assert retry.status == 200
    assert control.held == {("episode", "taken-a1")}


async def test_no_claim_mode_keeps_the_lease_but_claims_nothing(
    aiohttp_client: Any, router: ScriptedRouter, control: ControlClient
) -> None:
    http: Http = await aiohttp_client(
        build_demo_app(worker_id="w0", client=control, signing_key=KEY, claim=False)
    )
    token = (await start(http, {"ep": "ep1"}))["token"]
    assert (await call(http, token, "get"))[0] == 200
    assert router.ops() == ["hello", "sync"] and router.holders == {}
    assert control.connected


async def test_claim_waits_for_a_reconnect(
    aiohttp_client: Any, router: ScriptedRouter, control: ControlClient
) -> None:
    http: Http = await aiohttp_client(
        build_demo_app(worker_id="w0", client=control, signing_key=KEY)
    )
    await router.close()
    await eventually(lambda: not control.connected)
    starting = asyncio.create_task(start(http, {"ep": "ep1"}), name="start-episode")
    await asyncio.sleep(0.2)
    assert not starting.done()
    await router.start()
    started = await asyncio.wait_for(starting, 3)
    assert started["episode"] == "ep1-a0"
    assert router.holders == {("episode", "ep1-a0"): "w0"}


async def test_a_refused_hello_leaves_no_lease_a_claim_is_503_not_a_refused_claim(
    aiohttp_client: Any, router: ScriptedRouter, control: ControlClient
) -> None:
    http: Http = await aiohttp_client(
        build_demo_app(worker_id="w0", client=control, signing_key=KEY)
    )
    router.secret = "rotated-secret-0123"  # this worker's next hello is refused: forbidden
    await router.drop_connections()
    await eventually(lambda: control.refusal is not None or not control.connected)
    response = await http.post("/episodes", json={"ep": "ep1"})
    answer = await response.json()
    assert (response.status, answer["error"]) == (503, "control_unavailable")
    assert "forbidden" in answer["detail"]


# --- the process --------------------------------------------------------------------------------


async def run_demo(*args: str) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EPISODE_")}
    env["EPISODE_TOKEN_SECRET"] = "k" * 32
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.demo", "--port", "0", *args,
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip


async def test_demo_process_says_hello_serves_and_says_bye_on_sigterm(
    router: ScriptedRouter,
) -> None:
    process = await run_demo("--worker-id", "w5", "--control", f"unix:{router.path}")
    try:
        await eventually(lambda: router.ops()[:1] == ["hello"], within=15)
        hello = router.messages[0]
        assert hello["worker"] == "w5" and hello["url"].startswith("http://127.0.0.1:")
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{hello['url']}/health") as health:
                assert (health.status, await health.json()) == (200, {"worker": "w5"})
            async with session.post(f"{hello['url']}/episodes", json={"ep": "ep1"}) as started:
                token = (await started.json())["token"]
        assert router.holders == {("episode", "ep1-a0"): "w5"}
        assert parse_token(token, now=time.time(), verifier=KEY.verifier()).key == "ep1-a0"
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 10) == 0
        assert router.ops()[-1] == "bye"
        assert router.tombstones == {("episode", "ep1-a0"): "worker_exited"}
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_demo_process_exits_on_sigterm_while_the_router_is_away(tmp_path: Path) -> None:
    process = await run_demo("--worker-id", "w5", "--control", f"unix:{tmp_path / 'none.sock'}")
    try:
        await asyncio.sleep(1.0)  # let it start and retry the control socket a few times
        assert process.returncode is None
        process.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(process.wait(), 10) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_demo_process_exits_1_when_the_hello_is_refused(
    router: ScriptedRouter, control: ControlClient
) -> None:
    process = await run_demo("--worker-id", "w0", "--control", f"unix:{router.path}")
    try:
        assert await asyncio.wait_for(process.wait(), 15) == 1
        assert router.ops() == ["hello", "sync", "hello"]
        assert control.connected
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
