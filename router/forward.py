"""The forwarding path: one request relayed to a worker and its reply relayed back.

This module owns the keep-alive pools to each worker, the hop-by-hop and
forwarding-header rules of DESIGN §8, the streaming of both bodies, and the
connect, first-byte and stream-idle timeouts. It never decides where a request
goes and never writes an answer of its own: a failure before the reply head
reached the client is raised as `UpstreamFailure` for the public handler to
translate, and a failure after it aborts the client connection, so the client
sees an incomplete reply rather than a forged clean end.

It is built on aiohttp's client for now; the interface (`Upstream`,
`ForwardTimeouts`, `Forwarder`, `UpstreamFailure`) is kept small so that the
internals can be swapped for a leaner protocol without touching callers.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import os
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, Protocol

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict
from yarl import URL

__all__ = ["ForwardTimeouts", "Forwarder", "ReplyObserver", "Upstream", "UpstreamFailure"]

log = logging.getLogger("episode_router.forward")

# too_large: a streamed request body went over the body limit (the router answers 413).
FailureKind = Literal["refused", "error", "timeout", "too_large"]

# Hop-by-hop headers (RFC 9110 §7.6.1) plus the legacy ones proxies still see.
# Any other `Proxy-*` name is dropped too (see `_is_hop_by_hop`).
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
    }
)
# Request headers the router owns: it sets Host and the X-Forwarded-* set itself and never
# trusts a client's. `Expect` was answered at the public edge (the body is already flowing),
# so the worker must not be asked to send a second 100 Continue.
_ROUTER_OWNED = frozenset({"host", "forwarded", "x-real-ip", "expect"})
_ROUTER_OWNED_PREFIXES = ("x-forwarded-", "x-episode-router-")
_REWRITTEN_REPLY_HEADERS = frozenset({"location", "content-location"})
# aiohttp adds these to a request unless told not to; the worker gets only what the client sent.
_NO_AUTO_HEADERS = (hdrs.ACCEPT, hdrs.ACCEPT_ENCODING, hdrs.USER_AGENT, hdrs.CONTENT_TYPE)
_REFUSED_ERRNOS = frozenset({errno.ECONNREFUSED, errno.ENOENT})
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})

# Idle keep-alive connections are closed by the router after 4 s: below the 5 s default of
# uvicorn and hypercorn, so it is the router, not the worker, that closes an idle
# connection, and a request is not sent into a connection the worker is closing.
_KEEPALIVE_S = 4.0
# While a reply streams, the client connection is checked this often, so an idle stream (SSE
# waiting for its next event) whose client left releases its worker connection promptly.
_CLIENT_CHECK_S = 0.5
# A reply header line from a worker may be this long: workers are our own processes and a
# large Set-Cookie or MCP header must pass, but a runaway one still fails the reply.
_MAX_REPLY_FIELD = 64 * 1024


class ReplyObserver(Protocol):
    """Sees a reply before its head goes to the client (to learn claims from it)."""

    def head(self, status: int, headers: Mapping[str, str], set_cookies: list[str]) -> int:
        """Called with the worker's reply head. Returns how many body bytes it wants
        to see (0: none); the body is then read up to that before the head goes out."""
        ...

    def body(self, data: bytes) -> None:
        """The whole reply body, when it ended within the bytes `head` asked for."""
        ...


@dataclass(frozen=True, slots=True)
class Upstream:
    """Where one worker listens: `http://host:port` or `unix:/path/to/socket`."""

    worker_id: str
    url: str


@dataclass(frozen=True, slots=True)
class ForwardTimeouts:
    """Bounds on one forward; the defaults live in the configuration.

    connect_s: connecting to the worker (and waiting for a free pooled connection).
    first_byte_s: waiting for the reply head once the request is sent; while the request
        body is still being sent, it bounds each stretch without upload progress.
    stream_idle_s: each wait for the next reply body chunk (an idle bound, never a total).
    """

    connect_s: float
    first_byte_s: float
    stream_idle_s: float

    def __post_init__(self) -> None:
        for name in ("connect_s", "first_byte_s", "stream_idle_s"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < math.inf):
                raise ValueError(f"ForwardTimeouts.{name} must be a positive number, got {value!r}")


class UpstreamFailure(Exception):
    """The forward failed before any reply head reached the client.

    kind: "refused" (connect refused, or the Unix socket file is missing), "timeout"
        (connect or first-byte timeout) or "error" (anything else: reset, invalid reply...).
    detail: one human sentence about what happened.
    request_sent: False only when nothing of the request reached the worker, so the
        request may safely be tried on another worker.
    """

    __slots__ = ("detail", "kind", "request_sent")

    def __init__(self, kind: FailureKind, detail: str, request_sent: bool = True) -> None:
        super().__init__(kind, detail, request_sent)
        self.kind: FailureKind = kind
        self.detail = detail
        self.request_sent = request_sent

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


# --- header rules (pure) ------------------------------------------------------------------


def _connection_named(items: list[tuple[str, str]]) -> frozenset[str]:
    """The lower-cased header names listed in every Connection header."""
    return frozenset(
        token.strip().lower()
        for name, value in items
        if name.lower() == "connection"
        for token in value.split(",")
        if token.strip()
    )


def _is_hop_by_hop(lower_name: str, named: frozenset[str]) -> bool:
    return lower_name in _HOP_BY_HOP or lower_name in named or lower_name.startswith("proxy-")


def request_headers_for_worker(
    client_headers: Iterable[tuple[str, str]],
    *,
    worker_host: str,
    client_ip: str | None,
    scheme: str,
    extra: Mapping[str, str] = _NO_HEADERS,
) -> CIMultiDict[str]:
    """The header section a worker receives for a client's request (DESIGN §8).

    Drops hop-by-hop headers (and those Connection names), names containing `_`, and the
    headers the router owns; sets Host to the worker's address and the X-Forwarded-* set;
    adds `extra` last. Repeated headers and the client's order are kept. When the client
    sent Transfer-Encoding, its Content-Length is dropped too: the body is re-framed as
    chunked and a leftover length would let the two framings disagree.
    """
    items = list(client_headers)
    named = _connection_named(items)
    chunked = any(k.lower() == "transfer-encoding" for k, _ in items)
    out: CIMultiDict[str] = CIMultiDict()
    out[hdrs.HOST] = worker_host
    original_host: str | None = None
    for name, value in items:
        lower = name.lower()
        if lower == "host" and original_host is None:
            original_host = value
        if _keeps_request_header(lower, named) and not (chunked and lower == "content-length"):
            out.add(name, value)
    if original_host is not None:
        out["X-Forwarded-Host"] = original_host
    if client_ip:
        out["X-Forwarded-For"] = client_ip
    out["X-Forwarded-Proto"] = scheme
    for name, value in extra.items():
        out[name] = value
    return out


def _keeps_request_header(lower: str, named: frozenset[str]) -> bool:
    # A name with `_` is dropped: CGI/WSGI stacks map `-` and `_` to the same variable, so
    # `Content_Length` or `Transfer_Encoding` would be read there as the real framing header.
    if "_" in lower or _is_hop_by_hop(lower, named) or lower in _ROUTER_OWNED:
        return False
    return not lower.startswith(_ROUTER_OWNED_PREFIXES)


def reply_headers_for_client(
    worker_headers: Iterable[tuple[str, str]],
    *,
    private_origin: str,
    public_base: str | None,
) -> CIMultiDict[str]:
    """The header section a client receives for a worker's reply (DESIGN §1, §8).

    Drops hop-by-hop headers and those Connection names; rewrites a Location or
    Content-Location naming `private_origin` to `public_base` when one is given.
    Everything else, repeated Set-Cookie included, passes unchanged and in order.
    """
    items = list(worker_headers)
    named = _connection_named(items)
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in items:
        lower = name.lower()
        if _is_hop_by_hop(lower, named):
            continue
        if public_base is not None and lower in _REWRITTEN_REPLY_HEADERS:
            value = rewrite_location(value, private_origin, public_base)
        out.add(name, value)
    return out


def rewrite_location(value: str, private_origin: str, public_base: str) -> str:
    """`value` with a leading `private_origin` (e.g. `http://127.0.0.1:9002`, matched in any
    case) replaced by `public_base`, as nginx's `proxy_redirect default`; else unchanged."""
    size = len(private_origin)
    if value[:size].lower() != private_origin.lower():
        return value
    rest = value[size:]
    if rest and rest[0] not in "/?#":
        return value  # a longer host or port, e.g. :90021 or 127.0.0.10
    return public_base.rstrip("/") + rest


