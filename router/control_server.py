"""The control socket's I/O: listen, read lines, hand them to `ControlSession`.

Owns the listening socket (Unix, created under umask 0117 so it is mode 0660
from the first instant, or loopback TCP) and one protocol object per
connection. It never decides anything about claims or leases:
`router.control` and `router.core` do.

Each connection is a plain asyncio Protocol rather than a stream task: every
line that arrived in one read is answered in one write (and journaled in one),
claims and releases by `ControlSession`'s fast path, which is what lets a
pipelining worker reach over a hundred thousand claims a second. Lines are
answered only while the unsent replies stay under WRITE_BUFFER_HIGH: the rest
of a read waits, unread, until the peer has read enough.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Callable
from typing import cast

from router.control import (
    MAX_LINE_BYTES,
    ControlPolicy,
    ControlSession,
    Peer,
    decode_line,
    encode,
    error_reply,
)
from router.core import RouterCore
from router.metrics import RouterMetrics
from router.workers import Worker

log = logging.getLogger("episode_router.control")

# Stop reading a connection with more than this many unsent reply bytes (DESIGN §3).
WRITE_BUFFER_HIGH = 1 << 20
CLOSE_WAIT_S = 1.0  # at shutdown, how long connections get to end after their transport closed
# A connection the router drops gets this long to send its last replies, then it is
# aborted: a close waits for them for ever when the peer does not read.
CLOSE_DRAIN_S = 1.0
# A connection must say hello this soon, or it is closed: a peer that never does
# would hold a descriptor for ever. Workers say hello as their first line.
HELLO_DEADLINE_S = 10.0


class ControlSocketInUse(OSError):
    """Another live router listens on the control socket path."""


def bind_unix(path: str) -> socket.socket:
    """A listening Unix socket at `path`, mode 0660 from the start.

    A stale socket file left by a dead router is replaced; a live one is not
    stolen (ControlSocketInUse); a path that is not a socket is an error.
    """
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(path).st_mode
        if not stat.S_ISSOCK(mode):
            raise ControlSocketInUse(f"{path} exists and is not a socket")
        if _socket_is_live(path):
            raise ControlSocketInUse(f"another process listens on {path}")
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o117)  # startup is single-threaded: nothing else sees this umask
    try:
        sock.bind(path)
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old_umask)
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def _socket_is_live(path: str) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            return False
        raise
    finally:
        probe.close()
    return True


def peer_of(transport: asyncio.BaseTransport) -> Peer:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return Peer(uid=uid, tcp=False, pid=pid)
    return Peer(uid=None, tcp=True)


class _Connection(asyncio.Protocol):
    """One control connection: splits lines, answers them, applies backpressure."""

    def __init__(self, server: ControlServer) -> None:
        self._server = server
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.session: ControlSession | None = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self._abort_timer: asyncio.TimerHandle | None = None
        self._writing_paused = False  # between pause_writing and resume_writing
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but behave as one.
        self.transport = cast(asyncio.Transport, transport)
        server = self._server
        self.session = ControlSession(server.core, server.policy, peer_of(transport))
        # While more than WRITE_BUFFER_HIGH of replies is unsent, pause_writing stops
        # reading this peer (DESIGN §3 backpressure).
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        self._arm_hello_deadline()
        server.connections.add(self)

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
        while not self._writing_paused and not transport.is_closing():
            end = buffer.rfind(b"\n")
            if end < 0:
                if len(buffer) >= MAX_LINE_BYTES:
                    self._refuse_long_line()
                return
            lines = bytes(buffer[: end + 1]).split(b"\n")
            lines.pop()  # the piece after the last newline is empty
            room = WRITE_BUFFER_HIGH - transport.get_write_buffer_size()
            # The journal lines of every request answered here go out in one write,
            # before any of their replies: a claim is acknowledged only once written.
            # With state.path set: 49,000 -> 58,000 pairs/s over one pipelined
            # connection (bench.micro's control client, 4 runs each).
            journal.hold()
            try:
                replies, used, too_long = self._answer_lines(lines, room)
            finally:
                journal.flush()
            if too_long:
                self._write_and_close(b"".join(replies))
                return
            if used == len(lines):
                del buffer[: end + 1]
            else:
                del buffer[: sum(len(line) + 1 for line in lines[:used])]
            if replies:
                transport.write(b"".join(replies))  # may call pause_writing at once
            if used == len(lines) and len(buffer) >= MAX_LINE_BYTES:
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
        replies: list[bytes] = []
        size = 0
        for used, line in enumerate(lines, 1):
            if len(line) >= MAX_LINE_BYTES:  # the newline makes it one over
                replies.append(encode(error_reply(None, "bad_request", "Line over 1 MiB.")))
                return replies, used, True
            answered = fast(line, now)
            if answered is not None:
                op, result, reply = answered
                count_op(op, result)
            elif line.strip():
                reply = encode(self._answer(line, now))
            else:
                continue
            replies.append(reply)
            size += len(reply)
            if size > room:  # at least one line is answered: a paused writer resumes
                return replies, used, False
        return replies, len(lines), False

    def eof_received(self) -> bool:
        if self._buffer.strip():
            self._write_and_close(encode(error_reply(None, "bad_request", "Unterminated line.")))
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
        if not self._writing_paused and not transport.is_closing():
            transport.resume_reading()

    def connection_lost(self, exc: Exception | None) -> None:
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

    def _answer(self, line: bytes, now: float) -> dict[str, object]:
        """The general path: any line, parsed and checked in full."""
        server = self._server
        session = self.session
        assert session is not None
        request = decode_line(line)
        # decode_line returns the error reply itself (it has "ok") for a bad line.
        reply = request if "ok" in request else session.handle(request, now)
        server.observe(session, request, reply)
        if session.worker is not None and self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        elif session.worker is None and self._hello_timer is None:
            # A `bye` left the connection with no lease: like a new one, it must say
            # hello again in time, or it is closed (a peer that said bye and went
            # silent would hold a descriptor for ever).
            self._arm_hello_deadline()
        return reply

    def _arm_hello_deadline(self) -> None:
        loop = asyncio.get_running_loop()
        self._hello_timer = loop.call_later(self._server.hello_deadline_s, self._hello_overdue)

    def _refuse_long_line(self) -> None:
        self._buffer.clear()
        self._write_and_close(encode(error_reply(None, "bad_request", "Line over 1 MiB.")))

    def _write_and_close(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)
            self.close()

    def _hello_overdue(self) -> None:
        self._hello_timer = None
        if self.session is not None and self.session.worker is None:
            log.info("control connection closed: no hello in time")
            self._write_and_close(encode(error_reply(None, "no_hello", "No hello in time.")))


class ControlServer:
    """Serves the control protocol for one `RouterCore`."""

    def __init__(
        self,
        core: RouterCore,
        policy: ControlPolicy,
        *,
        on_lease_lost: Callable[[Worker], None],
        metrics: RouterMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        hello_deadline_s: float = HELLO_DEADLINE_S,
    ) -> None:
        self._metrics = metrics
        self.core = core
        self.policy = policy
        self._on_lease_lost = on_lease_lost
        self.clock = clock
        self.hello_deadline_s = hello_deadline_s
        self._server: asyncio.Server | None = None
        self._sock: socket.socket | None = None
        self._unix_path: str | None = None
        self.connections: set[_Connection] = set()
        self._closing = False

    @property
    def connection_count(self) -> int:
        return len(self.connections)

    async def start(self, address: str) -> None:
        """Listen on `unix:/path` or `tcp://host:port` and serve."""
        self.bind(address)
        await self.serve()

    def bind(self, address: str) -> None:
        """Take the address (`unix:/path` or `tcp://host:port`) without serving yet.

        The bound socket is also the router's lock: a second router fails here,
        before it touches anything else the live one uses (its journal).
        Connections wait in the backlog until `serve`.
        """
        if address.startswith("unix:"):
            path = address[len("unix:") :]
            self._sock = bind_unix(path)
            self._unix_path = path  # only once it is ours: close() removes it
        else:
            host, _, port = address[len("tcp://") :].rpartition(":")
            self._sock = socket.create_server((host.strip("[]"), int(port)), backlog=1024)
            self._sock.setblocking(False)

    async def serve(self) -> None:
        assert self._sock is not None, "bind() first"
        loop = asyncio.get_running_loop()
        factory = lambda: _Connection(self)  # noqa: E731 - one Protocol per connection
        if self._unix_path is not None:
            # backlog again: asyncio listens anew with its default of 100 otherwise.
            self._server = await loop.create_unix_server(factory, sock=self._sock, backlog=1024)
        else:
            self._server = await loop.create_server(factory, sock=self._sock, backlog=1024)

    @property
    def tcp_port(self) -> int | None:
        if self._server is None or self._unix_path is not None:
            return None
        return int(self._server.sockets[0].getsockname()[1])

    def close_lease(self, worker: Worker) -> None:
        """Close the connection holding `worker`'s lease (it went silent or exited)."""
        for connection in list(self.connections):
            if connection.session is not None and connection.session is worker.lease:
                connection.close()

    async def close(self) -> None:
        """Stop listening, close every connection, remove the socket file."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()  # bound but never served
        connections = list(self.connections)
        for connection in connections:
            connection.close()
        if connections:
            await asyncio.wait([c.closed for c in connections], timeout=CLOSE_WAIT_S)
            for connection in connections:
                if not connection.closed.done():
                    connection.abort()  # a peer that does not read its last replies
        if self._server is not None:
            await self._server.wait_closed()
        if self._unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)

    def connection_closed(self, connection: _Connection) -> None:
        self.connections.discard(connection)
        if connection.session is None:
            return
        worker = connection.session.closed(self.clock())
        if worker is not None and not self._closing:
            log.info("worker lease lost", extra={"worker": worker.id})
            self._on_lease_lost(worker)

    def observe(
        self, session: ControlSession, request: dict[str, object], reply: dict[str, object]
    ) -> None:
        """Metrics and the log line for one answered request."""
        op = request.get("op") if "ok" not in request else None
        ok = bool(reply.get("ok"))
        if op == "hello" and ok and session.worker is not None:
            worker = session.worker
            log.info("worker live", extra={"worker": worker.id, "url": worker.url})
            self._close_superseded(session, worker)
        if self._metrics is None:
            return
        result = "ok" if ok else str(reply.get("error"))
        self.count_op(op if isinstance(op, str) else "invalid", result)
        if op == "hello" and ok:
            self._metrics.worker_transition("live")

    def _close_superseded(self, session: ControlSession, worker: Worker) -> None:
        """A hello took `worker`'s lease over from another connection (a worker that
        reconnected while its old connection still looked open, a half-open one most
        often). The old one can do nothing more (its lines get no_hello): it is closed,
        not left to hold a descriptor for as long as its peer stays silent."""
        for connection in list(self.connections):
            other = connection.session
            if other is not None and other is not session and other.worker is worker:
                connection.close()

    def count_op(self, op: str, result: str) -> None:
        """Count one answered request in the metrics."""
        if self._metrics is None:
            return
        self._metrics.control_op(op, result)
        if result == "conflict":
            self._metrics.claim_conflict()
