"""The worker side of the control socket (design §3).

This module owns a worker's half of the control protocol: the hello, claims and
releases, a ping whenever the connection is idle, reconnects with the same boot,
and the sync after every hello, the first one included, that declares what this
worker holds (an empty set on a fresh worker): a restarted router restores its
view from it and counts the worker as recovered. It also decides what a refused
hello means: a refusal of the first hello, or one in FINAL_HELLO_REFUSALS,
stops the client; any other (`worker_busy`) fails calls while it stands, and the
client keeps redialling with backoff until a hello is accepted again.

The requests in flight (ids, replies, what a lost connection keeps) and
`ControlError` live in `router.worker.requests`, one connection's socket, reader
and pinger in `router.worker.connection`, the pure line helpers in
`router.worker.lines`, and the boot check for worker apps
(`X-Episode-Router-Boot`, answered 410 by a worker that is not the boot the
router meant) in `router.worker.boot`; the public names are re-exported here, so a
worker imports everything it needs from this module.

It must never make routing decisions, never write a boot value or the shared
secret to a log, and never leave a caller waiting once `stop()` has run or a
hello was refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Callable

from router.protocol import (
    BOOT_HEADER,
    MAX_LINE_BYTES,
    ControlAddress,
    Reply,
    encode_line,
    valid_boot,
    valid_key_prefix,
)

# The ASGI type aliases and SYNC_BATCH_CLAIMS are not in __all__ but were importable
# from this module before the split; the `X as X` form keeps them exported.
from router.worker.boot import ASGIApp as ASGIApp
from router.worker.boot import ASGIBootMiddleware, aiohttp_boot_middleware, boot_mismatch_answer
from router.worker.boot import ASGIMessage as ASGIMessage
from router.worker.boot import ASGIReceive as ASGIReceive
from router.worker.boot import ASGIScope as ASGIScope
from router.worker.boot import ASGISend as ASGISend
from router.worker.connection import ControlConnection
from router.worker.lines import (
    FINAL_HELLO_REFUSALS,
    claims_within_limit,
    hello_message,
    parse_control_address,
    sync_messages,
    sync_refusals,
)
from router.worker.lines import SYNC_BATCH_CLAIMS as SYNC_BATCH_CLAIMS
from router.worker.requests import (
    Claim,
    ConnectionGone,
    ControlError,
    Request,
    RequestBook,
    mark_retrieved,
)

__all__ = [
    "BOOT_HEADER",
    "FINAL_HELLO_REFUSALS",
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

log = logging.getLogger("router.client")  # the name workers configure; kept across moves

# The router declares a peer silent after 5 s without a line (design §3).
MAX_PING_INTERVAL_S = 5.0
# First reconnect delay; doubles up to `reconnect_max_s`.
RECONNECT_START_S = 0.05
# How long `stop()` waits for the router to acknowledge `bye`.
BYE_TIMEOUT_S = 1.0


class ControlClient:
    """A worker's lease on the router: claims, releases and drain over one control connection.

    `start()` connects, says hello and syncs (an empty set on a fresh worker);
    the connection is then kept up by a background task that reconnects with
    backoff, says hello again with the same boot, and syncs every held claim.
    Calls made while disconnected wait and are sent once the connection is back.

    When the router refuses a later hello, the calls waiting for it fail with a
    ControlError carrying the refusal's code. A code in FINAL_HELLO_REFUSALS
    (`forbidden`, `unsupported_version`, `bad_request`) stops the client: every
    later call raises that refusal. Any other (`worker_busy`: another live
    process has this worker id or url) may clear once that process goes: the
    client keeps redialling with backoff, calls raise the refusal until a hello
    is accepted, and then it re-syncs as after any reconnect.
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
        # What the router's last hello reply offered to start minted keys with (design
        # §10, `directory.key_prefix`): its incarnation, so any router of the fleet
        # routes them with no lookup. None: it offered none.
        self.key_prefix: str | None = None
        self.ping_interval_s = ping_interval_s
        self.reconnect_max_s = reconnect_max_s
        self._secret = secret
        # The router answers every request in order, pings included: a request this
        # long without its reply means a hung router or a half-open connection.
        self._silence_s = max(4 * ping_interval_s, 1.0)
        self._held: set[Claim] = set()
        self._draining = False
        self._requests = RequestBook()
        self._connection: ControlConnection | None = None
        self._ready = False
        self._stopping = False
        # What calls raise once stopping: `client_stopped`, or the final refusal that stopped it.
        self._stopped_by = ControlError("client_stopped")
        self._refusal: ControlError | None = None
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

    def mint_key(self) -> str:
        """A new random key (128 bits) for an episode this worker starts, begun with the
        router's key prefix when its hello reply offered one: claim it, then put it in
        the episode's token (`ep`) or session. It fits a token's `ep` (at most 128
        characters) while the router id and its epoch take 94 characters or fewer."""
        return f"{self.key_prefix or ''}{secrets.token_hex(16)}"

    @property
    def held(self) -> frozenset[Claim]:
        """The (kind, key) claims the router has acknowledged and not seen released."""
        return frozenset(self._held)

    @property
    def connected(self) -> bool:
        """True while a connection is up and its hello was acknowledged."""
        return self._ready and self._connection is not None and self._connection.is_open

    @property
    def refusal(self) -> ControlError | None:
        """The router's refusal of the last hello, until a hello is accepted (else None)."""
        return self._refusal

    # --- public operations -------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, say hello and sync; returns once both are acknowledged.

        Retries refused connects forever (until `stop()`). Raises ControlError
        when the router refuses the hello (`forbidden`, `worker_busy`, ...):
        a refusal of the first hello, whatever its code, stops the client.
        """
        if self._task is not None or self._stopping:
            raise RuntimeError("the control client was already started (a stopped one too)")
        self._first_hello = asyncio.get_running_loop().create_future()
        self._first_hello.add_done_callback(mark_retrieved)
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
        """Ask for no new sessions (or, with on=False, for them again); kept across reconnects.

        Raises ControlError when the router did not take it (a refused hello included):
        then the next hello's handshake repeats the state asked before, not this one.
        """
        previous, self._draining = self._draining, on
        try:
            await self._call({"op": "drain", "on": on})
        except ControlError:
            if self._draining is on:  # no later drain() has asked otherwise meanwhile
                self._draining = previous
            raise

    async def stop(self) -> None:
        """Say bye (best effort), close the connection and fail every pending call."""
        self._stopping = True
        if self.connected:
            with contextlib.suppress(ConnectionError, ControlError, TimeoutError):
                async with asyncio.timeout(BYE_TIMEOUT_S):
                    await self._send_internal({"op": "bye"})
        await self._halt()

    # --- requests and replies ----------------------------------------------------------------

    async def _call(self, message: Reply, on_reply: Callable[[Reply], None] | None = None) -> None:
        if self._stopping:
            raise self._stopped_by.again()
        if self._task is None:
            raise ControlError("not_started")
        if self._refusal is not None:  # a refusal that may clear: calls fail while it stands
            raise self._refusal.again()
        if len(encode_line({**message, "id": 2**63})) > MAX_LINE_BYTES:
            # Refused before it is queued: it would also be listed by the next hello's sync.
            raise ControlError("line_too_long")
        request = self._requests.new(message, replay=True, on_reply=on_reply)
        if self.connected:
            self._transmit(request)
        else:
            self._requests.park(request)  # sent once the connection is back
        # Shielded: a caller that gives up does not withdraw an operation the router may
        # already hold; its reply still updates `held`.
        reply = await asyncio.shield(request.future)
        if reply.get("ok") is not True:
            raise ControlError.from_reply(reply)

    async def _send_internal(self, message: Reply) -> Reply:
        request = self._requests.new(message, replay=False)
        self._transmit(request)
        reply = await request.future
        if reply.get("ok") is not True:
            raise ControlError.from_reply(reply)
        return reply

    def _transmit(self, request: Request) -> None:
        """Write `request` on the current connection (see RequestBook.send)."""
        if self._connection is not None:
            self._connection.transmit(request)
        else:
            self._requests.send(request, None, asyncio.get_running_loop().time())

    # --- the connection ----------------------------------------------------------------------

    async def _run(self) -> None:
        """Keep a connection up until stopped: connect, hello, serve, back off, again."""
        delay = RECONNECT_START_S
        failures = 0
        while not self._stopping:
            try:
                connection = await ControlConnection.connect(
                    self.address,
                    self._requests,
                    ping_interval_s=self.ping_interval_s,
                    silence_s=self._silence_s,
                )
            except Exception as exc:
                # Not only OSError: an address the resolver refuses (idna's UnicodeError)
                # ended this task, left start() and every call waiting, and made stop()
                # raise. The first failure of a run is a warning, so a permanent one
                # (a wrong path) is seen; the retries are debug.
                failures += 1
                level = logging.WARNING if failures == 1 else logging.DEBUG
                log.log(level, "control connect to %s failed: %r", self.address.scheme, exc)
            else:
                failures = 0
                if await self._serve(connection):
                    delay = RECONNECT_START_S
            if self._stopping:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.reconnect_max_s)

    async def _serve(self, connection: ControlConnection) -> bool:
        """Run one connection to its end; True when its hello was acknowledged."""
        self._connection = connection
        try:
            if not await self._handshake(connection):
                return False
            await connection.wait_ended()
            log.warning("control connection lost; reconnecting")
            return True
        finally:
            self._ready = False
            self._connection = None
            await connection.close()

    async def _handshake(self, connection: ControlConnection) -> bool:
        """Hello, sync and drain on every connection, the first one too; True once it is ready."""
        try:
            secret = self._secret if self.address.scheme == "tcp" else None
            reply = await self._send_internal(
                hello_message(self.worker_id, self.url, self.boot, secret)
            )
        except ConnectionGone:
            return False
        except ControlError as exc:
            return self._hello_refused(exc)
        if self._refusal is not None:
            log.warning("the router accepts this worker's hello again")
            self._refusal = None
        router_id = reply.get("router")
        new_router = isinstance(router_id, str) and router_id != self.router_id
        if new_router and self.router_id is not None:
            log.warning("the router restarted; re-syncing %d claims", len(self._held))
        self.router_id = router_id if isinstance(router_id, str) else None
        offered = reply.get("key_prefix")
        self.key_prefix = offered if valid_key_prefix(offered) else None
        try:
            # Sync after every hello, the first one too (with what may be an empty
            # set): after a restart, the router counts workers that synced to end
            # its recovery window early.
            await self._resync()
            if self._draining:
                await self._send_internal({"op": "drain", "on": True})
        except (ConnectionGone, ControlError) as exc:
            log.warning("control re-sync failed: %s", exc)
            return False
        if not connection.is_open:  # the connection ended just as the last reply came in
            return False
        self._ready = True
        connection.send_parked()
        if self._first_hello is not None and not self._first_hello.done():
            self._first_hello.set_result(None)
        log.info("control connection up as worker %s", self.worker_id)
        return True

    def _hello_refused(self, exc: ControlError) -> bool:
        """Fail what waits with the refusal; stop for good when it is the first or final."""
        first = self._first_hello is not None and not self._first_hello.done()
        if first or exc.error in FINAL_HELLO_REFUSALS:
            self._stopping = True
            self._stopped_by = exc
        if first:
            assert self._first_hello is not None
            self._first_hello.set_exception(exc.again())  # start() raises it
        elif self._stopping:
            log.error("the router refused this worker's hello for good: %s", exc)
        elif self._refusal is None or self._refusal.error != exc.error:
            log.error("the router refused this worker's hello (retrying): %s", exc)
        self._refusal = exc
        self._requests.fail_all(exc)
        return False

    async def _resync(self) -> None:
        """Declare every claim this worker holds or is claiming; drop the ones refused."""
        claims = self._requests.claims_after_waiting_ops(frozenset(self._held))
        while True:
            try:
                replies = await asyncio.gather(
                    *(self._send_internal(message) for message in sync_messages(claims))
                )
            except ControlError as exc:
                kept = claims_within_limit(claims, exc.reply)
                if kept is None or kept == claims:
                    raise
                # More than the router lets one worker hold (a reload lowered
                # control.max_claims_per_worker): the rest are not ours any more.
                log.error(
                    "sync refused: the router takes at most %d claims; %d dropped",
                    len(kept),
                    len(claims) - len(kept),
                )
                self._held &= kept
                claims = kept
                continue
            refused: set[Claim] = set()
            omitted = 0
            for reply in replies:
                listed, unlisted = sync_refusals(reply)
                for kind, key, error in listed:  # the router no longer counts them as ours
                    self._held.discard((kind, key))
                    refused.add((kind, key))
                    log.warning("sync refused %s %s: %s", kind, key, error)
                omitted += unlisted
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

    async def _halt(self) -> None:
        """Stop the connection task and fail whatever still waits."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                # Whatever ended it, what waits must still be failed below.
                log.exception("the control connection task failed")
        self._requests.fail_all(self._stopped_by)
        if self._first_hello is not None and not self._first_hello.done():
            self._first_hello.set_exception(self._stopped_by.again())
