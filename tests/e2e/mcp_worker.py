"""A real MCP SDK server process for the MCP end-to-end tests (tests/e2e/test_mcp.py).

One uvicorn process, one worker: a Starlette app around the MCP SDK's Streamable
HTTP session manager, plus the worker's half of the router contract. It claims
each episode over the control socket (`router.client.ControlClient`) before it
hands out the episode's token (minted with `router.tokens`), and checks the
token's signature, key and nonce on every MCP request.

Modes (`--mode`): `json` and `sse` are stateless Streamable HTTP servers that
answer JSON or SSE; `stateful` keeps protocol sessions (`Mcp-Session-Id`, SSE
replies), as servers of MCP 2025-11-25 and older do. Every mode also serves
the 2026-07-28 protocol (server/discover, no protocol session).

Each episode has a tool set of its own: episode `ep7` has `ep7_add`, `ep7_get`,
`ep7_echo` and `ep7_ticks`. tools/list shows only the tools of the episode the
request's X-NeMo-Gym-Episode-Token names, and only when this worker holds that
episode: on any other worker the list is empty and every call fails naming the
worker that refused it. In the stateful mode, a request with no token is served
the tools of its own MCP session (`session_add`, ...).

Every tool result says which worker ran it and how many calls its owner has
received. Every call reports one progress notification (it reaches the client
only on an SSE reply, and makes a 2026-07-28 SSE reply commit to SSE); `ticks`
reports `count` of them `interval_s` apart and returns when it sent each
(CLOCK_MONOTONIC, comparable across the processes of one host). `GET /streams`
tells whether each `ticks` call ran to its end or was cancelled because its
client went away.

Endpoints: `GET /health`; `POST /episodes` with `{"ep": str, "att"?: int}`;
`GET /streams`; `/mcp`.

Run it as `python mcp_worker.py --port P --worker-id w1 --control unix:/path --mode json`
(`--no-claim` keeps the lease but claims nothing: the router then cannot route).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import re
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import anyio
import mcp_types as types
import uvicorn
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from router.client import ASGIBootMiddleware, ControlClient, ControlError
from router.tokens import SigningKey, TokenError, episode_key, mint_token, new_nonce, parse_token

TOKEN_HEADER = "X-NeMo-Gym-Episode-Token"
SESSION_HEADER = "Mcp-Session-Id"
MCP_PATH = "/mcp"
VERBS = ("add", "get", "echo", "ticks")
SESSION_PREFIX = "session"  # the tool-name prefix of an MCP session's own tools
MAX_TICKS = 100
MAX_TICK_INTERVAL_S = 5.0
CLAIM_TIMEOUT_S = 10.0  # a router away longer than this fails the start, never hangs it
SHUTDOWN_TIMEOUT_S = 3.0  # in-flight requests get this long after SIGTERM
Mode = Literal["json", "sse", "stateful"]
MODES: tuple[Mode, ...] = ("json", "sse", "stateful")


def tool_prefix(ep: str) -> str:
    """The tool-name prefix of episode `ep` (tool names allow `[A-Za-z0-9_.-]`)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", ep)


def tool_names(prefix: str) -> list[str]:
    """The names of the tools an owner with `prefix` sees, in listing order."""
    return [f"{prefix}_{verb}" for verb in VERBS]


_SCHEMAS: dict[str, dict[str, Any]] = {
    "add": {
        "type": "object",
        "properties": {"value": {"type": "integer"}},
        "required": ["value"],
    },
    "get": {"type": "object", "properties": {}},
    "echo": {"type": "object"},
    "ticks": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 1, "maximum": MAX_TICKS},
            "interval_s": {"type": "number", "minimum": 0, "maximum": MAX_TICK_INTERVAL_S},
        },
        "required": ["count", "interval_s"],
    },
}


@dataclass(slots=True)
class Owner:
    """What a tool call runs against: an episode held here, or an MCP session."""

    key: str  # the episode key, or "session:<Mcp-Session-Id>"
    prefix: str
    nonce: str | None = None  # episodes only: what their token must carry
    counter: int = 0
    calls: int = 0


@dataclass(slots=True)
class Stream:
    """One `ticks` call: when each tick went out, and how the call ended."""

    owner: str
    sent: list[float] = field(default_factory=list)
    state: str = "running"  # then "done" or "cancelled"


class ToolRefused(Exception):
    """A call this worker will not run; the client gets an error result naming the worker."""


