"""The control protocol's lines (design §3): its version, its limits, its codec.

This module is the one home of what both ends of the control socket must agree on:
the protocol version a hello names, a line's byte limit, a key's character limit, the
shape of a reply (`{"id", "ok", ...}`, and `error_reply`'s refusal), and the NDJSON
codec: `encode_line` writes one line (a request or a reply), `decode_line` reads a
request as the router does, `decode_reply` a reply as a worker does. The router
(`router.control`) and the worker client (`router.worker`) both import it.

It is pure: no socket, no clock, no session state, and it never decides what a request
does (`router.control.session` does). Malformed input is answered, never raised:
`decode_line` returns the error reply, `decode_reply` None.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "MAX_KEY_CHARS",
    "MAX_LINE_BYTES",
    "PROTOCOL_VERSION",
    "Reply",
    "decode_line",
    "decode_reply",
    "encode_line",
    "encoded_size",
    "error_reply",
]

PROTOCOL_VERSION = 1  # the `v` of a hello; another is refused `unsupported_version`
MAX_LINE_BYTES = 1 << 20  # design §3: a line over 1 MiB closes the connection
MAX_KEY_CHARS = 512  # longer than any key a token or cookie can carry

Reply = dict[str, Any]

# One encoder for every reply (json.dumps with arguments builds one per call), same
# output.
_JSON = json.JSONEncoder(separators=(",", ":"))


def encode_line(message: Reply) -> bytes:
    """One line: compact JSON (every non-ASCII character escaped, so it is ASCII) and a
    trailing newline."""
    return _JSON.encode(message).encode() + b"\n"


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


def decode_reply(line: bytes) -> Reply | None:
    """The JSON object on a reply `line` (UTF-8), or None when it is not one."""
    try:
        value = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError too
        return None
    return value if isinstance(value, dict) else None
