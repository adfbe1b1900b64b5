"""Session key formats: the values servers we cannot change put their session ids in.

This module owns reading a session key out of one value: a Starlette
SessionMiddleware cookie, an itsdangerous URLSafeSerializer token (NeMo Gym's
MCP session token), a raw value, an `Mcp-Session-Id`, a JSON body field, or a
path segment; and the small HTTP grammars around them (Cookie and Set-Cookie
headers, RFC 6901 JSON pointers, path patterns). Each parser returns the key or
raises `FormatError` carrying the router's answer code.

It is pure: it must never import asyncio or aiohttp, read a clock (callers
pass `now`), log, or touch the network. No exception other than `FormatError`
escapes a key parser, whatever the input.
"""

# Why values are read the way they are:
# - A value is read exactly as the server that minted it reads it (json.loads of bytes for
#   Starlette, UTF-8 text for itsdangerous, duplicate JSON keys: the last wins), so the router
#   and the worker always agree on the key. Only the framing around the payload (base64
#   alphabet, padding, separators) is checked more strictly than the libraries do: a value
#   the libraries would accept only by skipping characters was not minted by them.
# - Malformed input is `invalid_token` whether or not a key is configured, and only a
#   well-formed value whose signature fails is `bad_signature`: the code never depends on
#   the configuration, and a forged value costs one HMAC.
# - itsdangerous inflates a compressed payload without bound; here inflation stops at
#   MAX_PAYLOAD_BYTES, so a 16 KiB header can never become 16 MiB of memory.

from __future__ import annotations

import base64
import binascii
import json
import re
import unicodedata
import zlib
from collections.abc import Callable, Sequence
from email.utils import mktime_tz, parsedate_tz
from typing import TYPE_CHECKING, Final

from itsdangerous import BadSignature, TimestampSigner, URLSafeSerializer

from router.token_errors import RefusalCode, RefusedValue

if TYPE_CHECKING:
    from router.config import SignatureConfig

__all__ = [
    "MAX_KEY_CHARS",
    "FormatError",
    "compile_path_pattern",
    "itsdangerous_session_key",
    "json_pointer",
    "mcp_session_key",
    "parse_cookie_header",
    "parse_json_pointer",
    "raw_session_key",
    "set_cookie_value",
    "starlette_session_key",
]

MAX_KEY_CHARS: Final = 512  # the control protocol's key bound: a longer key can never be claimed
MAX_VALUE_CHARS: Final = 16384  # a signed value longer than the default header limit is not real
MAX_PAYLOAD_BYTES: Final = 65536  # inflated itsdangerous payloads; session tokens are far smaller

FormatErrorCode = RefusalCode

# Starlette: b64encode(json) "." base64url(timestamp) "." base64url(HMAC-SHA1).
_STARLETTE: Final = re.compile(r"([A-Za-z0-9+/]+={0,2})\.([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)")
# itsdangerous URLSafeSerializer: ["."] base64url(json or zlib(json)) "." base64url(signature).
_URLSAFE: Final = re.compile(r"(\.?)([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)")
# RFC 6265 §4.1.1: cookie-name is an RFC 2616 token (values: see parse_cookie_header).
_COOKIE_NAME: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_MAX_AGE: Final = re.compile(r"-?[0-9]+")
_ARRAY_INDEX: Final = re.compile(r"0|[1-9][0-9]*")
_POINTER_ESCAPE: Final = re.compile(r"~(?![01])")
# RFC 3986 pchar: unreserved, pct-encoded, sub-delims, ":" and "@".
_PATH_SEGMENT: Final = re.compile(r"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})+")
_KEY_PLACEHOLDER: Final = "{key}"


class FormatError(RefusedValue):
    """A session value the router refuses.

    ``code`` is ``invalid_token`` (HTTP 401: malformed, undecodable, missing or
    mistyped field) or ``bad_signature`` (HTTP 403: the server's key does not
    verify it, or it is older than the configured maximum age); ``detail`` is
    one human sentence for the answer body.
    """


def _invalid(detail: str) -> FormatError:
    return FormatError("invalid_token", detail)


def _forged(detail: str) -> FormatError:
    return FormatError("bad_signature", detail)


# ---------------------------------------------------------------------------- plain keys


def raw_session_key(value: str) -> str:
    """`value` itself as a session key: 1 to 512 characters, none of them a control character.

    Raises `FormatError("invalid_token")` otherwise.
    """
    if not value:
        raise _invalid("The session key is empty.")
    if len(value) > MAX_KEY_CHARS:
        raise _invalid(f"The session key is longer than {MAX_KEY_CHARS} characters.")
    if not value.isprintable() and any(unicodedata.category(c) == "Cc" for c in value):
        raise _invalid("The session key contains a control character.")
    return value


