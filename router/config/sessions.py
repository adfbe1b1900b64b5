"""Session kinds (design §4): the `sessions` list, where each kind's key comes from, its routes.

This module owns the parsing of each kind (one key source: header, cookie,
mcp, body_field or path; the token or cookie format and its edge check; the
seed and close routes and where a seed reply carries the key) and the checks
across kinds: no two read the same header, cookie, body field or path, and no
route is one kind's seed and another's close.

It must never read a request or a reply: it checks what the file says.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Final, NamedTuple

from router.config.errors import quote
from router.config.model import (
    BodyFieldConfig,
    Config,
    CookieSourceConfig,
    LearnConfig,
    McpSourceConfig,
    PathSourceConfig,
    RouteConfig,
    SessionKindConfig,
    SignatureConfig,
    TokenFormatConfig,
    VerifyConfig,
)
from router.config.patterns import compile_path_pattern, parse_json_pointer
from router.config.reader import Section
from router.config.secrets import (
    INLINE_SECRET,
    MIN_HS256_SECRET,
    find_secret,
    inline_refused,
    public_key_problem,
    read_secret,
    secret_from_file,
)

_SESSION_NAME: Final = re.compile(r"[a-z0-9_]{1,32}")
# RFC 9110 token characters without '_': the router drops such headers (design §8).
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^`|~0-9A-Za-z-]{1,128}")
_RESERVED_HEADERS: Final = frozenset(
    {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}
    | {"host", "content-length", "cookie", "forwarded"}
)
_RESERVED_PREFIXES: Final = ("proxy-", "x-forwarded-", "x-episode-router-")
_ALGS: Final = ("HS256", "EdDSA", "ES256")
_KEY_SOURCES: Final = ("secret_env", "secret_file", "public_key_file")  # HS256: 2, others: 1
_INLINE_KEYS: Final = {
    **inline_refused("secret"),
    "key": INLINE_SECRET.format("secret") + " (or public_key_file)",
    "public_key": "inline keys are not allowed; use public_key_file",
}
_SESSION_KEYS: Final = (
    *("name", "header", "token", "cookie", "mcp", "body_field", "path"),
    *("seed", "close", "unclaimed"),
)
_SOURCES: Final = ("header", "cookie", "mcp", "body_field", "path")
_TOKEN_CHAR: Final = r"[!#$%&'*+.^_`|~0-9A-Za-z-]"  # RFC 9110 tchar
# RFC 6265 cookie-name: a token, where '_' is fine (cookies are not headers).
_COOKIE_NAME: Final = re.compile(_TOKEN_CHAR + "{1,128}")
_METHOD: Final = re.compile(_TOKEN_CHAR + "{1,32}")
# Headers of replies, which the router reads as they come: '_' included.
_REPLY_HEADER: Final = re.compile(_TOKEN_CHAR + "{1,128}")
_UNREADABLE_REPLY_HEADERS: Final = frozenset(
    {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "content-length"}
)
_MAX_BODY_FIELD_BYTES: Final = 16 << 20  # buffering more than this per request is not routing
_ALSO: Final = "is also read by {other}"
_TOKEN_KEYS: Final = ("format", "field", "verify")
_COOKIE_KEYS: Final = ("name", "format", "field", "verify")
_LEARN_KEYS: Final = ("json_pointer", "header", "cookie")
_SECRET_KEYS: Final = ("secret_env", "secret_file")
_COOKIE_SIGNATURE_REJECTED: Final = {
    **_INLINE_KEYS,
    "salt": "Starlette's SessionMiddleware signs with itsdangerous' default salt",
    "alg": "Starlette cookies are signed with HMAC-SHA1 by itsdangerous; alg is for jws tokens",
}
_TOKEN_SIGNATURE_REJECTED: Final = {
    **_INLINE_KEYS,
    "max_age_s": "URLSafeSerializer tokens carry no timestamp, so they have no age",
    "alg": "itsdangerous tokens are signed with HMAC-SHA1; alg is for jws tokens",
}


class _Mark(NamedTuple):
    """Something at most one kind may read: its key path in the kind, identity and complaint."""

    key: str
    identity: tuple[str, str]
    # "{other}" stands for the earlier kind; replaced, not formatted, since paths hold braces.
    reason: str


def read_sessions(root: Section) -> tuple[SessionKindConfig, ...]:
    if not root.has("sessions"):
        return Config().sessions
    sections = root.sections("sessions", _SESSION_KEYS)
    if not sections:
        raise root.fail("sessions", "needs at least one kind; leave it out for the default kind")
    kinds: list[SessionKindConfig] = []
    owners: dict[tuple[str, str], int] = {}
    for i, sec in enumerate(sections):
        kind = _session_kind(sec)
        for mark in _marks(kind):
            j = owners.setdefault(mark.identity, i)
            if j != i:
                raise sec.fail(mark.key, mark.reason.replace("{other}", f"sessions[{j}]"))
        _check_routes(sec, kind, kinds)
        kinds.append(kind)
    return tuple(kinds)


def _marks(kind: SessionKindConfig) -> list[_Mark]:
    duplicate = f"duplicate session kind {quote(kind.name)} (also {{other}})"
    marks = [_Mark("name", ("name", kind.name), duplicate)]
    if kind.header is not None:
        marks.append(_header_mark("header", kind.header))
    if kind.mcp is not None:
        marks.append(_Mark("mcp", ("mcp", ""), "only one kind may read MCP sessions: {other} does"))
        marks.append(_header_mark("mcp.header", kind.mcp.header))
    if kind.cookie is not None:
        name = kind.cookie.name
        marks.append(_Mark("cookie.name", ("cookie", name), f"cookie {quote(name)} {_ALSO}"))
    if kind.body_field is not None:
        pointer = kind.body_field.pointer
        marks.append(_Mark("body_field", ("body", pointer), f"body field {quote(pointer)} {_ALSO}"))
    if kind.path is not None:
        pattern = kind.path.pattern
        marks.append(_Mark("path", ("path", pattern), f"path {quote(pattern)} {_ALSO}"))
    return marks


def _header_mark(key: str, header: str) -> _Mark:
    return _Mark(key, ("header", header.lower()), f"header {quote(header)} {_ALSO}")


def _check_routes(sec: Section, kind: SessionKindConfig, earlier: list[SessionKindConfig]) -> None:
    """A seed route may be shared by kinds, and so may a close route; one route is never both."""
    seed, close = _route_id(kind.seed), _route_id(kind.close)
    if seed is not None and seed == close:
        raise sec.fail("close", f"{seed} is also this kind's seed route")
    for j, other in enumerate(earlier):
        if seed is not None and seed == _route_id(other.close):
            raise sec.fail("seed", f"{seed} is the close route of sessions[{j}]")
        if close is not None and close == _route_id(other.seed):
            raise sec.fail("close", f"{close} is the seed route of sessions[{j}]")


def _route_id(route: RouteConfig | None) -> str | None:
    return None if route is None else f"{route.method} {route.path}"


def _session_kind(sec: Section) -> SessionKindConfig:
    name = sec.text("name")
    if not _SESSION_NAME.fullmatch(name):
        raise sec.fail("name", f"must be 1 to 32 of a-z 0-9 _, got {quote(name)}")
    source = _source(sec)
    if source != "header" and sec.has("token"):
        raise sec.fail("token", f"only a header kind reads a token; this kind reads a {source}")
    kind = SessionKindConfig(
        name,
        header=_kind_header(sec) if source == "header" else None,
        token=_token_format(sec.child("token", _TOKEN_KEYS)),
        cookie=_cookie(sec.child("cookie", _COOKIE_KEYS)) if source == "cookie" else None,
        mcp=_mcp(sec.child("mcp", ("path", "header"))) if source == "mcp" else None,
        body_field=_body_field(sec) if source == "body_field" else None,
        path=_path_source(sec) if source == "path" else None,
        unclaimed=sec.choice("unclaimed", "reject", ("reject", "forward")),
    )
    if source == "path" and sec.has("close"):
        # The key is read from the path pattern, and a close route is one exact path:
        # no request to it could name the session it should end.
        raise sec.fail(
            "close",
            "a path kind's key is in its path pattern, which no exact close route matches",
        )
    return dataclasses.replace(kind, seed=_seed(sec, kind), close=_close(sec))


def _source(sec: Section) -> str:
    found = [key for key in _SOURCES if sec.has(key)]
    if len(found) == 1:
        return found[0]
    if not found:
        reason = f"needs a key source: one of {', '.join(_SOURCES)} (`mcp: {{}}` for MCP defaults)"
        raise sec.fail(None, reason)
    raise sec.fail(found[1], f"a kind reads one key source; this one also has {found[0]}")


def _kind_header(sec: Section) -> str:
    header = sec.text("header")
    if problem := _header_problem(header):
        raise sec.fail("header", problem)
    return header


def _header_problem(header: str) -> str | None:
    lower = header.lower()
    if "_" in header:
        return "header names with '_' are dropped by the router (they read as '-' behind WSGI)"
    if not _HEADER_NAME.fullmatch(header):
        return f"not an HTTP header name: {quote(header)}"
    if lower in _RESERVED_HEADERS or lower.startswith(_RESERVED_PREFIXES):
        return f"{quote(header)} is rewritten or stripped by the router"
    return None


def _token_format(sec: Section) -> TokenFormatConfig:
    token_format = sec.choice("format", "jws", ("jws", "raw", "itsdangerous"))
    if token_format == "itsdangerous":
        return _itsdangerous_token(sec)
    if sec.has("field"):
        raise sec.fail("field", "only the itsdangerous format reads a field")
    if token_format == "raw" and sec.has("verify"):
        raise sec.fail("verify", "a raw token is the key itself: it carries no signature to verify")
    if not sec.has("verify"):
        return TokenFormatConfig(token_format)
    verify = sec.child("verify", ("alg", *_KEY_SOURCES), _INLINE_KEYS)
    return TokenFormatConfig(token_format, None, _verify(verify))


def _itsdangerous_token(sec: Section) -> TokenFormatConfig:
    if not sec.has("field"):
        reason = "the itsdangerous format needs the payload field holding the key (NeMo Gym: sid)"
        raise sec.fail("field", reason)
    field = sec.text("field")
    if not sec.has("verify"):
        return TokenFormatConfig("itsdangerous", field)
    verify = sec.child("verify", (*_SECRET_KEYS, "salt"), _TOKEN_SIGNATURE_REJECTED)
    return TokenFormatConfig("itsdangerous", field, None, _signature(verify))


def _verify(sec: Section) -> VerifyConfig:
    alg = sec.choice("alg", None, _ALGS)
    sources = [k for k in _KEY_SOURCES if sec.has(k)]
    wanted = _KEY_SOURCES[:2] if alg == "HS256" else _KEY_SOURCES[2:]
    if len(sources) != 1:
        got = " and ".join(sources) or "none"
        reason = f"needs exactly one key source, got {got}; for {alg}: {' or '.join(wanted)}"
        raise sec.fail(None, reason)
    if sources[0] not in wanted:
        raise sec.fail(sources[0], f"{alg} takes its key from {' or '.join(wanted)}")
    if alg == "HS256":
        return VerifyConfig(alg, read_secret(sec, sources[0], MIN_HS256_SECRET))
    pem = secret_from_file(sec, "public_key_file")
    if problem := public_key_problem(alg, pem):
        raise sec.fail("public_key_file", problem)
    return VerifyConfig(alg, pem)


def _signature(sec: Section) -> SignatureConfig:
    """The server's own secret (any length: it is the server's choice) and the optional checks."""
    secret = find_secret(sec, "secret", 1)
    if secret is None:
        raise sec.fail(None, "needs the server's secret key: secret_env or secret_file")
    max_age = sec.seconds("max_age_s", 0) if sec.has("max_age_s") else None
    return SignatureConfig(secret[1], max_age, sec.optional_text("salt"))


def _cookie(sec: Section) -> CookieSourceConfig:
    name = _cookie_name(sec, "name")
    cookie_format = sec.choice("format", "starlette", ("starlette", "raw"))
    if cookie_format == "raw":
        for key in ("field", "verify"):
            if sec.has(key):
                raise sec.fail(
                    key, "a raw cookie's value is the key itself: no field, no signature"
                )
        return CookieSourceConfig(name, cookie_format)
    field = sec.text("field", CookieSourceConfig("").field)
    if not sec.has("verify"):
        return CookieSourceConfig(name, cookie_format, field)
    verify = sec.child("verify", (*_SECRET_KEYS, "max_age_s"), _COOKIE_SIGNATURE_REJECTED)
    return CookieSourceConfig(name, cookie_format, field, _signature(verify))


def _cookie_name(sec: Section, key: str) -> str:
    name = sec.text(key)
    if not _COOKIE_NAME.fullmatch(name):
        raise sec.fail(
            key, f"not a cookie name (1 to 128 RFC 6265 token characters): {quote(name)}"
        )
    return name


def _mcp(sec: Section) -> McpSourceConfig:
    d = McpSourceConfig()
    path = _exact_path(sec, "path", d.path)
    header = sec.text("header", d.header)
    if problem := _header_problem(header):
        raise sec.fail("header", problem)
    return McpSourceConfig(path, header)


def _body_field(sec: Section) -> BodyFieldConfig:
    if isinstance(sec.value("body_field"), str):
        field = sec.text("body_field")
        if field.startswith("/"):
            reason = f"a field name; for a JSON pointer write {{pointer: {field}}}"
            raise sec.fail("body_field", reason)
        return BodyFieldConfig("/" + field.replace("~", "~0").replace("/", "~1"))
    body = sec.child("body_field", ("pointer", "max_bytes"))
    pointer = _json_pointer(body, "pointer")
    max_bytes = body.integer("max_bytes", BodyFieldConfig("").max_bytes, 1, _MAX_BODY_FIELD_BYTES)
    return BodyFieldConfig(pointer, max_bytes)


def _json_pointer(sec: Section, key: str) -> str:
    pointer = sec.text(key)
    try:
        parse_json_pointer(pointer)
    except ValueError as exc:
        raise sec.fail(key, f"not an RFC 6901 JSON pointer: {exc}; got {quote(pointer)}") from None
    return pointer


def _path_source(sec: Section) -> PathSourceConfig:
    pattern = sec.text("path")
    try:
        compile_path_pattern(pattern)
    except ValueError as exc:
        raise sec.fail("path", f"{exc}; got {quote(pattern)}") from None
    return PathSourceConfig(pattern)


def _exact_path(sec: Section, key: str, default: str | None = None) -> str:
    path = sec.text(key, default)
    if not (path.startswith("/") and all("!" <= c <= "~" and c not in "?#" for c in path)):
        reason = f"expected an exact path: /, then visible ASCII without ? or #; got {quote(path)}"
        raise sec.fail(key, reason)
    return path


def _route(sec: Section) -> RouteConfig:
    method = sec.text("method").upper()
    if not _METHOD.fullmatch(method):
        raise sec.fail("method", f"not an HTTP method: {quote(method)}")
    return RouteConfig(method, _exact_path(sec, "path"))


def _seed(sec: Section, kind: SessionKindConfig) -> RouteConfig | None:
    if not sec.has("seed"):
        return None
    if kind.mcp is not None:
        reason = "an mcp kind learns Mcp-Session-Id from every reply on its path; it has no seed"
        raise sec.fail("seed", reason)
    seed = sec.child("seed", ("method", "path", "learn"))
    route = _route(seed)
    if seed.has("learn"):
        return dataclasses.replace(route, learn=_learn_places(seed))
    if kind.cookie is not None:
        return dataclasses.replace(route, learn=(LearnConfig(cookie=kind.cookie.name),))
    if kind.header is not None:
        return dataclasses.replace(route, learn=(LearnConfig(header=kind.header),))
    reason = (
        f"a {kind.source} kind needs learn: {{json_pointer, header or cookie}} to find its key "
        "in the reply, or learn: request when the seed request names it"
    )
    raise seed.fail("learn", reason)


def _learn_places(seed: Section) -> tuple[LearnConfig, ...]:
    """`learn`: one place in the reply, a list of them (the head's places are read
    before the body's, each in order; the first that holds a value wins), or `request`
    (the seed request names the key, in the kind's own source)."""
    value = seed.value("learn")
    if value == "request":
        return (LearnConfig(request=True),)
    if isinstance(value, str):
        reason = "expected request, a {json_pointer, header or cookie} mapping, or a list of them"
        raise seed.fail("learn", f"{reason}; got {quote(value)}")
    if isinstance(value, list):
        places = tuple(_learn(place) for place in seed.sections("learn", _LEARN_KEYS))
        if not places:
            raise seed.fail("learn", "an empty list learns nothing")
        return places
    return (_learn(seed.child("learn", _LEARN_KEYS)),)


def _learn(sec: Section) -> LearnConfig:
    found = [key for key in _LEARN_KEYS if sec.has(key)]
    if len(found) != 1:
        got = " and ".join(found) or "none"
        raise sec.fail(None, f"needs exactly one of json_pointer, header, cookie; got {got}")
    if found[0] == "json_pointer":
        return LearnConfig(json_pointer=_json_pointer(sec, "json_pointer"))
    if found[0] == "cookie":
        return LearnConfig(cookie=_cookie_name(sec, "cookie"))
    header = sec.text("header")
    if not _REPLY_HEADER.fullmatch(header):
        raise sec.fail("header", f"not an HTTP header name: {quote(header)}")
    if header.lower() == "set-cookie":
        raise sec.fail("header", "write learn: {cookie: NAME} to read a cookie from Set-Cookie")
    if header.lower() in _UNREADABLE_REPLY_HEADERS:
        raise sec.fail("header", f"{quote(header)} is a framing header, never a session key")
    return LearnConfig(header=header)


def _close(sec: Section) -> RouteConfig | None:
    if not sec.has("close"):
        return None
    rejected = {"learn": "a close route releases the claim on a 2xx reply; it learns nothing"}
    return _route(sec.child("close", ("method", "path"), rejected))
