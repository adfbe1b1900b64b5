"""Properties of the pure parsers under hostile input: only their own errors ever escape.

Hypothesis drives four surfaces a peer controls:

- the episode token (`router.tokens.parse_token`): any text, valid tokens mutated, and
  hand-built segments of arbitrary JSON raise nothing but `TokenError`; what is accepted
  keeps design §2's bounds, and with a verifier it names exactly what was signed;
- the session formats (`router.sessions.formats`): Starlette cookies and itsdangerous tokens,
  arbitrary and mutated, raise nothing but `FormatError` (and round-trip when valid); the
  cookie and Set-Cookie readers, JSON pointers and path patterns keep their documented
  error contracts;
- the control codec: `decode_line` never raises and always gives a dict; a
  `ControlSession` fed any sequence of lines answers each request with its id, never
  raises, and every reply encodes as one line;
- the header filter (`router.relay.contract.request_headers_for_worker`): no hop-by-hop header,
  no name with `_`, no client-sent X-Forwarded-*/X-Episode-Router-* value ever reaches a
  worker, and everything else the client sent does, in order.

Example counts are moderate so the file runs in seconds; the example database is off and
Hypothesis' other caches go to a temporary folder, so a run leaves nothing behind.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir
from itsdangerous import TimestampSigner, URLSafeSerializer

from router.config import SignatureConfig
from router.config.patterns import compile_path_pattern, parse_json_pointer
from router.control.session import ControlPolicy, ControlSession, Peer
from router.core.machine import CoreSettings, RouterCore
from router.protocol.control import decode_line, encode_line
from router.relay.contract import request_headers_for_worker
from router.sessions.formats import (
    MAX_KEY_CHARS,
    FormatError,
    itsdangerous_session_key,
    mcp_session_key,
    raw_session_key,
    starlette_session_key,
)
from router.sessions.sources import json_pointer, parse_cookie_header, set_cookie_value
from router.tokens import (
    ALGORITHMS,
    EpisodeToken,
    SigningKey,
    TokenError,
    TokenVerifier,
    mint_token,
    parse_token,
)

# Hypothesis caches what it learns of the source (from collection on): not in the work tree.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "episode-router-hypothesis")

FEW = settings(
    max_examples=100,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
MANY = settings(FEW, max_examples=200)

NOW = 1_700_000_000.0
EP = re.compile(r"[A-Za-z0-9._:-]{1,128}")
KEYS = {alg: SigningKey.generate(alg) for alg in ALGORITHMS}

# JSON values of any shape, small enough to build quickly.
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


@st.composite
def mutated(draw: st.DrawFn, text: str) -> str:
    """`text` with one to three edits: a character replaced, inserted or removed, a
    slice cut, repeated or swapped with another, or a case flip."""
    for _ in range(draw(st.integers(1, 3))):
        if not text:
            return draw(st.text(max_size=8))
        i = draw(st.integers(0, len(text) - 1))
        j = draw(st.integers(i, len(text)))
        char = draw(st.characters() | st.sampled_from(".=_-+/ A0\x00\n"))
        text = draw(
            st.sampled_from(
                [
                    text[:i] + char + text[i + 1 :],
                    text[:i] + char + text[i:],
                    text[:i] + text[i + 1 :],
                    text[:i] + text[j:],
                    text[:j] + text[i:j] + text[j:],
                    text[i:j] + text[:i] + text[j:],
                    text[:i] + text[i:j].swapcase() + text[j:],
                ]
            )
        )
    return text


# --- the episode token ------------------------------------------------------------------------


@st.composite
def valid_tokens(draw: st.DrawFn) -> tuple[str, str]:
    """(alg, token) minted with one of the three keys."""
    alg = draw(st.sampled_from(ALGORITHMS))
    token = mint_token(
        ep=draw(st.from_regex(r"[A-Za-z0-9._:-]{1,40}", fullmatch=True)),
        att=draw(st.integers(0, 1_000_000)),
        nonce=draw(st.text(min_size=1, max_size=40)),
        key=KEYS[alg],
        iat=draw(st.integers(0, 2**40)),
        exp=draw(st.none() | st.integers(int(NOW) + 1, 2**40)),
        kid=draw(st.none() | st.text(max_size=10)),
    )
    return alg, token


@st.composite
def built_tokens(draw: st.DrawFn) -> str:
    """Three segments of whatever JSON (or bytes) a hostile client might encode."""
    claim_names = st.sampled_from(["ep", "att", "nonce", "iat", "exp"]) | st.text(max_size=5)
    header_names = st.sampled_from(["alg", "typ", "kid", "crit"]) | st.text(max_size=5)
    header_values = st.sampled_from([*ALGORITHMS, "none", "JWT", "jwt"]) | json_values
    claim_values = json_values | st.integers(-2, 2_000_000) | st.just("ep-1")
    segments = [
        draw(st.dictionaries(header_names, header_values, max_size=4)),
        draw(st.dictionaries(claim_names, claim_values, max_size=6)),
    ]
    encoded = [
        b64url(draw(st.binary(max_size=40)))
        if draw(st.booleans()) and draw(st.booleans())
        else b64url(json.dumps(segment).encode())
        for segment in segments
    ]
    signature = b64url(draw(st.binary(min_size=0, max_size=70)))
    return ".".join([*encoded, signature])


def parse_or_error(token: Any, verifier: TokenVerifier | None = None) -> EpisodeToken | None:
    """parse_token's result, or None when it refused with a well-formed TokenError."""
    try:
        claims = parse_token(token, now=NOW, verifier=verifier)
    except TokenError as exc:
        assert exc.code in ("invalid_token", "bad_signature"), exc.code
        assert exc.status == (401 if exc.code == "invalid_token" else 403)
        assert isinstance(exc.detail, str) and exc.detail, exc
        return None
    assert EP.fullmatch(claims.ep), claims
    assert 0 <= claims.att <= 1_000_000 and type(claims.att) is int, claims
    assert claims.key == f"{claims.ep}-a{claims.att}"
    assert claims.alg in ALGORITHMS and (claims.exp is None or claims.exp > NOW), claims
    return claims


