"""A client's request as the public edge parsed it: its head, and its body as it streams.

This module owns what a handler sees of one request: the method, the target exactly as
the client wrote it, the version, the headers (a case-insensitive multidict, values
decoded as UTF-8 with surrogate escapes so the bytes can be given back exactly), the
client's address, and `RequestBody`, the body as the connection feeds it, with flow
control: past a high-water mark the connection stops reading until the body is taken.
It never reads a socket itself and never writes one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Final, Protocol

from multidict import CIMultiDict

from router.core import Answer

__all__ = [
    "DETACHED_CLIENT",
    "BodyBroken",
    "BodySource",
    "DetachedClient",
    "PublicRequest",
    "RequestBody",
    "RequestClient",
]

# A body holds at most this much unread before its connection stops reading: a client
# uploading faster than the worker takes it waits in its own socket buffer, not in ours.
BODY_HIGH_WATER: Final = 256 * 1024
# The names `PublicRequest.getall` is asked for (the router's own: the session headers,
# Transfer-Encoding), encoded once each as asked and lower-cased; bounded all the same.
_WANTED_NAMES: Final[dict[str, tuple[bytes, bytes]]] = {}
_MAX_WANTED_NAMES: Final = 256


class BodyBroken(Exception):
    """The request body cannot be had: malformed framing, the client left mid-body, or
    it went silent mid-body.

    A malformed body gets 400; a silent client, 408 (`timed_out`); a departed one, nothing.
    """

    def __init__(self, reason: str, *, malformed: bool, timed_out: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.malformed = malformed
        self.timed_out = timed_out


class BodySource(Protocol):
    """The connection a body comes from, as the body sees it (flow control)."""

    def body_backlogged(self) -> None:
        """The body holds more than the high-water mark: stop reading."""

    def body_drained(self) -> None:
        """The body was taken: read again."""


class RequestBody:
    """The bytes of one request body, fed by its connection, taken by one reader."""

    __slots__ = (
        "_broken",
        "_buffered",
        "_chunks",
        "_high_water",
        "_loop",
        "_source",
        "_throttled",
        "_waiter",
        "complete",
        "received",
    )

    def __init__(self, source: BodySource, loop: asyncio.AbstractEventLoop) -> None:
        self._source = source
        self._loop = loop
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._broken: BodyBroken | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._throttled = False
        self._high_water = BODY_HIGH_WATER  # raised while `gather` waits for the body
        self.complete = False  # every byte of the body has been fed
        self.received = 0  # bytes fed so far

    @property
    def broken(self) -> BodyBroken | None:
        return self._broken

    def feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        self.received += len(data)
        if self._buffered > self._high_water and not self._throttled:
            self._throttled = True
            self._source.body_backlogged()
        self._wake()

    def feed_eof(self) -> None:
        self.complete = True
        self._wake()

    def fail(self, reason: str, *, malformed: bool, timed_out: bool = False) -> None:
        """The body will not complete; a reader waiting (or to come) gets BodyBroken."""
        if self.complete or self._broken is not None:
            return
        self._broken = BodyBroken(reason, malformed=malformed, timed_out=timed_out)
        self._wake()

    def take(self) -> bytes:
        """Every byte fed and not yet taken (b"" when none), without waiting."""
        chunks = self._chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._chunks = []
        self._buffered = 0
        if self._throttled:
            self._throttled = False
            self._source.body_drained()
        return data

    async def gather(self, limit: int) -> bool:
        """Waits, taking nothing, until the whole body is here (True) or more than `limit`
        bytes of it are held (False): meanwhile the connection reads on up to `limit`
        (the high-water mark is raised to it), so a body is buffered before anything is
        sent on. Raises BodyBroken when it will not complete."""
        self._high_water = max(limit, BODY_HIGH_WATER)
        if self._throttled and self._buffered <= self._high_water:
            self._throttled = False
            self._source.body_drained()
        try:
            while not self.complete:
                broken = self._broken
                if broken is not None:
                    # A new exception, as in `readany`: the one kept would keep the
                    # traceback, whose frames keep this body (a cycle).
                    raise BodyBroken(
                        broken.reason, malformed=broken.malformed, timed_out=broken.timed_out
                    )
                if self._buffered > limit:
                    return False
                self._waiter = self._loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            return True
        finally:
            self._high_water = BODY_HIGH_WATER

    async def readany(self) -> bytes:
        """What has arrived and was not taken yet, waiting for some if none has; b"" at
        the end of the body. Raises BodyBroken when it will not complete."""
        while not self._chunks:
            if self.complete:
                return b""
            broken = self._broken
            if broken is not None:
                # A new exception each time: the one kept, raised, would keep the
                # traceback, whose frames keep this body (a cycle, freed only by the
                # collector).
                raise BodyBroken(
                    broken.reason, malformed=broken.malformed, timed_out=broken.timed_out
                )
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.take()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def detach(self, source: BodySource) -> None:
        """Its connection closed: `source` stands in for it (router.edge.server), and the
        bytes held and the failure kept are dropped, so a body kept in a reference cycle
        holds none of them until the collector runs."""
        self._source = source
        self._chunks = []
        self._buffered = 0
        self._broken = None


class ClientLost:
    """What a request's `on_client_lost` holds: told once (`client_lost()`) if the client
    connection closes while the request is handled. An object, not a callable: the
    compiled build calls it directly, and no bound method is made per request."""

    __slots__ = ()

    def client_lost(self) -> None:
        """The client connection closed."""
        raise NotImplementedError


class RequestClient(asyncio.Protocol):
    """The connection a request came on, as its handler sees it: the replies it writes for
    the request at the head of its queue, and what it is told of the handler's progress.

    `router.edge.serving.ServingConnection` implements it (each method's contract is
    said there). A base class of the connection's layers rather than a Protocol, so that
    a request names its connection without importing the layers above it and the
    compiled build still calls these methods directly.
    """

    __slots__ = ()

    def answer(self, request: PublicRequest, answer: Answer) -> None:
        raise NotImplementedError

    def reply_whole(
        self,
        request: PublicRequest,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        raise NotImplementedError

    def reply_as_is(
        self,
        request: PublicRequest,
        status: int,
        whole: bytes,
        body_length: int | None,
        has_date: bool,
    ) -> bool:
        raise NotImplementedError

    def reply_start(
        self,
        request: PublicRequest,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        first: bytes,
    ) -> None:
        raise NotImplementedError

    def reply_write(self, data: bytes) -> None:
        raise NotImplementedError

    def reply_end(self) -> None:
        raise NotImplementedError

    def reply_abort(self, idle_s: float) -> None:
        raise NotImplementedError

    async def drain(self) -> None:
        raise NotImplementedError

    def send_continue(self) -> None:
        raise NotImplementedError

    def drop(self) -> None:
        raise NotImplementedError

    def carry_on(self, request: PublicRequest, rest: Awaitable[None]) -> None:
        raise NotImplementedError

    def finished(self, request: PublicRequest) -> None:
        raise NotImplementedError

    @property
    def client_gone(self) -> bool:
        raise NotImplementedError


class DetachedClient(RequestClient):
    """What a request handled on a closed connection names as its client once the
    connection let go of it: every reply is dropped and the client is gone. The request
    may live on in its handler's reference cycles; pointing at this, it keeps no
    connection (and no parser, no buffers) alive with it."""

    __slots__ = ()

    def answer(self, request: PublicRequest, answer: Answer) -> None:
        pass

    def reply_whole(
        self,
        request: PublicRequest,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
    ) -> None:
        pass

    def reply_as_is(
        self,
        request: PublicRequest,
        status: int,
        whole: bytes,
        body_length: int | None,
        has_date: bool,
    ) -> bool:
        return True

    def reply_start(
        self,
        request: PublicRequest,
        status: int,
        reason: bytes,
        headers: list[tuple[bytes, bytes]],
        first: bytes,
    ) -> None:
        pass

    def reply_write(self, data: bytes) -> None:
        pass

    def reply_end(self) -> None:
        pass

    def reply_abort(self, idle_s: float) -> None:
        pass

    async def drain(self) -> None:
        raise ConnectionResetError("the client went away")

    def send_continue(self) -> None:
        pass

    def drop(self) -> None:
        pass

    def carry_on(self, request: PublicRequest, rest: Awaitable[None]) -> None:
        pass

    def finished(self, request: PublicRequest) -> None:
        pass

    @property
    def client_gone(self) -> bool:
        return True

    def body_backlogged(self) -> None:
        pass

    def body_drained(self) -> None:
        pass


DETACHED_CLIENT: Final = DetachedClient()


class PublicRequest:
    """One request on the public port, from its head on.

    `target` is the request target in origin form, as the client wrote it (the path and
    query of an absolute-form target, whose authority is `authority`); `path` its path
    part (both raw, never normalised: routes match what the worker will read). `host`
    is the authority of an absolute-form target, else the Host header, else the
    address the client connected to. `body` is None for
    a request without one. `keep_alive` says whether the client allows another request
    on the connection after this one; `version_11`, whether it speaks HTTP/1.1 or later.
    """

    __slots__ = (
        "_header_list",
        "_headers",
        "_whole_body",
        "authority",
        "body",
        "chunked",
        "client",
        "content_length",
        "expect_continue",
        "host",
        "keep_alive",
        "method",
        "on_client_lost",
        "raw_headers",
        "remote",
        "target",
        "version",
        "version_11",
    )

    scheme = "http"

    def __init__(
        self,
        method: str,
        target: str,
        version: tuple[int, int],
        *,
        raw_headers: list[tuple[bytes, bytes]],
        remote: str | None,
        host: str,
        keep_alive: bool,
        content_length: int | None,
        chunked: bool,
        body: RequestBody | None,
        client: RequestClient,
        authority: str | None = None,
    ) -> None:
        self.method = method
        self.target = target
        self.version = version
        # HTTP/1.1 or later: chunked replies and persistent connections by default.
        # Worked out once, by its numbers: a property comparing the tuples cost more, at
        # every read.
        self.version_11 = version[0] > 1 or (version[0] == 1 and version[1] >= 1)
        # The (name, value) pairs in the order they came, as the bytes llhttp gave: what
        # the worker's head is built from with no decode and encode of each header. Text
        # is decoded when asked for: `getall` decodes the values it finds, `header_list`
        # and `headers` all.
        self.raw_headers = raw_headers
        self._header_list: list[tuple[str, str]] | None = None
        self._headers: CIMultiDict[str] | None = None
        self.remote = remote
        self.host = host
        self.keep_alive = keep_alive
        self.content_length = content_length
        self.chunked = chunked
        self.body = body
        self.authority = authority
        self.expect_continue = False
        self._whole_body: bytes | None = None
        # The connection it came on, which writes its reply (router.edge.server.EdgeConnection,
        # as its handler sees it: RequestClient).
        self.client = client
        # Told once if the client connection closes while this request is handled.
        self.on_client_lost: ClientLost | None = None

    def let_go(self, client: DetachedClient) -> None:
        """Its connection closed and its handler is done with it: `client` stands in for
        the connection, and the head's headers and the body read whole are dropped, so
        a request kept in a reference cycle (an exception's traceback holding the
        handler's frames) holds none of the bytes of its head until the collector runs.
        The request line stays."""
        self.client = client
        self.raw_headers = []
        self._header_list = None
        self._headers = None
        self._whole_body = None
        self.on_client_lost = None
        body = self.body
        if body is not None:
            body.detach(client)

    def keep_one_header(self, name: str, value: str) -> None:
        """Header `name` (any case) becomes one line holding `value`, where its first line
        stood: what the worker gets of a session header repeated with one value."""
        wanted = name.lower().encode("latin-1")
        line = value.encode("utf-8", "surrogateescape")
        kept: list[tuple[bytes, bytes]] = []
        placed = False
        for pair in self.raw_headers:
            if pair[0].lower() != wanted:
                kept.append(pair)
            elif not placed:
                kept.append((pair[0], line))
                placed = True
        self.raw_headers = kept
        self._header_list = None
        self._headers = None

    @property
    def header_list(self) -> list[tuple[str, str]]:
        """The (name, value) pairs as text, in order: a name as Latin-1 (llhttp let only
        token characters in), a value as UTF-8 with surrogate escapes, which encode back
        to the exact bytes."""
        pairs = self._header_list
        if pairs is None:
            pairs = self._header_list = [
                (pair[0].decode("latin-1"), pair[1].decode("utf-8", "surrogateescape"))
                for pair in self.raw_headers
            ]
        return pairs

    @property
    def headers(self) -> CIMultiDict[str]:
        """The headers as a case-insensitive multidict (built on first use)."""
        headers = self._headers
        if headers is None:
            headers = self._headers = CIMultiDict(self.header_list)
        return headers

    def getall(self, key: str, default: list[str]) -> list[str]:
        """The values of header `key` (any case) in order, else `default`: what
        `headers.getall` answers, read off the bytes. A forwarded request's session is
        read this way, so the multidict is never built for it."""
        names = _WANTED_NAMES.get(key)
        if names is None:
            # No header name outside Latin-1 can match one llhttp accepted.
            names = (key.encode("latin-1", "replace"), key.lower().encode("latin-1", "replace"))
            if len(_WANTED_NAMES) < _MAX_WANTED_NAMES:
                _WANTED_NAMES[key] = names
        spelled, wanted = names
        size = len(wanted)
        found: list[str] | None = None
        for pair in self.raw_headers:
            name = pair[0]
            # The name as asked is compared first: a client usually spells it so, and a
            # lower() is a call by name and a new object (see router.edge.parsing's on_header).
            if len(name) == size and (name == spelled or name.lower() == wanted):
                if found is None:
                    found = []
                found.append(pair[1].decode("utf-8", "surrogateescape"))
        return default if found is None else found

    @property
    def path(self) -> str:
        """`target` without its query. Worked out when asked: a forward whose session
        is in a header never asks."""
        return self.target.partition("?")[0]

    @property
    def content_type(self) -> str:
        """The media type of the body, lowercased, without parameters ("" when none)."""
        value = self.headers.get("Content-Type", "")
        return value.partition(";")[0].strip().lower()

    @property
    def body_complete(self) -> bool:
        """True when there is no body, or all of it has arrived."""
        body = self.body
        return body is None or body.complete

    async def read(self) -> bytes:
        """The whole body (b"" when none), waiting for all of it; kept, so a second call
        (a request tried again on another worker) gets the same bytes. Raises BodyBroken."""
        if self._whole_body is not None:
            return self._whole_body
        body = self.body
        # All here (the usual small body): taken at once, no readany() coroutines.
        if body is None or body.complete:
            return self.read_now()
        parts = []
        while True:
            chunk = await body.readany()
            if not chunk:
                break
            parts.append(chunk)
        self._whole_body = b"".join(parts)
        return self._whole_body

    def read_now(self) -> bytes:
        """The whole body of a request whose body is complete (`body_complete`), without
        waiting; kept, as `read()` keeps it."""
        if self._whole_body is None:
            body = self.body
            assert body is None or body.complete, "read_now() before the body is complete"
            self._whole_body = b"" if body is None else body.take()
        return self._whole_body
