"""Session kinds: which session a request names (design §4).

`SessionReader` reads the sources in the contract's fixed order, and within
each source in the configured order:

1. JWS or raw header tokens;
2. cookies;
3. itsdangerous header tokens and `Mcp-Session-Id`;
4. JSON body fields;
5. paths.

The first source that is present decides on its own, even when its value is
invalid: the router never falls through to a weaker source. A session header
(or cookie) repeated with different values is `ambiguous_session`. A request
to a kind's seed route ignores that kind's own source, so a stale cookie never
pins a new session.

Pure: no aiohttp, no clock reads. The body is read by the caller (only when a
body kind could decide) and handed in as bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Protocol

from router.config import (
    LearnConfig,
    RouteConfig,
    SessionKindConfig,
    SignatureConfig,
    compile_path_pattern,
)
from router.core import Answer
from router.sessions.formats import (
    FormatError,
    itsdangerous_session_key,
    mcp_session_key,
    raw_session_key,
    starlette_session_key,
)
from router.sessions.sources import json_pointer, parse_cookie_header
from router.tokens import RefusedValue, TokenCache, TokenVerifier, parse_token


class Headers(Protocol):
    def getall(self, key: str, default: list[str]) -> list[str]: ...


@dataclass(frozen=True, slots=True)
class Route:
    """A seed or close route: exact method and path."""

    method: str
    path: str

    def matches(self, method: str, path: str) -> bool:
        return self.path == path and self.method == method


@dataclass(frozen=True, slots=True)
class SessionKind:
    """One configured kind, reduced to what reading requests and replies needs."""

    name: str
    source: str  # "header" | "cookie" | "mcp" | "body_field" | "path"
    format: str = "jws"  # header: jws | raw | itsdangerous; cookie: starlette | raw
    header: str | None = None  # header and mcp kinds
    cookie: str | None = None
    field: str | None = None  # itsdangerous payload key, or the Starlette session field
    verifier: TokenVerifier | None = None  # jws edge verification
    signature: SignatureConfig | None = None  # itsdangerous / starlette edge verification
    pointer: str | None = None  # body_field kinds
    max_body_bytes: int = 65536
    path_match: Callable[[str], str | None] | None = None  # path kinds
    mcp_path: str | None = None
    seed: Route | None = None
    close: Route | None = None
    learn: LearnConfig | None = None

    @property
    def precedence(self) -> int:
        """The contract's source order (lower reads first)."""
        if self.source == "header":
            return 3 if self.format == "itsdangerous" else 1
        return {"cookie": 2, "mcp": 3, "body_field": 4, "path": 5}[self.source]

    @property
    def not_found_code(self) -> str:
        """What naming an unknown key of this kind gets (MCP: 404, as its spec says)."""
        return "unknown_session" if self.source == "mcp" else "unknown_episode"


def kind_from_config(config: SessionKindConfig) -> SessionKind:
    """The runtime view of one configured kind."""
    base = SessionKind(
        name=config.name,
        source=config.source,
        seed=_route(config.seed),
        close=_route(config.close),
        learn=config.seed.learn if config.seed is not None else None,
    )
    if config.cookie is not None:
        cookie = config.cookie
        return replace(
            base,
            format=cookie.format,
            cookie=cookie.name,
            field=cookie.field,
            signature=cookie.signature,
        )
    if config.mcp is not None:
        return replace(base, format="raw", header=config.mcp.header, mcp_path=config.mcp.path)
    if config.body_field is not None:
        body = config.body_field
        return replace(base, format="raw", pointer=body.pointer, max_body_bytes=body.max_bytes)
    if config.path is not None:
        return replace(base, format="raw", path_match=compile_path_pattern(config.path.pattern))
    token = config.token
    verifier = None
    if token.format == "jws" and token.verify is not None:
        verifier = TokenVerifier.from_config(token.verify.alg, token.verify.key)
    return replace(
        base,
        format=token.format,
        header=config.header,
        field=token.field,
        verifier=verifier,
        signature=token.signature,
    )


