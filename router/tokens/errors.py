"""The error every episode-token check raises, and how a peer's value appears in its detail.

This module owns `TokenError` and its base `RefusedValue` (a code, a detail sentence
and an HTTP status, shared with `router.sessions.formats.FormatError`), and
`_show`, which cuts a peer's value short before it goes into a detail. Both
the parser (`router.tokens`) and the keys (`router.tokens.keys`) raise it. It
sits below both because `router.tokens` imports and re-exports the keys, so
the keys cannot import `router.tokens`.

It is pure: it must never import asyncio or aiohttp, log, or echo a peer's
value at full length.
"""

from __future__ import annotations

from typing import Literal

RefusalCode = Literal["invalid_token", "bad_signature"]
TokenErrorCode = RefusalCode


class RefusedValue(Exception):
    """A token or session value the router refuses: the base of `TokenError` and
    `router.sessions.formats.FormatError`, which share the codes, the detail and the status.

    ``code`` is ``invalid_token`` (HTTP 401) or ``bad_signature`` (HTTP 403);
    ``detail`` is one human sentence for the answer body.
    """

    code: RefusalCode
    detail: str

    def __init__(self, code: RefusalCode, detail: str) -> None:
        super().__init__(code, detail)  # both in args, so the error pickles intact
        self.code = code
        self.detail = detail

    def __str__(self) -> str:
        return self.detail

    @property
    def status(self) -> int:
        """The HTTP status of the router's answer: 401 or 403."""
        return 401 if self.code == "invalid_token" else 403


class TokenError(RefusedValue):
    """A token the router refuses.

    ``code`` is ``invalid_token`` (HTTP 401: malformed, wrong types, expired) or
    ``bad_signature`` (HTTP 403: the signature or its alg fails edge verification);
    ``detail`` is one human sentence for the answer body.
    """


def _show(value: object) -> str:
    """A short repr of a peer's value for a detail sentence: never echo 4 KiB back."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
