"""Lookups on a tracked connection, and the channel Redis invalidates them on (RESP2
client tracking with REDIRECT), so the lookup cache is on only while both are live.

Two connections of our own, each read all the time by a named task: the channel,
subscribed to `__redis__:invalidate`, and the lookup connection, whose reads Redis
tracks (`CLIENT TRACKING ON REDIRECT <channel id>`; keys read inside scripts are
tracked too). redis-py's pooled connections are read only while a command waits, so
a connection Redis closed (with its tracking) would go unnoticed while cached answers
were served; these two are watched, and the cache goes off the moment either closes.
They speak RESP2 through hiredis (`pack_command`, `Reader`): replies in request order,
and on the channel, messages. Standalone Redis only (URL or Unix socket): under
Sentinel the cache stays off and lookups use the pooled client.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, cast

import hiredis
from redis.asyncio.connection import parse_url

from router.directory.cache import LookupCache
from router.directory.connect import redis_url
from router.directory.errors import DirectoryUnavailable
from router.directory.scripts import Script, ScriptRunner

log = logging.getLogger("episode_router.directory")

INVALIDATE = "__redis__:invalidate"
RETRY_S = 0.5  # after a lost connection: soon, and never a busy loop against a down Redis
PING_S = 0.1  # a pong every 100 ms keeps the cache's silence bound (cache.py) met
# 2 s, as claim_timeout_s: connecting, subscribing and turning tracking on take a few
# round trips; past that the Redis (or the link) is not answering: try again later.
SETUP_TIMEOUT_S = 2.0
# 5 s without a pong: the connections are given up and made again (a link cut without a
# close would otherwise hold them, silent, until TCP gives up, which takes minutes).
RECONNECT_AFTER_S = 5.0


# What waits for a reply on a connection: a future, or a callback the reply (or the
# DirectoryUnavailable of a closed connection) is handed to as it is read.
_Waiter = asyncio.Future[Any] | Callable[[object], None]


class _Connection(asyncio.Protocol):
    """One RESP2 connection: requests answered in order; anything else to `on_message`.

    A protocol, not a stream pair: a reply is parsed and handed over in the loop
    callback that read it. A first ask's lookup (design §10) waits on one round trip;
    a reader task behind a StreamReader, with the batch's own task (batcher.py), cost
    a serial first ask three loop turns and 28 µs of CPU (docs/performance.md)."""

    def __init__(
        self,
        on_message: Callable[[object], None] | None = None,
        on_item: Callable[[], None] | None = None,
    ) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = hiredis.Reader(encoding="utf-8")
        self._waiting: deque[_Waiter] = deque()
        self._on_message = on_message
        self._on_item = on_item
        self.closed = asyncio.Event()

    async def open(self, address: dict[str, Any]) -> None:
        loop = asyncio.get_running_loop()
        if "path" in address:
            await loop.create_unix_connection(lambda: self, address["path"])
        else:
            host, port = address.get("host", "127.0.0.1"), address.get("port", 6379)
            await loop.create_connection(lambda: self, host, port)
        if address.get("password"):
            auth = [address["username"]] if address.get("username") else []
            await self.call("AUTH", *auth, address["password"])

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport (uvloop's is not registered as an asyncio.Transport).
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed(data)
            while (item := self._parser.gets()) is not False:
                self._deliver(item)
        except hiredis.ProtocolError as error:
            log.warning("the directory sent what is not RESP: %s", error)
            self.close()
            return
        if self._on_item is not None:
            self._on_item()

    def eof_received(self) -> bool:
        self.close()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.close()

    def call(self, *args: str | int) -> asyncio.Future[Any]:
        """Send a command; the future gets its reply (a hiredis.ReplyError for an error)."""
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self.call_then(reply, *args)
        return reply

    def call_then(self, waiter: _Waiter, *args: str | int) -> None:
        """Send a command; `waiter` gets its reply (a future its result, a callback the
        reply itself). Raises DirectoryUnavailable if the connection is closed."""
        transport = self._transport
        if transport is None or self.closed.is_set():
            raise DirectoryUnavailable("the tracked connection is closed")
        self._waiting.append(waiter)
        # hiredis's stub types a one-element tuple where it takes any number of them.
        transport.write(hiredis.pack_command(args))  # type: ignore[arg-type]

    def send(self, *args: str | int) -> None:
        """Send a command whose reply nobody waits for (it goes to `on_message`)."""
        if self._transport is not None and not self.closed.is_set():
            self._transport.write(hiredis.pack_command(args))  # type: ignore[arg-type]

    def _deliver(self, item: object) -> None:
        if self._on_message is not None and isinstance(item, list) and item[:1] == ["message"]:
            self._on_message(item)  # a published message is never a reply
        elif self._waiting:
            _hand(self._waiting.popleft(), item)
        elif self._on_message is not None:
            self._on_message(item)

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        if self._transport is not None:
            self._transport.close()
        while self._waiting:
            _hand(self._waiting.popleft(), DirectoryUnavailable("the tracked connection closed"))


def _hand(waiter: _Waiter, item: object) -> None:
    if isinstance(waiter, asyncio.Future):
        if not waiter.done():  # a caller past its deadline cancelled its own
            if isinstance(item, DirectoryUnavailable):
                waiter.set_exception(item)
            else:
                waiter.set_result(item)
    else:
        waiter(item)


class TrackedLookups:
    """The lookup script on a tracked connection, with the cache it keeps valid."""

    def __init__(
        self,
        address: str,
        cache: LookupCache,
        scripts: ScriptRunner,
        reconnect_after_s: float = RECONNECT_AFTER_S,
    ) -> None:
        self._address: dict[str, Any] = dict(parse_url(redis_url(address)))
        self.cache = cache
        self._scripts = scripts
        self._reconnect_after_s = reconnect_after_s
        self._heard_at = 0.0
        self.sessions = 0  # times both connections were set up, tracking on
        self._lookups: _Connection | None = None
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()  # both connections up, tracking on

    def start(self) -> None:
        if self._task is None:
            task = asyncio.get_running_loop().create_task(self._run(), name="directory-tracking")
            self._task = task

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def lookup_then(
        self, keys: Sequence[str], args: Sequence[str | int], then: Callable[[object], None]
    ) -> None:
        """Run the lookup script on the tracked connection; `then` gets its reply, or a
        DirectoryUnavailable (NOSCRIPT: the script is loaded and run again first).
        Raises DirectoryUnavailable if the connection is not up."""
        connection = self._lookups
        if connection is None or not self.connected.is_set():
            raise DirectoryUnavailable("the tracked lookup connection is not up")
        command = ("EVALSHA", self._scripts.sha(Script.LOOKUP), len(keys), *keys, *args)
        source = self._scripts.source(Script.LOOKUP)
        connection.call_then(_LookupReply(connection, command, source, then), *command)

    async def _run(self) -> None:
        while True:
            try:
                await self._connect_and_watch()
            except (OSError, TimeoutError, DirectoryUnavailable) as error:
                log.warning("directory tracking lost, lookups not cached: %s", error)
            finally:
                self._went_down()
            await asyncio.sleep(RETRY_S)

    async def _connect_and_watch(self) -> None:
        channel = _Connection(self._on_channel_message, self._heard)
        lookups = _Connection()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(SETUP_TIMEOUT_S):
                await channel.open(self._address)
                channel_id = await channel.call("CLIENT", "ID")
                await channel.call("SUBSCRIBE", INVALIDATE)
                await lookups.open(self._address)
                on = await lookups.call("CLIENT", "TRACKING", "ON", "REDIRECT", channel_id)
            if isinstance(on, hiredis.ReplyError):
                raise DirectoryUnavailable(f"client tracking refused: {on}")
            self._heard_at = time.monotonic()
            self.sessions += 1
            self._lookups = lookups
            self.cache.switch_on()
            self.connected.set()
            closed: list[asyncio.Future[Any]] = [
                loop.create_task(c.closed.wait(), name="directory-tracking-closed")
                for c in (channel, lookups)
            ]
            closed.append(loop.create_task(self._ping(channel), name="directory-channel-ping"))
            try:
                await asyncio.wait(closed, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in closed:
                    waiter.cancel()
        finally:
            channel.close()
            lookups.close()

    async def _ping(self, channel: _Connection) -> None:
        """PING the channel every PING_S (a subscribed connection answers it); give the
        connections up after `reconnect_after_s` without a word (on time.monotonic, the
        cache's clock)."""
        while not channel.closed.is_set():
            if time.monotonic() - self._heard_at > self._reconnect_after_s:
                log.warning("the directory's invalidation channel is silent: reconnecting")
                return
            channel.send("PING")  # the pong is read, and heard, by the channel's reader
            await asyncio.sleep(PING_S)

    def _heard(self) -> None:
        self._heard_at = time.monotonic()
        self.cache.heard(self._heard_at)

    def _went_down(self) -> None:
        self.connected.clear()
        self._lookups = None
        self.cache.switch_off()

    def _on_channel_message(self, message: object) -> None:
        # ['message', '__redis__:invalidate', [keys] or None (a flush)]
        if isinstance(message, list) and len(message) == 3 and message[0] == "message":
            keys = message[2]
            self.cache.invalidate(keys if isinstance(keys, list) else None)


class _LookupReply:
    """The callback a tracked lookup's reply is handed to: a NOSCRIPT (a Redis that
    restarted, or flushed its scripts) loads the script and runs the lookup once more;
    an error reply is a DirectoryUnavailable; anything else goes to `then` as it is."""

    __slots__ = ("_command", "_connection", "_retried", "_source", "_then")

    def __init__(
        self,
        connection: _Connection,
        command: tuple[str | int, ...],
        source: str,
        then: Callable[[object], None],
    ) -> None:
        self._connection = connection
        self._command = command
        self._source = source
        self._then = then
        self._retried = False

    def __call__(self, reply: object) -> None:
        if isinstance(reply, hiredis.ReplyError):
            if str(reply).startswith("NOSCRIPT") and not self._retried:
                self._retried = True
                try:
                    self._connection.call_then(_ignore, "SCRIPT", "LOAD", self._source)
                    self._connection.call_then(self, *self._command)
                except DirectoryUnavailable as error:
                    self._then(error)
                return
            reply = DirectoryUnavailable(f"the lookup failed: {reply}")
        self._then(reply)


def _ignore(reply: object) -> None:
    """A reply nobody needs (a SCRIPT LOAD's: the EVALSHA after it says if it took)."""