def mcp_session_key(value: str) -> str:
    """An `Mcp-Session-Id` as a session key: 1 to 512 visible ASCII characters (0x21-0x7E).

    The MCP specification allows only visible ASCII in a session id. Raises
    `FormatError("invalid_token")` otherwise.
    """
    if not 1 <= len(value) <= MAX_KEY_CHARS:
        raise _invalid(f"The Mcp-Session-Id must be 1 to {MAX_KEY_CHARS} characters.")
    if not (value.isascii() and all("!" <= c <= "~" for c in value)):
        raise _invalid("The Mcp-Session-Id must be visible ASCII (0x21 to 0x7E).")
    return value


def _field_key(payload: object, field: str, what: str) -> str:
    """The session key in `payload[field]`: a string, or an integer written in decimal."""
    if not isinstance(payload, dict):
        raise _invalid(f"The {what} is {_json_type(payload)}, not a JSON object.")
    if field not in payload:
        raise _invalid(f"The {what} has no {field!r} field.")
    return _scalar_key(payload[field], f"The {what}'s {field!r} field")


def _scalar_key(value: object, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _invalid(f"{what} is {_json_type(value)}, not a string or an integer.")
    try:
        return raw_session_key(value if isinstance(value, str) else str(value))
    except FormatError as exc:
        raise _invalid(f"{what} is not a usable session key: {exc.detail}") from None


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


# ---------------------------------------------------------------------------- Starlette


def starlette_session_key(
    cookie_value: str, *, field: str, signature: SignatureConfig | None, now: float
) -> str:
    """The session key in a Starlette SessionMiddleware cookie's `field`.

    The cookie is `TimestampSigner(secret).sign(b64encode(json.dumps(session)))`.
    Without `signature` the payload is read without checking the signature;
    with it, the signature must verify with `signature.key` and, when
    `signature.max_age_s` is set, the cookie must be signed at most that many
    seconds before `now` (wall-clock seconds, as SessionMiddleware counts).
    Raises `FormatError`: `invalid_token` for a malformed cookie or field,
    `bad_signature` for a forged or expired one.
    """
    if len(cookie_value) > MAX_VALUE_CHARS:
        raise _invalid(f"The session cookie is longer than {MAX_VALUE_CHARS} characters.")
    match = _STARLETTE.fullmatch(cookie_value)
    if match is None:
        raise _invalid("The session cookie is not a signed Starlette session.")
    try:
        data = base64.b64decode(match[1], validate=True)
    except binascii.Error:
        raise _invalid("The session cookie's payload is not valid base64.") from None
    try:
        session = json.loads(data)  # bytes, exactly as SessionMiddleware reads them
    except (ValueError, RecursionError):
        raise _invalid("The session cookie's payload is not valid JSON.") from None
    key = _field_key(session, field, "session cookie")
    if signature is not None:
        _check_timestamp_signature(cookie_value, signature, now)
    return key


def _check_timestamp_signature(value: str, signature: SignatureConfig, now: float) -> None:
    signer = TimestampSigner(signature.key)  # SessionMiddleware: TimestampSigner(str(secret))
    try:
        _, signed_at = signer.unsign(value, return_timestamp=True)
    except BadSignature:
        raise _forged("The session cookie's signature does not verify.") from None
    if signature.max_age_s is None:
        return
    # itsdangerous' own rule, with an injected clock: whole seconds, and never from the future.
    age = int(now) - int(signed_at.timestamp())
    if age > signature.max_age_s:
        raise _forged(f"The session cookie expired: signed {age} s ago.")
    if age < 0:
        raise _forged("The session cookie is signed in the future.")


# ---------------------------------------------------------------------------- itsdangerous


def itsdangerous_session_key(token: str, *, field: str, signature: SignatureConfig | None) -> str:
    """The session key in an itsdangerous URLSafeSerializer token.

    The payload is base64url JSON, zlib-compressed when it starts with ".". An
    object payload gives its `field`; a payload that is itself a string or an
    integer is the key (NeMo Gym signs the bare session id when a session has
    no tool restriction). Without `signature` the signature is not checked;
    with it, it must verify with `signature.key` and `signature.salt` (None:
    itsdangerous' default salt). Raises `FormatError`: `invalid_token` for a
    malformed token or field, `bad_signature` for a forged one.
    """
    if len(token) > MAX_VALUE_CHARS:
        raise _invalid(f"The session token is longer than {MAX_VALUE_CHARS} characters.")
    match = _URLSAFE.fullmatch(token)
    if match is None:
        raise _invalid("The session token is not an itsdangerous URL-safe token.")
    payload = _urlsafe_payload(match[2], compressed=bool(match[1]))
    key = (
        _field_key(payload, field, "session token")
        if isinstance(payload, dict)
        else _scalar_key(payload, "The session token's payload")
    )
    if signature is not None:
        salt = signature.salt
        serializer = (
            URLSafeSerializer(signature.key)
            if salt is None
            else URLSafeSerializer(signature.key, salt=salt)
        )
        try:
            serializer.make_signer().unsign(token)
        except BadSignature:
            raise _forged("The session token's signature does not verify.") from None
    return key


def _urlsafe_payload(segment: str, *, compressed: bool) -> object:
    if len(segment) % 4 == 1:
        raise _invalid("The session token's payload is not valid base64.")
    data = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
    if compressed:
        data = _inflate(data)
    try:
        return json.loads(data.decode("utf-8"))  # text, exactly as itsdangerous reads it
    except UnicodeDecodeError:
        raise _invalid("The session token's payload is not valid UTF-8.") from None
    except (ValueError, RecursionError):
        raise _invalid("The session token's payload is not valid JSON.") from None


def _inflate(data: bytes) -> bytes:
    inflater = zlib.decompressobj()
    try:
        out = inflater.decompress(data, MAX_PAYLOAD_BYTES)
    except zlib.error:
        raise _invalid("The session token's payload is not valid zlib data.") from None
    if not inflater.eof and (inflater.unconsumed_tail or len(out) == MAX_PAYLOAD_BYTES):
        raise _invalid(f"The session token's payload inflates past {MAX_PAYLOAD_BYTES} bytes.")
    if not inflater.eof or inflater.unused_data:
        raise _invalid("The session token's payload is not one complete zlib stream.")
    return out


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


def parse_json_pointer(pointer: str) -> tuple[str, ...]:
    """The reference tokens of an RFC 6901 JSON pointer, unescaped ("~1" is "/", "~0" is "~").

    "" is the whole document. Raises ValueError for a pointer that does not
    start with "/" or has a "~" not followed by 0 or 1.
    """
    if not pointer:
        return ()
    if not pointer.startswith("/"):
        raise ValueError("a JSON pointer starts with '/'")
    if _POINTER_ESCAPE.search(pointer):
        raise ValueError("'~' in a JSON pointer must be followed by 0 or 1 (~0 is ~, ~1 is /)")
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/"))


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
            raise LookupError(f"{_json_type(value)} has no member {token!r}")
    return value


# ---------------------------------------------------------------------------- path patterns


def compile_path_pattern(pattern: str) -> Callable[[str], str | None]:
    """A matcher for `pattern`, like "/rollouts/{key}/stop": it gives a path's key, or None.

    The pattern starts with "/", has exactly one "{key}" segment and at least
    one literal segment; literal segments are RFC 3986 path characters and
    match exactly. The matcher takes a request's raw path (a query string is
    ignored) and returns the key segment exactly as written there, with no
    percent-decoding, since workers read the same raw path; an empty key
    segment does not match. Callers check the key with `raw_session_key`.
    Raises ValueError for a bad pattern.
    """
    segments = _pattern_segments(pattern)
    index = segments.index(_KEY_PLACEHOLDER)

    def match(path: str) -> str | None:
        parts = path.partition("?")[0].split("/")
        if len(parts) != len(segments) + 1 or parts[0]:
            return None
        del parts[0]
        key = parts[index]
        parts[index] = _KEY_PLACEHOLDER
        return key if key and parts == segments else None

    return match


def _pattern_segments(pattern: str) -> list[str]:
    if not pattern.startswith("/"):
        raise ValueError("a path pattern starts with '/'")
    segments = pattern[1:].split("/")
    if segments.count(_KEY_PLACEHOLDER) != 1:
        raise ValueError("a path pattern has exactly one {key} segment")
    literals = [s for s in segments if s != _KEY_PLACEHOLDER]
    if not literals:
        raise ValueError(
            "a path pattern needs a literal segment besides {key}, "
            "or every one-segment path (/health, /seed_session) would name a session"
        )
    for segment in literals:
        if "{" in segment or "}" in segment or "*" in segment:
            raise ValueError(f"{segment!r}: {{key}} must be a whole segment; '*' is not supported")
        if not _PATH_SEGMENT.fullmatch(segment):
            raise ValueError(f"{segment!r} is not a path segment (empty, or not URL characters)")
    return segments
