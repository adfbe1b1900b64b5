"""The forwarding contract: its types and the header rules of design §8.

This module owns what every forwarding path shares: `Upstream` (where a worker
listens), `ForwardTimeouts`, `UpstreamFailure` (a forward that failed before any
reply head reached the client: refused, timeout, error, or a streamed body over
the limit), `ReplyObserver` (shown a reply before the client, to learn claims),
and the pure header rules for both directions (hop-by-hop, router-owned and
underscore names dropped, Host and X-Forwarded-* set, Location rewritten).

The forwarding itself lives in `router.relay.forwarder` (its own pools of asyncio
connections and llhttp): this module never opens a socket.
"""

from __future__ import annotations

import math
from collections.abc import Coroutine, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Final, Literal, Protocol, TypeVar

from aiohttp import hdrs
from multidict import CIMultiDict

from router.relay.reply_parser import CLOSED_BEFORE_REPLY, CONNECTION_BROKE

__all__ = [
    "ALWAYS_END_TO_END",
    "MAX_CACHED_ROLES",
    "BufferLimits",
    "ForwardTimeouts",
    "ReplyObserver",
    "Upstream",
    "UpstreamFailure",
    "as_value",
    "end_to_end_headers",
    "keeps_every_reply_header",
    "relayed_reply_headers",
    "remember_role",
    "reply_headers_for_client",
    "request_headers_for_worker",
    "rewrite_location",
]

# too_large: a streamed request body went over the body limit (the router answers 413).
# bad_body: the client's request body was malformed (a bad chunk) after its head (400).
# client_left: the client went away before the reply head (nothing left to answer).
# client_timeout: the client's request body went silent (408; the worker is not blamed).
# busy: no connection to the worker could be had because its pool was full, or its share
#   for client-paced exchanges was (503 worker_busy; the worker is not blamed).
# directory: the claims directory did not take the session the reply created (design
#   §10): the reply is not relayed (503 recovering; the worker is not blamed).
FailureKind = Literal[
    "refused",
    "error",
    "timeout",
    "too_large",
    "bad_body",
    "client_left",
    "client_timeout",
    "busy",
    "directory",
]