class McpWorker:
    """The episodes and MCP sessions of one worker, and its MCP handlers."""

    def __init__(
        self, worker_id: str, mode: Mode, client: ControlClient | None, claim: bool
    ) -> None:
        self.worker_id = worker_id
        self.mode = mode
        self.client = client if claim else None
        self.signing_key = SigningKey.generate("HS256")
        self.verifier = self.signing_key.verifier()
        self.episodes: dict[str, Owner] = {}
        self.sessions: dict[str, Owner] = {}
        self.streams: list[Stream] = []

    # --- who a request speaks for -------------------------------------------------------

    def owner_for(self, headers: Mapping[str, str]) -> Owner | None:
        """The episode the token names when this worker holds it, else (stateful mode,
        no token) the request's MCP session; None when neither."""
        token = headers.get(TOKEN_HEADER)
        if token is not None:
            return self._episode(token)
        session_id = headers.get(SESSION_HEADER)
        if self.mode != "stateful" or not session_id:
            return None
        owner = self.sessions.get(session_id)
        if owner is None:
            owner = self.sessions[session_id] = Owner(f"session:{session_id}", SESSION_PREFIX)
        return owner

    def _episode(self, token: str) -> Owner | None:
        try:
            claims = parse_token(token, now=time.time(), verifier=self.verifier)
        except TokenError:
            return None  # minted by another worker, or not a token at all
        owner = self.episodes.get(claims.key)
        if owner is None or owner.nonce is None:
            return None
        if not hmac.compare_digest(claims.nonce.encode(), owner.nonce.encode()):
            return None
        return owner

    # --- MCP handlers --------------------------------------------------------------------

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        owner = self.owner_for(_headers(ctx))
        if owner is None:
            return types.ListToolsResult(tools=[])
        tools = [
            types.Tool(name=name, input_schema=_SCHEMAS[verb])
            for name, verb in zip(tool_names(owner.prefix), VERBS, strict=True)
        ]
        return types.ListToolsResult(tools=tools)

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        try:
            owner = self.owner_for(_headers(ctx))
            if owner is None:
                raise ToolRefused(f"worker {self.worker_id} holds no episode for this request")
            prefix, _, verb = params.name.rpartition("_")
            if prefix != owner.prefix or verb not in VERBS:
                raise ToolRefused(f"{owner.key} has no tool {params.name!r}")
            owner.calls += 1
            result = await self._run(ctx, owner, verb, dict(params.arguments or {}))
        except ToolRefused as refused:
            text = json.dumps({"worker": self.worker_id, "error": str(refused)})
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=text)], is_error=True
            )
        body = {
            "worker": self.worker_id,
            "owner": owner.key,
            "result": result,
            "calls": owner.calls,
        }
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=json.dumps(body))],
            structured_content=body,
        )

    async def _run(
        self, ctx: ServerRequestContext[Any], owner: Owner, verb: str, args: dict[str, Any]
    ) -> object:
        if verb == "ticks":
            return await self._ticks(ctx, owner, args)
        # One notification on every call: on an SSE reply it travels ahead of the result.
        await ctx.session.report_progress(1, 1)
        if verb == "add":
            owner.counter += _int_arg(args, "value", -(2**53), 2**53)
            return owner.counter
        if verb == "echo":
            return args
        return owner.counter

    async def _ticks(
        self, ctx: ServerRequestContext[Any], owner: Owner, args: dict[str, Any]
    ) -> object:
        count = _int_arg(args, "count", 1, MAX_TICKS)
        interval = args.get("interval_s")
        if not isinstance(interval, int | float) or not 0 <= interval <= MAX_TICK_INTERVAL_S:
            raise ToolRefused(f"interval_s must be a number from 0 to {MAX_TICK_INTERVAL_S}")
        stream = Stream(owner.key)
        self.streams.append(stream)
        try:
            for tick in range(count):
                if tick:
                    await anyio.sleep(interval)
                stream.sent.append(time.monotonic())
                await ctx.session.report_progress(tick + 1, count)
        except BaseException:
            stream.state = "cancelled"
            raise
        stream.state = "done"
        return {"sent": stream.sent}

    # --- HTTP endpoints ------------------------------------------------------------------

    async def health(self, request: Request) -> JSONResponse:
        return JSONResponse({"worker": self.worker_id, "mode": self.mode})

    async def start_episode(self, request: Request) -> JSONResponse:
        """Claim a new attempt, and only then hand out its token."""
        try:
            body = json.loads(await request.body() or b"{}")
        except ValueError:
            return self._refusal(400, "bad_request", "The body is not JSON.")
        if not isinstance(body, dict):
            return self._refusal(400, "bad_request", "The body must be a JSON object.")
        ep, att = body.get("ep"), body.get("att", 0)
        if not isinstance(ep, str) or isinstance(att, bool) or not isinstance(att, int):
            return self._refusal(400, "bad_request", "`ep` must be a string, `att` an integer.")
        nonce = new_nonce()
        try:
            token = mint_token(
                ep=ep, att=att, nonce=nonce, key=self.signing_key, iat=int(time.time())
            )
        except ValueError as exc:
            return self._refusal(400, "bad_request", str(exc))
        key = episode_key(ep, att)
        if key in self.episodes:
            return self._refusal(409, "episode_exists", "This worker already runs this attempt.")
        try:
            await self._claim(key)
        except (ControlError, TimeoutError) as exc:
            return self._refusal(409, "claim_refused", f"The router refused the claim: {exc!r}")
        prefix = tool_prefix(ep)
        self.episodes[key] = Owner(key, prefix, nonce)
        body = {
            "token": token,
            "episode": key,
            "worker": self.worker_id,
            "tools": tool_names(prefix),
        }
        return JSONResponse(body)

    async def _claim(self, key: str) -> None:
        if self.client is not None:
            async with asyncio.timeout(CLAIM_TIMEOUT_S):
                await self.client.claim(key)

    async def streams_view(self, request: Request) -> JSONResponse:
        views = [{"owner": s.owner, "sent": len(s.sent), "state": s.state} for s in self.streams]
        return JSONResponse({"worker": self.worker_id, "streams": views})

    def _refusal(self, status: int, error: str, detail: str) -> JSONResponse:
        body = {"error": error, "detail": detail, "worker": self.worker_id}
        return JSONResponse(body, status_code=status)


