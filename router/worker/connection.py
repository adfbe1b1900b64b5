"""One control connection of a worker's client (design §3): its socket and its two tasks.

This module owns the I/O of a single connection to the router: opening it
(`unix:` or `tcp://`, with a timeout), writing request lines, reading reply
lines into the client's `RequestBook`, pinging whenever nothing was sent for a
ping interval, and aborting the connection when the router leaves a request
unanswered too long (a hung router or a half-open connection).

It must never say hello, sync or decide what a reply means (`router.client`
does), never reconnect, and never wait on a peer that does not read: closing
aborts the transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from router.protocol import MAX_LINE_BYTES, ControlAddress, decode_reply
from router.worker.requests import Request, RequestBook

log = logging.getLogger("router.client")  # one logger for the whole client, as before its split

# A connect that takes longer is treated as refused and retried.
CONNECT_TIMEOUT_S = 5.0


class ControlConnection:
    """A connection to the router, from `connect()` until `close()`."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        requests: RequestBook,
        *,
        ping_interval_s: float,
        silence_s: float,
    ) -> None:
        self._writer = writer
        self._requests = requests
        self._ping_interval_s = ping_interval_s
        self._silence_s = silence_s
        self._ended = False
        requests.last_sent = asyncio.get_running_loop().time()
        self._reader_task = asyncio.create_task(
            self._read_replies(reader), name="control-client-reader"
        )
        self._pinger_task = asyncio.create_task(self._ping_while_idle(), name="control-client-ping")

    @classmethod
    async def connect(
        cls,
        address: ControlAddress,
        requests: RequestBook,
        *,
        ping_interval_s: float,
        silence_s: float,
    ) -> ControlConnection:
        """Connect to `address`; raises OSError or TimeoutError when that fails."""
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            if address.scheme == "unix":
                streams = await asyncio.open_unix_connection(address.path, limit=MAX_LINE_BYTES)
            else:
                streams = await asyncio.open_connection(
                    address.host, address.port, limit=MAX_LINE_BYTES
                )
        return cls(*streams, requests, ping_interval_s=ping_interval_s, silence_s=silence_s)

    @property
    def is_open(self) -> bool:
        """True until the reader saw the end or the connection was closed."""
        return not self._ended and not self._writer.is_closing()

    def transmit(self, request: Request) -> None:
        """Write `request` here (see RequestBook.send: parked or failed when not open)."""
        write = self._writer.write if self.is_open else None
        self._requests.send(request, write, asyncio.get_running_loop().time())

    def send_parked(self) -> None:
        """Write the callers' requests that waited for a connection, in call order."""
        if self.is_open:
            self._requests.send_parked(self._writer.write, asyncio.get_running_loop().time())

    async def wait_ended(self) -> None:
        """Returns on EOF, a read error, or the pinger's abort."""
        await self._reader_task

    async def close(self) -> None:
        """Stop both tasks, keep callers' requests for the next connection, and abort."""
        self._ended = True
        for task in (self._reader_task, self._pinger_task):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._requests.connection_lost()
        self._writer.transport.abort()  # never waits on a half-open peer

    async def _read_replies(self, reader: asyncio.StreamReader) -> None:
        """Match each reply line to its request until the connection ends."""
        try:
            while line := await reader.readline():
                reply = decode_reply(line)
                if reply is None:
                    log.warning("ignoring a control line that is not a JSON object")
                    continue
                self._requests.answer(reply)
        # ValueError: a line over the limit; RecursionError: JSON nested past the parser's
        # depth (a broken router): either ends this connection, never the client.
        except (OSError, ValueError, RecursionError) as exc:
            log.warning("control connection read failed: %s", exc)
        finally:
            # Nothing more will be answered here: later writes must not wait on this connection.
            self._ended = True
            self._requests.connection_lost()

    async def _ping_while_idle(self) -> None:
        """Ping when nothing was sent for a ping interval; abort when the router is silent."""
        loop = asyncio.get_running_loop()
        requests = self._requests
        while True:
            now = loop.time()
            waited = now - requests.oldest_unanswered(now)
            if waited > self._silence_s:
                log.warning("the router left a request unanswered for %.1f s", waited)
                self._writer.transport.abort()  # the reader sees the end; the client redials
                return
            due = requests.last_sent + self._ping_interval_s
            if now >= due:
                self.transmit(requests.new({"op": "ping"}, replay=False))
                due = now + self._ping_interval_s  # even if the write failed: never spin
            await asyncio.sleep(due - now)
