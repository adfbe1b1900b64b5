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
from typing import Any

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
READ_SIZE = 65536


class _Connection:
    """One RESP2 connection: requests answered in order; anything else to `on_message`."""

    def __init__(
        self,
        on_message: Callable[[object], None] | None = None,
        on_item: Callable[[], None] | None = None,
    ) -> None:
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._parser = hiredis.Reader(encoding="utf-8")
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self._on_message = on_message
        self._on_item = on_item
        self.closed = asyncio.Event()

    async def open(self, address: dict[str, Any]) -> None:
        if "path" in address:
            self._reader, self._writer = await asyncio.open_unix_connection(address["path"])
        else:
            self._reader, self._writer = await asyncio.open_connection(
                address.get("host", "127.0.0.1"), address.get("port", 6379)
            )
        if address.get("password"):
            auth = [address["username"]] if address.get("username") else []
            await self.call("AUTH", *auth, address["password"])

    def call(self, *args: str | int) -> asyncio.Future[Any]:
        """Send a command; the future gets its reply (a hiredis.ReplyError for an error)."""
        if self._writer is None or self.closed.is_set():
            raise DirectoryUnavailable("the tracked connection is closed")
        reply: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting.append(reply)
        # hiredis's stub types a one-element tuple where it takes any number of them.
        self._writer.write(hiredis.pack_command(args))  # type: ignore[arg-type]
        return reply

    async def read_until_closed(self) -> None:
        assert self._reader is not None
        try:
            while data := await self._reader.read(READ_SIZE):
                self._parser.feed(data)
                while (item := self._parser.gets()) is not False:
                    self._deliver(item)
                if self._on_item is not None:
                    self._on_item()
        except OSError:
            pass
        finally:
            self.close()

    def send(self, *args: str | int) -> None:
        """Send a command whose reply nobody waits for (it goes to `on_message`)."""
        if self._writer is not None and not self.closed.is_set():
            self._writer.write(hiredis.pack_command(args))  # type: ignore[arg-type]

    def _deliver(self, item: object) -> None:
        if self._on_message is not None and isinstance(item, list) and item[:1] == ["message"]:
            self._on_message(item)  # a published message is never a reply
        elif self._waiting:
            reply = self._waiting.popleft()
            if not reply.done():  # a caller past its deadline cancelled its own
                reply.set_result(item)
        elif self._on_message is not None:
            self._on_message(item)

    def close(self) -> None:
        self.closed.set()
        if self._writer is not None:
            self._writer.close()
        while self._waiting:
            reply = self._waiting.popleft()
            if not reply.done():
                reply.set_exception(DirectoryUnavailable("the tracked connection closed"))


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

    async def lookup(self, keys: Sequence[str], args: Sequence[str | int]) -> object:
        """Run the lookup script on the tracked connection (NOSCRIPT: load, run again)."""
        connection = self._lookups
        if connection is None or not self.connected.is_set():
            raise DirectoryUnavailable("the tracked lookup connection is not up")
        sha = self._scripts.sha(Script.LOOKUP)
        reply = await connection.call("EVALSHA", sha, len(keys), *keys, *args)
        if isinstance(reply, hiredis.ReplyError) and str(reply).startswith("NOSCRIPT"):
            await connection.call("SCRIPT", "LOAD", self._scripts.source(Script.LOOKUP))
            reply = await connection.call("EVALSHA", sha, len(keys), *keys, *args)
        if isinstance(reply, hiredis.ReplyError):
            raise DirectoryUnavailable(f"the lookup failed: {reply}")
        return reply

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
        readers: list[asyncio.Task[None]] = []
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(SETUP_TIMEOUT_S):
                await channel.open(self._address)
                reader = loop.create_task(channel.read_until_closed(), name="directory-channel")
                readers.append(reader)
                channel_id = await channel.call("CLIENT", "ID")
                await channel.call("SUBSCRIBE", INVALIDATE)
                await lookups.open(self._address)
                reader = loop.create_task(lookups.read_until_closed(), name="directory-tracked")
                readers.append(reader)
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
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

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
