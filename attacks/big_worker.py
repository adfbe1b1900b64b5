"""The demo worker with one route more, for the attacks: `GET /big?bytes=N` answers N bytes.

The reply has a Content-Length (`&chunked=1`: none, chunked, its length unknown to the
router until it ends) and is written as fast as the router takes it, so a
client that asks for it and never reads shows where the bytes wait: in the router's
memory (the reply buffer), or in a worker connection held at the client's pace. Every
other route is the demo worker's (`router.demo`): episodes are claimed over the control
socket and routed by their token.

    python attacks/big_worker.py --port P --worker-id w0 --control unix:/path

It listens on loopback only and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
from collections.abc import Sequence

from aiohttp import web

from router.client import ControlClient
from router.demo import build_demo_app, signing_key_from_env

MAX_BIG = 64 << 20  # the most one reply may ask for
CHUNK = 64 * 1024


async def big(request: web.Request) -> web.StreamResponse:
    """`bytes` bytes of `x`, framed by a Content-Length, or chunked with `chunked=1`."""
    size = min(int(request.query.get("bytes", "0")), MAX_BIG)
    response = web.StreamResponse()
    if request.query.get("chunked") == "1":
        response.enable_chunked_encoding()
    else:
        response.content_length = size
    await response.prepare(request)
    sent = 0
    while sent < size:
        part = min(CHUNK, size - sent)
        await response.write(b"x" * part)
        sent += part
    await response.write_eof()
    return response


async def serve(port: int, worker_id: str, control: str) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    url = f"http://127.0.0.1:{port}"
    client = ControlClient(control, worker_id=worker_id, url=url)
    app = build_demo_app(
        worker_id=worker_id, client=client, signing_key=signing_key_from_env(os.environ)
    )
    app.router.add_get("/big", big)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    try:
        await web.SockSite(runner, sock).start()
        await client.start()
        await stop.wait()
    finally:
        await runner.cleanup()
        await client.stop()
        sock.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--worker-id", required=True)
    parser.add_argument("--control", required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve(args.port, args.worker_id, args.control))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