def _route(route: RouteConfig | None) -> Route | None:
    return None if route is None else Route(route.method, route.path)


# Not frozen: one is made per request naming a session, and a frozen init costs more
# than a plain one. Treated as immutable all the same. Its own __init__ for the compiled
# build, as router.core.machine.Forward.
@dataclass(slots=True, init=False)
class SessionRef:
    kind: str
    key: str
    # A session header that came repeated (lines, or values joined by commas) with one
    # value: that value, which the worker gets in one line instead (None otherwise).
    one_line: str | None

    def __init__(self, kind: str, key: str, one_line: str | None = None) -> None:
        self.kind = kind
        self.key = key
        self.one_line = one_line


# Session formats whose text cannot hold a comma (base64url, dots, dashes).
_COMMA_FREE_FORMATS: Final = frozenset({"jws", "itsdangerous"})


@dataclass(slots=True)
class _Ordered:
    head: list[SessionKind] = field(default_factory=list)  # sources 1-3
    body: list[SessionKind] = field(default_factory=list)
    path: list[SessionKind] = field(default_factory=list)


class SessionReader:
    """Reads the session a request names, in the contract's order."""

    def __init__(self, kinds: Sequence[SessionKind]) -> None:
        self.kinds = tuple(kinds)
        self.by_name = {kind.name: kind for kind in self.kinds}
        ordered = sorted(self.kinds, key=lambda kind: kind.precedence)  # stable: config order
        self._order = _Ordered()
        for kind in ordered:
            bucket = {"body_field": self._order.body, "path": self._order.path}
            bucket.get(kind.source, self._order.head).append(kind)
        self.max_body_bytes = max((k.max_body_bytes for k in self._order.body), default=0)
        # Episode tokens in a header: parsed once per token, then looked up (TokenCache).
        self._token_caches = {
            kind.name: TokenCache(kind.verifier)
            for kind in self.kinds
            if kind.source == "header" and kind.format == "jws"
        }
        # Header kinds whose values never hold a comma: a line `A, B` is two values (RFC
        # 9110 §5.3, as a proxy joins repeated lines), so it is as ambiguous as two lines.
        self._listed = frozenset(
            kind.name
            for kind in self.kinds
            if kind.source == "header" and kind.format in _COMMA_FREE_FORMATS
        )
        # Requests that cannot use a feature skip it: an episode-token-only setup
        # pays for none of seeds, bodies, paths or learning.
        self.has_seeds = any(kind.seed is not None for kind in self.kinds)
        self.reads_paths = bool(self._order.path)
        self.learns = any(
            kind.seed is not None or kind.close is not None or kind.mcp_path is not None
            for kind in self.kinds
        )

    @property
    def reads_bodies(self) -> bool:
        return bool(self._order.body)

    def seeding(self, method: str, path: str) -> frozenset[str]:
        """The kinds whose seed route this request is (their own source is ignored)."""
        return frozenset(
            kind.name for kind in self.kinds if kind.seed and kind.seed.matches(method, path)
        )

    def read_head(
        self, headers: Headers, now: float, skip: frozenset[str] = frozenset()
    ) -> SessionRef | Answer | None:
        """Sources 1-3 (header tokens, cookies, MCP). `now` is wall-clock seconds."""
        cookies: dict[str, list[str]] | None = None
        for kind in self._order.head:
            if kind.name in skip:
                continue
            if kind.source == "cookie":
                if cookies is None:
                    cookies = parse_cookie_header(headers.getall("Cookie", []))
                values = cookies.get(kind.cookie or "", [])
            else:
                values = headers.getall(kind.header or "", [])
            if values:
                return self._decide(kind, values, now)
        return None

    def read_kind(
        self, kind: SessionKind, headers: Headers, now: float
    ) -> SessionRef | Answer | None:
        """`kind`'s own source in the head (its header or cookie) read as read_head reads
        it, whatever stronger source decided the request; None for a kind read from the
        body or the path, or when the request does not carry it."""
        if kind not in self._order.head:
            return None
        if kind.source == "cookie":
            values = parse_cookie_header(headers.getall("Cookie", [])).get(kind.cookie or "", [])
        else:
            values = headers.getall(kind.header or "", [])
        return self._decide(kind, values, now) if values else None

    def read_body(
        self, body: bytes, skip: frozenset[str] = frozenset()
    ) -> SessionRef | Answer | None:
        """Source 4: a JSON body field. A body that is not JSON, or lacks the field
        (or has it null), names no session: it is the worker's to judge. A field that
        is present decides, like any source: a value that cannot be a key is
        `invalid_token`, never a fall-through to the path."""
        try:
            document = json.loads(body)
        except (ValueError, RecursionError):
            return None
        for kind in self._order.body:
            if kind.name in skip or kind.pointer is None or len(body) > kind.max_body_bytes:
                continue
            try:
                value = json_pointer(document, kind.pointer)
            except LookupError:
                continue
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, str | int):
                detail = f"The body field {kind.pointer} is not a key."
                return Answer("invalid_token", detail, kind=kind.name)
            try:
                return SessionRef(kind.name, raw_session_key(str(value)))
            except FormatError as exc:
                return Answer(exc.code, exc.detail, kind=kind.name)
        return None

    def read_path(self, path: str, skip: frozenset[str] = frozenset()) -> SessionRef | None:
        """Source 5: a path pattern."""
        for kind in self._order.path:
            if kind.name in skip or kind.path_match is None:
                continue
            segment = kind.path_match(path)
            if segment is None:
                continue
            try:
                return SessionRef(kind.name, raw_session_key(segment))
            except FormatError:
                continue  # not a key this router could ever hold: no session
        return None

    def _decide(self, kind: SessionKind, values: list[str], now: float) -> SessionRef | Answer:
        lines = values
        if kind.name in self._listed:
            values = _list_items(values)
        if len(values) > 1 and any(value != values[0] for value in values[1:]):
            label = f"{kind.cookie} cookie" if kind.source == "cookie" else f"{kind.header} header"
            detail = f"The {label} is repeated with different values."
            return Answer("ambiguous_session", detail, kind=kind.name)
        try:
            cache = self._token_caches.get(kind.name)
            if cache is not None:
                key = cache.key(values[0], now)
            else:
                key = session_key(kind, values[0], now)
        except RefusedValue as exc:  # a TokenError or a FormatError
            return Answer(exc.code, exc.detail, kind=kind.name)
        if (len(lines) > 1 or values is not lines) and kind.source != "cookie":
            # Read as one value here, but a worker reading the header as one line would
            # see `T, T`: it gets one line (a cookie header holds other cookies: as is).
            return SessionRef(kind.name, key, values[0])
        return SessionRef(kind.name, key)


def _list_items(values: list[str]) -> list[str]:
    """The items of header lines that may each be a comma-separated list, stripped of
    spaces and tabs, empty ones dropped (an empty line too: as it would be once joined
    to another); `values` itself when it is one line with no comma (the common case),
    or when nothing but commas and spaces is there (then refused as it stands)."""
    if len(values) == 1 and "," not in values[0]:
        return values
    items = [item.strip(" \t") for value in values for item in value.split(",")]
    return [item for item in items if item] or values


def session_key(kind: SessionKind, value: str, now: float) -> str:
    """The session key `value` names for `kind`; raises TokenError or FormatError."""
    if kind.source == "mcp":
        return mcp_session_key(value)
    if kind.format == "jws":
        return parse_token(value, now=now, verifier=kind.verifier).key
    if kind.format == "itsdangerous":
        return itsdangerous_session_key(value, field=kind.field or "", signature=kind.signature)
    if kind.format == "starlette":
        return starlette_session_key(
            value, field=kind.field or "session_id", signature=kind.signature, now=now
        )
    return raw_session_key(value)
