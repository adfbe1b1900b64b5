"""Session key formats: the values servers we cannot change put their session ids in.

This module owns reading a session key out of one value: a Starlette
SessionMiddleware cookie, an itsdangerous URLSafeSerializer token (NeMo Gym's
MCP session token), a raw value, an `Mcp-Session-Id`, a JSON body field, or a
path segment. Each parser returns the key or raises `FormatError` carrying the
router's answer code. Finding the value in a request or a reply (Cookie and
Set-Cookie headers, JSON pointers, path patterns) is `router.sessions.sources`' work.

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
from typing import TYPE_CHECKING, Final

from itsdangerous import BadSignature, TimestampSigner, URLSafeSerializer

from router.protocol import MAX_KEY_CHARS  # a longer key can never be claimed
from router.tokens import RefusalCode, RefusedValue

if TYPE_CHECKING:
    from router.config import SignatureConfig

__all__ = [
    "MAX_KEY_CHARS",
    "FormatError",
    "itsdangerous_session_key",
    "json_type",
    "mcp_session_key",
    "raw_session_key",
    "starlette_session_key",
]

MAX_VALUE_CHARS: Final = 16384  # a signed value longer than the default header limit is not real
MAX_PAYLOAD_BYTES: Final = 65536  # inflated itsdangerous payloads; session tokens are far smaller

FormatErrorCode = RefusalCode

# Starlette: b64encode(json) "." base64url(timestamp) "." base64url(HMAC-SHA1).
_STARLETTE: Final = re.compile(r"([A-Za-z0-9+/]+={0,2})\.([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)")
# itsdangerous URLSafeSerializer: ["."] base64url(json or zlib(json)) "." base64url(signature).
_URLSAFE: Final = re.compile(r"(\.?)([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)")


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
        raise _invalid(f"The {what} is {json_type(payload)}, not a JSON object.")
    if field not in payload:
        raise _invalid(f"The {what} has no {field!r} field.")
    return _scalar_key(payload[field], f"The {what}'s {field!r} field")


def _scalar_key(value: object, what: str) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _invalid(f"{what} is {json_type(value)}, not a string or an integer.")
    try:
        return raw_session_key(value if isinstance(value, str) else str(value))
    except FormatError as exc:
        raise _invalid(f"{what} is not a usable session key: {exc.detail}") from None


def json_type(value: object) -> str:
    """How an error message names the type of a parsed JSON value: "null", "a number", ..."""
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
    Raises `FormatError`: `invalid_token` for a malformed or expired cookie or field,
    `bad_signature` for a forged one.
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
    # A genuine signature on a cookie out of its time is no forgery: 401 invalid_token,
    # as an expired episode token is (design §1: malformed, wrong types, expired).
    if age > signature.max_age_s:
        raise _invalid(f"The session cookie expired: signed {age} s ago.")
    if age < 0:
        raise _invalid("The session cookie is signed in the future.")


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
