"""The public handler: read the session, ask the core, forward or answer.

This is the edge where a decision becomes HTTP: the router's own answers are
written here (and only here) from `router.answers`, and forwarding failures
are translated into the answers of DESIGN §1.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from router.answers import Answer, render
from router.core import Forward, RouterCore
from router.forward import Forwarder, Upstream, UpstreamFailure
from router.sessions import SessionReader, SessionRef
from router.workers import Worker, WorkerState

log = logging.getLogger("episode_router.public")

BOOT_HEADER = "X-Episode-Router-Boot"
MAX_SESSIONLESS_TRIES = 3  # connect refused on a sessionless request: try this many workers


def answer_response(answer: Answer, request: web.Request | None = None) -> web.Response:
    """The HTTP response for one of the router's own answers."""
    status, headers, body = render(answer)
    response = web.Response(status=status, body=body, headers=headers)
    if request is not None and request.body_exists and not request.content.is_eof():
        # The body was not read: close rather than leave its bytes on a kept-alive
        # connection, and never send 100 Continue for a request we refuse.
        response.force_close()
    return response


async def _no_continue(request: web.Request) -> None:
    """Expect handler that sends nothing: 100 Continue goes out only when we forward."""
    return None


class PublicHandler:
    """Routes one request at a time; holds no per-request state of its own."""

    def __init__(
        self,
        core: RouterCore,
        sessions: SessionReader,
        forwarder: Forwarder,
        *,
        check_worker: Callable[[Worker], Awaitable[bool]],
        max_body_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.core = core
        self.sessions = sessions
        self.forwarder = forwarder
        # Probes a worker whose forward failed and retires it if nothing listens.
        self._check_worker = check_worker
        self.max_body_bytes = max_body_bytes
        self._clock = clock
        self._wall_clock = wall_clock
        self.shutting_down = False

    def application(self, **kwargs: object) -> web.Application:
        app = web.Application(handler_args=kwargs or None, client_max_size=0)
        app.router.add_route("*", "/{tail:.*}", self.handle, expect_handler=_no_continue)
        return app

    async def handle(self, request: web.Request) -> web.StreamResponse:
        refusal = self._refuse_early(request)
        if refusal is not None:
            return answer_response(refusal, request)
        found = self.sessions.read(request.headers, self._wall_clock())
        if isinstance(found, Answer):
            return answer_response(found, request)
        kind, key = (found.kind, found.key) if isinstance(found, SessionRef) else (None, None)
        decision = self.core.route(kind, key, self._clock())
        if isinstance(decision, Answer):
            return answer_response(decision, request)
        return await self._forward(request, decision, sessionless=key is None)

    def _refuse_early(self, request: web.Request) -> Answer | None:
        if self.shutting_down:
            return Answer("shutting_down", "The router is shutting down.", retry_after_s=1.0)
        length = request.content_length
        if self.max_body_bytes is not None and length is not None and length > self.max_body_bytes:
            return Answer("payload_too_large", "The request body is over the router's limit.")
        return None

    async def _forward(
        self, request: web.Request, decision: Forward, *, sessionless: bool
    ) -> web.StreamResponse:
        if request.headers.get("Expect", "").lower() == "100-continue":
            # The client waits for this before it sends the body; the worker never
            # sees Expect (the forwarder drops it), so the router says it here.
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        tried: set[str] = set()
        while True:
            worker = decision.worker
            tried.add(worker.id)
            outcome = await self._forward_once(request, decision)
            if not isinstance(outcome, UpstreamFailure):
                return outcome
            gone = outcome.kind != "timeout" and await self._check_worker(worker)
            retriable = sessionless and outcome.kind == "refused" and not outcome.request_sent
            if retriable and len(tried) < MAX_SESSIONLESS_TRIES:
                # Nothing reached that worker: another one may take the request.
                retry = self.core.balance(None, frozenset(tried))
                if isinstance(retry, Forward):
                    decision = retry
                    continue
                return answer_response(retry, request)
            return answer_response(self._failure_answer(outcome, gone, decision), request)

    async def _forward_once(
        self, request: web.Request, decision: Forward
    ) -> web.StreamResponse | UpstreamFailure:
        worker = decision.worker
        extra = {BOOT_HEADER: decision.boot} if decision.boot else {}
        worker.in_flight += 1
        try:
            return await self.forwarder.forward(
                request,
                Upstream(worker.id, worker.url),
                extra_headers=extra,
                public_base=f"{request.scheme}://{request.host}",
            )
        except UpstreamFailure as failure:
            return failure
        finally:
            worker.in_flight -= 1

    def _failure_answer(self, failure: UpstreamFailure, gone: bool, decision: Forward) -> Answer:
        """DESIGN §3: before the reply head, a refused connect or a worker whose lease
        is gone is 410 worker_exited; otherwise 502, or 504 on a timeout."""
        session = decision.session
        gone = gone or decision.worker.state in (WorkerState.EXITED, WorkerState.LOST)
        if failure.kind == "refused" or (gone and failure.kind == "error"):
            return Answer(
                "worker_exited", "The worker that ran this episode is no longer running.", session
            )
        if failure.kind == "timeout":
            return Answer("upstream_timeout", "The worker did not answer in time.", session)
        return Answer("upstream_error", f"The worker failed: {failure.detail}", session)