@MANY
@given(st.text(max_size=300) | st.text(alphabet="AQgw.-_=+/eyJ0", max_size=300))
def test_any_text_is_a_token_or_a_token_error(text: str) -> None:
    parse_or_error(text)
    parse_or_error(text, KEYS["HS256"].verifier())


@FEW
@given(st.none() | st.integers() | st.binary() | st.lists(st.text()))
def test_a_value_that_is_not_even_a_string_is_a_token_error(value: object) -> None:
    assert parse_or_error(value) is None


@MANY
@given(st.data())
def test_a_mutated_token_is_refused_or_names_what_was_signed(data: st.DataObject) -> None:
    alg, token = data.draw(valid_tokens())
    original = parse_or_error(token, KEYS[alg].verifier())
    assert original is not None
    changed = data.draw(mutated(token))
    parse_or_error(changed)  # without a key: anything structurally valid may pass
    verified = parse_or_error(changed, KEYS[alg].verifier())
    assert verified is None or verified == original, (token, changed)


@MANY
@given(built_tokens())
def test_hand_built_segments_are_a_token_or_a_token_error(token: str) -> None:
    parse_or_error(token)
    parse_or_error(token, KEYS["EdDSA"].verifier())


# --- the session formats ----------------------------------------------------------------------

SECRET = "the-servers-own-secret"
SALT = "nemo-gym-mcp-session-token"
FIELD = "session_id"
SIGNATURES = st.sampled_from(
    [
        None,
        SignatureConfig(SECRET.encode()),
        SignatureConfig(SECRET.encode(), max_age_s=60.0),
        SignatureConfig(SECRET.encode(), salt=SALT),
    ]
)
keys = st.text(min_size=1, max_size=40).filter(lambda k: k.isprintable())


def format_result(parse: Callable[[], str]) -> str | None:
    """The key a format parser returns, or None when it refused with a FormatError."""
    try:
        key = parse()
    except FormatError as exc:
        assert exc.code in ("invalid_token", "bad_signature") and exc.detail, exc
        assert exc.status == (401 if exc.code == "invalid_token" else 403)
        return None
    assert isinstance(key, str) and 1 <= len(key) <= MAX_KEY_CHARS, key
    return key


def usable_key(held: object) -> str | None:
    """The key a session field holding `held` names, when it certainly is a usable one."""
    if isinstance(held, int) and not isinstance(held, bool):
        return str(held) if len(str(held)) <= MAX_KEY_CHARS else None
    ok = isinstance(held, str) and 1 <= len(held) <= MAX_KEY_CHARS and held.isprintable()
    return held if ok and isinstance(held, str) else None


@st.composite
def starlette_cookies(draw: st.DrawFn) -> tuple[str, object]:
    """(cookie, what its field holds) as SessionMiddleware signs one."""
    session = draw(st.dictionaries(st.text(max_size=8), json_values, max_size=3))
    if draw(st.booleans()):
        session[FIELD] = draw(keys | json_values)
    payload = base64.b64encode(json.dumps(session).encode())
    cookie = TimestampSigner(SECRET).sign(payload).decode()
    return cookie, session.get(FIELD)


