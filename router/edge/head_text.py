"""The text of a request head's bytes: its method, target, Host and version.

This module owns turning the bytes llhttp hands the public edge into the text a
`PublicRequest` carries, cheaply for the usual case: clients send the same Host, and
mostly the same method and target, request after request, so the last of each is kept
and its text reused while the bytes are the same. It is pure: no sockets, no event loop,
no limits (the connection checks those before it asks).
"""

from __future__ import annotations

import re
from typing import Final

from router.edge.wire import split_target

__all__ = ["HTTP_11", "forwarded_host_text", "host_text", "method_text", "target_of", "version_of"]

HTTP_11: Final = (1, 1)

# The usual versions and methods, looked up instead of parsed and decoded per request
# (measured with the other trims of that change: docs/performance.md).
_VERSIONS: Final = {"1.1": (1, 1), "1.0": (1, 0)}
_METHODS: Final = {
    m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH")
}


def version_of(text: str) -> tuple[int, int]:
    """The (major, minor) of an HTTP version as llhttp gave it ("1.1")."""
    known = _VERSIONS.get(text)
    if known is not None:
        return known
    major, _, minor = text.partition(".")
    return int(major), int(minor)


class _LastRead:
    """The last bytes of one kind read as text: the bytes, the text, and the authority
    of a request target (None for other kinds)."""

    def __init__(self, raw: bytes = b"", text: str = "") -> None:
        self.raw = raw
        self.text = text
        self.authority: str | None = None


# Clients send the same Host, and mostly the same method and target, request after
# request: the last one's text is reused when the bytes are the same, instead of
# decoding them (or looking the bytes up by hash), which cost more in on_header (Host)
# and on_headers_complete (method, target).
_LAST_HOST: Final = _LastRead()
# A peer listener reads two Hosts a request (its own, from the edge, and the client's,
# X-Forwarded-Host, which the sending router set): each has its own last read, or both
# would miss every request.
_LAST_FORWARDED_HOST: Final = _LastRead()
_LAST_METHOD: Final = _LastRead(b"POST", "POST")
_LAST_TARGET: Final = _LastRead()


# RFC 3986's host (a name, an IPv4 address or a bracketed IP literal) and port, in the
# characters they may hold; empty too (RFC 9110 §7.2: a target with no authority).
_HOST_VALUE: Final = re.compile(rb"[A-Za-z0-9._~!$&'()*+,;=%:\[\]-]*")


def host_text(value: bytes) -> str | None:
    """A Host header's value as text, or None when it is no host and port (RFC 9112
    §3.2: 400), as nginx refuses one with a space in it. Checked only when the bytes
    change, like the rest: the same Host, request after request, is read once."""
    return _host_text(value, _LAST_HOST)


def forwarded_host_text(value: bytes) -> str | None:
    """`host_text` for the X-Forwarded-Host a peer hop carries (its own last read)."""
    return _host_text(value, _LAST_FORWARDED_HOST)


def _host_text(value: bytes, last: _LastRead) -> str | None:
    if value == last.raw:
        return last.text
    if _HOST_VALUE.fullmatch(value) is None:
        return None
    text = value.decode("ascii")
    last.raw = value
    last.text = text
    return text


def method_text(method: bytes) -> str:
    """A request method as text (llhttp let only token characters in)."""
    last = _LAST_METHOD
    if method == last.raw:
        return last.text
    text = _METHODS.get(method) or method.decode("ascii")
    last.raw = method
    last.text = text
    return text


def target_of(url: bytes) -> tuple[str, str | None]:
    """The request target and authority (`split_target`) of `url` as llhttp gave it."""
    last = _LAST_TARGET
    if url == last.raw:
        return last.text, last.authority
    target, authority = split_target(url.decode("utf-8", "surrogateescape"))
    last.raw = url
    last.text = target
    last.authority = authority
    return target, authority