def _headers(ctx: ServerRequestContext[Any]) -> Mapping[str, str]:
    """The HTTP request headers of the MCP message being handled (none off HTTP)."""
    request = ctx.request
    return request.headers if isinstance(request, Request) else {}


def _int_arg(args: Mapping[str, Any], name: str, low: int, high: int) -> int:
    value = args.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ToolRefused(f"`{name}` must be an integer from {low} to {high}")
    return value


# --- the app and the process ---------------------------------------------------------------


def build_app(worker: McpWorker, client: ControlClient) -> ASGIBootMiddleware:
    """The worker's ASGI app: the MCP endpoint, episodes, health, behind the boot check.
    Its lifespan says hello to the router once the MCP session manager runs, and bye last."""
    server: Server[Any] = Server(
        f"e2e-{worker.worker_id}",
        on_list_tools=worker.list_tools,
        on_call_tool=worker.call_tool,
        # The tool schemas hold no Mcp-Param headers to check: skip the per-call listing.
        get_tool_input_schema=lambda name: None,
    )
    manager = StreamableHTTPSessionManager(
        server,
        json_response=worker.mode == "json",
        stateless=worker.mode != "stateful",
        # What the SDK sets up for a server bound to loopback: the router must send the
        # worker's own address as Host.
        security_settings=TransportSecuritySettings(
            enable_dns_rebinding_protection=True,
            allowed_hosts=["127.0.0.1:*", "localhost:*"],
            allowed_origins=["http://127.0.0.1:*", "http://localhost:*"],
        ),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with manager.run():
            await client.start()
            try:
                yield
            finally:
                await client.stop()

    routes = [
        Route("/health", worker.health, methods=["GET"]),
        Route("/episodes", worker.start_episode, methods=["POST"]),
        Route("/streams", worker.streams_view, methods=["GET"]),
        Route(MCP_PATH, StreamableHTTPASGIApp(manager)),
    ]
    return ASGIBootMiddleware(Starlette(routes=routes, lifespan=lifespan), client.boot)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling, which re-raises SIGTERM once the server has
    stopped (the process would end by the signal, not exit 0); the loop's handler asks it to
    stop instead, and the lifespan's bye is the last word."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT; then stop accepting, finish, and say bye."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        # Listening before the hello: a request the router forwards at once waits in the
        # backlog until uvicorn accepts it, and is never refused.
        sock.listen(128)
        url = f"http://{args.host}:{sock.getsockname()[1]}"
        client = ControlClient(args.control, worker_id=args.worker_id, url=url)
        worker = McpWorker(args.worker_id, args.mode, client, claim=not args.no_claim)
        config = uvicorn.Config(
            build_app(worker, client),
            lifespan="on",
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=int(SHUTDOWN_TIMEOUT_S),
        )
        server = _Server(config)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, setattr, server, "should_exit", True)
        await server.serve(sockets=[sock])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--control", required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--no-claim", action="store_true", help="keep the lease, skip claims")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args))
    else:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