# --- pools --------------------------------------------------------------------------------


class _Pool:
    """One worker's keep-alive pool and the addresses derived from its URL."""

    __slots__ = ("base", "host", "private_origin", "session", "url")

    def __init__(self, url: str, session: aiohttp.ClientSession, base: str, host: str) -> None:
        self.url = url
        self.session = session
        self.base = base  # what request targets are appended to
        self.host = host  # the Host header the worker sees
        self.private_origin = f"http://{host}"


def _parse_upstream(url: str) -> tuple[str, str | None]:
    """(authority for Host, Unix socket path or None); raises ValueError when unsupported."""
    if url.startswith("unix:"):
        path = url[len("unix:") :]
        if not path:
            raise ValueError("a unix: address needs a socket path")
        return "localhost", path
    if not url.startswith("http://"):
        raise ValueError("only http://host:port and unix:/path addresses are supported")
    parsed = URL(url)
    if not parsed.raw_host or parsed.raw_path not in ("", "/") or parsed.raw_query_string:
        raise ValueError("an http address is http://host:port with no path or query")
    if parsed.raw_user is not None or parsed.raw_fragment:
        raise ValueError("an http address carries no user or fragment")
    return parsed.raw_authority, None


# --- the request body ---------------------------------------------------------------------


class _Upload:
    """The client's request body on its way to the worker.

    While the body flows, each chunk handed on pushes the first-byte deadline forward, so
    `first_byte_s` bounds a stall in the upload and, after its last chunk, the wait for the
    reply head.
    """

    __slots__ = ("client_broke", "content", "deadline", "first_byte_s", "loop")

    def __init__(self, content: aiohttp.StreamReader, first_byte_s: float) -> None:
        self.content = content
        self.first_byte_s = first_byte_s
        self.loop = asyncio.get_running_loop()
        self.deadline: asyncio.Timeout | None = None
        self.client_broke = False

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self.content
        while True:
            try:
                # readany hands over what the socket delivered, without joining chunks.
                chunk = await content.readany()
            except Exception:
                self.client_broke = True
                raise
            if not chunk:
                return
            deadline = self.deadline
            if deadline is not None and not deadline.expired():
                deadline.reschedule(self.loop.time() + self.first_byte_s)
            yield chunk


