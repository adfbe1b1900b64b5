"""Request framing the parser lets through but the router refuses (design §8).

aiohttp's parser already refuses the worst (CL with TE, repeated or odd
Content-Length, bad syntax). What it accepts and a proxy must not pass on:

- a Transfer-Encoding other than plain `chunked` (`gzip, chunked`): the parser
  undoes only the chunking, so the worker would get a still-coded body with
  nothing saying so; like nginx, only `chunked` is accepted;
- Transfer-Encoding below HTTP/1.1, whose framing RFC 9112 §6.1 calls faulty;
- a body on GET or HEAD: it has no meaning there, and a worker that does not
  read it would take it as its next request on a kept-alive connection;
- a `#` in the request target: a target has no fragment (RFC 9112 §3.2), and
  the part after it would be read differently by the router and the worker;
- CONNECT and the asterisk form (`OPTIONS *`): the router forwards requests for
  a worker's resources, never a tunnel, and `*` names no resource of a worker.

Pure: takes what the parser produced, returns a problem or None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

_BODYLESS_METHODS: Final = frozenset({"GET", "HEAD"})


def framing_problem(
    method: str,
    version: tuple[int, int],
    transfer_encodings: Sequence[str],
    content_length: int | None,
    raw_target: str,
) -> str | None:
    """One sentence saying why the request is refused, or None to go on."""
    if version > (1, 1):
        # llhttp takes any major.minor: HTTP/2 and above is not HTTP/1.1 text, and is
        # not forwarded as if it were (nginx answers 505). HTTP/0.9's bare request line
        # is forwarded, as the desync corpus's "acceptable" tier asks.
        return "HTTP versions above 1.1 are not served in this syntax."
    if transfer_encodings:
        if version < (1, 1):
            return "Transfer-Encoding needs HTTP/1.1."
        codings = ",".join(transfer_encodings).replace(" ", "").replace("\t", "").lower()
        if codings != "chunked":
            return "Only Transfer-Encoding: chunked is accepted."
    has_body = bool(transfer_encodings) or bool(content_length)
    if has_body and method in _BODYLESS_METHODS:
        return f"A {method} request carries no body here."
    if "#" in raw_target:
        return "A request target has no fragment (#)."
    if method == "CONNECT":
        return "CONNECT is not forwarded: the router opens no tunnels."
    if raw_target == "*":
        return "The asterisk form (OPTIONS *) names no worker resource."
    return None


def content_length_number(value: bytes) -> int:
    """The number a Content-Length value spells, as `int(value)` reads it (llhttp has
    let through only digits, with any whitespace around them outside its span).

    Digit by digit for the usual value: `int()` on bytes is a generic call from the
    compiled build, and this loop costs much less for a short length (measured:
    docs/performance.md, "The hot path's trims"). Anything but plain digits goes to
    `int()`, so the result, and the error for a value that is no number, are the same.
    """
    if not value or len(value) > _DIGITS_DONE_BY_HAND:
        return int(value)
    number = 0
    for index in range(len(value)):
        digit = value[index] - 48  # "0"
        if digit < 0 or digit > 9:
            return int(value)
        number = number * 10 + digit
    return number


# Longer values (never a real body's length) are left to int().
_DIGITS_DONE_BY_HAND: Final = 18
