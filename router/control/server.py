"""The control socket's listening side: bind, serve, close, and the set of connections.

Owns the listening socket (Unix, created under umask 0117 so it is mode 0660
from the first instant, or loopback TCP), the set of open connections and its
bounds (how many may be open, how many may wait for their hello), and what
the router hears of them: a lease lost when one closes, the metrics and log line
of every answered request, the close of a connection whose lease a hello took
over. It never decides anything about claims or leases (`router.control.session` and
`router.core.machine` do) and never reads a connection's lines: `ControlConnection` in
`router.control.connection` does, one per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import time
from collections.abc import Callable

from router.control.connection import ControlConnection
from router.control.session import ControlPolicy, ControlSession
from router.core import RouterCore, Worker
from router.directory.gate import BatchClaimGate
from router.metrics import RouterMetrics

log = logging.getLogger("episode_router.control")

CLOSE_WAIT_S = 1.0  # at shutdown, how long connections get to end after their transport closed
# A connection must say hello this soon, or it is closed: a peer that never does
# would hold a descriptor for ever. Workers say hello as their first line.
HELLO_DEADLINE_S = 10.0
# How often the refusal of a connection over that bound is logged at most.
REFUSAL_LOG_INTERVAL_S = 10.0


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
        claim_gate: BatchClaimGate | None = None,
    ) -> None:
        self._metrics = metrics
        # With a claims directory, claims are acknowledged once it holds them (design §10).
        self.claim_gate = claim_gate
        self.core = core
        self.policy = policy
        self._on_lease_lost = on_lease_lost
        self.clock = clock
        self.hello_deadline_s = hello_deadline_s
        # The open connections that hold no lease and have a hello deadline running.
        self.waiting_for_hello: set[ControlConnection] = set()
        self._refused_unlogged = 0  # refused since the last log line
        self._refusal_logged_at: float | None = None
        self._server: asyncio.Server | None = None
        self._sock: socket.socket | None = None
        self._unix_path: str | None = None
        self.connections: set[ControlConnection] = set()
        self._closing = False

    @property
    def connection_count(self) -> int:
        return len(self.connections)

    def set_policy(self, policy: ControlPolicy) -> None:
        """Who may say hello from now on: on new connections, and on open ones that
        have not said it yet or say it again (a lease already held stays)."""
        self.policy = policy
        for connection in self.connections:
            if connection.session is not None:
                connection.session.policy = policy

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
        factory = lambda: ControlConnection(self)  # noqa: E731 - one Protocol per connection
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

    def connection_opened(self, connection: ControlConnection) -> None:
        self.connections.add(connection)

    def connection_closed(self, connection: ControlConnection) -> None:
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
        if op == "hello" and ok and session.became_live:
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

    def refusal_of_a_new_connection(self) -> str | None:
        """Why a connection just opened (and counted) must be closed at once, or None:
        max_connections are open, or max_connections_before_hello already wait for
        their hello. A refusal is counted, and logged at most every
        REFUSAL_LOG_INTERVAL_S."""
        policy = self.policy
        if len(self.connections) > policy.max_connections:
            detail = "Too many control connections are open (control.max_connections)."
        elif len(self.waiting_for_hello) >= policy.max_connections_before_hello:
            detail = "Too many control connections have not said hello; try again."
        else:
            return None
        self.count_op("hello", "too_many_connections")
        self._refused_unlogged += 1
        now = self.clock()
        logged_at = self._refusal_logged_at
        if logged_at is None or now - logged_at >= REFUSAL_LOG_INTERVAL_S:
            log.warning(
                "control connections refused: %d open, %d wait for their hello",
                len(self.connections) - 1,
                len(self.waiting_for_hello),
                extra={"refused": self._refused_unlogged},
            )
            self._refusal_logged_at = now
            self._refused_unlogged = 0
        return detail

    def count_op(self, op: str, result: str) -> None:
        """Count one answered request in the metrics."""
        if self._metrics is None:
            return
        self._metrics.control_op(op, result)
        if result == "conflict":
            self._metrics.claim_conflict()
