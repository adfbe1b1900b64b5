"""The bytes of a relayed request: worker addresses and the request head.

This module owns the request side of the wire format on the worker side of the router:
where a worker's address says to connect and what `Host` the worker sees, and the
request head serialized in one piece (the header rules of `router.relay.contract`, applied to
the client's bytes as they came, with the lines the router adds cached). It never does
I/O, never touches an event loop and never reads a reply (`router.relay.reply_parser` does).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

# The header rules have one home, router.relay.contract (the forwarding contract); this module
# builds the same head in one pass, pinned equal by tests/relay/test_wire.py.
from router.protocol import HTTP, is_ip, parse_upstream
from router.relay.contract import (
    ALWAYS_END_TO_END,
    LastNames,
    _connection_named,
    _keeps_request_header,
    remember_role,
)

__all__ = [
    "IDEMPOTENT_METHODS",
    "NO_EXTRA",
    "WorkerAddress",
    "parse_worker_address",
    "serialize_request_head",
    "worker_request_head",
]

# Methods a stale pooled connection may be retried for (RFC 9110 §9.2.2): a second copy
# of the request changes nothing the first did not. POST and PATCH are never retried.
IDEMPOTENT_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})

# The empty `extra`, for every module that passes none: never written to. A dict, which
# the compiled build iterates directly, where a Mapping's items() is a generic call.
NO_EXTRA: Final[dict[str, str]] = {}
_NONE_NAMED: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class WorkerAddress:
    """Where a worker listens and how it is named on the wire.

    host_header: the `Host` the worker receives (`127.0.0.1:9002`, `localhost` for Unix).
    private_origin: `http://<host_header>`, what a Location naming the worker starts with.
    tcp_host, tcp_port: the TCP address, when it is one (`tcp_host` is None for Unix).
    tcp_literal: True when `tcp_host` is an IP address (no name lookup needed).
    unix_path: the Unix socket path, when it is one.
    """

    host_header: str
    private_origin: str
    tcp_host: str | None = None
    tcp_port: int = 0
    tcp_literal: bool = False
    unix_path: str | None = None


def parse_worker_address(url: str) -> WorkerAddress:
    """Where the worker at `url` listens, read by the protocol's grammar of worker urls
    (`router.protocol.addresses.parse_upstream`, as every registration was); the `Host`
    it receives is the url's `host:port` as written. Raises ValueError saying why a url
    is not one."""
    parsed = parse_upstream(url)
    if isinstance(parsed, str):
        raise ValueError(parsed)
    if parsed.path:
        return WorkerAddress("localhost", "http://localhost", unix_path=parsed.path)
    authority = url[len(HTTP) :]
    return WorkerAddress(
        authority,
        f"{HTTP}{authority}",
        tcp_host=parsed.host,
        tcp_port=parsed.port,
        tcp_literal=is_ip(parsed.host),
    )


def worker_request_head(
    method: str,
    target: str,
    client_headers: list[tuple[bytes, bytes]],
    *,
    worker_host: str,
    client_ip: str | None,
    scheme: str,
    extra: dict[str, str] = NO_EXTRA,
    content_length: int | None = None,
    chunked: bool = False,
    authority: str | None = None,
    body: bytes = b"",
    kept: frozenset[str] = ALWAYS_END_TO_END,
) -> bytes:
    """The request head a worker receives, as bytes: `method target HTTP/1.1`, the header
    section of `router.relay.contract.request_headers_for_worker` (same rules, same order), and
    the body's framing: `content_length` replaces the client's Content-Length where it
    stood (or is added last), `chunked` adds `Transfer-Encoding: chunked` last.
    `authority`: an absolute-form target's, which stands in for the client's Host.
    `body`: bytes to follow the head in the same piece (a whole, framed body).
    `kept`: the names a Connection option never removes (design §8).

    `method`, `target` and `client_headers` (the (name, value) pairs as the bytes the
    client sent) are as llhttp parsed them, which lets no CR or LF into any of them: the
    client's bytes are copied as they came, with no decode and encode of each. The
    lines the router adds are checked: ValueError when a part of one carries a CR or
    LF, which would let one header smuggle in another.
    """
    # A list of (bytes, bytes), declared so: the compiled build then reads its items
    # and their fields directly (pair[0], not unpacking, which goes through the
    # iterator protocol), where an Iterable's cost a generic call each.
    items = client_headers
    roles, rare = _roles_by_name(items)
    drop_length = False
    if rare:
        if _CONNECTION in roles:
            # The names Connection lists are dropped too: roles for this request alone.
            text = [(_text(pair[0]), _text(pair[1])) for pair in items]
            named = _connection_named(text, kept)
            roles = [_role(pair[0].lower(), named) for pair in text]
        # Transfer-Encoding wins over Content-Length (RFC 9112 §6.3): the client's goes.
        drop_length = _TRANSFER_ENCODING in roles
    length_line = None if content_length is None else b"Content-Length: %d\r\n" % content_length
    parts = [_request_line(method, target), _line_from(_HOST_LINES, "Host", worker_host)]
    original_host: bytes | None = None
    # By index, not zip(strict=True): the keyword call costs far more, compiled.
    for index, pair in enumerate(items):
        role = roles[index]
        if role == _KEEP or (role == _LENGTH and not drop_length and length_line is None):
            parts.append(pair[0])
            parts.append(b": ")
            parts.append(pair[1])
            parts.append(b"\r\n")
        elif role == _HOST:
            if original_host is None:
                original_host = pair[1]
        elif role == _LENGTH and not drop_length:
            assert length_line is not None
            parts.append(length_line)  # in the client's place; any repeat goes
            length_line = None
            drop_length = True
    if authority is not None:
        # The client's own text, not kept: it would let clients fill the cache.
        parts.append(_checked_line("X-Forwarded-Host", authority))
    elif original_host is not None:
        parts.append(b"X-Forwarded-Host: ")
        parts.append(original_host)
        parts.append(b"\r\n")
    if client_ip:
        parts.append(_line_from(_FORWARDED_FOR_LINES, "X-Forwarded-For", client_ip))
    parts.append(_line_from(_FORWARDED_PROTO_LINES, "X-Forwarded-Proto", scheme))
    for extra_name, extra_value in extra.items():
        parts.append(_header_line(extra_name, extra_value))
    if length_line is not None:
        parts.append(length_line)
    if chunked:
        parts.append(b"Transfer-Encoding: chunked\r\n")
    parts.append(b"\r\n")
    if body:
        parts.append(body)
    return b"".join(parts)


# The lines the router adds (Host, X-Forwarded-*, the boot) repeat from request to
# request: each is checked and encoded once, then looked up by name, then value (the
# same string objects request after request: their hashes are cached, and a dict
# compares them by identity first). A name's lines are emptied when there are too many,
# so invented values cannot grow the cache (measured with the client's bytes copied as
# they came, no decode, encode and CR/LF search of each: docs/performance.md).
_LINES: Final[dict[str, dict[str, bytes]]] = {}
MAX_CACHED_LINES: Final = 4096  # per name
_MAX_CACHED_NAMES: Final = 64
_MAX_CACHED_VALUE: Final = 256  # characters: a longer value is built each time


def _header_line(name: str, value: str) -> bytes:
    """`name: value` and its line break, as bytes; raises ValueError when the name or
    the value carries a CR or LF."""
    by_value = _LINES.get(name)
    if by_value is not None:
        line = by_value.get(value)
        if line is not None:
            return line
    return _new_header_line(name, value)


def _new_header_line(name: str, value: str) -> bytes:
    line = _checked_line(name, value)
    if len(value) <= _MAX_CACHED_VALUE:
        _keep(_LINES, name, value, line)
    return line


# The lines of the names every forward carries, kept by value in tables of their own:
# one lookup, not two.
_HOST_LINES: Final[dict[str, bytes]] = {}
_FORWARDED_FOR_LINES: Final[dict[str, bytes]] = {}
_FORWARDED_PROTO_LINES: Final[dict[str, bytes]] = {}


def _line_from(lines: dict[str, bytes], name: str, value: str) -> bytes:
    """`_header_line` for a name whose lines are kept in `lines`."""
    line = lines.get(value)
    if line is None:
        line = _checked_line(name, value)
        if len(value) <= _MAX_CACHED_VALUE:
            _put(lines, value, line, MAX_CACHED_LINES)
    return line


# The request line, kept by method, then target: a tool call's target repeats (the
# same few routes), and a line looked up costs less than one formatted and encoded.
# Targets are the client's choice, so the bound is tighter than the added lines': the
# usual methods only, MAX_CACHED_TARGETS a method, none over _MAX_CACHED_TARGET
# characters (at most ~1 MB). `method` and `target` are as llhttp parsed them (no CR or
# LF).
_REQUEST_LINES: Final[dict[str, dict[str, bytes]]] = {
    method: {} for method in ("GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS")
}
MAX_CACHED_TARGETS: Final = 512
_MAX_CACHED_TARGET: Final = 128


def _request_line(method: str, target: str) -> bytes:
    by_target = _REQUEST_LINES.get(method)
    if by_target is not None:
        line = by_target.get(target)
        if line is not None:
            return line
    line = f"{method} {target} HTTP/1.1\r\n".encode("utf-8", "surrogateescape")
    if by_target is not None and len(target) <= _MAX_CACHED_TARGET:
        _put(by_target, target, line, MAX_CACHED_TARGETS)
    return line


def _keep(cache: dict[str, dict[str, bytes]], first: str, second: str, line: bytes) -> None:
    """Keeps `line` under `first`, then `second`; a table that is full is emptied."""
    by_second = cache.get(first)
    if by_second is None:
        if len(cache) >= _MAX_CACHED_NAMES:
            cache.clear()
        by_second = cache[first] = {}
    _put(by_second, second, line, MAX_CACHED_LINES)


def _put(lines: dict[str, bytes], key: str, line: bytes, bound: int) -> None:
    """Keeps `line` under `key`; a table with `bound` lines already is emptied first."""
    if len(lines) >= bound:
        lines.clear()
    lines[key] = line


def _checked_line(name: str, value: str) -> bytes:
    if "\n" in name or "\r" in name or "\n" in value or "\r" in value:
        raise ValueError("a header name or value carries a line break")
    return f"{name}: {value}\r\n".encode("utf-8", "surrogateescape")


def _text(data: bytes) -> str:
    return data.decode("utf-8", "surrogateescape")


# What a client's header becomes in the worker's request: its role, by name. Names
# repeat from request to request (Host, Content-Type, the token header), so each one's
# role is worked out once (the cache is bounded: invented names cannot grow it). With
# a Connection header, which may name more headers to drop, roles are per request.
# That costs less than a lower() and a rules check per header per request.
# (Final: the compiled build compares them as machine integers, not as objects.)
_KEEP: Final = 1
_DROP: Final = 2
_HOST: Final = 3
_LENGTH: Final = 4
_CONNECTION: Final = 5
_TRANSFER_ENCODING: Final = 6
_NAME_ROLES: Final[dict[bytes, int]] = {}


def _role(lower: str, named: frozenset[str]) -> int:
    if lower == "host":
        return _HOST  # set to the worker's; the client's goes in X-Forwarded-Host
    if not _keeps_request_header(lower, named):
        if lower == "connection":
            return _CONNECTION
        return _TRANSFER_ENCODING if lower == "transfer-encoding" else _DROP
    return _LENGTH if lower == "content-length" else _KEEP


# The last request's names and roles (see router.relay.contract.LastNames).
_LAST_NAMES: Final = LastNames()


def _roles_by_name(items: list[tuple[bytes, bytes]]) -> tuple[list[int], bool]:
    """Each header's role by its name alone (a list never changed in place), and
    whether any is a Connection or Transfer-Encoding (`rare`: the request's own roles
    are worked out then)."""
    last = _LAST_NAMES
    if last.same(items):
        return last.roles, last.flag
    names: list[bytes] = []
    roles: list[int] = []
    rare = False  # a Connection or Transfer-Encoding header: flagged here, not searched for
    for pair in items:
        name = pair[0]
        role = _NAME_ROLES.get(name)
        if role is None:
            role = _name_role(name)
        if role >= _CONNECTION:
            rare = True
        names.append(name)
        roles.append(role)
    last.keep(names, roles, rare)
    return roles, rare


def _name_role(name: bytes) -> int:
    return remember_role(_NAME_ROLES, name, _role(name.decode("latin-1").lower(), _NONE_NAMED))


def serialize_request_head(method: str, target: str, headers: Iterable[tuple[str, str]]) -> bytes:
    """`method target HTTP/1.1`, then `headers` as they are, as bytes; raises ValueError
    when any part carries a CR or LF."""
    lines = [f"{method} {target} HTTP/1.1"]
    lines.extend([f"{name}: {value}" for name, value in headers])
    return _encode_head(lines)


def _encode_head(lines: list[str]) -> bytes:
    # Every CR and LF must be ours: the lines joined without them are searched for one
    # (memchr). Counting them in the head instead took far more: two loops over every
    # character.
    flat = "".join(lines)
    if "\n" in flat or "\r" in flat:
        raise ValueError("a header name or value carries a line break")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogateescape")
