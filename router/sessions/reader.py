"""Session kinds: which session a request names (design §4).

`SessionReader` reads the sources in the contract's fixed order, and within
each source in the configured order:

1. JWS or raw header tokens;
2. itsdangerous header tokens and `Mcp-Session-Id`;
3. cookies;
4. JSON body fields;
5. paths.

Headers come before cookies: a client sets a header for the request it sends, where
a cookie may be one a jar kept from any earlier reply. The first source that is
present decides on its own, even when its value is invalid: the router never falls
through to a weaker source. A session header (or cookie) repeated with different
values is `ambiguous_session`. A request to a kind's seed route ignores that kind's
own source, so a stale cookie never pins a new session, unless the kind learns from
the request (the caller names the session it seeds). Routes, the MCP path and path
kinds match the path behind a prefix the workers strip (`path_prefixes`).

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
    compile_path_prefix,
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
    # Where a seed's key is found: places in the reply, the first that has it winning,
    # or the request itself (`names_own_seed`).
    learn: tuple[LearnConfig, ...] = ()

    @property
    def precedence(self) -> int:
        """The contract's source order (lower reads first)."""
        if self.source == "header":
            return 2 if self.format == "itsdangerous" else 1
        return {"mcp": 2, "cookie": 3, "body_field": 4, "path": 5}[self.source]

    @property
    def names_own_seed(self) -> bool:
        """Its seed request names the session it starts (`learn: request`)."""
        return any(place.request for place in self.learn)

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
        learn=config.seed.learn if config.seed is not None else (),
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

    def __init__(self, kinds: Sequence[SessionKind], path_prefixes: Sequence[str] = ()) -> None:
        self.kinds = tuple(kinds)
        self._prefixes = tuple(compile_path_prefix(prefix) for prefix in path_prefixes)
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
        # Whether any route or path is matched: the route path is worked out only then.
        self.routes = self.learns or self.reads_paths

    @property
    def reads_bodies(self) -> bool:
        return bool(self._order.body)

    def route_path(self, path: str) -> str:
        """The path routes are matched on: behind the first prefix the workers strip
        that `path` starts with, else `path` itself."""
        for rest in self._prefixes:
            behind = rest(path)
            if behind is not None:
                return behind
        return path

    def seeding(self, method: str, path: str) -> frozenset[str]:
        """The kinds whose seed route this request is and whose own source it ignores
        (all but those whose seed names its own session). `path`: the route path."""
        return frozenset(
            kind.name
            for kind in self.kinds
            if kind.seed and kind.seed.matches(method, path) and not kind.names_own_seed
        )

    def route_of(self, kind_name: str, method: str, path: str) -> str:
        """How a request naming a session of `kind_name` is routed: "close" on that
        kind's close route, "seed" on its seed route when the seed names its own
        session, "session" otherwise. `path`: the route path."""
        kind = self.by_name[kind_name]
        if kind.close is not None and kind.close.matches(method, path):
            return "close"
        if kind.seed is not None and kind.names_own_seed and kind.seed.matches(method, path):
            return "seed"
        return "session"

    def wants_body(self, method: str, path: str) -> bool:
        """A body kind's seed or close route: its body is read whatever decided the
        request, for the session the seed names or the close ends."""
        return any(
            (kind.seed is not None and kind.seed.matches(method, path))
            or (kind.close is not None and kind.close.matches(method, path))
            for kind in self._order.body
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
        self,
        kind: SessionKind,
        headers: Headers,
        now: float,
        *,
        body: bytes | None = None,
        path: str | None = None,
    ) -> SessionRef | Answer | None:
        """`kind`'s own source read as the reading of a request reads it, whatever
        stronger source decided the request: its header or cookie, its field of `body`
        (when the body was read), its segment of `path` (the route path); None when the
        request does not carry it."""
        if kind.source == "body_field":
            if body is None:
                return None
            document = _json_document(body)
            return None if document is None else _field(kind, document, len(body))
        if kind.source == "path":
            return None if path is None else _path_key(kind, path)
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
        document = _json_document(body)
        if document is None:
            return None
        for kind in self._order.body:
            if kind.name in skip:
                continue
            found = _field(kind, document, len(body))
            if found is not None:
                return found
        return None

    def read_path(self, path: str, skip: frozenset[str] = frozenset()) -> SessionRef | None:
        """Source 5: a path pattern (on the route path)."""
        for kind in self._order.path:
            if kind.name in skip:
                continue
            found = _path_key(kind, path)
            if found is not None:
                return found
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


def _json_document(body: bytes) -> object | None:
    """The parsed body; None for one that is not JSON (it names no session)."""
    try:
        document: object = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return document


def _field(kind: SessionKind, document: object, size: int) -> SessionRef | Answer | None:
    """The session `kind`'s body field names in `document` (a body of `size` bytes)."""
    if kind.pointer is None or size > kind.max_body_bytes:
        return None
    try:
        value = json_pointer(document, kind.pointer)
    except LookupError:
        return None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        detail = f"The body field {kind.pointer} is not a key."
        return Answer("invalid_token", detail, kind=kind.name)
    try:
        return SessionRef(kind.name, raw_session_key(str(value)))
    except FormatError as exc:
        return Answer(exc.code, exc.detail, kind=kind.name)


def _path_key(kind: SessionKind, path: str) -> SessionRef | None:
    """The session `kind`'s path pattern names in `path`, if it is one this router could
    ever hold."""
    if kind.path_match is None:
        return None
    segment = kind.path_match(path)
    if segment is None:
        return None
    try:
        return SessionRef(kind.name, raw_session_key(segment))
    except FormatError:
        return None  # not a key this router could ever hold: no session


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