# --- the reply ----------------------------------------------------------------------------


class _RelayedResponse(web.StreamResponse):
    """A worker's reply on its way to the client.

    aiohttp fills in Server and a default Content-Type, and drops Content-Length from a
    304; a relayed reply carries the worker's headers instead. The one header added is
    Date when the worker sent none, which RFC 9110 §6.6.1 asks of a proxy.
    """

    __slots__ = ()

    async def _prepare_headers(self) -> None:
        headers = self.headers
        had_server = hdrs.SERVER in headers
        had_type = hdrs.CONTENT_TYPE in headers
        length_304 = headers.get(hdrs.CONTENT_LENGTH) if self.status == 304 else None
        await super()._prepare_headers()
        if not had_server:
            headers.popall(hdrs.SERVER, None)
        if not had_type:
            headers.popall(hdrs.CONTENT_TYPE, None)
        if length_304 is not None:
            headers[hdrs.CONTENT_LENGTH] = length_304


class _ClientGone(ConnectionResetError):
    """Set on the worker's reply stream when the client connection closed under it."""


class _ClientWatch:
    """Wakes a blocked read of the worker's reply once the client connection has closed.

    aiohttp only cancels a handler on disconnect when asked to; this keeps the guarantee
    that a departed client releases its worker connection without relying on that.
    """

    __slots__ = ("_content", "_handle", "_loop", "_transport")

    def __init__(self, transport: asyncio.Transport, content: aiohttp.StreamReader) -> None:
        self._transport = transport
        self._content = content
        self._loop = asyncio.get_running_loop()
        self._handle = self._loop.call_later(_CLIENT_CHECK_S, self._check)

    def _check(self) -> None:
        if self._transport.is_closing():
            self._content.set_exception(_ClientGone("the client went away"))
        else:
            self._handle = self._loop.call_later(_CLIENT_CHECK_S, self._check)

    def stop(self) -> None:
        self._handle.cancel()


