"""Where a session key sits in a request or a reply: the small grammars around the values.

This module owns reading the places `router.sessions.formats`' values come from: the
request's Cookie header lines and a reply's Set-Cookie headers (as the servers
behind the router read and write them) and RFC 6901 JSON pointers into a parsed body
(the grammars of pointers and path patterns, which the config checks, are
`router.config.patterns`'). Each gives the value as written there,
or None (a LookupError for a pointer) when there is none, and raises ValueError for
a malformed pointer or pattern; checking the value as a session key is
`router.sessions.formats`' work.

It is pure: it must never import asyncio or aiohttp, read a clock (callers
pass `now`), log, or touch the network.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from email.utils import mktime_tz, parsedate_tz
from typing import Final

from router.config import parse_json_pointer
from router.sessions.formats import json_type

__all__ = [
    "json_pointer",
    "parse_cookie_header",
    "set_cookie_value",
]

# RFC 6265 §4.1.1: cookie-name is an RFC 2616 token (values: see parse_cookie_header).
_COOKIE_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_MAX_AGE: Final = re.compile(r"-?[0-9]+")
_ARRAY_INDEX: Final = re.compile(r"0|[1-9][0-9]*")


# ---------------------------------------------------------------------------- cookies


def parse_cookie_header(values: Sequence[str]) -> dict[str, list[str]]:
    """Every cookie in the request's Cookie header lines: name -> all its values, in order.

    Read as the servers behind the router read them (Starlette's cookie parser, over
    Python's http.cookies), not by RFC 6265's stricter grammar: `name=value` pairs
    separated by ";", whitespace around name and value dropped, any value kept, and a
    value in double quotes unquoted with its backslash escapes (`_unquote`). A value
    the grammar forbids (a space, a comma) still reaches the worker, which reads it:
    skipping it here would route the request as if it named no session, or by
    another source or another copy of the cookie than the worker reads. A pair with
    no "=" or a name no cookie may have is skipped. Several values under one name let
    the caller notice a cookie repeated with different values.
    """
    cookies: dict[str, list[str]] = {}
    for line in values:
        for pair in line.split(";"):
            name, sep, raw = pair.partition("=")
            name = name.strip()
            if sep and _COOKIE_NAME.fullmatch(name):
                cookies.setdefault(name, []).append(_unquote(raw.strip()))
    return cookies


# A backslash escape in a quoted cookie value: three octal digits, or any one character.
_COOKIE_ESCAPE: Final = re.compile(r"\\(?:([0-3][0-7][0-7])|(.))", re.DOTALL)


def _unquote(value: str) -> str:
    """A cookie value as http.cookies reads it: one in double quotes loses them, and
    its escapes (`\\054` for a comma, `\\"` for a quote) become what they stand for,
    as Python's servers send them (`set_cookie("s", "a,b")` sends `s="a\\054b"`)."""
    if len(value) < 2 or value[0] != '"' or value[-1] != '"':
        return value
    return _COOKIE_ESCAPE.sub(_unescaped, value[1:-1])


def _unescaped(match: re.Match[str]) -> str:
    octal = match.group(1)
    return chr(int(octal, 8)) if octal is not None else match.group(2)


def set_cookie_value(
    set_cookie_values: Sequence[str], name: str, *, now: float | None = None
) -> str | None:
    """The value a reply's Set-Cookie headers give cookie `name`: the last one wins.

    None when no header sets it, or when the last one deletes it: an empty
    value, `Max-Age` zero or below, or (only when `now`, wall-clock seconds, is
    given) an `Expires` at or before `now` with no `Max-Age` (RFC 6265 §5.3:
    Max-Age wins). Starlette clears a session with `null; expires=1970`, so
    callers that can should pass `now`. A quoted value is unquoted as
    `parse_cookie_header` unquotes it, so what is learned is what is read back.
    """
    found: str | None = None
    for line in set_cookie_values:
        pair, *attributes = line.split(";")
        cookie_name, sep, value = pair.partition("=")
        if not sep or cookie_name.strip(" \t") != name:
            continue
        value = _unquote(value.strip(" \t"))
        found = None if not value or _deletes(attributes, now) else value
    return found


def _deletes(attributes: list[str], now: float | None) -> bool:
    max_age: int | None = None
    expires: float | None = None
    for attribute in attributes:
        attr_name, _, attr_value = attribute.partition("=")
        attr_name, attr_value = attr_name.strip(" \t").lower(), attr_value.strip(" \t")
        if attr_name == "max-age" and _MAX_AGE.fullmatch(attr_value):
            max_age = int(attr_value)
        elif attr_name == "expires":
            expires = _http_date(attr_value)
    if max_age is not None:
        return max_age <= 0
    return expires is not None and now is not None and expires <= now


def _http_date(text: str) -> float | None:
    """Seconds since the epoch of an HTTP date (RFC 1123 or RFC 850 forms), or None."""
    if len(text) > 64:  # dates are 29 characters; a long one is not a date
        return None
    try:
        parsed = parsedate_tz(text)
        return None if parsed is None else float(mktime_tz(parsed))
    except (ValueError, OverflowError, TypeError, IndexError):
        return None


# ---------------------------------------------------------------------------- JSON pointers


def json_pointer(document: object, pointer: str) -> object:
    """The value `pointer` (RFC 6901) refers to in a parsed JSON `document`.

    Array indices are decimal without leading zeros; "-" (past the end) never
    refers to a value. Raises LookupError when the value does not exist (a
    missing key, an index out of range, a step into a scalar) and ValueError
    for a malformed pointer.
    """
    value = document
    for token in parse_json_pointer(pointer):
        if isinstance(value, dict):
            if token not in value:
                raise LookupError(f"no member {token!r}")
            value = value[token]
        elif isinstance(value, list):
            if not _ARRAY_INDEX.fullmatch(token) or int(token) >= len(value):
                raise LookupError(f"no array element {token!r}")
            value = value[int(token)]
        else:
            raise LookupError(f"{json_type(value)} has no member {token!r}")
    return value
