"""One control connection's I/O: split lines, answer them, apply backpressure.

This module owns a control connection's life as its asyncio Protocol: the lines read
and waiting, the replies written, reading paused while the peer does not read its
replies, the hello deadline, and the close that waits (CLOSE_DRAIN_S) for the last
replies. It never decides anything about claims or leases: `ControlSession` answers
every line, and the `ControlServer` it belongs to keeps the set of connections,
counts and logs what they answer, and hears when one closes.

Each connection is a plain asyncio Protocol rather than a stream task: every
line that arrived in one read is answered in one write (and journaled in one),
claims and releases by `ControlSession`'s fast path, which is what lets a
pipelining worker reach over a hundred thousand claims a second. Lines are
answered only while the unsent replies stay under WRITE_BUFFER_HIGH: the rest
of a read waits, unread, until the peer has read enough.

With a claims directory (a `BatchClaimGate`, design §10) some replies wait for it:
they take their place in an ordered outbox, the claims of one read go to the gate in
one call (one task a read, not one a claim; the directory batches them with the other
callers of the loop turn), and the outbox's ready prefix is applied and written as
soon as it is ready, so replies keep request order. Lines
go on being read and answered meanwhile, until MAX_WAITING_REPLIES wait: then the
connection is read no further until they drain. The gate bounds each wait
(`directory.claim_timeout_s`); the connection keeps no timer of its own per claim.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from collections import deque
from typing import Protocol, cast

from router.control.session import ControlPolicy, ControlSession, Peer
from router.control.waiting import MAX_WAITING_REPLIES, GateAnswer, WaitingReply
from router.core import RouterCore
from router.directory.errors import DirectoryError, DirectoryReplyError, DirectoryUnavailable
from router.directory.gate import BatchClaimGate
from router.protocol import MAX_LINE_BYTES, Reply, decode_line, encode_line, error_reply

__all__ = [
    "CLOSE_DRAIN_S",
    "HELLO_LINE_BYTES",
    "WRITE_BUFFER_HIGH",
    "AcceptingServer",
    "ControlConnection",
    "peer_of",
]

log = logging.getLogger("episode_router.control")

# Stop reading a connection with more than this many unsent reply bytes (design §3).
WRITE_BUFFER_HIGH = 1 << 20
# A connection the router drops gets this long to send its last replies, then it is
# aborted: a close waits for them for ever when the peer does not read.
CLOSE_DRAIN_S = 1.0
# The longest line a connection may send before its hello is accepted (design §3): a
# hello with the longest control secret the config takes (8 KiB, even if JSON escapes
# every byte of it) fits, and a peer that has proved nothing holds a sixteenth of what
# a worker may.
HELLO_LINE_BYTES = 64 << 10


def peer_of(transport: asyncio.BaseTransport) -> Peer:
    """Who is on the other end of `transport`: SO_PEERCRED's uid and pid on a Unix socket."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return Peer(uid=uid, tcp=False, pid=pid)
    return Peer(uid=None, tcp=True)


class AcceptingServer(Protocol):
    """What a control connection needs of the server that accepted it
    (`router.control.server.ControlServer`): the core and the policy its session
    answers with, the clock and the hello deadline, and where it reports."""

    @property
    def core(self) -> RouterCore: ...
    @property
    def policy(self) -> ControlPolicy: ...
    @property
    def hello_deadline_s(self) -> float: ...
    @property
    def claim_gate(self) -> BatchClaimGate | None: ...
    @property
    def waiting_for_hello(self) -> set[ControlConnection]: ...
    def refusal_of_a_new_connection(self) -> str | None: ...
    def clock(self) -> float: ...
    def connection_opened(self, connection: ControlConnection) -> None: ...
    def connection_closed(self, connection: ControlConnection) -> None: ...
    def count_op(self, op: str, result: str) -> None: ...
    def observe(
        self, session: ControlSession, request: dict[str, object], reply: dict[str, object]
    ) -> None: ...


