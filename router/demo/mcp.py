"""The demo worker's MCP endpoint: its tools over MCP Streamable HTTP.

`POST /mcp` serves the demo's tools over MCP Streamable HTTP (the initialize
handshake, stateless: no `Mcp-Session-Id`), so `episode-router demo` can be
tried with an MCP client; every MCP request carries the episode token too, and
is routed by it like any other call (design §7). It answers JSON, or SSE when
the client accepts only SSE, or when a `stream` call asked for progress: its
events then travel as `notifications/progress` ahead of the result.

This module owns the JSON-RPC side: message checks, the Accept and protocol
version negotiation (pure functions), and McpEndpoint, the handler. It must
never check a token or hold episodes itself (`router.demo.episodes` does that),
and a malformed message or a refused episode is always a JSON-RPC error answer
(McpError, carrying its HTTP status and code), never an exception out of the
handler.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from router import __version__
from router.demo.episodes import (
    MAX_STREAM_EVENTS,
    MAX_STREAM_INTERVAL_S,
    STREAM_TOOL,
    TOOLS,
    DemoError,
    EpisodeState,
    HeldEpisodes,
    int_arg,
    read_json,
    seconds_arg,
)

__all__ = [
    "MCP_PATH",
    "MCP_TOOLS",
    "MCP_VERSIONS",
    "McpEndpoint",
    "McpError",
    "Notify",
    "mcp_reply_media",
    "mcp_version",
]

MCP_PATH = "/mcp"
# Handshake-era versions, newest first: initialize answers the client's own when listed here.
MCP_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26")
_PARSE_ERROR, _INVALID_REQUEST, _METHOD_NOT_FOUND, _INVALID_PARAMS = -32700, -32600, -32601, -32602
_EPISODE_REFUSED = -32001  # server-defined: the token names no episode this worker runs


def _schema(**properties: object) -> dict[str, object]:
    """A tool's input schema: an object whose `properties` are all required."""
    return {"type": "object", "properties": properties, "required": list(properties)}


_SECONDS = {"type": "number", "minimum": 0}
MCP_TOOLS: list[dict[str, object]] = [
    {
        "name": "add",
        "description": "Add `value` to the counter.",
        "inputSchema": _schema(value={"type": "integer"}),
    },
    {"name": "get", "description": "The episode's counter.", "inputSchema": _schema()},
    {"name": "echo", "description": "Its arguments, back.", "inputSchema": {"type": "object"}},
    {
        "name": "sleep",
        "description": "Hold the call `seconds`.",
        "inputSchema": _schema(seconds=_SECONDS),
    },
    {
        "name": STREAM_TOOL,
        "description": "`events` progress notifications `interval_s` apart.",
        "inputSchema": _schema(events={"type": "integer", "minimum": 1}, interval_s=_SECONDS),
    },
]


