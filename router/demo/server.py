"""The demo environment server: one worker process for `episode-router demo` and the e2e tests.

It owns a toy episode store (a counter per episode) and the worker's half of the
token contract (design §2, §3): it claims each episode over the control socket
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
is routed by it like any other call (design §7). It answers JSON, or SSE when
the client accepts only SSE, or when a `stream` call asked for progress: its
events then travel as `notifications/progress` ahead of the result.

Run it as `python -m router.demo --port 9001 --worker-id w0 [--control unix:/path]`.
"""

# Layout: the episodes, their tokens and the tools live in router.demo.episodes, the MCP
# endpoint in router.demo.mcp. This module owns the worker's claims, its HTTP endpoints, its
# app and its process, and re-exports the public names callers import from here.

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import sys
from collections.abc import Coroutine
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from router.client import ControlClient, ControlError, aiohttp_boot_middleware
from router.demo.episodes import (
    MAX_ADD,
    MAX_SLEEP_S,
    MAX_STREAM_EVENTS,
    MAX_STREAM_INTERVAL_S,
    STREAM_TOOL,
    TOKEN_HEADER,
    TOOLS,
    DemoError,
    EpisodeState,
    HeldEpisodes,
    Tool,
    episode_request,
    int_arg,
    read_json,
    seconds_arg,
    signing_key_from_env,
)
from router.demo.mcp import (
    MCP_PATH,
    MCP_TOOLS,
    MCP_VERSIONS,
    McpEndpoint,
    McpError,
    Notify,
    mcp_reply_media,
    mcp_version,
)
from router.tokens import SigningKey

__all__ = [
    "MAX_ADD",
    "MAX_SLEEP_S",
    "MAX_STREAM_EVENTS",
    "MAX_STREAM_INTERVAL_S",
    "MCP_PATH",
    "MCP_TOOLS",
    "MCP_VERSIONS",
    "STREAM_TOOL",
    "TOKEN_HEADER",
    "TOOLS",
    "DemoError",
    "EpisodeState",
    "McpError",
    "Notify",
    "Tool",
    "build_demo_app",
    "episode_request",
    "main",
    "mcp_reply_media",
    "mcp_version",
    "serve_demo_worker",
    "signing_key_from_env",
]

log = logging.getLogger("router.demo")  # the name it has always logged under

MAX_BODY_BYTES = 1 << 20  # a tool call's arguments are small; bounds what one request can cost
CLAIM_TIMEOUT_S = 10.0  # a router away longer than this fails the start with 503, not a hang
SHUTDOWN_TIMEOUT_S = 5.0  # how long in-flight requests get after SIGTERM
# ControlError codes the client raises itself: the router refused nothing.
LOCAL_ERRORS = frozenset({"client_stopped", "not_started", "line_too_long"})


# --- the app ----------------------------------------------------------------------------------


class DemoWorker:
    """The demo worker's handlers and the episodes it holds."""

    def __init__(
        self, worker_id: str, client: ControlClient | None, signing_key: SigningKey, claim: bool
    ) -> None:
        self.worker_id = worker_id
        self.client = client if claim else None  # without claims the control client only leases
        self.episodes = HeldEpisodes(worker_id, signing_key)
        self._background: set[asyncio.Task[None]] = set()
        self._mcp = McpEndpoint(self.episodes)

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"worker": self.worker_id})

    async def start_episode(self, request: web.Request) -> web.Response:
        """Mint a token for a new attempt, claim it, and only then hand the token out."""
        ep, att = episode_request(await read_json(request, default={}))
        state, token = self.episodes.open(ep, att)
        try:
            await self._claim(state.key)
        except BaseException:
            self.episodes.drop(state.key)
            raise
        return web.json_response({"token": token, "episode": state.key, "worker": self.worker_id})

    async def _claim(self, key: str) -> None:
        if self.client is None:
            return
        try:
            async with asyncio.timeout(CLAIM_TIMEOUT_S):
                await self.client.claim(key)
        except ControlError as exc:
            # Not connected: a refused hello (whatever its code) left this worker no lease.
            if exc.error in LOCAL_ERRORS or not self.client.connected:
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
        state = self.episodes.for_request(request)
        self.episodes.drop(state.key)
        if self.client is not None:
            try:
                async with asyncio.timeout(CLAIM_TIMEOUT_S):
                    await self.client.release(state.key)
            except ControlError as exc:
                log.warning("release of %s refused: %s", state.key, exc)
            except TimeoutError:
                log.warning("release of %s not yet acknowledged; it stays queued", state.key)
        result = {"ended": True, "counter": state.counter}
        return web.json_response(self.episodes.reply(state, result))

    async def call_tool(self, request: web.Request) -> web.StreamResponse:
        """Run one tool on the episode the token names."""
        state = self.episodes.for_request(request)
        name = request.match_info["name"]
        if name != STREAM_TOOL and name not in TOOLS:
            raise DemoError(404, "unknown_tool", f"This server has no tool {name!r}.")
        args = await read_json(request, default={})
        state.calls.append(name)  # every call the episode received, refused arguments included
        if name == STREAM_TOOL:
            return await self._stream(request, state, args)
        return web.json_response(self.episodes.reply(state, await TOOLS[name](state, args)))

    async def _stream(
        self, request: web.Request, state: EpisodeState, args: object
    ) -> web.StreamResponse:
        """Send `events` SSE events, `interval_s` apart, each as it happens."""
        events = int_arg(args, "events", 1, MAX_STREAM_EVENTS)
        interval = seconds_arg(args, "interval_s", MAX_STREAM_INTERVAL_S)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for index in range(events):
            if index:
                await asyncio.sleep(interval)
            reply = self.episodes.reply(state, {"event": index})
            data = json.dumps(reply, separators=(",", ":"))
            await response.write(f"data: {data}\n\n".encode())
        await response.write_eof()
        return response

    async def mcp(self, request: web.Request) -> web.StreamResponse:
        """The MCP endpoint: one JSON-RPC message per POST, for the episode the token names."""
        return await self._mcp.handle(request)

    async def close(self, app: web.Application) -> None:
        for task in list(self._background):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


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
        # Whatever the router's default limits let through (a header line up to 16 KiB),
        # the demo takes too: aiohttp's own defaults (8,190 bytes) are lower.
        runner = web.AppRunner(
            app,
            access_log=None,
            shutdown_timeout=SHUTDOWN_TIMEOUT_S,
            max_line_size=16384,
            max_field_size=16384,
        )
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
