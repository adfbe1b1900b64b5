"""The demo environment server: one worker process for `episode-router demo` and the e2e tests.

It owns a toy episode store (a counter per episode) and the worker's half of the
token contract (DESIGN §2, §3): it claims each episode over the control socket
before it hands out the episode's token, and checks the signature, `ep`, `att`
and nonce on every call. It must never serve a call for an episode it does not
hold: an unknown episode is a 404 `unknown_episode` naming this worker, which is
how the tests see a misrouted request.

Endpoints: `GET /health`; `POST /episodes` (optional `{"ep", "att"}`) returns a
token; `POST /tools/{add,get,echo,sleep,stream}` and `POST /episodes/end` take
the token in `X-NeMo-Gym-Episode-Token`. Refusals are JSON `{"error", "detail",
"worker"}`.

`POST /mcp` serves the same tools over MCP Streamable HTTP (the initialize
handshake, stateless: no `Mcp-Session-Id`), so `episode-router demo` can be
tried with an MCP client; every MCP request carries the episode token too, and
is routed by it like any other call (DESIGN §7). It answers JSON, or SSE when
the client accepts only SSE, or when a `stream` call asked for progress: its
events then travel as `notifications/progress` ahead of the result.

Run it as `python -m router.demo --port 9001 --worker-id w0 [--control unix:/path]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from router import __version__
from router.client import ControlClient, ControlError, aiohttp_boot_middleware
from router.tokens import SigningKey, TokenError, episode_key, mint_token, new_nonce, parse_token

__all__ = [
    "MCP_PATH",
    "MCP_VERSIONS",
    "TOKEN_HEADER",
    "TOOLS",
    "DemoError",
    "EpisodeState",
    "build_demo_app",
    "episode_request",
    "main",
    "mcp_reply_media",
    "mcp_version",
    "serve_demo_worker",
    "signing_key_from_env",
]

log = logging.getLogger(__name__)

TOKEN_HEADER = "X-NeMo-Gym-Episode-Token"
MAX_BODY_BYTES = 1 << 20  # a tool call's arguments are small; bounds what one request can cost
CLAIM_TIMEOUT_S = 10.0  # a router away longer than this fails the start with 503, not a hang
MAX_SLEEP_S = 30.0  # `sleep` exists to hold a request open, not a worker
MAX_STREAM_EVENTS = 1000  # enough to test a long stream, few enough to end quickly
MAX_STREAM_INTERVAL_S = 10.0  # under the router's default stream idle timeout
SHUTDOWN_TIMEOUT_S = 5.0  # how long in-flight requests get after SIGTERM
MAX_ADD = 2**53  # the counter stays exact in every JSON implementation
# ControlError codes the client raises itself: the router refused nothing.
LOCAL_ERRORS = frozenset({"client_stopped", "not_started", "line_too_long"})


class DemoError(Exception):
    """A request the demo worker refuses: `status`, and a JSON body with `error` and `detail`."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


class EpisodeState:
    """One episode attempt held by this worker: what its token must say, and its toy state."""

    __slots__ = ("att", "calls", "counter", "ep", "nonce")

    def __init__(self, ep: str, att: int, nonce: str) -> None:
        self.ep = ep
        self.att = att
        self.nonce = nonce
        self.counter = 0
        self.calls: list[str] = []

    @property
    def key(self) -> str:
        return episode_key(self.ep, self.att)

    def matches(self, ep: str, att: int, nonce: str) -> bool:
        """True when a token's claims name this very attempt (nonce compared in constant time)."""
        same_nonce = hmac.compare_digest(nonce.encode(), self.nonce.encode())
        return same_nonce and ep == self.ep and att == self.att


# --- pure argument checks ---------------------------------------------------------------------


def _bad(detail: str) -> DemoError:
    return DemoError(400, "bad_request", detail)