@st.composite
def itsdangerous_tokens(draw: st.DrawFn) -> tuple[str, object]:
    """(token, its payload), often large enough for URLSafeSerializer to compress it."""
    body = draw(
        keys
        | json_values
        | st.dictionaries(st.just("sid"), keys | json_values, min_size=1)
        | st.builds(lambda k, n: {"sid": k, "pad": "a" * n}, keys, st.integers(0, 400))
    )
    salt = draw(st.sampled_from([None, SALT]))
    serializer = URLSafeSerializer(SECRET) if salt is None else URLSafeSerializer(SECRET, salt=salt)
    return serializer.dumps(body), body


@MANY
@given(st.text(max_size=200), SIGNATURES, st.floats(0, 2e9))
def test_any_cookie_text_is_a_key_or_a_format_error(
    text: str, signature: SignatureConfig | None, now: float
) -> None:
    format_result(lambda: starlette_session_key(text, field=FIELD, signature=signature, now=now))
    format_result(lambda: itsdangerous_session_key(text, field="sid", signature=signature))
    format_result(lambda: raw_session_key(text))
    key = format_result(lambda: mcp_session_key(text))
    assert key is None or (key.isascii() and " " not in key), key


@MANY
@given(st.data(), SIGNATURES)
def test_a_mutated_starlette_cookie_is_a_key_or_a_format_error(
    data: st.DataObject, signature: SignatureConfig | None
) -> None:
    cookie, held = data.draw(starlette_cookies())
    now = data.draw(st.floats(0, 2e9))
    read = format_result(
        lambda: starlette_session_key(cookie, field=FIELD, signature=None, now=now)
    )
    if (expected := usable_key(held)) is not None:
        assert read == expected  # a valid cookie round-trips
    changed = data.draw(mutated(cookie))
    format_result(lambda: starlette_session_key(changed, field=FIELD, signature=signature, now=now))


@MANY
@given(st.data(), SIGNATURES)
def test_a_mutated_itsdangerous_token_is_a_key_or_a_format_error(
    data: st.DataObject, signature: SignatureConfig | None
) -> None:
    token, body = data.draw(itsdangerous_tokens())
    read = format_result(lambda: itsdangerous_session_key(token, field="sid", signature=None))
    held = body.get("sid") if isinstance(body, dict) else body
    if (expected := usable_key(held)) is not None:
        assert read == expected  # a valid token round-trips, compressed or not
    changed = data.draw(mutated(token))
    format_result(lambda: itsdangerous_session_key(changed, field="sid", signature=signature))


@FEW
@given(st.binary(max_size=300), st.booleans())
def test_a_compressed_payload_of_any_bytes_is_a_key_or_a_format_error(
    data: bytes, deflate: bool
) -> None:
    payload = zlib.compress(data) if deflate else data
    token = "." + b64url(payload) + "." + b64url(b"signature")
    format_result(lambda: itsdangerous_session_key(token, field="sid", signature=None))


cookie_lines = st.lists(
    st.text(max_size=60) | st.text(alphabet='ab=;" \t,\\', max_size=40), max_size=4
)


