"""The control protocol's line codec (DESIGN §3).

This module owns what one line of the control socket is: `decode_line` turns one
NDJSON line into a request or an error reply, `encode` writes one reply line, and
`error_reply` builds the reply every refusal shares; with them the protocol's limits
(a line's bytes, a key's characters). It is pure: no socket, no clock, no
session state, and it never decides what a request does (`router.control.session` does).

Malformed input is answered, never raised: `decode_line` returns the error reply.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "MAX_KEY_CHARS",
    "MAX_LINE_BYTES",
    "Reply",
    "decode_line",
    "encode",
    "encoded_size",
    "error_reply",
]

MAX_LINE_BYTES = 1 << 20  # DESIGN §3: a line over 1 MiB closes the connection
MAX_KEY_CHARS = 512  # longer than any key a token or cookie can carry

Reply = dict[str, Any]

# One encoder for every reply (json.dumps with arguments builds one per call), same
# output: 56,600 -> 63,200 pairs/s on `bench.micro --only control` with every line
# on the general path (3 runs each).
_JSON = json.JSONEncoder(separators=(",", ":"))


def encode(reply: Reply) -> bytes:
    """One reply line."""
    return _JSON.encode(reply).encode() + b"\n"


def encoded_size(value: object) -> int:
    """The bytes of `value` as JSON text in a reply line, without a newline (the
    encoder escapes every non-ASCII character, so characters and bytes agree)."""
    return len(_JSON.encode(value))


def error_reply(request_id: object, error: str, detail: str, **extra: Any) -> Reply:
    return {"id": request_id, "ok": False, "error": error, "detail": detail, **extra}


def decode_line(line: bytes) -> dict[str, Any] | Reply:
    """Parse one line into a request dict with a valid `id` and string `op`.

    Returns the request, or (when `"ok"` is in the result) the error reply.
    """
    try:
        # Decode first: json.loads(bytes) would also take UTF-16/32 and a BOM.
        message = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser goes
        return error_reply(None, "bad_request", "The line is not a JSON object.")
    if not isinstance(message, dict):
        return error_reply(None, "bad_request", "The line is not a JSON object.")
    request_id = message.get("id")
    if request_id is not None and (
        isinstance(request_id, bool) or not isinstance(request_id, (str, int))
    ):
        return error_reply(None, "bad_request", "`id` must be a string or an integer.")
    if "ok" in message:
        return error_reply(request_id, "bad_request", "Requests carry no `ok` field.")
    if not isinstance(message.get("op"), str):
        return error_reply(request_id, "bad_request", "`op` must be a string.")
    return message
