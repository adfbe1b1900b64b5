"""The worker side of the control socket (DESIGN §3).

This module owns a worker's half of the control protocol: the hello, claims and
releases, a ping whenever the connection is idle, reconnects with the same boot,
and the sync after every hello, the first one included, that declares what this
worker holds (an empty set on a fresh worker): a restarted router restores its
view from it and counts the worker as recovered.

The pure line helpers live in `router.client_protocol` and the boot check for
worker apps (`X-Episode-Router-Boot`, answered 410 by a worker that is not the
boot the router meant) in `router.boot`; both are re-exported here, so a worker
imports everything it needs from this module.

It must never make routing decisions, never write a boot value or the shared
secret to a log, and never leave a caller waiting once `stop()` has run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from router.boot import (
    BOOT_HEADER,
    ASGIBootMiddleware,
    aiohttp_boot_middleware,
    boot_mismatch_answer,
    valid_boot,
)

# The ASGI type aliases and SYNC_BATCH_CLAIMS are not in __all__ but were importable
# from this module before the split; the `X as X` form keeps them exported.
from router.boot import ASGIApp as ASGIApp
from router.boot import ASGIMessage as ASGIMessage
from router.boot import ASGIReceive as ASGIReceive
from router.boot import ASGIScope as ASGIScope
from router.boot import ASGISend as ASGISend
from router.client_protocol import (
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    ControlAddress,
    Reply,
    decode_reply,
    encode_line,
    parse_control_address,
    sync_messages,
)
from router.client_protocol import SYNC_BATCH_CLAIMS as SYNC_BATCH_CLAIMS

__all__ = [
    "BOOT_HEADER",
    "ASGIBootMiddleware",
    "ControlAddress",
    "ControlClient",
    "ControlError",
    "aiohttp_boot_middleware",
    "boot_mismatch_answer",
    "encode_line",
    "parse_control_address",
    "sync_messages",
]

log = logging.getLogger(__name__)

# The router declares a peer silent after 5 s without a line (DESIGN §3).
MAX_PING_INTERVAL_S = 5.0
# First reconnect delay; doubles up to `reconnect_max_s`.
RECONNECT_START_S = 0.05
# A connect that takes longer is treated as refused and retried.
CONNECT_TIMEOUT_S = 5.0
# How long `stop()` waits for the router to acknowledge `bye`.
BYE_TIMEOUT_S = 1.0


class ControlError(Exception):
    """An `ok:false` reply from the router; `error` is its code, `reply` the whole reply.

    The client also raises it, with `error` set to `client_stopped`, `not_started`
    or `line_too_long`, for calls it cannot carry out.
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


# --- the client ------------------------------------------------------------------------------


class _Request:
    """One request in flight: its message without an id, and who waits for the reply."""

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
        self.sent_at: float | None = None  # loop time of the write on the current connection


def _count(value: object) -> int:
    """A non-negative count from a reply field (0 when absent or not a count)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return 0


def _mark_retrieved(future: asyncio.Future[Any]) -> None:
    """Marks a future's exception as seen: an abandoned call never logs "never retrieved"."""
    if not future.cancelled():
        future.exception()


class _Lost(ConnectionError):
    """The connection a request was sent on is gone."""


