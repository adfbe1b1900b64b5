"""The public listener's HTTP server: aiohttp's low-level server with the router's edge rules.

Owns what happens before a request reaches the public handler:
- a request head that cannot be parsed (bad framing, a line or a header section
  over the limits) gets the router's own JSON answer (400, 414 or 431) and a
  closed connection, logged at debug level so hostile traffic cannot flood
  the log;
- a head must arrive complete within `header_timeout_s` of its first byte (of
  the connection's start, for the first request), or the connection is closed
  (slowloris); an idle keep-alive connection is bounded by `idle_timeout_s`.

The low-level server has no URL dispatcher: every request goes to one handler,
and nothing sends `100 Continue` on the router's behalf.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler

from router.answers import Answer, render

log = logging.getLogger("episode_router.edge")

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


def head_error_answer(exc: BaseException | None, max_line_size: int) -> Answer:
    """The router's answer to a head the parser refused. The parser reports a long
    request target and a long header alike; the limit it names tells them apart."""
    if isinstance(exc, http_exceptions.LineTooLong):
        if exc.args[1:2] == (max_line_size,):
            return Answer("uri_too_long", "The request line is over the router's limit.")
        return Answer("headers_too_large", "A request header is over the router's limit.")
    text = str(getattr(exc, "message", "") or exc or "").strip()
    if "too many headers" in text.lower() or "header section" in text.lower():
        return Answer("headers_too_large", "The request has more headers than the router allows.")
    detail = f"The request is malformed: {text[:120]}." if text else "The request is malformed."
    return Answer("bad_request", detail)


class EdgeHandler(RequestHandler):
    """One client connection (aiohttp's protocol), with the head timeout and the
    router's answers to malformed heads."""

    def __init__(self, *args: Any, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_line_size = int(kwargs.get("max_line_size", 8190))
        self._header_timeout_s = header_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._finished = 0  # responses sent on this connection
        self._awaiting_head = False  # between requests: the next byte starts a head

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._awaiting_head and data:
            self._awaiting_head = False
            self._arm_head_timer()
        count = self._request_count
        super().data_received(data)
        if self._request_count > count:
            self._disarm_head_timer()  # a complete head arrived

    async def finish_response(self, *args: Any, **kwargs: Any) -> Any:
        result = await super().finish_response(*args, **kwargs)
        self._finished += 1
        # The next head's clock starts at its first byte (idle time is the keep-alive
        # bound's business), unless it already arrived whole, pipelined.
        self._awaiting_head = self._request_count <= self._finished
        return result

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status != 400:
            return super().handle_error(request, status, exc, message)
        answer = head_error_answer(exc, self._max_line_size)
        log.debug("refused a malformed request head", extra={"error": answer.code})
        code, headers, body = render(answer)
        response = web.Response(status=code, body=body, headers=headers)
        response.force_close()
        return response

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        # The handler's own loop: asyncio.get_running_loop() costs a getpid() syscall
        # per call on Python 3.11 (seen in strace), once per request here.
        self._head_timer = self._loop.call_later(self._header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport is not None and not self.transport.is_closing():
            log.debug("closed a connection whose request head did not arrive in time")
            self.transport.close()


class EdgeServer(web.Server):
    """aiohttp's low-level server making `EdgeHandler` connections."""

    def __init__(self, handler: Handler, *, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._header_timeout_s = header_timeout_s

    def set_limits(self, *, header_timeout_s: float, **kwargs: Any) -> None:
        """Limits for the connections accepted from now on (a config reload)."""
        self._header_timeout_s = header_timeout_s
        self._kwargs.update(kwargs)

    def __call__(self) -> RequestHandler:
        return EdgeHandler(
            self, loop=self._loop, header_timeout_s=self._header_timeout_s, **self._kwargs
        )
