"""The boot check for worker apps: a request meant for another worker process gets 410.

The router forwards a lost worker's episodes with `X-Episode-Router-Boot`, and a
worker answers 410 `worker_exited` itself when that boot is not its own, so a
process restarted on the same port never serves a dead one's episodes. This
module owns that check (`boot_mismatch_answer`) and its aiohttp and ASGI
middlewares; `router.client` re-exports them.

It must never write a boot value to a log or show one in an answer, and never
change a request it lets through.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from router.protocol import BOOT_HEADER


def boot_mismatch_answer(
    boot: str, header_value: str | None
) -> tuple[int, dict[str, object]] | None:
    """The 410 a worker answers when the router forwarded a request meant for another boot.

    None when the request carries no boot header or carries this process's own.
    The answer never shows either boot value.
    """
    if header_value is None:
        return None
    # surrogateescape: aiohttp decodes header bytes that are not UTF-8 so, and such a
    # value must get its 410 like any other stranger's, not a 500 from encode().
    if hmac.compare_digest(header_value.encode("utf-8", "surrogateescape"), boot.encode()):
        return None
    detail = "The worker process that held this session is no longer running."
    return 410, {"error": "worker_exited", "detail": detail, "session": None}


def aiohttp_boot_middleware(boot: str) -> Middleware:
    """An aiohttp middleware answering 410 `worker_exited` for a request meant for another boot."""

    @web.middleware
    async def check_boot(request: web.Request, handler: Handler) -> web.StreamResponse:
        for value in request.headers.getall(BOOT_HEADER, []):
            answer = boot_mismatch_answer(boot, value)
            if answer is not None:
                return web.json_response(answer[1], status=answer[0])
        return await handler(request)

    return check_boot


ASGIScope = MutableMapping[str, Any]
ASGIMessage = MutableMapping[str, Any]
ASGIReceive = Callable[[], Awaitable[ASGIMessage]]
ASGISend = Callable[[ASGIMessage], Awaitable[None]]
ASGIApp = Callable[[ASGIScope, ASGIReceive, ASGISend], Awaitable[None]]

_BOOT_HEADER_RAW = BOOT_HEADER.lower().encode()


class ASGIBootMiddleware:
    """Wraps an ASGI app: HTTP requests meant for another boot get 410 `worker_exited`.

    Other scopes (lifespan, websocket) pass through: the router never tunnels
    an upgrade, so a websocket never arrives through it.
    """

    def __init__(self, app: ASGIApp, boot: str) -> None:
        self.app = app
        self.boot = boot

    async def __call__(self, scope: ASGIScope, receive: ASGIReceive, send: ASGISend) -> None:
        if scope["type"] == "http":
            for name, value in scope.get("headers", ()):
                if name.lower() != _BOOT_HEADER_RAW:
                    continue
                answer = boot_mismatch_answer(self.boot, value.decode("latin-1"))
                if answer is not None:
                    await _send_json(send, *answer)
                    return
        await self.app(scope, receive, send)


async def _send_json(send: ASGISend, status: int, body: Mapping[str, object]) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
