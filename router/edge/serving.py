"""What a request handler sees of a public client connection: requests, then replies.

This module owns `ServingConnection`, the layer of `router.edge.server.EdgeConnection` that a
`PublicRequest.client` is:
- the queue of requests parsed and not yet answered, handed to the handler one at a
  time and in order (`Handler`: `finished()`, `carry_on()`), and a refused head behind
  them answered after them; reading stops past `MAX_PIPELINED` of them or
  `MAX_PIPELINED_BYTES` read while they queue;
- the replies the handler writes for the request at the head of the queue: relayed
  replies and the router's own answers (`reply_*`, `answer`), framed for the client's
  HTTP version; the connection stays open only when both sides allow it and every
  body byte was read;
- the writing side's flow control (`drain`).

It never parses a request and never decides where one goes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import sys
import termios
from collections.abc import Awaitable, Callable
from typing import Final

from router.core import Answer, render
from router.edge.clock import HEAD_DEADLINE, IDLE_DEADLINE, ClockedConnection, EdgeLimits
from router.edge.request import DETACHED_CLIENT, PublicRequest
from router.edge.wire import BodyFraming, answer_head, continue_line, head_additions, reply_head

__all__ = ["MAX_PIPELINED", "MAX_PIPELINED_BYTES", "Handler", "ServingConnection"]

log = logging.getLogger("episode_router.edge")

# A handler either returns an awaitable, which the connection runs in a task (the
# request is finished when it returns), or returns None and calls `finished()` on the
# request's connection once it is done with it: at once, or later from a callback.
Handler = Callable[[PublicRequest], Awaitable[None] | None]

MAX_PIPELINED: Final = 16  # requests parsed ahead of the one being handled, before reading stops
# ... and the bytes read while they queue, before reading stops: two maximal heads (with
# their bodies' first bytes), more than a real pipelining client sends ahead.
MAX_PIPELINED_BYTES: Final = 128 * 1024


def detach(request: PublicRequest) -> None:
    """`request`, done with on a closed connection, names that connection no more (nor
    does its body), and lets go of its head: what of it lives on in a reference cycle
    keeps no connection alive, and no head's bytes."""
    request.let_go(DETACHED_CLIENT)