@MANY
@given(cookie_lines, st.text(max_size=10), st.none() | st.floats(0, 2e9))
def test_the_cookie_readers_never_raise(lines: list[str], name: str, now: float | None) -> None:
    cookies = parse_cookie_header(lines)
    assert all(isinstance(v, list) and v for v in cookies.values())
    assert all(re.fullmatch(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+", n) for n in cookies)
    value = set_cookie_value(lines, name, now=now)
    assert value is None or isinstance(value, str)


@MANY
@given(json_values, st.text(max_size=20) | st.text(alphabet="/~01a", max_size=12))
def test_a_json_pointer_finds_a_value_or_raises_lookup_or_value_error(
    document: object, pointer: str
) -> None:
    try:
        tokens = parse_json_pointer(pointer)
    except ValueError:
        with pytest.raises(ValueError):  # a malformed pointer, whatever the document
            json_pointer(document, pointer)
        return
    assert all(isinstance(token, str) for token in tokens)
    with contextlib.suppress(LookupError):  # a well-formed one finds a value or none
        json_pointer(document, pointer)


@MANY
@given(
    st.text(max_size=30) | st.text(alphabet="/{key}ab*", max_size=20),
    st.lists(st.text(max_size=30) | st.text(alphabet="/ab?%", max_size=20), max_size=5),
)
def test_a_path_pattern_compiles_or_raises_value_error_and_never_fails_a_match(
    pattern: str, paths: list[str]
) -> None:
    try:
        match = compile_path_pattern(pattern)
    except ValueError:
        return
    for path in paths:
        key = match(path)
        assert key is None or (key and "/" not in key and "?" not in key), (pattern, path, key)


# --- the control codec --------------------------------------------------------------------------

OPS = ["hello", "claim", "release", "sync", "drain", "bye", "ping"]
PEER_UID = 1000
ids = st.none() | st.integers(-(2**64), 2**64) | st.text(max_size=6) | json_values
plausible = {
    "v": st.just(1) | json_values,
    "worker": st.sampled_from(["w0", "w1"]) | json_values,
    "url": st.sampled_from(["http://127.0.0.1:9001", "http://127.0.0.1:9002", "unix:/s"])
    | json_values,
    "boot": st.sampled_from(["b0", "b1"]) | json_values,
    "key": st.sampled_from(["ep1", "ep2", "x" * 600]) | json_values,
    "kind": st.sampled_from(["episode", "open", "nope"]) | json_values,
    "claims": st.lists(
        st.fixed_dictionaries({"key": st.sampled_from(["ep1", "ep3"])}) | json_values,
        max_size=3,
    )
    | json_values,
    "more": st.booleans() | json_values,
    "on": st.booleans() | json_values,
    "auth": st.text(max_size=5) | json_values,
}


@st.composite
def control_lines(draw: st.DrawFn) -> bytes:
    """A control line: mostly a request with plausible fields, sometimes anything at all."""
    if draw(st.integers(0, 9)) == 0:
        return draw(
            st.binary(max_size=60) | st.builds(lambda v: json.dumps(v).encode(), json_values)
        )
    message: dict[str, Any] = {"op": draw(st.sampled_from([*OPS, "nope"]) | json_values)}
    if draw(st.integers(0, 4)):
        message["id"] = draw(ids)
    for name in draw(st.sets(st.sampled_from(sorted(plausible)), max_size=6)):
        message[name] = draw(plausible[name])
    if message["op"] == "hello" and draw(st.booleans()):
        message.update(v=1, worker=draw(st.sampled_from(["w0", "w1"])), boot="b0")
        message["url"] = f"http://127.0.0.1:900{draw(st.integers(0, 2))}"
    return json.dumps(message).encode()


@MANY
@given(st.binary(max_size=200) | st.builds(lambda v: json.dumps(v).encode(), json_values))
def test_decode_line_always_gives_a_dict(line: bytes) -> None:
    decoded = decode_line(line)
    assert isinstance(decoded, dict)
    if "ok" in decoded:
        assert decoded["ok"] is False and decoded["error"] == "bad_request", decoded
    else:
        assert isinstance(decoded["op"], str), decoded


@FEW
@given(st.lists(st.tuples(st.integers(0, 2), control_lines(), st.floats(0, 20)), max_size=30))
def test_a_control_session_answers_every_line_with_its_id(
    script: list[tuple[int, bytes, float]],
) -> None:
    core = RouterCore(CoreSettings(kinds={"episode": False, "open": True}), 0.0)
    policy = ControlPolicy(PEER_UID, frozenset(), frozenset(), None, "router-boot")
    sessions = [ControlSession(core, policy, Peer(uid=PEER_UID, tcp=False)) for _ in range(2)]
    now = 0.0
    for which, line, step in script:
        now += step
        if which == 2:  # the connection of session 0 closes; a new one takes its place
            sessions[0].closed(now)
            sessions[0] = ControlSession(core, policy, Peer(uid=PEER_UID, tcp=False))
            continue
        request = decode_line(line)
        if "ok" in request:
            reply = request
        else:
            reply = sessions[which].handle(request, now)
            assert reply["id"] == request.get("id"), (request, reply)
        assert isinstance(reply["ok"], bool), reply
        assert reply["ok"] or isinstance(reply["error"], str), reply
        wire = encode_line(reply)
        assert wire.endswith(b"\n") and wire.count(b"\n") == 1
        assert json.loads(wire) == json.loads(json.dumps(reply)), reply


# --- the header filter --------------------------------------------------------------------------

HOP_BY_HOP = {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}
SPECIAL_NAMES = [
    *HOP_BY_HOP,
    "proxy-connection",
    "proxy-authorization",
    "proxy-whatever",
    "host",
    "content-length",
    "forwarded",
    "x-real-ip",
    "expect",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-forwarded-proto",
    "x-forwarded-by",
    "x-episode-router-boot",
    "x-episode-router-anything",
    "content_length",
    "transfer_encoding",
    "x_forwarded_for",
    "x-listed",
    "x-other",
    "cookie",
    "authorization",
    "content-type",
    "upgrade-insecure-requests",
]
names = st.sampled_from(SPECIAL_NAMES).flatmap(
    lambda name: st.lists(st.booleans(), min_size=len(name), max_size=len(name)).map(
        lambda upper: "".join(c.upper() if u else c for c, u in zip(name, upper, strict=True))
    )
) | st.from_regex(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,12}", fullmatch=True)
values = st.text(max_size=20)


@st.composite
def client_headers(draw: st.DrawFn) -> list[tuple[str, str]]:
    headers = draw(st.lists(st.tuples(names, values), max_size=12))
    for _ in range(draw(st.integers(0, 2))):
        listed = draw(st.lists(names, max_size=4))
        headers.insert(draw(st.integers(0, len(headers))), ("Connection", " , ".join(listed)))
    return headers


# design §8: a client's Connection options never remove these (with no session kind
# configured here, none of a kind's own headers).
NEVER_REMOVED_BY_CONNECTION = {"cookie", "authorization", "content-type", "content-length"}


def listed_in_connection(headers: list[tuple[str, str]]) -> set[str]:
    """The names a client's Connection options remove."""
    return {
        token.strip().lower()
        for name, value in headers
        if name.lower() == "connection"
        for token in value.split(",")
    } - NEVER_REMOVED_BY_CONNECTION


def dropped(lower: str, listed: set[str], chunked: bool) -> bool:
    """design §8: what a worker never gets from a client."""
    return (
        "_" in lower
        or lower in HOP_BY_HOP
        or lower in listed
        or lower.startswith(("proxy-", "x-forwarded-", "x-episode-router-"))
        or lower in ("host", "forwarded", "x-real-ip", "expect")
        or (chunked and lower == "content-length")
    )


@MANY
@given(
    client_headers(),
    st.none() | st.sampled_from(["127.0.0.1", "::1", "10.1.2.3"]),
    st.sampled_from(["http", "https"]),
    st.dictionaries(st.sampled_from(["X-Episode-Router-Boot"]), st.text(min_size=1, max_size=8)),
)
def test_the_worker_never_gets_what_the_router_owns_or_strips(
    headers: list[tuple[str, str]], client_ip: str | None, scheme: str, extra: dict[str, str]
) -> None:
    out = request_headers_for_worker(
        headers, worker_host="127.0.0.1:9001", client_ip=client_ip, scheme=scheme, extra=extra
    )
    listed = listed_in_connection(headers)
    chunked = any(name.lower() == "transfer-encoding" for name, _ in headers)
    lowered = [name.lower() for name in out]
    router_set = {"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"}
    added = {"host", *router_set, *(name.lower() for name in extra)}
    relayed = [name for name in lowered if name not in added]
    assert not any("_" in name or name in HOP_BY_HOP or name in listed for name in relayed), out
    assert not any(name.startswith("proxy-") for name in lowered), out
    assert out.getall("Host") == ["127.0.0.1:9001"]
    assert out.getall("X-Forwarded-For", []) == ([client_ip] if client_ip else [])
    assert out.getall("X-Forwarded-Proto") == [scheme]
    hosts = [value for name, value in headers if name.lower() == "host"]
    assert out.getall("X-Forwarded-Host", []) == hosts[:1]
    assert {n for n in lowered if n.startswith("x-forwarded-")} <= router_set, out
    assert [(n, v) for n, v in out.items() if n.lower().startswith("x-episode-router-")] == list(
        extra.items()
    )
    assert not {"forwarded", "x-real-ip", "expect"} & set(lowered), out
    kept = [(n, v) for n, v in headers if not dropped(n.lower(), listed, chunked)]
    passed = [(n, v) for n, v in out.items() if n.lower() not in {"host", *router_set}]
    passed = [(n, v) for n, v in passed if not n.lower().startswith("x-episode-router-")]
    assert passed == kept  # everything else, in the client's order


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_the_strategies_reach_accepted_tokens(alg: str) -> None:
    """A guard on the generators: a freshly minted token of every alg verifies."""
    token = mint_token(ep="ep-1", att=2, nonce="n", key=KEYS[alg], iat=0)
    claims = parse_or_error(token, KEYS[alg].verifier())
    assert claims is not None and claims.key == "ep-1-a2"