class McpError(Exception):
    """A JSON-RPC error answer: the HTTP `status`, and the error's `code` and `message`."""

    def __init__(self, status: int, code: int, message: str, data: object = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.data = data

    def body(self, message_id: object) -> dict[str, object]:
        error: dict[str, object] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return {"jsonrpc": "2.0", "id": message_id, "error": error}


def mcp_reply_media(accept: str, *, streams: bool) -> str | None:
    """How to answer a client whose Accept header is `accept`: "json", "sse", or None when
    it takes neither. SSE when it takes only SSE, or when the reply `streams` (carries
    notifications ahead of its result) and it takes SSE at all."""
    media = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    json_ok = not media.isdisjoint({"application/json", "application/*", "*/*"})
    sse_ok = "text/event-stream" in media
    if sse_ok and (streams or not json_ok):
        return "sse"
    return "json" if json_ok else None


def mcp_version(requested: object) -> str:
    """The protocol version initialize answers: the client's own when supported, else ours."""
    return (
        requested if isinstance(requested, str) and requested in MCP_VERSIONS else MCP_VERSIONS[0]
    )


def _rpc_message(body: object) -> dict[str, Any]:
    """One JSON-RPC request or notification, or McpError (400)."""
    if not isinstance(body, dict):
        raise McpError(400, _INVALID_REQUEST, "The body must be one JSON-RPC message (no batch).")
    message_id = body.get("id")
    # A notification has no id at all; a request's is a string or an integer.
    id_ok = "id" not in body or (
        isinstance(message_id, str | int) and not isinstance(message_id, bool)
    )
    if body.get("jsonrpc") != "2.0" or not isinstance(body.get("method"), str) or not id_ok:
        raise McpError(400, _INVALID_REQUEST, "Not a JSON-RPC 2.0 request or notification.")
    if not isinstance(body.get("params", {}), dict):
        raise McpError(400, _INVALID_REQUEST, "`params` must be an object.")
    return body


def _progress_token(message: Mapping[str, Any]) -> str | int | None:
    meta = message.get("params", {}).get("_meta")
    token = meta.get("progressToken") if isinstance(meta, dict) else None
    return token if isinstance(token, str | int) and not isinstance(token, bool) else None


def _streams(message: Mapping[str, Any]) -> bool:
    """Whether the reply carries notifications: a `stream` call that asked for progress."""
    params = message.get("params", {})
    called = message.get("method") == "tools/call" and params.get("name") == STREAM_TOOL
    return called and _progress_token(message) is not None


def _tool_result(body: object, *, is_error: bool = False) -> dict[str, object]:
    text = json.dumps(body, separators=(",", ":"))
    result: dict[str, object] = {"content": [{"type": "text", "text": text}], "isError": is_error}
    if not is_error:
        result["structuredContent"] = body
    return result


def _sse_event(payload: Mapping[str, object]) -> bytes:
    return f"event: message\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


Notify = Callable[[int, int], Awaitable[None]]


# --- the endpoint ----------------------------------------------------------------------------


class McpEndpoint:
    """One demo worker's `POST /mcp`: the JSON-RPC handling over the `episodes` it holds."""

    __slots__ = ("episodes",)

    def __init__(self, episodes: HeldEpisodes) -> None:
        self.episodes = episodes

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """The MCP endpoint: one JSON-RPC message per POST, for the episode the token names."""
        if request.method != "POST":
            # No server-initiated stream and no protocol session to delete.
            return web.Response(status=405, headers={"Allow": "POST"})
        message_id: object = None
        try:
            message = _rpc_message(await self._body(request))
            message_id = message.get("id")
            state = self._episode(request)
            media = mcp_reply_media(request.headers.get("Accept", ""), streams=_streams(message))
            if media is None:
                raise McpError(406, _INVALID_REQUEST, "Accept application/json or SSE.")
            if "id" not in message:
                return web.Response(status=202)  # a notification: nothing to answer
            version = request.headers.get("MCP-Protocol-Version")
            if message["method"] != "initialize" and version not in (None, *MCP_VERSIONS):
                raise McpError(400, _INVALID_REQUEST, f"Unsupported protocol version {version}.")
            if media == "sse":
                return await self._sse(request, state, message)
            result = await self._result(state, message, None)
        except McpError as exc:
            return web.json_response(exc.body(message_id), status=exc.status)
        return web.json_response({"jsonrpc": "2.0", "id": message_id, "result": result})

    async def _body(self, request: web.Request) -> object:
        try:
            return await read_json(request, default=None)
        except DemoError as exc:
            code = _PARSE_ERROR if exc.status == 400 else _INVALID_REQUEST
            raise McpError(exc.status, code, exc.detail) from None

    def _episode(self, request: web.Request) -> EpisodeState:
        try:
            return self.episodes.for_request(request)
        except DemoError as exc:
            data = {"error": exc.error, "worker": self.episodes.worker_id}
            raise McpError(exc.status, _EPISODE_REFUSED, exc.detail, data) from None

    async def _sse(
        self, request: web.Request, state: EpisodeState, message: dict[str, Any]
    ) -> web.StreamResponse:
        """The reply as an event stream: progress notifications (if asked for), then the
        result, each written as it happens."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        token = _progress_token(message)

        async def notify(progress: int, total: int) -> None:
            params = {"progressToken": token, "progress": progress, "total": total}
            note = {"jsonrpc": "2.0", "method": "notifications/progress", "params": params}
            await response.write(_sse_event(note))

        try:
            result = await self._result(state, message, notify if token is not None else None)
            payload = {"jsonrpc": "2.0", "id": message["id"], "result": result}
        except McpError as exc:
            payload = exc.body(message["id"])
        await response.write(_sse_event(payload))
        await response.write_eof()
        return response

    async def _result(
        self, state: EpisodeState, message: Mapping[str, Any], notify: Notify | None
    ) -> object:
        method, params = message["method"], message.get("params", {})
        if method == "initialize":
            return {
                "protocolVersion": mcp_version(params.get("protocolVersion")),
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": {"name": "episode-router-demo", "version": __version__},
            }
        if method == "ping":
            return {}
        if method == "tools/list":
            return {"tools": MCP_TOOLS}
        if method == "tools/call":
            return await self._call(state, params, notify)
        raise McpError(200, _METHOD_NOT_FOUND, f"Method not found: {method}")

    async def _call(
        self, state: EpisodeState, params: Mapping[str, Any], notify: Notify | None
    ) -> object:
        name, args = params.get("name"), params.get("arguments", {})
        if not isinstance(name, str) or (name not in TOOLS and name != STREAM_TOOL):
            raise McpError(200, _INVALID_PARAMS, f"Unknown tool: {name!r}")
        state.calls.append(name)
        try:
            if name == STREAM_TOOL:
                result = await _stream_progress(args, notify)
            else:
                result = await TOOLS[name](state, args)
        except DemoError as exc:  # bad arguments: an error result the model can read
            body = {"error": exc.error, "detail": exc.detail, "worker": self.episodes.worker_id}
            return _tool_result(body, is_error=True)
        return _tool_result(self.episodes.reply(state, result))


async def _stream_progress(args: object, notify: Notify | None) -> object:
    """The `stream` tool over MCP: `events` progress notifications `interval_s` apart."""
    events = int_arg(args, "events", 1, MAX_STREAM_EVENTS)
    interval = seconds_arg(args, "interval_s", MAX_STREAM_INTERVAL_S)
    for index in range(events):
        if index:
            await asyncio.sleep(interval)
        if notify is not None:
            await notify(index + 1, events)
    return {"events": events}