class ServingConnection(ClockedConnection):
    """A client connection as its requests' handler uses it."""

    __slots__ = (
        "_busy",
        "_dispatching",
        "_drain_waiter",
        "_framing",
        "_halted",
        "_handler",
        "_pipelined_bytes",
        "_queue",
        "_refusal",
        "_replied",
        "_reply_keep_alive",
        "_task",
        "_transport_write",
    )

    def __init__(
        self,
        handler: Handler,
        loop: asyncio.AbstractEventLoop,
        time: Callable[[], float],
        limits: EdgeLimits,
    ) -> None:
        super().__init__(loop, time, limits)
        self._handler = handler
        # Requests parsed and not yet answered, the one being handled first.
        # A list, not a deque: the compiled build appends to and pops from a list
        # directly, and calls a deque's methods by name; reading stops past
        # MAX_PIPELINED, so popping the first one moves a few pointers (measured with
        # the bound methods in router.edge.parsing.ParsingConnection). An empty list
        # is also smaller than an empty deque, per connection.
        self._queue: list[PublicRequest] = []
        # Bytes read while requests queued behind another (their heads and bodies), until
        # the queue is down to one again: counted per read (router.edge.server).
        self._pipelined_bytes = 0
        self._busy = False  # the request at the head of the queue is with the handler
        self._dispatching = False  # _dispatch() is on the stack
        self._halted = False  # no more requests are handed to the handler
        self._task: asyncio.Task[None] | None = None  # a handler's awaitable, running
        self._refusal: Answer | None = None  # a bad head after the queued requests
        # The reply being written, through the transport's write (set as the connection
        # is made).
        self._transport_write: Callable[[bytes], object] | None = None
        self._framing = BodyFraming.NONE
        self._reply_keep_alive = False
        self._replied = False  # a reply head went out for the current request
        self._drain_waiter: asyncio.Future[None] | None = None

    # --- serving ----------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Hands the queued requests to the handler in order, as far as they go now.

        A request the handler finishes at once, or drives by callbacks, takes no task (the
        router's usual forward; measured with the relay's lane: docs/performance.md); one
        whose handler returns an awaitable runs in a task, and the queue moves on when it
        ends. Once the queue is empty, a refusal waiting behind it is written, or the idle
        clock starts.
        """
        queue = self._queue
        self._dispatching = True
        try:
            # Not while the client's replies back up (pause_writing): resume_writing
            # goes on from here.
            while (
                queue
                and not self._busy
                and not self._write_paused
                and not self._halted
                and not self._lost
            ):
                request = queue[0]
                self._replied = False
                self._busy = True
                try:
                    pending = self._handler(request)
                except Exception:
                    self._handler_failed()
                    return
                if pending is not None:
                    self._task = self._loop.create_task(self._run_handler(request, pending))
                    return
        finally:
            self._dispatching = False
        if queue or self._busy or self._halted or self._lost:
            return
        # A head has begun when llhttp is in one, or when a read started one before its
        # target (data_received started its clock then).
        head_begun = self._in_head or self._deadline_kind == HEAD_DEADLINE
        if self._refusal is not None:
            self._write_answer_and_close(self._refusal)
        elif self._closing and (self._stopped or not head_begun):
            self._close()  # (stopped: whatever head began will never be read)
        elif not head_begun:
            self._set_deadline(self._time() + self._limits.idle_timeout_s, IDLE_DEADLINE)
            self._went_idle()

    def _went_idle(self) -> None:
        """The connection is idle, kept alive (router.edge.server orders the idle ones)."""

    async def _run_handler(self, request: PublicRequest, pending: Awaitable[None]) -> None:
        try:
            await pending
        except Exception:
            self._handler_failed()
            return
        finally:
            self._task = None
        self.finished(request)

    def carry_on(self, request: PublicRequest, rest: Awaitable[None]) -> None:
        """The handler, having returned None for `request`, finishes it in a task after
        all: `rest` runs as a returned awaitable would (`finished()` when it ends)."""
        self._task = self._loop.create_task(self._run_handler(request, rest))

    def finished(self, request: PublicRequest) -> None:
        """The handler is done with `request`, the one at the head of the queue: its reply
        went out (or the client was dropped). The next request is handed on, or the
        connection closes after a reply that said so."""
        queue = self._queue
        if not queue or queue[0] is not request or not self._busy:
            raise RuntimeError("finished() for a request that is not being handled")
        self._busy = False
        queue.pop(0)
        if self._lost:
            detach(request)
        if not self._replied:
            log.error("the request handler sent no reply; closing the connection")
            self._halted = True
            self.abort()
            return
        if self._pipelined_bytes and len(queue) <= 1:
            self._release_pipelined()  # what queued behind the request is all handled
        if (
            self._pipeline_full
            and len(queue) <= MAX_PIPELINED
            and self._pipelined_bytes <= MAX_PIPELINED_BYTES
            and not (self._pipelined_bytes and self._over_budget())
        ):
            self._pipeline_full = False
            if self._unparsed is not None:
                # Parsed from the loop, not from inside this reply's finish: reading
                # stays paused until then, so bytes are parsed in the order they came.
                self._loop.call_soon(self._parse_unparsed)
            self._update_reading()
        if not self._reply_keep_alive:
            self._halted = True
            self._close_after(request)
            return
        if not self._dispatching:
            self._dispatch()

    def _hold_pipelined(self, size: int) -> None:
        """`size` more bytes read while requests queue behind the one handled: past
        MAX_PIPELINED_BYTES, or past the budget of all connections' held bytes
        (`_over_budget`), reading stops (backpressure, not a refusal) until the queue
        is down to one. Not before: only the last request queued may still be receiving
        its body, and it is handled once the rest are."""
        self._pipelined_bytes += size
        self._held_changed(size)
        if not self._pipeline_full and (
            self._pipelined_bytes > MAX_PIPELINED_BYTES or self._over_budget()
        ):
            self._pipeline_full = True
            self._update_reading()

    def _over_budget(self) -> bool:
        """All connections' held bytes are over their budget (router.edge.server)."""
        return False

    def _release_pipelined(self) -> None:
        """The bytes read while requests queued are held no more."""
        self._held_changed(-self._pipelined_bytes)
        self._pipelined_bytes = 0

    def _refused(self, answer: Answer) -> None:
        """A head refused before any handler saw it (router.edge.server counts it)."""

    def _head_late(self) -> None:
        if not self._busy:
            super()._head_late()
            return
        # The next head is late while a request is in flight: that request's reply still
        # goes out (saying Connection: close, unless its head went out already) and the
        # connection closes after it; nothing more is read. (Closed at once, the reply
        # was lost and the request counted as the client's leaving.)
        log.debug("a request head did not arrive in time: closing after the reply")
        self._stopped = True
        self._release_head()  # never read on: not held against the budget till the reply ends
        self._closing = True

    def _parse_unparsed(self) -> None:
        unparsed = self._drop_unparsed()
        if unparsed is not None and not self._lost:
            self.data_received(unparsed)  # may keep a rest again
        self._update_reading()

    def _handler_failed(self) -> None:
        log.exception("the request handler failed")
        self._halted = True
        self.abort()

    def close_when_idle(self) -> None:
        """Shutdown: an idle connection closes now; a busy one after its queue."""
        self._closing = True
        if not self._busy and not self._queue:
            self._close()

    def _close_after(self, request: PublicRequest) -> None:
        """Closes once a reply said `Connection: close`; lingers when the client may
        still be sending the body of the request it was an answer to."""
        self._stopped = True
        self._release_head()
        if request.body_complete:
            self._close()
        else:
            self._linger()

    # --- replies (called by the handler, for the request at the head of the queue) ----

    def send_continue(self) -> None:
        """`100 Continue`, for a client waiting for it before it sends the body (the one
        arriving), whose silence counts from now."""
        transport = self.transport
        if transport is not None and not self._lost:
            transport.write(continue_line())
        receiving = self._receiving
        if receiving is not None:
            receiving.expect_continue = False  # said: never again, and the clock runs
            self._restart_body_clock()

    def answer(self, request: PublicRequest, answer: Answer) -> None:
        """One of the router's own answers, whole. The connection closes after a
        400 (its framing cannot be trusted) and after any answer to a request whose body
        has not all arrived (its rest is never read as a next request)."""
        status, headers, body = render(answer)
        keep_alive = (
            request.keep_alive
            and not self._closing
            and answer.code != "bad_request"
            and request.body_complete
        )
        head = answer_head(
            status, headers, len(body), keep_alive=keep_alive, version_11=request.version_11
        )
        self._write(head + body if request.method != "HEAD" else head)
        self._replied = True
        self._reply_keep_alive = keep_alive

    def reply_whole(
        self,
        request: PublicRequest,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        """A relayed reply whose body is all here: head and body in one write."""
        head, framing = self._reply_head(request, status, reason, headers)
        if framing is BodyFraming.LENGTH or framing is BodyFraming.CLOSE:
            self._write(head + body)
        elif framing is BodyFraming.CHUNKED:
            self._write(
                head + b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if body else head + b"0\r\n\r\n"
            )
        else:
            self._write(head)

    def reply_as_is(
        self,
        request: PublicRequest,
        status: int,
        whole: bytes,
        body_length: int | None,
        has_date: bool,
    ) -> bool:
        """Relays `whole`, a worker's whole HTTP/1.1 reply with `status` whose headers
        are all kept for the client, as its bytes (a Date line added if it has none)
        when that is what `reply_whole` would say (`head_additions`); else writes nothing
        and returns False. `body_length`: its Content-Length; `has_date`: a Date header
        is among its headers.

        No head rebuilt and no body copied (measured: docs/performance.md)."""
        additions = head_additions(
            status,
            body_length is not None,
            has_date,
            version_11=request.version_11,
            head_request=request.method == "HEAD",
            keep_alive=request.keep_alive and not self._closing and request.body_complete,
        )
        if additions is None:
            return False
        if additions:
            assert body_length is not None
            cut = len(whole) - body_length - 2  # the empty line that ends the head
            whole = b"".join((whole[:cut], additions, whole[cut:]))
        self._framing = BodyFraming.LENGTH
        self._reply_keep_alive = True
        self._replied = True
        self._write(whole)
        return True

    def reply_start(
        self,
        request: PublicRequest,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        first: bytes,
    ) -> None:
        """The head of a streamed reply, with the body bytes already here (b"": the head
        alone, so an event stream's client sees it before the first event)."""
        head, _ = self._reply_head(request, status, reason, headers)
        self._replied = False  # not finished until reply_end
        self._write(head + self._framed(first) if first else head)

    def reply_write(self, data: bytes) -> None:
        """More of a streamed reply's body, as it arrived."""
        if data:
            self._write(self._framed(data))

    def reply_end(self) -> None:
        """The end of a streamed reply (the chunked terminator, if chunked)."""
        if self._framing is BodyFraming.CHUNKED:
            self._write(b"0\r\n\r\n")
        elif self._framing is BodyFraming.CLOSE:
            self._reply_keep_alive = False
        self._replied = True

    def reply_abort(self, idle_s: float) -> None:
        """Ends the connection with no clean terminator after what was relayed, so the
        client sees the reply is incomplete. A client that does not read what is left
        gets the connection reset after `idle_s`."""
        self._replied = True
        self._reply_keep_alive = False
        self._stopped = True
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.close()
        if transport.get_write_buffer_size():
            self._loop.call_later(idle_s, transport.abort)

    def drop(self) -> None:
        """No reply for this request (its client left): the connection ends."""
        self._replied = True
        self._reply_keep_alive = False
        self.abort()

    @property
    def client_gone(self) -> bool:
        return self._lost

    async def drain(self) -> None:
        """Waits while the client is slower than the reply; raises ConnectionResetError
        once the client is gone."""
        if self._lost:
            raise ConnectionResetError("the client went away")
        if not self._write_paused:
            return
        self._drain_waiter = self._loop.create_future()
        try:
            await self._drain_waiter
        finally:
            self._drain_waiter = None

    def pause_writing(self) -> None:
        """The transport holds more than its high-water mark of unsent replies: no more
        requests are read or handed to the handler until the client takes them (a
        pipelining client that reads nothing grew the write buffer without bound). A
        client that takes nothing for idle_timeout_s is dropped, as nginx's send_timeout
        drops it."""
        self._write_paused = True
        self._update_reading()
        if self._send_timer is None:
            self._send_buffered = self._unsent()
            self._send_timer = self._loop.call_later(
                self._limits.idle_timeout_s, self._send_stalled
            )

    def _unsent(self) -> int:
        """Bytes written for the client and not yet taken: the transport's buffer and the
        kernel's send queue (TIOCOUTQ, Linux). The kernel wakes a writer only once a
        third of its large buffer is free, so the transport's alone stood still for
        seconds while a slow client read on; where the ioctl fails, it is all there is."""
        transport = self.transport
        if transport is None:
            return 0
        unsent = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                unsent += int.from_bytes(queued, sys.byteorder, signed=True)
        return unsent

    def _send_stalled(self) -> None:
        self._send_timer = None
        unsent = self._unsent()
        if unsent < self._send_buffered:
            # It took some since (still above the low-water mark): slow, not stopped.
            self._send_buffered = unsent
            self._send_timer = self._loop.call_later(
                self._limits.idle_timeout_s, self._send_stalled
            )
            return
        log.debug("dropped a client that took none of its replies in time")
        self.abort()

    def resume_writing(self) -> None:
        self._write_paused = False
        timer = self._send_timer
        if timer is not None:
            self._send_timer = None
            timer.cancel()
        self._update_reading()
        if self._queue and not self._busy and not self._dispatching:
            self._dispatch()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _reply_head(
        self,
        request: PublicRequest,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
    ) -> tuple[bytes, BodyFraming]:
        keep_alive = request.keep_alive and not self._closing and request.body_complete
        head, framing, keep_alive = reply_head(
            status,
            reason,
            headers,
            version_11=request.version_11,
            head_request=request.method == "HEAD",
            keep_alive=keep_alive,
        )
        self._framing = framing
        self._reply_keep_alive = keep_alive
        self._replied = True
        return head, framing

    def _framed(self, data: bytes) -> bytes:
        if self._framing is BodyFraming.CHUNKED:
            return b"%x\r\n%b\r\n" % (len(data), data)
        return data

    def _write(self, data: bytes) -> None:
        write = self._transport_write
        if write is not None and not self._lost:
            write(data)

    def _write_answer_and_close(self, answer: Answer) -> None:
        status, headers, body = render(answer)
        self._write(answer_head(status, headers, len(body), keep_alive=False) + body)
        self._refusal = None
        self._refused(answer)
        # The client may still be sending the rest of the refused head, or requests after
        # it: it reads the answer rather than a reset.
        self._linger()
