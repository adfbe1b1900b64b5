"""One request on its way through the public handler, and the router's own answers to it.

This module owns what the handler learns of one request (its session, its decision, its
outcome and status for the metrics) and the translation of what went wrong into the
answers of design §1 and §3: the answer written and logged, a body that broke, a client
that left, a forward that failed. The handler's answers are written here, from
`router.core.answers` (the public server answers a head it refuses itself). It never
routes, never forwards and never waits: the flow is `router.app.handler`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Coroutine
from typing import Any, Final

from router.core import Answer, Forward, WorkerState
from router.edge import BodyBroken, PublicRequest
from router.metrics import CLIENT_CLOSED
from router.relay import LaneDone, UpstreamFailure
from router.sessions import SessionRef

__all__ = [
    "BODY_OVER_LIMIT",
    "CLIENT_CLOSED_STATUS",
    "MAX_LOGGED_PATH",
    "Exchange",
    "ExchangeOwner",
    "body_timeout_answer",
    "failure_answer",
]

answers_log = logging.getLogger("episode_router.answers")
# A body over `limits.max_body_bytes`, by its Content-Length or as it streams in.
BODY_OVER_LIMIT: Final = Answer("payload_too_large", "The request body is over the router's limit.")
MAX_LOGGED_PATH: Final = 200  # a hostile client's path is cut here in the log
# A request whose client left before its reply is counted with nginx's status for it.
CLIENT_CLOSED_STATUS: Final = 499


class ExchangeOwner:
    """What an exchange tells when its forward's lane ends: the `PublicHandler` that made
    it. A base class rather than a Protocol, so that the compiled build calls it
    directly."""

    __slots__ = ()

    def lane_done(self, exchange: Exchange, result: int | Coroutine[Any, Any, int]) -> None:
        """The reply went out (`result` is its status), or the rest of the forward is
        the coroutine `result`, to run."""
        raise NotImplementedError


class Exchange(LaneDone):
    """One request on its way through the handler, with what was learned of it."""

    __slots__ = (
        "body",
        "decided",
        "decision",
        "found",
        "handler",
        "kind",
        "outcome",
        "request",
        "route_path",
        "seeding",
        "started",
        "status",
    )

    def __init__(self, handler: ExchangeOwner, request: PublicRequest, started: float) -> None:
        self.handler = handler
        self.request = request
        self.started = started  # time.perf_counter() when it was handed to the handler
        self.kind: str | None = None  # the session kind it named, for metrics
        self.outcome = "forwarded"  # or the code of the router's own answer
        self.status = 0  # the reply's status, for metrics
        self.seeding: frozenset[str] = frozenset()
        # The path routes match (behind a prefix the workers strip); set when a kind
        # has routes or reads paths.
        self.route_path = ""
        self.found: SessionRef | None = None
        self.body: bytes | None = None  # read only when a body kind needed it
        self.decision: Forward | None = None  # set when it goes on the relay's lane
        self.decided = 0.0  # time.perf_counter() when it was routed (0: not routed)

    def lane_done(self, result: int | Coroutine[Any, Any, int]) -> None:
        self.handler.lane_done(self, result)

    @property
    def path(self) -> str:
        """The request's path: routes are matched on the raw path, as the worker will
        read it."""
        return self.request.path

    def answer(self, answer: Answer) -> None:
        """Sends the router's own answer to this request, logged as one line (never the
        token: `session` is the key the token names)."""
        self.outcome = answer.code
        self.status = answer.status
        request = self.request
        answers_log.info(
            "answered",
            extra={
                "code": answer.code,
                "status": answer.status,
                "kind": self.kind,
                "session": answer.session,
                "method": request.method,
                "path": self.path[:MAX_LOGGED_PATH],
                "client": request.remote,
            },
        )
        request.client.answer(request, answer)

    def body_broke(self, broken: BodyBroken) -> None:
        """The request body could not be read: 400 for a malformed one, 408 for one whose
        client went silent; nothing for a client that left (there is no one to answer)."""
        if broken.malformed:
            self.answer(Answer("bad_request", f"The request body is malformed ({broken.reason})."))
        elif broken.timed_out:
            self.answer(body_timeout_answer(broken.reason))
        else:
            self.client_left()

    def client_left(self) -> None:
        """The client went away before its reply: counted, nothing is sent."""
        self.outcome = CLIENT_CLOSED
        self.status = CLIENT_CLOSED_STATUS
        self.request.client.drop()

    def failed_by_client(self, failure: UpstreamFailure) -> bool:
        """Answers a forward the client's side failed (it left, its body was malformed,
        went silent or grew over the limit); False for a failure of the worker's side,
        which is left to the caller."""
        kind = failure.kind
        if kind == "client_left":
            self.client_left()
        elif kind == "bad_body":
            self.answer(Answer("bad_request", f"The request body is malformed ({failure.detail})."))
        elif kind == "client_timeout":
            self.answer(body_timeout_answer(failure.detail))
        elif kind == "too_large":
            self.answer(BODY_OVER_LIMIT)
        else:
            return False
        return True


def body_timeout_answer(reason: str) -> Answer:
    """408: the client went silent mid-body (its fault, not the worker's)."""
    return Answer("request_timeout", f"The request body stopped arriving ({reason}).")


def failure_answer(failure: UpstreamFailure, gone: bool, decision: Forward) -> Answer:
    """design §3: before the reply head, a refused connect or a worker whose lease
    is gone is 410 worker_exited; otherwise 502, or 504 on a timeout. A worker whose
    connections are all busy is 503 worker_busy (design §1)."""
    session = decision.session
    if failure.kind == "directory":
        return Answer(
            "recovering",
            "The claims directory did not take the session this reply created; retry shortly.",
            session,
            retry_after_s=1.0,
        )
    if failure.kind == "busy":
        return Answer(
            "worker_busy",
            f"The worker's connections are all busy ({failure.detail}); try again.",
            session,
            retry_after_s=1.0,
        )
    gone = gone or decision.worker.state in (WorkerState.EXITED, WorkerState.LOST)
    if failure.kind == "refused" or (gone and failure.kind == "error"):
        ran = "ran this episode" if session is not None else "was chosen for this request"
        return Answer("worker_exited", f"The worker that {ran} is no longer running.", session)
    if failure.kind == "timeout":
        return Answer("upstream_timeout", "The worker did not answer in time.", session)
    return Answer("upstream_error", f"The worker failed: {failure.detail}", session)