# Hop-by-hop headers (RFC 9110 §7.6.1) plus the legacy ones proxies still see.
# Any other `Proxy-*` name is dropped too (see `_is_hop_by_hop`).
_HOP_BY_HOP: Final = frozenset(
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
_ROUTER_OWNED: Final = frozenset({"host", "forwarded", "x-real-ip", "expect"})
_ROUTER_OWNED_PREFIXES: Final = ("x-forwarded-", "x-episode-router-")
_REWRITTEN_REPLY_HEADERS: Final = frozenset({"location", "content-location"})
_NO_HEADERS: Mapping[str, str] = MappingProxyType({})
_NONE_NAMED: frozenset[str] = frozenset()


class ReplyObserver(Protocol):
    """Sees a reply before its head goes to the client (to learn claims from it)."""

    def head(self, status: int, headers: Mapping[str, str], set_cookies: list[str]) -> int:
        """Called with the worker's reply head. Returns how many body bytes it wants
        to see (0: none); the body is then read up to that before the head goes out."""
        ...

    def body(self, data: bytes) -> None:
        """The whole reply body, when it ended within the bytes `head` asked for."""
        ...

    # Set by `head` or `body` when the reply taught a claim the claims directory must
    # take before the reply goes on (design §10): awaited then, False meaning the
    # reply must not be relayed. None without a directory.
    directory_write: Coroutine[Any, Any, bool] | None


# Not frozen: one is made per forward, and a frozen init costs more than a plain one.
# Its own __init__ for the compiled build, as router.core.machine.Forward.
@dataclass(slots=True, init=False)
class Upstream:
    """Where one worker listens: `http://host:port` or `unix:/path/to/socket`."""

    worker_id: str
    url: str

    def __init__(self, worker_id: str, url: str) -> None:
        self.worker_id = worker_id
        self.url = url


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


@dataclass(frozen=True, slots=True)
class BufferLimits:
    """How much of an exchange the router holds in memory so that a slow client costs
    its own bytes, not a worker connection; the defaults live in the configuration.

    body_bytes: a request body at most this large is read whole before a worker
        connection is taken; a larger one (or a chunked one that grows past it) streams.
    reply_bytes: a reply at most this large is read whole, and its connection goes back
        to the pool, before the client takes it; a larger one is relayed at the client's
        pace.
    budget_bytes: the most the process holds this way at once, bodies and replies
        together; past it, a body or reply streams as it would if it were large.
    paced_share: the share of a worker's pool that exchanges held at a client's pace
        (streamed uploads, replies streamed to the client) may take.
    """

    body_bytes: int = 1024 * 1024
    reply_bytes: int = 1024 * 1024
    budget_bytes: int = 256 * 1024 * 1024
    paced_share: float = 0.5

    def __post_init__(self) -> None:
        for name in ("body_bytes", "reply_bytes", "budget_bytes"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 0):
                raise ValueError(f"BufferLimits.{name} must be a whole number >= 0, got {value!r}")
        if not 0 < self.paced_share <= 1:
            share = self.paced_share
            raise ValueError(f"BufferLimits.paced_share must be in (0, 1], got {share!r}")


class UpstreamFailure(Exception):
    """The forward failed before any reply head reached the client.

    kind: "refused" (connect refused, or the Unix socket file is missing), "timeout"
        (connect or first-byte timeout) or "error" (anything else: reset, invalid reply...).
    detail: one human sentence about what happened.
    request_sent: False only when nothing of the request reached the worker, so the
        request may safely be tried on another worker; or when it may be sent again as
        if nothing had (an idempotent request on a kept-alive connection the worker
        closed before a byte of reply, whose connection opened to send it again was
        refused: the worker is gone).
    """

    __slots__ = ("detail", "kind", "request_sent")

    def __init__(self, kind: FailureKind, detail: str, request_sent: bool = True) -> None:
        super().__init__(kind, detail, request_sent)
        self.kind: FailureKind = kind
        self.detail = detail
        self.request_sent = request_sent

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"

    @property
    def ended_unanswered(self) -> bool:
        """Whether the far side's connection ended before its reply's head: closed
        before a byte of it, or reset (a process killed with the request unread)."""
        if self.kind != "error":
            return False
        return self.detail == CLOSED_BEFORE_REPLY or self.detail.startswith(CONNECTION_BROKE)


# Exceptions chained to a failure (its cause, their causes) whose tracebacks `as_value`
# clears: the relay chains one at most; the bound keeps a looped chain finite.
_MAX_CHAINED: Final = 8


def as_value(failure: UpstreamFailure) -> UpstreamFailure:
    """`failure`, caught to be handed on as a value: its traceback, and those of the
    exceptions chained to it, dropped. Each holds the frames that raised it, which hold
    the request (its head's bytes, its body) and the exception itself: a reference cycle
    the collector alone would free, for every client that left mid-forward."""
    chained: BaseException | None = failure
    for _ in range(_MAX_CHAINED):
        if chained is None:
            break
        chained.with_traceback(None)
        context = chained.__context__
        chained = chained.__cause__
        if chained is None:
            chained = context
    return failure


# --- header rules (pure) ------------------------------------------------------------------


# Headers a client's Connection options never remove (design §8): the router reads them
# to frame and route the request, so the worker must get the same ones. RFC 9110 §7.6.1
# forbids listing a header meant for every recipient; a client that does is not obeyed.
# The session kinds' own headers are added to these where the router is configured
# (`end_to_end_headers`).
ALWAYS_END_TO_END: Final = frozenset({"cookie", "authorization", "content-length", "content-type"})


_NO_NAMES: Final[frozenset[str]] = frozenset()  # a reply's Connection options are all obeyed


def end_to_end_headers(session_headers: Iterable[str]) -> frozenset[str]:
    """The lower-cased names a Connection option never removes: ALWAYS_END_TO_END and
    the headers the session kinds read (`session_headers`, any case)."""
    return ALWAYS_END_TO_END | frozenset(name.lower() for name in session_headers)


def _connection_named(
    items: list[tuple[str, str]], kept: frozenset[str] = ALWAYS_END_TO_END
) -> frozenset[str]:
    """The lower-cased header names listed in every Connection header, but for `kept`
    (the names a Connection option never removes)."""
    return frozenset(
        token.strip().lower()
        for name, value in items
        if name.lower() == "connection"
        for token in value.split(",")
        if token.strip()
    ).difference(kept)


def _is_hop_by_hop(lower_name: str, named: frozenset[str]) -> bool:
    return lower_name in _HOP_BY_HOP or lower_name in named or lower_name.startswith("proxy-")


def request_headers_for_worker(
    client_headers: Iterable[tuple[str, str]],
    *,
    worker_host: str,
    client_ip: str | None,
    scheme: str,
    extra: Mapping[str, str] = _NO_HEADERS,
    authority: str | None = None,
    kept: frozenset[str] = ALWAYS_END_TO_END,
) -> CIMultiDict[str]:
    """The header section a worker receives for a client's request (design §8).

    Drops hop-by-hop headers (and those Connection names but `kept`), names containing `_`, and the
    headers the router owns; sets Host to the worker's address and the X-Forwarded-* set;
    adds `extra` last. Repeated headers and the client's order are kept. When the client
    sent Transfer-Encoding, its Content-Length is dropped too: the body is re-framed as
    chunked and a leftover length would let the two framings disagree. `authority`: an
    absolute-form target's, which stands in for the client's Host (RFC 9112 §3.2.2).
    `kept`: the names a Connection option never removes (`end_to_end_headers`).
    """
    items = list(client_headers)
    named = _connection_named(items, kept)
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
    if authority is not None:
        original_host = authority
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
) -> list[tuple[str, str]]:
    """The header section a client receives for a worker's reply (design §1, §8).

    Drops hop-by-hop headers and those Connection names; rewrites a Location or
    Content-Location naming `private_origin` to `public_base` when one is given.
    Everything else, repeated Set-Cookie included, passes unchanged and in order.
    (The text form of `relayed_reply_headers`, which the relay uses on the bytes.)
    """
    # surrogatepass: any text goes to bytes and back unchanged, whatever it holds.
    raw = [
        (n.encode("utf-8", "surrogatepass"), v.encode("utf-8", "surrogatepass"))
        for n, v in worker_headers
    ]
    kept = relayed_reply_headers(raw, private_origin=private_origin, public_base=public_base)
    return [
        (n.decode("utf-8", "surrogatepass"), v.decode("utf-8", "surrogatepass")) for n, v in kept
    ]


