"""A public client connection's lifetime: its bounds, its clocks, its reading, its end.

This module owns `ClockedConnection`, the base of `router.edge.server.EdgeConnection`:
- `EdgeLimits`, the per-connection bounds;
- the one timer a connection has and why its deadline is set: a head arriving (the
  connection closes when it passes), kept alive with nothing in flight (closes), a body
  gone silent (its request fails, and its handler answers 408), lingering (closes);
- whether the connection reads: it stops while too many requests wait or a body holds
  more than its high-water mark, and starts again when both are gone;
- how it ends: closed, aborted, or lingering after an answer to a body still arriving
  (reading and dropping up to `LINGER_MAX_BYTES` for up to `LINGER_S`, so the client
  reads the answer instead of a reset).

It never parses a request and never writes a reply (lingering only shuts the sending
side). The layers above it set the flags it reads; what they mean is said here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from router.edge.request import PublicRequest, RequestClient

__all__ = [
    "BODY_DEADLINE",
    "HEAD_DEADLINE",
    "IDLE_DEADLINE",
    "LINGER_DEADLINE",
    "LINGER_MAX_BYTES",
    "LINGER_S",
    "ClockedConnection",
    "EdgeLimits",
]

log = logging.getLogger("episode_router.edge")

LINGER_S: Final = 2.0  # how long a closing connection keeps reading (and dropping) a client's body
LINGER_MAX_BYTES: Final = 1 << 20  # ... and how much of it, before it closes at once

# Why the connection's deadline is set (what happens when it passes).
HEAD_DEADLINE: Final = 1  # a request head is arriving: close
IDLE_DEADLINE: Final = 2  # kept alive, nothing in flight: close
LINGER_DEADLINE: Final = 3  # closing, reading what the client still sends: close
BODY_DEADLINE: Final = 4  # a request body is arriving and went silent: 408


@dataclass(frozen=True, slots=True)
class EdgeLimits:
    """Per-connection bounds (`limits` in the config)."""

    header_timeout_s: float = 10.0
    idle_timeout_s: float = 75.0
    max_line_bytes: int = 8190
    max_header_bytes: int = 16384  # as the config's default (LimitsConfig)
    max_headers: int = 100
    body_timeout_s: float = 60.0
    max_head_bytes: int = 65536  # one unfinished head (as LimitsConfig)
    max_held_head_bytes: int = 64 * 1024 * 1024  # all connections' unfinished heads
    max_connections: int = 0  # open public connections; 0: no limit


class ClockedConnection(RequestClient):
    """A client connection's transport, flags, reading switch and clocks."""

    # Each layer of the connection lists its own attributes (see EdgeConnection).
    __slots__ = (
        "_body_backlog",
        "_closing",
        "_deadline",
        "_deadline_kind",
        "_discarded",
        "_in_head",
        "_limits",
        "_loop",
        "_lost",
        "_pipeline_full",
        "_reading_paused",
        "_receiving",
        "_send_buffered",
        "_send_timer",
        "_stopped",
        "_time",
        "_timer",
        "_timer_when",
        "_unparsed",
        "_write_paused",
        "transport",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, time: Callable[[], float], limits: EdgeLimits
    ) -> None:
        self._loop = loop
        self._time = time  # the loop's clock, kept bound (see router.edge.parsing)
        self._limits = limits
        self.transport: asyncio.Transport | None = None
        self._in_head = False  # a request head is being parsed (its clock runs)
        self._receiving: PublicRequest | None = None  # its body is still arriving
        self._stopped = False  # no more requests are read on this connection
        self._lost = False
        self._closing = False  # answer what is queued with Connection: close, then close
        self._discarded = 0  # bytes dropped while lingering
        # Reading stops for any of these reasons; it starts again when all are gone.
        self._pipeline_full = False
        self._body_backlog = False
        self._write_paused = False  # the client takes its replies slower than they come
        # Read and not yet parsed: the rest of a large read, kept while MAX_PIPELINED
        # requests wait (router.edge.server's data_received).
        self._unparsed: bytes | None = None
        self._reading_paused = False
        # Runs while writing is paused: a client that takes nothing for idle_timeout_s
        # is dropped (pause_writing). Paused writes are rare: no cost per request.
        self._send_timer: asyncio.TimerHandle | None = None
        self._send_buffered = 0  # unsent bytes when it was armed, or last found moving
        # One timer per connection, moved lazily: setting a later deadline only stores it
        # (the timer re-arms itself when it fires early), so a kept-alive connection
        # costs no timer call per request.
        self._deadline: float | None = None
        self._deadline_kind = 0
        self._timer: asyncio.TimerHandle | None = None
        self._timer_when = 0.0

    # --- flow control -----------------------------------------------------------------

    def body_backlogged(self) -> None:
        self._body_backlog = True
        self._update_reading()

    def body_drained(self) -> None:
        self._body_backlog = False
        self._update_reading()

    def _update_reading(self) -> None:
        transport = self.transport
        if transport is None or self._lost:
            return
        pause = (
            self._pipeline_full
            or self._body_backlog
            or self._write_paused
            or self._unparsed is not None
        )
        if pause and not self._reading_paused:
            self._reading_paused = True
            transport.pause_reading()
            kind = self._deadline_kind
            if kind in (BODY_DEADLINE, HEAD_DEADLINE):
                # Not the client's silence while it is not read: a head cut at a read's
                # end waited out the head's time behind replies the client was taking.
                self._set_deadline(None, 0)
        elif not pause and self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
            if self._in_head:
                self._set_deadline(self._time() + self._head_timeout_s(), HEAD_DEADLINE)
            self._restart_body_clock()

    def _restart_body_clock(self) -> None:
        """Gives the body arriving body_timeout_s from now, when its clock runs: the
        router reads it, and its client was not asked to wait (one that sent `Expect:
        100-continue` rightly sends nothing until the 100 goes out: send_continue
        starts the clock then)."""
        receiving = self._receiving
        if (
            receiving is not None
            and not self._reading_paused
            and not self._stopped
            and not receiving.expect_continue
        ):
            self._set_deadline(self._time() + self._limits.body_timeout_s, BODY_DEADLINE)

    # --- deadlines ----------------------------------------------------------------------

    def _head_timeout_s(self) -> float:
        # The idle bound covers a connection on which no request is being handled, a
        # head still arriving included: the shorter of the two applies.
        limits = self._limits
        return min(limits.header_timeout_s, limits.idle_timeout_s)

    def _set_deadline(self, when: float | None, kind: int) -> None:
        self._deadline = when
        self._deadline_kind = kind
        if when is None:
            return
        timer = self._timer
        if timer is not None:
            if self._timer_when <= when:
                return  # it fires early, sees the later deadline, and re-arms
            timer.cancel()
        self._timer = self._loop.call_at(when, self._deadline_passed)
        self._timer_when = when

    def _deadline_passed(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None or self._lost:
            return
        if self._time() < deadline:
            self._timer = self._loop.call_at(deadline, self._deadline_passed)
            self._timer_when = deadline
            return
        kind = self._deadline_kind
        self._deadline = None
        receiving = self._receiving
        if kind == BODY_DEADLINE and receiving is not None and receiving.body is not None:
            # The handler answers 408 when it reads the body, then the connection closes
            # (its rest is never parsed as a next request).
            self._receiving = None
            self._stopped = True
            reason = f"no bytes for {self._limits.body_timeout_s:g} s"
            receiving.body.fail(reason, malformed=False, timed_out=True)
            return
        if kind == HEAD_DEADLINE:
            self._head_late()
            return
        self._close()

    def _release_head(self) -> None:
        """The unfinished head's bytes are held no more (router.edge.parsing counts them,
        router.edge.server in its budget too): called wherever reading stops for good."""

    def _held_changed(self, size: int) -> None:
        """`size` more (or, negative, fewer) bytes read ahead and held by this connection:
        kept unparsed, or queued behind the request handled (router.edge.server counts
        them in its budget)."""

    def _drop_unparsed(self) -> bytes | None:
        """The rest of a read kept unparsed, taken (to be parsed, or never) and held no
        more."""
        unparsed = self._unparsed
        if unparsed is not None:
            self._unparsed = None
            self._held_changed(-len(unparsed))
        return unparsed

    def _head_late(self) -> None:
        """A request head did not arrive whole within its time."""
        log.debug("closed a connection whose request head did not arrive in time")
        self._close()

    # --- the end ------------------------------------------------------------------------

    def abort(self) -> None:
        transport = self.transport
        if transport is not None:
            transport.abort()

    def _linger(self) -> None:
        """Shuts the sending side after the answer written, and reads (and drops) what
        the client still sends for a while: closing with unread bytes would reset the
        connection, and the client could lose the answer."""
        self._stopped = True
        self._release_head()
        transport = self.transport
        if transport is None or self._lost:
            return
        if not transport.can_write_eof():
            self._close()
            return
        transport.write_eof()  # the answer is all the client gets; it may stop sending
        self._set_deadline(self._time() + LINGER_S, LINGER_DEADLINE)
        self._pipeline_full = self._body_backlog = False
        self._drop_unparsed()  # never parsed now
        self._update_reading()

    def _discard(self, size: int) -> None:
        """`size` bytes read after the connection stopped reading requests: dropped, and
        the connection closed once a lingering client sent too many of them."""
        if self._deadline_kind == LINGER_DEADLINE:
            self._discarded += size
            if self._discarded > LINGER_MAX_BYTES:
                self._close()

    def _close(self) -> None:
        self._stopped = True
        self._release_head()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()
