"""Session kinds: which session a request names, read from its headers (DESIGN §4).

`SessionReader.read(headers, now)` returns the (kind, key) a request names,
None when it names none, or the router's answer when what it carries cannot be
used (malformed token, bad signature, the same header repeated with different
values). The first source present decides on its own: the router never falls
through to a weaker source when a stronger one is invalid.

Pure: takes any header mapping with `getall`, reads no clock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from router.answers import Answer
from router.tokens import TokenError, TokenVerifier, parse_token

MAX_RAW_KEY_CHARS = 512  # the control protocol's key bound: longer can never be claimed


class Headers(Protocol):
    def getall(self, key: str, default: list[str]) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class SessionKind:
    """One configured kind, reduced to what reading a request needs."""

    name: str
    header: str
    format: str  # "jws" | "raw"
    verifier: TokenVerifier | None = None
    unclaimed_forward: bool = False


@dataclass(frozen=True, slots=True)
class SessionRef:
    kind: str
    key: str


class SessionReader:
    """Reads the session a request names, in the configured order."""

    def __init__(self, kinds: Sequence[SessionKind]) -> None:
        self.kinds = tuple(kinds)

    def read(self, headers: Headers, now: float) -> SessionRef | Answer | None:
        """`now` is wall-clock seconds (token expiry is wall time)."""
        for kind in self.kinds:
            values = headers.getall(kind.header, [])
            if not values:
                continue
            if any(value != values[0] for value in values[1:]):
                return Answer(
                    "ambiguous_session",
                    f"The {kind.header} header is repeated with different values.",
                )
            return self._key(kind, values[0], now)
        return None

    def _key(self, kind: SessionKind, value: str, now: float) -> SessionRef | Answer:
        if kind.format == "raw":
            if not value or len(value) > MAX_RAW_KEY_CHARS:
                return Answer("invalid_token", f"The {kind.header} value is empty or too long.")
            return SessionRef(kind.name, value)
        try:
            token = parse_token(value, now=now, verifier=kind.verifier)
        except TokenError as exc:
            return Answer(exc.code, exc.detail)
        return SessionRef(kind.name, token.key)