def _int_arg(args: object, name: str, low: int, high: int) -> int:
    """`args[name]` as an integer within [low, high], or a 400."""
    value = args.get(name) if isinstance(args, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(f"`{name}` must be an integer from {low} to {high}.")
    return value


def _seconds_arg(args: object, name: str, high: float) -> float:
    """`args[name]` as a number of seconds within [0, high], or a 400."""
    value = args.get(name) if isinstance(args, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
        raise _bad(f"`{name}` must be a number of seconds from 0 to {high:g}.")
    return float(value)


def episode_request(body: object) -> tuple[str, int]:
    """The (ep, att) a `POST /episodes` body asks for; ep defaults to a fresh random id."""
    if not isinstance(body, dict):
        raise _bad("The body must be a JSON object.")
    ep = body.get("ep", f"ep-{secrets.token_hex(8)}")
    att = body.get("att", 0)
    if not isinstance(ep, str) or isinstance(att, bool) or not isinstance(att, int):
        raise _bad("`ep` must be a string and `att` an integer.")
    return ep, att


# --- tools ------------------------------------------------------------------------------------

Tool = Callable[[EpisodeState, object], Awaitable[object]]


async def _add(state: EpisodeState, args: object) -> object:
    state.counter += _int_arg(args, "value", -MAX_ADD, MAX_ADD)
    return state.counter


async def _get(state: EpisodeState, args: object) -> object:
    return state.counter


async def _echo(state: EpisodeState, args: object) -> object:
    return args


async def _sleep(state: EpisodeState, args: object) -> object:
    seconds = _seconds_arg(args, "seconds", MAX_SLEEP_S)
    await asyncio.sleep(seconds)
    return seconds


TOOLS: dict[str, Tool] = {"add": _add, "get": _get, "echo": _echo, "sleep": _sleep}
STREAM_TOOL = "stream"


# --- MCP: the same tools over Streamable HTTP (pure parts) -------------------------------------

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


# --- the app ----------------------------------------------------------------------------------


class DemoWorker:
    """The demo worker's handlers and the episodes it holds."""

    def __init__(
        self, worker_id: str, client: ControlClient | None, signing_key: SigningKey, claim: bool
    ) -> None:
        self.worker_id = worker_id
        self.client = client if claim else None  # without claims the control client only leases
        self.signing_key = signing_key
        self.verifier = signing_key.verifier()
        self.episodes: dict[str, EpisodeState] = {}
        self._background: set[asyncio.Task[None]] = set()

    def reply(self, state: EpisodeState, result: object) -> dict[str, object]:
        return {
            "worker": self.worker_id,
            "episode": state.key,
            "result": result,
            "calls": len(state.calls),
        }

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"worker": self.worker_id})

    async def start_episode(self, request: web.Request) -> web.Response:
        """Mint a token for a new attempt, claim it, and only then hand the token out."""
        ep, att = episode_request(await _read_json(request, default={}))
        state = EpisodeState(ep, att, new_nonce())
        try:
            token = mint_token(ep=ep, att=att, nonce=state.nonce, key=self.signing_key, iat=_now())
        except ValueError as exc:
            raise _bad(f"Cannot start this episode: {exc}.") from None
        if state.key in self.episodes:
            raise DemoError(409, "episode_exists", "This worker already runs this attempt.")
        self.episodes[state.key] = state
        try:
            await self._claim(state.key)
        except BaseException:
            del self.episodes[state.key]
            raise
        return web.json_response({"token": token, "episode": state.key, "worker": self.worker_id})

    async def _claim(self, key: str) -> None:
        if self.client is None:
            return
        try:
            async with asyncio.timeout(CLAIM_TIMEOUT_S):
                await self.client.claim(key)
        except ControlError as exc:
            if exc.error in LOCAL_ERRORS:
                raise DemoError(503, "control_unavailable", f"No control lease: {exc}.") from None
            raise DemoError(409, exc.error, f"The router refused the claim: {exc}.") from None
        except (TimeoutError, asyncio.CancelledError) as exc:
            self._release_later(key)  # the claim may still land: take it back
            if isinstance(exc, asyncio.CancelledError):
                raise
            detail = "The router did not acknowledge the claim in time."
            raise DemoError(503, "control_unavailable", detail) from None

    def _release_later(self, key: str) -> None:
        if self.client is None:
            return
        task = asyncio.create_task(self._release_quietly(key), name=f"demo-release:{key}")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release_quietly(self, key: str) -> None:
        if self.client is not None:
            with contextlib.suppress(ControlError):
                await self.client.release(key)

    async def end_episode(self, request: web.Request) -> web.Response:
        """Forget the episode and release its claim."""
        state = self._episode_for(request)
        del self.episodes[state.key]
        if self.client is not None:
            try:
                async with asyncio.timeout(CLAIM_TIMEOUT_S):
                    await self.client.release(state.key)
            except ControlError as exc:
                log.warning("release of %s refused: %s", state.key, exc)
            except TimeoutError:
                log.warning("release of %s not yet acknowledged; it stays queued", state.key)
        return web.json_response(self.reply(state, {"ended": True, "counter": state.counter}))

    async def call_tool(self, request: web.Request) -> web.StreamResponse:
        """Run one tool on the episode the token names."""
        state = self._episode_for(request)
        name = request.match_info["name"]
        if name != STREAM_TOOL and name not in TOOLS:
            raise DemoError(404, "unknown_tool", f"This server has no tool {name!r}.")
        args = await _read_json(request, default={})
        state.calls.append(name)  # every call the episode received, refused arguments included
        if name == STREAM_TOOL:
            return await self._stream(request, state, args)
        return web.json_response(self.reply(state, await TOOLS[name](state, args)))

    async def _stream(
        self, request: web.Request, state: EpisodeState, args: object
    ) -> web.StreamResponse:
        """Send `events` SSE events, `interval_s` apart, each as it happens."""
        events = _int_arg(args, "events", 1, MAX_STREAM_EVENTS)
        interval = _seconds_arg(args, "interval_s", MAX_STREAM_INTERVAL_S)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for index in range(events):
            if index:
                await asyncio.sleep(interval)
            data = json.dumps(self.reply(state, {"event": index}), separators=(",", ":"))
            await response.write(f"data: {data}\n\n".encode())
        await response.write_eof()
        return response

    async def mcp(self, request: web.Request) -> web.StreamResponse:
        """The MCP endpoint: one JSON-RPC message per POST, for the episode the token names."""
        if request.method != "POST":
            # No server-initiated stream and no protocol session to delete.
            return web.Response(status=405, headers={"Allow": "POST"})
        message_id: object = None
        try:
            message = _rpc_message(await self._mcp_body(request))
            message_id = message.get("id")
            state = self._mcp_episode(request)
            media = mcp_reply_media(request.headers.get("Accept", ""), streams=_streams(message))
            if media is None:
                raise McpError(406, _INVALID_REQUEST, "Accept application/json or SSE.")
            if "id" not in message:
                return web.Response(status=202)  # a notification: nothing to answer
            version = request.headers.get("MCP-Protocol-Version")
            if message["method"] != "initialize" and version not in (None, *MCP_VERSIONS):
                raise McpError(400, _INVALID_REQUEST, f"Unsupported protocol version {version}.")
            if media == "sse":
                return await self._mcp_sse(request, state, message)
            result = await self._mcp_result(state, message, None)
        except McpError as exc:
            return web.json_response(exc.body(message_id), status=exc.status)
        return web.json_response({"jsonrpc": "2.0", "id": message_id, "result": result})

    async def _mcp_body(self, request: web.Request) -> object:
        try:
            return await _read_json(request, default=None)
        except DemoError as exc:
            code = _PARSE_ERROR if exc.status == 400 else _INVALID_REQUEST
            raise McpError(exc.status, code, exc.detail) from None

    def _mcp_episode(self, request: web.Request) -> EpisodeState:
        try:
            return self._episode_for(request)
        except DemoError as exc:
            data = {"error": exc.error, "worker": self.worker_id}
            raise McpError(exc.status, _EPISODE_REFUSED, exc.detail, data) from None

    async def _mcp_sse(
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
            result = await self._mcp_result(state, message, notify if token is not None else None)
            payload = {"jsonrpc": "2.0", "id": message["id"], "result": result}
        except McpError as exc:
            payload = exc.body(message["id"])
        await response.write(_sse_event(payload))
        await response.write_eof()
        return response

    async def _mcp_result(
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
            return await self._mcp_call(state, params, notify)
        raise McpError(200, _METHOD_NOT_FOUND, f"Method not found: {method}")

    async def _mcp_call(
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
            body = {"error": exc.error, "detail": exc.detail, "worker": self.worker_id}
            return _tool_result(body, is_error=True)
        return _tool_result(self.reply(state, result))

    def _episode_for(self, request: web.Request) -> EpisodeState:
        """The episode this request's token names, checked against what this worker holds."""
        values = request.headers.getall(TOKEN_HEADER, [])
        if not values:
            raise DemoError(401, "invalid_token", f"The request carries no {TOKEN_HEADER}.")
        if len(set(values)) > 1:
            raise DemoError(400, "ambiguous_session", "The token header is repeated.")
        try:
            token = parse_token(values[0], now=time.time(), verifier=self.verifier)
        except TokenError as exc:
            raise DemoError(exc.status, exc.code, exc.detail) from None
        state = self.episodes.get(token.key)
        if state is None:
            detail = f"Worker {self.worker_id} holds no episode {token.key}."
            raise DemoError(404, "unknown_episode", detail)
        if not state.matches(token.ep, token.att, token.nonce):
            raise DemoError(403, "bad_nonce", "The token is not the one issued for this episode.")
        return state

    async def close(self, app: web.Application) -> None:
        for task in list(self._background):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _read_json(request: web.Request, *, default: object) -> object:
    """The request's JSON body (`default` when empty); 400 if it is not JSON, 413 if too big."""
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise DemoError(413, "payload_too_large", "The body is over 1 MiB.") from None
    if not body.strip():
        return default
    try:
        return json.loads(body)
    except ValueError:
        raise _bad("The body is not JSON.") from None


async def _stream_progress(args: object, notify: Notify | None) -> object:
    """The `stream` tool over MCP: `events` progress notifications `interval_s` apart."""
    events = _int_arg(args, "events", 1, MAX_STREAM_EVENTS)
    interval = _seconds_arg(args, "interval_s", MAX_STREAM_INTERVAL_S)
    for index in range(events):
        if index:
            await asyncio.sleep(interval)
        if notify is not None:
            await notify(index + 1, events)
    return {"events": events}


def _now() -> int:
    return int(time.time())


def _errors_middleware(worker_id: str) -> Middleware:
    """Turns a DemoError into its JSON answer: the one place refusals are written."""

    @web.middleware
    async def answer_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except DemoError as exc:
            body = {"error": exc.error, "detail": exc.detail, "worker": worker_id}
            return web.json_response(body, status=exc.status)

    return answer_errors


def build_demo_app(
    *,
    worker_id: str,
    client: ControlClient | None,
    signing_key: SigningKey,
    claim: bool = True,
) -> web.Application:
    """The demo worker's app. With `client` it claims each episode before returning its token.

    `claim=False` keeps the control lease but skips claims (the router then
    cannot route episodes: a test uses it to show that claims are needed).
    """
    worker = DemoWorker(worker_id, client, signing_key, claim)
    boot = client.boot if client is not None else secrets.token_hex(8)
    app = web.Application(
        client_max_size=MAX_BODY_BYTES,
        middlewares=[aiohttp_boot_middleware(boot), _errors_middleware(worker_id)],
    )
    app.router.add_get("/health", worker.health)
    app.router.add_post("/episodes", worker.start_episode)
    app.router.add_post("/episodes/end", worker.end_episode)
    app.router.add_post("/tools/{name}", worker.call_tool)
    app.router.add_route("*", MCP_PATH, worker.mcp)
    app.on_cleanup.append(worker.close)
    return app


# --- the process ------------------------------------------------------------------------------


def signing_key_from_env(environ: Mapping[str, str]) -> SigningKey:
    """HS256 with EPISODE_TOKEN_SECRET when set (ValueError if under 32 bytes), else random."""
    secret = environ.get("EPISODE_TOKEN_SECRET")
    if secret:
        return SigningKey.hs256(secret.encode())
    return SigningKey.generate("HS256")


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _public_url(host: str, port: int) -> str:
    """The URL the router should forward to: a wildcard bind is reached over loopback."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def serve_demo_worker(
    *,
    host: str,
    port: int,
    worker_id: str,
    control: str | None,
    claim: bool = True,
    signing_key: SigningKey | None = None,
    control_secret: str | None = None,
    url: str | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve the demo worker until `stop` is set; then stop accepting, say bye, and return.

    `port` 0 picks a free port (the hello names the real one). `url` is the
    address the hello gives the router (default: derived from host and port). The
    signing key defaults to `signing_key_from_env`, the control secret to
    EPISODE_ROUTER_SECRET.
    Raises ControlError when the router refuses the hello, OSError when the port is taken.
    """
    key = signing_key if signing_key is not None else signing_key_from_env(os.environ)
    secret = control_secret or os.environ.get("EPISODE_ROUTER_SECRET") or None
    stop = stop or asyncio.Event()
    with _bind(host, port) as sock:
        url = url or _public_url(host, sock.getsockname()[1])
        client = (
            ControlClient(control, worker_id=worker_id, url=url, secret=secret) if control else None
        )
        app = build_demo_app(worker_id=worker_id, client=client, signing_key=key, claim=claim)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
            if client is not None:
                await _start_unless_stopped(client, stop)
            log.info("demo worker %s serving on %s", worker_id, url)
            await stop.wait()
        finally:
            await runner.cleanup()  # stops accepting, lets in-flight requests finish
            if client is not None:
                await client.stop()


async def _start_unless_stopped(client: ControlClient, stop: asyncio.Event) -> None:
    """`client.start()`, given up when `stop` is set first (a router that never comes up)."""
    starting = asyncio.create_task(client.start(), name="demo-control-start")
    stopping = asyncio.create_task(stop.wait(), name="demo-stop-wait")
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        starting.cancel()
        stopping.cancel()
        await asyncio.gather(starting, stopping, return_exceptions=True)
    if not starting.cancelled():
        starting.result()  # raises the hello's refusal


async def _serve_until_signalled(args: argparse.Namespace, worker_id: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await serve_demo_worker(
        host=args.host,
        port=args.port,
        worker_id=worker_id,
        control=args.control,
        claim=not args.no_claim,
        url=os.environ.get("EPISODE_ROUTER_WORKER_URL") or None,  # set by the router's spawner
        stop=stop,
    )


def _run(coro: Coroutine[Any, Any, None]) -> None:
    """Run on uvloop when it is installed."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(coro)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m router.demo", description=__doc__)
    parser.add_argument("--port", type=int, required=True, help="0 picks a free port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--worker-id", default=os.environ.get("EPISODE_ROUTER_WORKER_ID"))
    parser.add_argument("--control", default=os.environ.get("EPISODE_ROUTER_CONTROL") or None)
    parser.add_argument("--no-claim", action="store_true", help="keep the lease, skip claims")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one demo worker until SIGTERM; 0 on a clean stop, 1 if it cannot serve."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.worker_id:
        parser.error("--worker-id is required when EPISODE_ROUTER_WORKER_ID is not set")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        _run(_serve_until_signalled(args, args.worker_id))
    except (ControlError, OSError, ValueError) as exc:
        log.error("demo worker %s cannot serve: %s", args.worker_id, exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
