"""The benchmark's worker: a trivial aiohttp server that claims a fixed set of episodes.

It owns nothing but its replies: every proxy under test forwards to the same
workers, so the worker's cost is the same for all of them and never counted.
At start it says hello on the router's control socket (when given one) and
claims its episode keys, then prints `READY <port>` on stdout; the router then
routes those episodes' tokens to it, over the real claim path.

Routes: `POST /sink` reads the whole body and answers its size; `GET /source?bytes=N`
streams N bytes; `GET /health`; any other request reads its body and answers
`{"worker": "<id>"}`. It never checks a token: the benchmark measures proxies.

With `--work-us N`, that last route first busy-spins N microseconds on
`time.perf_counter` (the CPU held, the event loop blocked), so one worker
serves at most 1e6 / N requests a second: the worker-bound throughput run uses
such workers to make the workers, not the proxy, the bottleneck. The spin is
timed on the wall clock, so a worker preempted by another process still ends
each request on time, as if it had a core of its own.

Run it as `python -m bench.worker --port 0 --worker-id w0 [--control unix:PATH --keys FILE]
[--work-us N]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

from router.client import ControlClient

__all__ = ["READY", "build_app", "main", "serve", "spin"]

READY = "READY"  # the line prefix the parent waits for: "READY <port>"
SOURCE_CHUNK = 256 * 1024  # the size /source writes its body in
SOURCE_MAX = 1 << 40  # a bound on one /source reply
_PATTERN = b"x" * SOURCE_CHUNK  # one chunk, reused: the worker allocates nothing per chunk


def spin(seconds: float) -> None:
    """Busy-waits `seconds` on `time.perf_counter`, holding the CPU (bounded by the clock)."""
    clock = time.perf_counter
    end = clock() + seconds
    while clock() < end:
        pass


def build_app(worker_id: str, work_us: float = 0.0) -> web.Application:
    """The worker's routes; see the module docstring. `work_us`: the spin per tool call."""
    reply = json.dumps({"worker": worker_id}).encode()
    work_s = work_us / 1e6

    async def tool(request: web.Request) -> web.Response:
        await request.read()
        if work_s > 0:
            spin(work_s)
        return web.Response(body=reply, content_type="application/json")

    async def sink(request: web.Request) -> web.Response:
        size = 0
        async for chunk in request.content.iter_any():
            size += len(chunk)
        return web.json_response({"worker": worker_id, "bytes": size})

    async def source(request: web.Request) -> web.StreamResponse:
        try:
            size = int(request.query.get("bytes", "0"))
        except ValueError:
            size = -1
        if not 0 <= size <= SOURCE_MAX:
            return web.json_response({"error": "bad_request"}, status=400)
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        response.content_length = size
        await response.prepare(request)
        view = memoryview(_PATTERN)
        while size > 0:
            step = min(size, SOURCE_CHUNK)
            await response.write(view[:step])
            size -= step
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=reply, content_type="application/json")

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/sink", sink)
    app.router.add_get("/source", source)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/{tail:.*}", tool)
    return app


async def serve(
    worker_id: str, port: int, control: str | None, keys: list[str], work_us: float = 0.0
) -> None:
    """Serve until SIGTERM or SIGINT, claiming `keys` over `control` first."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner = web.AppRunner(build_app(worker_id, work_us), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    bound = int(runner.addresses[0][1])
    client: ControlClient | None = None
    try:
        if control is not None:
            client = ControlClient(control, worker_id=worker_id, url=f"http://127.0.0.1:{bound}")
            await client.start()
            for key in keys:
                await client.claim(key)
        print(f"{READY} {bound}", flush=True)
        await stop.wait()
    finally:
        if client is not None:
            await client.stop()
        await runner.cleanup()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.worker", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--control", default=None, help="the router's control socket")
    parser.add_argument("--keys", default=None, help="a JSON file: the episode keys to claim")
    parser.add_argument(
        "--work-us",
        type=float,
        default=0.0,
        help="microseconds to busy-spin per tool call (default 0: none)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one benchmark worker until SIGTERM."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.work_us < 0:
        parser.error("--work-us must not be negative")
    keys: list[str] = json.loads(Path(args.keys).read_text()) if args.keys else []
    main_coro = serve(args.worker_id, args.port, args.control, keys, args.work_us)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency of the router
        asyncio.run(main_coro)
        return 0
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main_coro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