class ControlConnection(asyncio.Protocol):
    """One control connection: splits lines, answers them, applies backpressure."""

    def __init__(self, server: AcceptingServer) -> None:
        self._server = server
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.session: ControlSession | None = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self._abort_timer: asyncio.TimerHandle | None = None
        self._writing_paused = False  # between pause_writing and resume_writing
        # The longest line this connection may send now: HELLO_LINE_BYTES until a hello
        # is accepted (and again after a bye), MAX_LINE_BYTES while it holds a lease.
        self._line_limit = HELLO_LINE_BYTES
        self.closed = asyncio.get_running_loop().create_future()
        # With a gate: replies not written yet because one before them (or they
        # themselves) wait for the directory, in request order; those of the read being
        # answered that ask the gate (asked in one call once it is answered); the gate
        # calls in flight (referenced until done); whether a settle is scheduled; and
        # whether reading stopped because MAX_WAITING_REPLIES wait.
        self._outbox: deque[bytes | WaitingReply] = deque()
        self._asking: list[WaitingReply] = []
        self._gate_calls: set[asyncio.Task[None]] = set()
        self._settle_scheduled = False
        self._outbox_full = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = cast(asyncio.Transport, transport)
        server = self._server
        self.session = ControlSession(
            server.core, server.policy, peer_of(transport), server.claim_gate
        )
        # While more than WRITE_BUFFER_HIGH of replies is unsent, pause_writing stops
        # reading this peer (design §3 backpressure).
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        server.connection_opened(self)
        # Each one waiting may hold a partial line of HELLO_LINE_BYTES for the hello
        # deadline; each one open, a descriptor and a worker's claims.
        if (detail := server.refusal_of_a_new_connection()) is not None:
            self._write_and_close(encode_line(error_reply(None, "too_many_connections", detail)))
            return
        self._arm_hello_deadline()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        self._answer_buffered()

    def _answer_buffered(self) -> None:
        """Answer the complete lines in the buffer, in order, until the unsent replies
        pass WRITE_BUFFER_HIGH; the lines left wait for resume_writing."""
        transport = self.transport
        assert transport is not None
        buffer = self._buffer
        journal = self._server.core.journal
        session = self.session
        assert session is not None
        answer = self._answer_lines if session.gate is None else self._answer_lines_gated
        while not self._writing_paused and not self._outbox_full and not transport.is_closing():
            end = buffer.rfind(b"\n")
            if end < 0:
                if len(buffer) >= self._line_limit:
                    self._refuse_long_line()
                return
            lines = bytes(buffer[: end + 1]).split(b"\n")
            lines.pop()  # the piece after the last newline is empty
            room = WRITE_BUFFER_HIGH - transport.get_write_buffer_size()
            # The journal lines of every request answered here go out in one write,
            # before any of their replies: a claim is acknowledged only once written.
            # With state.path set, that carries more claim+release pairs a second over
            # one pipelined connection (docs/performance.md).
            journal.hold()
            try:
                replies, used, too_long = answer(lines, room)
            finally:
                journal.flush()
            if self._asking:  # even when the connection ends here: they still apply
                self._ask_gate()
            if too_long:
                self._write_and_close(b"".join(replies))
                return
            if used == len(lines):
                del buffer[: end + 1]
            else:
                del buffer[: sum(len(line) + 1 for line in lines[:used])]
            if replies:
                transport.write(b"".join(replies))  # may call pause_writing at once
            if used == len(lines) and len(buffer) >= self._line_limit:
                self._refuse_long_line()
                return
            # Lines left: loop, unless that write paused writing (then resume_writing
            # answers them); the peer read enough if it did not.

    def _answer_lines(self, lines: list[bytes], room: int) -> tuple[list[bytes], int, bool]:
        """The reply lines to the first lines of `lines` (blank ones get none), how
        many lines they answer, and whether a line over the limit ends the connection
        (its reply is then the last one). Stops after the replies pass `room` bytes.

        The hot loop of a pipelining worker: one clock read for all the lines of a
        read (they arrived together), and the claim/release fast path tried first.
        """
        server = self._server
        session = self.session
        assert session is not None
        now = server.clock()
        fast = session.answer_claim_or_release
        count_op = server.count_op
        limit = self._line_limit  # read again only after the general path (a hello, a bye)
        replies: list[bytes] = []
        size = 0
        for used, line in enumerate(lines, 1):
            if len(line) >= limit:  # the newline makes it one over
                replies.append(encode_line(self._long_line_reply()))
                return replies, used, True
            answered = fast(line, now)
            if answered is not None:
                op, result, reply = answered
                count_op(op, result)
            elif line.strip():
                reply = self._answer_now(line, now)
                limit = self._line_limit
            else:
                continue
            replies.append(reply)
            size += len(reply)
            if size > room:  # at least one line is answered: a paused writer resumes
                return replies, used, False
        return replies, len(lines), False

    def _answer_lines_gated(self, lines: list[bytes], room: int) -> tuple[list[bytes], int, bool]:
        """`_answer_lines` with a gate: a reply that waits for the directory, and every
        reply after it, goes to the outbox instead; the waiting claims that ask the
        gate are gathered in `_asking` (the caller asks them in one call). Also stops once
        MAX_WAITING_REPLIES are in the outbox (then reading stops until they drain)."""
        server = self._server
        session = self.session
        assert session is not None
        now = server.clock()
        fast = session.answer_through_gate
        count_op = server.count_op
        outbox = self._outbox
        asking = self._asking
        limit = self._line_limit
        replies: list[bytes] = []
        size = 0
        for used, line in enumerate(lines, 1):
            if len(line) >= limit:
                replies.append(encode_line(self._long_line_reply()))
                return replies, used, True
            answered = fast(line, now)
            reply: bytes | WaitingReply
            if answered is not None:
                op, result, reply = answered
                if result:  # a waiting reply is counted once it is decided
                    count_op(op, result)
            elif line.strip():
                decided = self._answer(line, now)
                reply = decided if isinstance(decided, WaitingReply) else encode_line(decided)
                limit = self._line_limit
            else:
                continue
            if isinstance(reply, WaitingReply):
                if reply.asks:
                    asking.append(reply)
                outbox.append(reply)
            elif outbox:
                outbox.append(reply)  # behind a reply that waits
            else:
                replies.append(reply)
                size += len(reply)
            if len(outbox) >= MAX_WAITING_REPLIES:
                self._outbox_full = True
                assert self.transport is not None
                self.transport.pause_reading()
                return replies, used, False
            if size > room:
                return replies, used, False
        return replies, len(lines), False

    def _ask_gate(self) -> None:
        """Claims the keys the replies in `_asking` wait for through the gate, in one
        call in a task of its own."""
        asking, self._asking = self._asking, []
        call = asyncio.get_running_loop().create_task(self._gate_answer(asking), name="gate-claim")
        self._gate_calls.add(call)
        call.add_done_callback(self._gate_calls.discard)

    async def _gate_answer(self, asking: list[WaitingReply]) -> None:
        session = self.session
        assert session is not None and session.gate is not None
        keys = [pair for waiting in asking for pair in waiting.asks]
        try:
            answers = await session.gate.claim_each(keys, session.worker)
            if len(answers) != len(keys):
                raise DirectoryReplyError(f"{len(keys)} keys asked, {len(answers)} answers")
        except Exception as error:  # a gate that broke its contract: as if unreachable
            log.exception("the claim gate failed")
            failed = DirectoryUnavailable(f"the claim gate failed: {error!r}")
            for waiting in asking:
                waiting.answer = failed
        else:
            at = 0
            for waiting in asking:
                count = len(waiting.asks)
                if count == 1:  # a claim
                    one = answers[at]
                    waiting.answer = one if isinstance(one, DirectoryError) else (one,)
                else:  # a sync: its keys are written, or it is unavailable, together
                    part = answers[at : at + count]
                    failure = next((a for a in part if isinstance(a, DirectoryError)), None)
                    waiting.answer = (
                        failure if failure is not None else cast(GateAnswer, tuple(part))
                    )
                at += count
        if not self._settle_scheduled:
            # Once per loop turn, after every answer of the directory's batch is in: the
            # replies they free go out in one write (and are journaled in one).
            self._settle_scheduled = True
            asyncio.get_running_loop().call_soon(self._settle)

    def _settle(self) -> None:
        """Applies and writes the outbox's ready prefix, in order; reading resumes once
        the waiting replies drained below half the bound. The local table changes even
        when the connection is gone (the worker may have a lease again); nothing is
        written to a closed transport."""
        self._settle_scheduled = False
        session = self.session
        assert session is not None
        server = self._server
        now = server.clock()
        outbox = self._outbox
        written: list[bytes] = []
        journal = server.core.journal
        journal.hold()
        try:
            while outbox:
                head = outbox[0]
                if isinstance(head, WaitingReply):
                    if not head.ready:
                        break
                    op, result, line = session.settle(head, now)
                    server.count_op(op, result)
                    written.append(line)
                else:
                    written.append(head)
                outbox.popleft()
        finally:
            journal.flush()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if written:
            transport.write(b"".join(written))
        if self._outbox_full and len(outbox) <= MAX_WAITING_REPLIES // 2:
            self._outbox_full = False
            self._answer_buffered()  # the lines left unread meanwhile
            if not self._writing_paused and not self._outbox_full and not transport.is_closing():
                transport.resume_reading()

    def eof_received(self) -> bool:
        if self._buffer.strip():
            self._write_and_close(
                encode_line(error_reply(None, "bad_request", "Unterminated line."))
            )
        return False  # close the transport

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self._answer_buffered()  # the lines left from the reads before the pause
        if not self._writing_paused and not self._outbox_full and not transport.is_closing():
            transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.waiting_for_hello.discard(self)
        if self._hello_timer is not None:
            self._hello_timer.cancel()
        if self._abort_timer is not None:
            self._abort_timer.cancel()
        self._server.connection_closed(self)
        if not self.closed.done():
            self.closed.set_result(None)

    def close(self) -> None:
        """Close after the unsent replies, or abort if they do not drain in CLOSE_DRAIN_S."""
        transport = self.transport
        if transport is None:
            return
        transport.close()
        if self._abort_timer is None and transport.get_write_buffer_size():
            loop = asyncio.get_running_loop()
            self._abort_timer = loop.call_later(CLOSE_DRAIN_S, transport.abort)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def _answer_now(self, line: bytes, now: float) -> bytes:
        """The general path without a gate, where every reply is decided at once."""
        reply = self._answer(line, now)
        assert not isinstance(reply, WaitingReply)
        return encode_line(reply)

    def _answer(self, line: bytes, now: float) -> Reply | WaitingReply:
        """The general path: any line, parsed and checked in full."""
        server = self._server
        session = self.session
        assert session is not None
        request = decode_line(line)
        # decode_line returns the error reply itself (it has "ok") for a bad line.
        reply = request if "ok" in request else session.handle(request, now)
        if not isinstance(reply, WaitingReply):  # one that waits is counted once decided
            server.observe(session, request, reply)
        if session.worker is not None and self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
            self._line_limit = MAX_LINE_BYTES
            server.waiting_for_hello.discard(self)
        elif session.worker is None and self._hello_timer is None:
            # A `bye` left the connection with no lease: like a new one, it must say
            # hello again in time, or it is closed (a peer that said bye and went
            # silent would hold a descriptor for ever). When as many as may already
            # wait for a hello, it is closed once its bye is answered, as a new one
            # would be refused (design §3).
            if len(server.waiting_for_hello) >= server.policy.max_connections_before_hello:
                asyncio.get_running_loop().call_soon(self.close)
            else:
                self._arm_hello_deadline()
        return reply

    def _arm_hello_deadline(self) -> None:
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(self._server.hello_deadline_s, self._hello_overdue)
        self._line_limit = HELLO_LINE_BYTES
        self._server.waiting_for_hello.add(self)

    def _long_line_reply(self) -> dict[str, object]:
        if self._line_limit == MAX_LINE_BYTES:
            return error_reply(None, "bad_request", "Line over 1 MiB.")
        return error_reply(None, "bad_request", "Line over 64 KiB before a hello.")

    def _refuse_long_line(self) -> None:
        self._buffer.clear()
        self._write_and_close(encode_line(self._long_line_reply()))

    def _write_and_close(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
            self.close()

    def _hello_overdue(self) -> None:
        self._hello_timer = None
        if self.session is not None and self.session.worker is None:
            log.info("control connection closed: no hello in time")
            self._write_and_close(encode_line(error_reply(None, "no_hello", "No hello in time.")))