def relayed_reply_headers(
    worker_headers: list[tuple[bytes, bytes]],
    *,
    private_origin: str,
    public_base: str | None,
) -> list[tuple[bytes, bytes]]:
    """`reply_headers_for_client` on the bytes of the header pairs, as llhttp gave them:
    the rules of each name are worked out once (a bytes-keyed cache), and only a
    Location to rewrite is decoded."""
    # Indexed, not unpacked: see router.relay.wire.worker_request_head.
    roles = [_REPLY_ROLES.get(pair[0]) or _reply_role(pair[0]) for pair in worker_headers]
    if _REPLY_CONNECTION in roles:
        # The names Connection lists are dropped too: roles for this reply alone.
        named = _connection_named([(_text(n), _text(v)) for n, v in worker_headers], _NO_NAMES)
        roles = [_reply_role_named(_text(n).lower(), named) for n, _ in worker_headers]
    out = []
    for index, pair in enumerate(worker_headers):  # zip(strict=True): see worker_request_head
        role = roles[index]
        if role == _REPLY_KEEP:
            out.append(pair)
        elif role == _REPLY_LOCATION:
            value = pair[1]
            if public_base is not None:
                rewritten = rewrite_location(_text(value), private_origin, public_base)
                value = rewritten.encode("utf-8", "surrogateescape")
            out.append((pair[0], value))
    return out