class ControlClient:
    """A worker's lease on the router: claims, releases and drain over one control connection.

    `start()` connects, says hello and syncs (an empty set on a fresh worker);
    the connection is then kept up by a background task that reconnects with
    backoff, says hello again with the same boot, and syncs every held claim.
    Calls made while disconnected wait and are sent once the connection is back.
    """

    def __init__(
        self,
        address: str,
        *,
        worker_id: str,
        url: str,
        boot: str | None = None,
        secret: str | None = None,
        ping_interval_s: float = 2.0,
        reconnect_max_s: float = 2.0,
    ) -> None:
        if not 0 < ping_interval_s < MAX_PING_INTERVAL_S:
            raise ValueError(f"ping_interval_s must be in (0, 5) s, not {ping_interval_s!r}")
        if not reconnect_max_s > 0:
            raise ValueError(f"reconnect_max_s must be positive, not {reconnect_max_s!r}")
        if not worker_id:
            raise ValueError("worker_id must not be empty")
        self.address = parse_control_address(address)
        if self.address.scheme == "tcp" and not secret:
            raise ValueError("a tcp control address needs the shared secret")
        self.worker_id = worker_id
        self.url = url
        if boot is not None and not valid_boot(boot):  # the router would refuse it
            raise ValueError("boot must be 1-128 visible ASCII characters, no spaces")
        self.boot = boot if boot is not None else secrets.token_hex(8)
        self.router_id: str | None = None
        self.ping_interval_s = ping_interval_s
        self.reconnect_max_s = reconnect_max_s
        self._secret = secret
        # The router answers every request in order, pings included: a request this
        # long without its reply means a hung router or a half-open connection.
        self._silence_s = max(4 * ping_interval_s, 1.0)
        self._held: set[tuple[str, str]] = set()
        self._draining = False
        self._pending: dict[int, _Request] = {}
        self._next_id = 0
        self._writer: asyncio.StreamWriter | None = None
        self._ready = False
        self._stopping = False
        self._last_sent = 0.0
        self._task: asyncio.Task[None] | None = None
        self._first_hello: asyncio.Future[None] | None = None

    @classmethod
    def from_env(cls, *, url: str, worker_id: str | None = None) -> ControlClient:
        """A client configured from EPISODE_ROUTER_CONTROL, _WORKER_ID and _SECRET.

        Raises ValueError when the address or the worker id is missing or bad.
        """
        address = os.environ.get("EPISODE_ROUTER_CONTROL")
        if not address:
            raise ValueError("EPISODE_ROUTER_CONTROL is not set")
        worker_id = worker_id or os.environ.get("EPISODE_ROUTER_WORKER_ID")
        if not worker_id:
            raise ValueError("no worker id given and EPISODE_ROUTER_WORKER_ID is not set")
        secret = os.environ.get("EPISODE_ROUTER_SECRET") or None
        return cls(address, worker_id=worker_id, url=url, secret=secret)

    @property
    def held(self) -> frozenset[tuple[str, str]]:
        """The (kind, key) claims the router has acknowledged and not seen released."""
        return frozenset(self._held)

    @property
    def connected(self) -> bool:
        """True while a connection is up and its hello was acknowledged."""
        return self._ready

    # --- public operations -------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, say hello and sync; returns once both are acknowledged.

        Retries refused connects forever (until `stop()`). Raises ControlError
        when the router refuses the hello (`forbidden`, `worker_busy`, ...).
        """
        if self._task is not None:
            raise RuntimeError("the control client was already started")
        self._first_hello = asyncio.get_running_loop().create_future()
        self._first_hello.add_done_callback(_mark_retrieved)
        self._task = asyncio.create_task(self._run(), name=f"control-client:{self.worker_id}")
        try:
            await asyncio.shield(self._first_hello)
        except BaseException:
            await self._halt()
            raise

    async def claim(self, key: str, kind: str = "episode") -> None:
        """Claim `key`; returns once the router holds it. Raises ControlError when refused."""

        def remember(reply: Reply) -> None:
            if reply.get("ok") is True:
                self._held.add((kind, key))

        await self._call({"op": "claim", "key": key, "kind": kind}, remember)

    async def release(self, key: str, kind: str = "episode") -> None:
        """Release `key` and forget it. Raises ControlError (`not_holder`) when refused."""
        self._held.discard((kind, key))
        await self._call(
            {"op": "release", "key": key, "kind": kind},
            lambda _reply: self._held.discard((kind, key)),
        )

    async def drain(self, on: bool = True) -> None:
        """Ask for no new sessions (or, with on=False, for them again); kept across reconnects."""
        self._draining = on
        await self._call({"op": "drain", "on": on})

    async def stop(self) -> None:
        """Say bye (best effort), close the connection and fail every pending call."""
        self._stopping = True
        if self._ready:
            with contextlib.suppress(ConnectionError, ControlError, TimeoutError):
                async with asyncio.timeout(BYE_TIMEOUT_S):
                    await self._send_internal({"op": "bye"})
        await self._halt()

    # --- requests and replies ----------------------------------------------------------------

    async def _call(self, message: Reply, on_reply: Callable[[Reply], None] | None = None) -> None:
        if self._stopping:
            raise ControlError("client_stopped")
        if self._task is None:
            raise ControlError("not_started")
        if len(encode_line({**message, "id": 2**63})) > MAX_LINE_BYTES:
            # Refused before it is queued: it would also be listed by the next hello's sync.
            raise ControlError("line_too_long")
        request = self._new_request(message, replay=True, on_reply=on_reply)
        if self._ready:
            self._transmit(request)
        else:
            self._pending[self._take_id()] = request  # sent once the connection is back
        # Shielded: a caller that gives up does not withdraw an operation the router may
        # already hold; its reply still updates `held`.
        reply = await asyncio.shield(request.future)
        if reply.get("ok") is not True:
            raise ControlError.from_reply(reply)

    async def _send_internal(self, message: Reply) -> Reply:
        request = self._new_request(message, replay=False)
        self._transmit(request)
        reply = await request.future
        if reply.get("ok") is not True:
            raise ControlError.from_reply(reply)
        return reply

    def _new_request(
        self, message: Reply, *, replay: bool, on_reply: Callable[[Reply], None] | None = None
    ) -> _Request:
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_mark_retrieved)
        return _Request(message, future, replay=replay, on_reply=on_reply)

    def _take_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _transmit(self, request: _Request) -> None:
        """Give `request` a fresh id and write it on the current connection."""
        request_id = self._take_id()
        line = encode_line({**request.message, "id": request_id})
        if len(line) > MAX_LINE_BYTES:
            # The router would close the connection, and the resend would loop forever.
            request.future.set_exception(ControlError("line_too_long"))
            return
        self._pending[request_id] = request
        if self._writer is None or self._writer.is_closing():
            if not request.replay:
                self._pending.pop(request_id)
                request.future.set_exception(_Lost("the control connection is down"))
            return
        self._writer.write(line)
        self._last_sent = request.sent_at = asyncio.get_running_loop().time()

    def _on_reply(self, reply: Reply) -> None:
        request_id = reply.get("id")
        if request_id is None:
            log.warning("the router could not parse a control line: %s", reply.get("error"))
            return
        request = None
        if isinstance(request_id, int) and not isinstance(request_id, bool):
            request = self._pending.pop(request_id, None)
        if request is None:
            log.debug("control reply for no pending request: %r", request_id)
            return
        if request.on_reply is not None:
            request.on_reply(reply)
        if not request.future.done():
            request.future.set_result(reply)

    def _connection_lost(self) -> None:
        """Fail the client's own requests; callers' requests wait for the next connection."""
        for request_id, request in list(self._pending.items()):
            request.sent_at = None
            if not request.replay:
                del self._pending[request_id]
                if not request.future.done():
                    request.future.set_exception(_Lost("the control connection closed"))

    def _fail_all(self, error: ControlError) -> None:
        for request in self._pending.values():
            if not request.future.done():
                request.future.set_exception(ControlError(error.error, error.reply))
        self._pending.clear()

    # --- the connection ----------------------------------------------------------------------

    async def _run(self) -> None:
        """Keep a connection up until stopped: connect, hello, serve, back off, again."""
        delay = RECONNECT_START_S
        while not self._stopping:
            try:
                reader, writer = await self._connect()
            except (OSError, TimeoutError) as exc:
                log.debug("control connect to %s failed: %s", self.address.scheme, exc)
            else:
                if await self._serve_connection(reader, writer):
                    delay = RECONNECT_START_S
            if self._stopping:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.reconnect_max_s)

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        address = self.address
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            if address.scheme == "unix":
                return await asyncio.open_unix_connection(address.path, limit=MAX_LINE_BYTES)
            return await asyncio.open_connection(address.host, address.port, limit=MAX_LINE_BYTES)

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Run one connection to its end; True when its hello was acknowledged."""
        self._writer = writer
        self._last_sent = asyncio.get_running_loop().time()
        reader_task = asyncio.create_task(self._read_replies(reader), name="control-client-reader")
        pinger_task = asyncio.create_task(self._ping_while_idle(writer), name="control-client-ping")
        try:
            if not await self._handshake():
                return False
            await reader_task  # ends on EOF, a read error, or the pinger's abort
            log.warning("control connection lost; reconnecting")
            return True
        finally:
            self._ready = False
            self._writer = None
            for task in (reader_task, pinger_task):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self._connection_lost()
            writer.transport.abort()  # never waits on a half-open peer

    async def _handshake(self) -> bool:
        """Hello, sync and drain on every connection, the first one too; True once it is ready."""
        try:
            reply = await self._send_internal(self._hello_message())
        except _Lost:
            return False
        except ControlError as exc:
            return self._hello_refused(exc)
        router_id = reply.get("router")
        new_router = isinstance(router_id, str) and router_id != self.router_id
        if new_router and self.router_id is not None:
            log.warning("the router restarted; re-syncing %d claims", len(self._held))
        self.router_id = router_id if isinstance(router_id, str) else None
        try:
            # Sync after every hello, the first one too (with what may be an empty
            # set): after a restart, the router counts workers that synced to end
            # its recovery window early.
            await self._resync()
            if self._draining:
                await self._send_internal({"op": "drain", "on": True})
        except (_Lost, ControlError) as exc:
            log.warning("control re-sync failed: %s", exc)
            return False
        if self._writer is None:  # the connection ended just as the last reply came in
            return False
        self._ready = True
        for request_id in sorted(self._pending):  # what waited for the connection, in order
            self._transmit(self._pending.pop(request_id))
        if self._first_hello is not None and not self._first_hello.done():
            self._first_hello.set_result(None)
        log.info("control connection up as worker %s", self.worker_id)
        return True

    def _hello_message(self) -> Reply:
        message: Reply = {
            "op": "hello",
            "v": PROTOCOL_VERSION,
            "worker": self.worker_id,
            "url": self.url,
            "boot": self.boot,
        }
        if self.address.scheme == "tcp" and self._secret:
            message["auth"] = self._secret
        return message

    def _hello_refused(self, exc: ControlError) -> bool:
        if self._first_hello is not None and not self._first_hello.done():
            self._stopping = True  # the first refusal is final: start() raises it
            self._first_hello.set_exception(exc)
        else:
            log.error("the router refused this worker's hello: %s", exc)
        return False

    async def _resync(self) -> None:
        """Declare every claim this worker holds or is claiming; drop the ones refused."""
        claims = set(self._held)
        for request_id in sorted(self._pending):  # operations still waiting, in call order
            message = self._pending[request_id].message
            pair = (str(message.get("kind")), str(message.get("key")))
            if message["op"] == "claim":
                claims.add(pair)
            elif message["op"] == "release":
                claims.discard(pair)
        while True:
            replies = await asyncio.gather(
                *(self._send_internal(message) for message in sync_messages(claims))
            )
            refused: set[tuple[str, str]] = set()
            omitted = 0
            for reply in replies:
                refused |= self._drop_refused(reply.get("refused"))
                omitted += _count(reply.get("refused_omitted"))
            if not omitted:
                return
            if not refused & claims:
                log.warning("sync: %d refusals were not listed and none were", omitted)
                return
            # The router lists only the refusals that fit in one reply line. Declaring the
            # set again without the ones it named makes it name the next ones; each round
            # is smaller, so this ends.
            log.warning("sync: %d refusals not listed; syncing again to learn them", omitted)
            claims -= refused

    def _drop_refused(self, refused: object) -> set[tuple[str, str]]:
        """Forget the claims a sync reply refused; returns them."""
        dropped: set[tuple[str, str]] = set()
        if not isinstance(refused, list):
            return dropped
        for item in refused:
            if isinstance(item, dict):
                pair = (str(item.get("kind", "episode")), str(item.get("key")))
                self._held.discard(pair)
                dropped.add(pair)
                log.warning("sync refused %s %s: %s", pair[0], pair[1], item.get("error"))
        return dropped

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        """Match each reply line to its request until the connection ends."""
        try:
            while line := await reader.readline():
                reply = decode_reply(line)
                if reply is None:
                    log.warning("ignoring a control line that is not a JSON object")
                    continue
                self._on_reply(reply)
        except (OSError, ValueError) as exc:  # ValueError: a line over the limit
            log.warning("control connection read failed: %s", exc)
        finally:
            # Nothing more will be answered here: later writes must not wait on this connection.
            self._ready = False
            self._writer = None
            self._connection_lost()

    async def _ping_while_idle(self, writer: asyncio.StreamWriter) -> None:
        """Ping when nothing was sent for `ping_interval_s`; drop the connection when silent."""
        loop = asyncio.get_running_loop()
        while True:
            now = loop.time()
            waited = now - self._oldest_unanswered(now)
            if waited > self._silence_s:
                log.warning("the router left a request unanswered for %.1f s", waited)
                writer.transport.abort()  # the reader sees the end and the connection is redone
                return
            due = self._last_sent + self.ping_interval_s
            if now >= due:
                self._transmit(self._new_request({"op": "ping"}, replay=False))
                due = now + self.ping_interval_s  # even if the write failed: never spin
            await asyncio.sleep(due - now)

    def _oldest_unanswered(self, now: float) -> float:
        """When the oldest request still waiting for its reply was written (`now` if none)."""
        sent = (r.sent_at for r in self._pending.values() if r.sent_at is not None)
        return min(sent, default=now)

    async def _halt(self) -> None:
        """Stop the connection task and fail whatever still waits."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._fail_all(ControlError("client_stopped"))
        if self._first_hello is not None and not self._first_hello.done():
            self._first_hello.set_exception(ControlError("client_stopped"))