def _failure(
    exc: BaseException, upload: _Upload | None, timeouts: ForwardTimeouts
) -> UpstreamFailure:
    """The UpstreamFailure for an exception raised before the reply head arrived."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        code = exc.os_error.errno
        # asyncio's own message names only the address; the errno says what went wrong.
        # Resolver errors carry negative codes and a message of their own.
        reason = os.strerror(code) if code and code > 0 else str(exc.os_error)
        return UpstreamFailure(
            "refused" if code in _REFUSED_ERRNOS else "error",
            f"cannot connect: {reason}",
            request_sent=False,
        )
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamFailure(
            "timeout", f"no connection within {timeouts.connect_s:g} s", request_sent=False
        )
    if upload is not None and upload.client_broke:
        return UpstreamFailure("error", "the client's request body broke off")
    if isinstance(exc, TimeoutError):
        return UpstreamFailure("timeout", f"no reply within {timeouts.first_byte_s:g} s")
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return UpstreamFailure("error", "it closed the connection before replying")
    if isinstance(exc, aiohttp.ClientResponseError):
        return UpstreamFailure("error", f"invalid reply: {exc.message}")
    if isinstance(exc, ValueError):  # the request could not be built: nothing went out
        return UpstreamFailure("error", f"cannot send the request: {exc}", request_sent=False)
    return UpstreamFailure("error", f"{type(exc).__name__}: {exc}")


class Forwarder:
    """Relays requests to workers over keep-alive pools, one pool per worker."""

    def __init__(self, timeouts: ForwardTimeouts, *, pool_size_per_upstream: int = 256) -> None:
        if pool_size_per_upstream < 1:
            raise ValueError("pool_size_per_upstream must be at least 1")
        self._pool_size = pool_size_per_upstream
        self._pools: dict[str, _Pool] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._closed = False
        self.set_timeouts(timeouts)

    def set_timeouts(self, timeouts: ForwardTimeouts) -> None:
        """Bounds for the forwards that start from now on (a config reload)."""
        self._timeouts = timeouts
        # connect bounds both the wait for a pooled connection and the TCP/Unix connect;
        # the reply-head and body bounds are enforced here, not by aiohttp. No ceiling of
        # timeouts to whole seconds: a 1 s connect bound must not become 2 s.
        self._client_timeout = aiohttp.ClientTimeout(
            total=None,
            connect=timeouts.connect_s,
            sock_connect=timeouts.connect_s,
            sock_read=None,
            ceil_threshold=math.inf,
        )

    async def forward(
        self,
        request: web.BaseRequest,
        upstream: Upstream,
        *,
        extra_headers: Mapping[str, str] = _NO_HEADERS,
        public_base: str | None = None,
        body: bytes | None = None,
        observer: ReplyObserver | None = None,
    ) -> web.StreamResponse:
        """Relays `request` to `upstream` and the reply back, streaming both bodies.

        `body`: the request body when the caller already read it (to find a session in
        it); it is sent as it is. `observer`: shown the reply head (and, if it asks, a
        small body) before anything reaches the client, so a claim learned from a reply
        is in the table before the client can send its next request.

        Returns the (already prepared and finished) response for the handler to return.
        Raises UpstreamFailure when the forward fails before the reply head was sent to the
        client. After the head went out, a failure aborts the client connection, without a
        clean terminator so the client sees the reply is incomplete, and the response is
        returned all the same.
        """
        pool = self._pool_for(upstream)
        reply = await self._send(pool, request, extra_headers, body)
        if reply.status == 101:
            reply.close()
            raise UpstreamFailure("error", "it switched protocols, which is not forwarded")
        prefix = b""
        if observer is not None:
            prefix = await self._observe(reply, observer)
        headers = reply_headers_for_client(
            reply.headers.items(), private_origin=pool.private_origin, public_base=public_base
        )
        response = _RelayedResponse(status=reply.status, reason=reply.reason, headers=headers)
        clean = False
        try:
            clean = await self._relay(request, reply.content, response, prefix)
        finally:
            # A fully relayed reply returns its connection to the pool; any other end closes
            # it, so a half-read connection is never reused.
            if clean:
                reply.release()
            else:
                reply.close()
        return response

    def forget(self, worker_id: str) -> None:
        """Closes and drops the pool of `worker_id` (its worker exited); a no-op if unknown.

        Call it from the event loop: the pool closes in the background.
        """
        pool = self._pools.pop(worker_id, None)
        if pool is not None:
            self._retire(pool)

    async def close(self) -> None:
        """Closes every pool; later forwards fail with UpstreamFailure("error")."""
        self._closed = True
        pools = list(self._pools.values())
        self._pools.clear()
        await asyncio.gather(*(pool.session.close() for pool in pools), *self._closing)

    # --- internals ----------------------------------------------------------------------

    def _pool_for(self, upstream: Upstream) -> _Pool:
        pool = self._pools.get(upstream.worker_id)
        if pool is not None and pool.url == upstream.url:
            return pool  # hot path: one dict lookup and one string compare
        if self._closed:
            raise UpstreamFailure("error", "the router is shutting down", request_sent=False)
        if pool is not None:
            self._retire(pool)  # the worker came back at another address
        pool = self._open_pool(upstream)
        self._pools[upstream.worker_id] = pool
        return pool

    def _open_pool(self, upstream: Upstream) -> _Pool:
        try:
            host, socket_path = _parse_upstream(upstream.url)
        except ValueError as exc:
            detail = f"unsupported worker address {upstream.url!r}: {exc}"
            raise UpstreamFailure("error", detail, request_sent=False) from exc
        connector: aiohttp.BaseConnector
        if socket_path is None:
            connector = aiohttp.TCPConnector(
                limit=self._pool_size, limit_per_host=0, keepalive_timeout=_KEEPALIVE_S
            )
        else:
            connector = aiohttp.UnixConnector(
                socket_path, limit=self._pool_size, keepalive_timeout=_KEEPALIVE_S
            )
        session = aiohttp.ClientSession(
            connector=connector,
            timeout=self._client_timeout,
            auto_decompress=False,  # bodies pass byte for byte
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=_NO_AUTO_HEADERS,
            max_line_size=_MAX_REPLY_FIELD,
            max_field_size=_MAX_REPLY_FIELD,
            trust_env=False,  # never route worker traffic through an environment proxy
        )
        return _Pool(upstream.url, session, f"http://{host}", host)

    def _retire(self, pool: _Pool) -> None:
        task = asyncio.get_running_loop().create_task(
            pool.session.close(), name=f"forward-pool-close {pool.url}"
        )
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _observe(self, reply: aiohttp.ClientResponse, observer: ReplyObserver) -> bytes:
        """Shows the head to `observer`, then the body if it is small and it asks;
        returns the body bytes read ahead (relayed before the rest)."""
        wanted = observer.head(reply.status, reply.headers, reply.headers.getall("Set-Cookie", []))
        if wanted <= 0 or (reply.content_length is not None and reply.content_length > wanted):
            return b""
        read: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self._timeouts.stream_idle_s):
                while size <= wanted:
                    chunk = await reply.content.readany()
                    if not chunk:
                        observer.body(b"".join(read))
                        break
                    read.append(chunk)
                    size += len(chunk)
        except (TimeoutError, aiohttp.ClientError, OSError):
            pass  # what was read is relayed; the copy loop meets the same fault and aborts
        return b"".join(read)

    async def _send(
        self,
        pool: _Pool,
        request: web.BaseRequest,
        extra_headers: Mapping[str, str],
        body: bytes | None,
    ) -> aiohttp.ClientResponse:
        """Sends the request head (and starts the body); returns once the reply head is in."""
        if request.method == hdrs.METH_CONNECT:
            raise UpstreamFailure("error", "CONNECT is not forwarded", request_sent=False)
        headers = request_headers_for_worker(
            request.headers.items(),
            worker_host=pool.host,
            client_ip=request.remote,
            scheme=request.scheme,
            extra=extra_headers,
        )
        upload = _Upload(request.content, self._timeouts.first_byte_s)
        data: bytes | AsyncIterator[bytes] | None = (
            body if body is not None else upload.chunks() if request.body_exists else None
        )
        loop = upload.loop
        timeouts = self._timeouts
        try:
            async with asyncio.timeout_at(
                loop.time() + timeouts.connect_s + timeouts.first_byte_s
            ) as deadline:
                upload.deadline = deadline
                return await pool.session.request(
                    request.method,
                    URL(pool.base + _target(request), encoded=True),
                    headers=headers,
                    data=data,
                    allow_redirects=False,
                    timeout=self._client_timeout,
                )
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            raise _failure(exc, upload, timeouts) from exc
        finally:
            upload.deadline = None

    async def _relay(
        self,
        request: web.BaseRequest,
        content: aiohttp.StreamReader,
        response: _RelayedResponse,
        prefix: bytes = b"",
    ) -> bool:
        """Sends the reply head (and `prefix`, body bytes already read) and copies the
        rest of the body; True when the client got all of it."""
        try:
            await response.prepare(request)
            if prefix:
                await response.write(prefix)
        except ConnectionError:
            return False  # the client left before the head went out
        transport = request.transport
        if transport is None:
            return False
        watch = _ClientWatch(transport, content)
        try:
            ended = await self._copy_body(content, response)
        finally:
            watch.stop()
        if ended is None:
            try:
                await response.write_eof()
            except ConnectionError:
                return False
            return True
        log.info("reply to %s %s aborted: %s", request.method, request.path, ended)
        self._abort_client(request)
        return False

    async def _copy_body(
        self, content: aiohttp.StreamReader, response: _RelayedResponse
    ) -> str | None:
        """Copies chunks as they arrive; None at a clean end, else why it stopped."""
        loop = asyncio.get_running_loop()
        idle_s = self._timeouts.stream_idle_s
        try:
            async with asyncio.timeout(None) as idle:
                while True:
                    # One deadline per chunk covers reading it and writing it on: a stall on
                    # either side (a silent worker, a client that stopped reading) ends it.
                    idle.reschedule(loop.time() + idle_s)
                    try:
                        chunk = await content.readany()
                    except _ClientGone:
                        return "the client went away"
                    except (aiohttp.ClientError, OSError) as exc:
                        return f"the worker's reply broke off ({exc})"
                    if not chunk:
                        return None
                    try:
                        # Written as it arrives, never gathered: SSE events go out at once.
                        await response.write(chunk)
                    except ConnectionError:
                        return "the client went away"
        except TimeoutError:
            return f"no reply data for {idle_s:g} s"

    def _abort_client(self, request: web.BaseRequest) -> None:
        """Ends the client connection with no clean terminator after the bytes relayed."""
        transport = request.transport
        if transport is None or transport.is_closing():
            return
        # close() flushes what was relayed, then sends FIN: no chunked terminator and fewer
        # bytes than announced, so the client sees the reply is incomplete. A client that
        # does not read what is left gets the connection reset after the idle bound.
        transport.close()
        if transport.get_write_buffer_size():
            asyncio.get_running_loop().call_later(self._timeouts.stream_idle_s, transport.abort)


def _target(request: web.BaseRequest) -> str:
    """The request target as the client wrote it (origin form), without re-quoting."""
    raw = request.raw_path
    return raw if raw.startswith("/") else request.rel_url.raw_path_qs
