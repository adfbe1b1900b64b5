"""The requests a worker's control client has in flight (design §3), and the error calls raise.

This module owns `ControlError` and the book of requests: it gives each request
a fresh id and its line, matches every reply to its request by id, keeps a
caller's operation across a lost connection so that it is resent after the
next hello (ops are idempotent), fails the client's own (hello, sync, ping,
bye) with their connection, and fails everything at once on a stop or a refused
hello. It also says what the held claims become once the waiting operations
are applied, and when the oldest unanswered request was written.

It must never open, read or write a socket, sleep, or read a clock (`now` and
the write function are passed in): `router.client` does the I/O.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from router.protocol import MAX_LINE_BYTES, Reply, encode_line

log = logging.getLogger("router.client")  # one logger for the whole client, as before its split

Claim = tuple[str, str]  # (kind, key)
Write = Callable[[bytes], None]


class ControlError(Exception):
    """An `ok:false` reply from the router; `error` is its code, `reply` the whole reply.

    The client also raises it, with `error` set to `client_stopped`, `not_started`
    or `line_too_long`, for calls it cannot carry out; and with the code of the
    router's refusal of its hello (`forbidden`, `worker_busy`, ...) while that
    refusal stands.
    """

    def __init__(self, error: str, reply: Mapping[str, object] | None = None) -> None:
        self.error = error
        self.reply: Reply = dict(reply) if reply is not None else {"ok": False, "error": error}
        detail = self.reply.get("detail")
        super().__init__(f"{error}: {detail}" if isinstance(detail, str) else error)

    @classmethod
    def from_reply(cls, reply: Mapping[str, object]) -> ControlError:
        """The error for an `ok:false` reply (code `unknown_error` when it names none)."""
        error = reply.get("error")
        return cls(error if isinstance(error, str) else "unknown_error", reply)

    def again(self) -> ControlError:
        """A fresh error with the same code and reply: one raise, one traceback."""
        return ControlError(self.error, self.reply)


class ConnectionGone(ConnectionError):
    """The connection a request was sent on is gone."""


class Request:
    """One request: its message without an id, and who waits for the reply."""

    __slots__ = ("future", "message", "on_reply", "replay", "sent_at")

    def __init__(
        self,
        message: Reply,
        future: asyncio.Future[Reply],
        *,
        replay: bool,
        on_reply: Callable[[Reply], None] | None = None,
    ) -> None:
        self.message = message
        self.future = future
        # Caller operations are resent after a reconnect (ops are idempotent);
        # the client's own (hello, sync, ping, bye) die with their connection.
        self.replay = replay
        self.on_reply = on_reply
        self.sent_at: float | None = None  # when it was written on the current connection


def mark_retrieved(future: asyncio.Future[Any]) -> None:
    """Marks a future's exception as seen: an abandoned call never logs "never retrieved"."""
    if not future.cancelled():
        future.exception()


class RequestBook:
    """The requests written and not yet answered, and the callers' ones waiting for a
    connection, by id; ids grow, so id order is call order."""

    def __init__(self) -> None:
        self._by_id: dict[int, Request] = {}
        self._next_id = 0
        self.last_sent = 0.0  # when a line was last written (the pinger's idle clock)

    def new(
        self, message: Reply, *, replay: bool, on_reply: Callable[[Reply], None] | None = None
    ) -> Request:
        """A request whose future belongs to the running loop (not yet in the book)."""
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        future.add_done_callback(mark_retrieved)
        return Request(message, future, replay=replay, on_reply=on_reply)

    def park(self, request: Request) -> None:
        """Keep a caller's `request` until the next connection is ready (`send_parked`)."""
        self._by_id[self._take_id()] = request

    def send(self, request: Request, write: Write | None, now: float) -> None:
        """Give `request` a fresh id and write its line with `write`.

        With no connection (`write` None) a caller's request stays parked and
        the client's own fails with ConnectionGone. A line over the limit fails
        the request with ControlError(`line_too_long`): the router would close
        the connection, and the resend would loop for ever.
        """
        request_id = self._take_id()
        line = encode_line({**request.message, "id": request_id})
        if len(line) > MAX_LINE_BYTES:
            request.future.set_exception(ControlError("line_too_long"))
            return
        if write is None:
            if request.replay:
                self._by_id[request_id] = request
            else:
                request.future.set_exception(ConnectionGone("the control connection is down"))
            return
        self._by_id[request_id] = request
        write(line)
        self.last_sent = request.sent_at = now

    def send_parked(self, write: Write, now: float) -> None:
        """Write what waited for the connection, in call order."""
        for request_id in sorted(self._by_id):
            self.send(self._by_id.pop(request_id), write, now)

    def answer(self, reply: Reply) -> None:
        """Hand `reply` to the request it answers (a reply for none is logged and dropped)."""
        request_id = reply.get("id")
        if request_id is None:
            error = reply.get("error")
            if error == "too_many_connections":  # it closes this connection; we redial
                log.warning("the router refused this control connection: %s", reply.get("detail"))
            else:
                log.warning("the router could not parse a control line: %s", error)
            return
        request = None
        if isinstance(request_id, int) and not isinstance(request_id, bool):
            request = self._by_id.pop(request_id, None)
        if request is None:
            log.debug("control reply for no pending request: %r", request_id)
            return
        if request.on_reply is not None:
            request.on_reply(reply)
        if not request.future.done():
            request.future.set_result(reply)

    def connection_lost(self) -> None:
        """Fail the client's own requests; callers' requests wait for the next connection."""
        for request_id, request in list(self._by_id.items()):
            request.sent_at = None
            if not request.replay:
                del self._by_id[request_id]
                if not request.future.done():
                    request.future.set_exception(ConnectionGone("the control connection closed"))

    def fail_all(self, error: ControlError) -> None:
        """Fail every request in the book with (a copy of) `error`, and forget them."""
        for request in self._by_id.values():
            if not request.future.done():
                request.future.set_exception(error.again())
        self._by_id.clear()

    def claims_after_waiting_ops(self, held: frozenset[Claim]) -> set[Claim]:
        """`held` with every waiting claim added and every waiting release removed, in order."""
        claims = set(held)
        for request_id in sorted(self._by_id):
            message = self._by_id[request_id].message
            pair = (str(message.get("kind")), str(message.get("key")))
            if message["op"] == "claim":
                claims.add(pair)
            elif message["op"] == "release":
                claims.discard(pair)
        return claims

    def oldest_unanswered(self, now: float) -> float:
        """When the oldest request still waiting for its reply was written (`now` if none)."""
        sent = (r.sent_at for r in self._by_id.values() if r.sent_at is not None)
        return min(sent, default=now)

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id