def keeps_every_reply_header(worker_headers: list[tuple[bytes, bytes]]) -> bool:
    """True when `relayed_reply_headers` would keep every one of `worker_headers` as it
    is: none dropped, none rewritten."""
    last = _LAST_REPLY_NAMES
    if last.same(worker_headers):
        return last.flag
    names: list[bytes] = []
    every = True
    for pair in worker_headers:
        name = pair[0]
        role = _REPLY_ROLES.get(name)
        if role is None:
            role = _reply_role(name)
        if role != _REPLY_KEEP:
            every = False
        names.append(name)
    last.keep(names, [], every)  # only the flag is asked for again: no roles kept
    return every


class LastNames:
    """The header names of the last message whose roles were worked out, the roles (when
    the caller reads them again), and one flag about them (the caller's).

    A worker's replies and a client's requests carry the same names in the same order,
    message after message: the last message's names are compared, name by name, before
    any is looked up by hash (a new bytes object each message, hashed in full).
    """

    def __init__(self) -> None:
        self.names: list[bytes] = []
        self.roles: list[int] = []
        self.flag = False

    def same(self, pairs: list[tuple[bytes, bytes]]) -> bool:
        """True when `pairs` are named as the last message, in the same order (never for
        no names: the flag of an empty message is not kept)."""
        names = self.names
        count = len(names)
        if count == 0 or len(pairs) != count:
            return False
        # A loop, not all() over a generator: the compiled build makes no generator.
        index = 0
        while index < count and pairs[index][0] == names[index]:
            index += 1
        return index == count

    def keep(self, names: list[bytes], roles: list[int], flag: bool) -> None:
        """The names, roles and flag of the message just worked out."""
        self.names = names
        self.roles = roles
        self.flag = flag


_LAST_REPLY_NAMES: Final = LastNames()


# What a worker's reply header becomes for the client, by name: worked out once per
# name (bounded: invented names cannot grow it), per reply only with a Connection
# header, instead of a lower() and three rule checks per header per reply.
_REPLY_KEEP: Final = 1
_REPLY_DROP: Final = 2
_REPLY_LOCATION: Final = 3
_REPLY_CONNECTION: Final = 4
_REPLY_ROLES: Final[dict[bytes, int]] = {}
# A header-role cache holds at most this many names: invented names cannot grow it.
MAX_CACHED_ROLES = 4096
_Name = TypeVar("_Name", str, bytes)


def remember_role(cache: dict[_Name, int], name: _Name, role: int) -> int:
    """`role`, kept in `cache` for `name` while the cache is under MAX_CACHED_ROLES (the
    request side's cache, router.relay.wire, and the reply side's here)."""
    if len(cache) < MAX_CACHED_ROLES:
        cache[name] = role
    return role


def _reply_role_named(lower: str, named: frozenset[str]) -> int:
    if _is_hop_by_hop(lower, named):
        return _REPLY_CONNECTION if lower == "connection" else _REPLY_DROP
    return _REPLY_LOCATION if lower in _REWRITTEN_REPLY_HEADERS else _REPLY_KEEP


def _text(data: bytes) -> str:
    """Header bytes as text, any bytes at all (surrogate escapes give them back)."""
    return data.decode("utf-8", "surrogateescape")


def _reply_role(name: bytes) -> int:
    return remember_role(_REPLY_ROLES, name, _reply_role_named(_text(name).lower(), _NONE_NAMED))


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
