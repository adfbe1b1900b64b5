"""The control socket's I/O: listen, read lines, hand them to `ControlSession`.

Owns the listening socket (Unix, created under umask 0117 so it is mode 0660
from the first instant, or loopback TCP) and one task per connection. It never
decides anything about claims or leases: `router.control` and `router.core`
do.
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


def peer_of(writer: asyncio.StreamWriter) -> Peer:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", creds)
        return Peer(uid=uid, tcp=False, pid=pid)
    return Peer(uid=None, tcp=True)


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
    ) -> None:
        self._metrics = metrics
        self.core = core
        self.policy = policy
        self._on_lease_lost = on_lease_lost
        self._clock = clock
        self._server: asyncio.Server | None = None
        self._sock: socket.socket | None = None
        self._unix_path: str | None = None
        self._connections: dict[ControlSession, asyncio.Task[None]] = {}
        self._writers: dict[ControlSession, asyncio.StreamWriter] = {}
        self._closing = False

    @property
    def connection_count(self) -> int:
        return len(self._connections)

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
        # readuntil accepts a separator found at index == limit: a limit of one less
        # than the maximum line (newline included) keeps lines at 1 MiB at most.
        limit = MAX_LINE_BYTES - 1
        if self._unix_path is not None:
            self._server = await asyncio.start_unix_server(
                self._serve, sock=self._sock, limit=limit
            )
        else:
            self._server = await asyncio.start_server(self._serve, sock=self._sock, limit=limit)

    @property
    def tcp_port(self) -> int | None:
        if self._server is None or self._unix_path is not None:
            return None
        return int(self._server.sockets[0].getsockname()[1])

    def close_lease(self, worker: Worker) -> None:
        """Close the connection holding `worker`'s lease (it went silent or exited)."""
        session = worker.lease
        if isinstance(session, ControlSession):
            writer = self._writers.get(session)
            if writer is not None:
                writer.close()

    async def close(self) -> None:
        """Stop listening, close every connection, remove the socket file."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()  # bound but never served
        for writer in list(self._writers.values()):
            writer.close()
        # Closed transports end each connection's read loop on its own; cancel
        # only what is stuck (a cancelled handler task is logged by asyncio).
        tasks = list(self._connections.values())
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        if self._unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._unix_path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = ControlSession(self.core, self.policy, peer_of(writer))
        task = asyncio.current_task()
        assert task is not None
        self._connections[session] = task
        self._writers[session] = writer
        writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
        try:
            await self._read_lines(session, reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            del self._connections[session]
            del self._writers[session]
            worker = session.closed(self._clock())
            writer.close()
            if worker is not None and not self._closing:
                log.info("worker lease lost", extra={"worker": worker.id})
                self._on_lease_lost(worker)

    def _count(self, request: dict[str, object], reply: dict[str, object]) -> None:
        assert self._metrics is not None
        op = request.get("op") if "ok" not in request else None
        result = "ok" if reply.get("ok") else str(reply.get("error"))
        self._metrics.control_op(op if isinstance(op, str) else "invalid", result)
        if result == "conflict":
            self._metrics.claim_conflict()
        if op == "hello" and result == "ok":
            self._metrics.worker_transition("live")

    async def _read_lines(
        self, session: ControlSession, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        while True:
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError:
                writer.write(encode(error_reply(None, "bad_request", "Line over 1 MiB.")))
                return
            except asyncio.IncompleteReadError as eof:
                if eof.partial.strip():
                    writer.write(encode(error_reply(None, "bad_request", "Unterminated line.")))
                return
            if not line.strip():
                continue
            request = decode_line(line)
            # decode_line returns the error reply itself (it has "ok") for a bad line.
            reply = request if "ok" in request else session.handle(request, self._clock())
            if self._metrics is not None:
                self._count(request, reply)
            if request.get("op") == "hello" and reply.get("ok") and session.worker is not None:
                worker = session.worker
                log.info("worker live", extra={"worker": worker.id, "url": worker.url})
            writer.write(encode(reply))
            # drain() only waits while more than WRITE_BUFFER_HIGH is unsent: that is
            # the backpressure of DESIGN §3, and it costs nothing otherwise.
            await writer.drain()
