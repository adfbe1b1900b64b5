"""Pure tests for router.sessions.reader: which session a request names (design §4).

Every kind is built as the service builds it, `kind_from_config(SessionKindConfig(...))`,
and every value is minted as the server that owns it mints it: episode tokens with the
package's helper, Starlette session cookies exactly as SessionMiddleware signs them (and, in
one test, by a real SessionMiddleware), NeMo Gym's MCP session tokens by itsdangerous'
URLSafeSerializer. `read` asks the reader in the order the public handler does (the head,
then a JSON body, then the path, skipping the kinds whose seed route the request is), so a
pair of sources is judged as a real request would be.

No event loop: headers are a CIMultiDict, the body is bytes, `now` is a number.
"""

from __future__ import annotations

import base64
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
from itsdangerous import TimestampSigner, URLSafeSerializer
from multidict import CIMultiDict
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from router.config import (
    BodyFieldConfig,
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
from router.core.answers import Answer
from router.sessions.reader import SessionKind, SessionReader, SessionRef, kind_from_config
from router.sessions.sources import set_cookie_value
from router.tokens import SigningKey, mint_token, new_nonce

NOW = 1_700_000_000  # wall-clock seconds every value is read at
TOKEN_HEADER = "X-NeMo-Gym-Episode-Token"
MCP_TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
COOKIE = "ResourcesServer___resources"
STARLETTE_SECRET = "resources-server-secret"
MCP_SECRET = "mcp-server-secret"
MCP_SALT = "nemo-gym-mcp-session-token"
EPISODE_SECRET = b"e" * 32
EPISODE_KEY = SigningKey.hs256(EPISODE_SECRET)
SEED = RouteConfig("POST", "/seed_session", (LearnConfig(cookie=COOKIE),))
CLOSE = RouteConfig("POST", "/close_session")


# --- values, minted as their servers mint them ---------------------------------------------


def jws(ep: str, att: int = 0, *, key: SigningKey = EPISODE_KEY, exp: int | None = None) -> str:
    return mint_token(ep=ep, att=att, nonce=new_nonce(), key=key, iat=NOW, exp=exp)


class _SignedAt(TimestampSigner):
    """SessionMiddleware's signer with a fixed clock, to mint cookies of a known age."""

    signed_at = NOW

    def get_timestamp(self) -> int:
        return self.signed_at


def starlette_cookie(
    session: dict[str, object], *, secret: str = STARLETTE_SECRET, signed_at: int = NOW
) -> str:
    """A session cookie exactly as SessionMiddleware builds one:
    TimestampSigner(secret).sign(b64encode(json.dumps(session)))."""
    signer = _SignedAt(secret)
    signer.signed_at = signed_at
    return signer.sign(base64.b64encode(json.dumps(session).encode())).decode()


def mcp_token(payload: object, *, secret: str = MCP_SECRET, salt: str | None = MCP_SALT) -> str:
    """NeMo Gym's MCP session token: a URLSafeSerializer payload."""
    serializer = URLSafeSerializer(secret) if salt is None else URLSafeSerializer(secret, salt=salt)
    token = serializer.dumps(payload)
    assert isinstance(token, str)
    return token


# --- requests -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Req:
    """The parts of a request a reader looks at."""

    method: str = "POST"
    path: str = "/tools/add"
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes | None = None


DEFAULT = Req()


def merge(*parts: Req) -> Req:
    """One request carrying every part: all headers (in order), the body and path set."""
    merged = DEFAULT
    for part in parts:
        merged = replace(
            merged,
            method=part.method if part.method != DEFAULT.method else merged.method,
            path=part.path if part.path != DEFAULT.path else merged.path,
            headers=merged.headers + part.headers,
            body=part.body if part.body is not None else merged.body,
        )
    return merged


def header(name: str, value: str) -> Req:
    return Req(headers=((name, value),))


def json_body(document: object) -> Req:
    return Req(body=json.dumps(document).encode())


def read(reader: SessionReader, req: Req, now: float = NOW) -> SessionRef | Answer | None:
    """What the public handler reads from `req`: its head, then its JSON body, then its
    path, skipping the kinds whose seed route it is (PublicHandler._read_session)."""
    seeding = reader.seeding(req.method, req.path)
    found = reader.read_head(CIMultiDict(req.headers), now, seeding)
    if found is None and req.body is not None:
        found = reader.read_body(req.body, seeding)
    if found is None:
        found = reader.read_path(req.path, seeding)
    return found


def reader_of(*configs: SessionKindConfig) -> SessionReader:
    return SessionReader([kind_from_config(config) for config in configs])


def refused(found: object) -> str:
    """The code of the router's own answer `found` must be."""
    assert isinstance(found, Answer), found
    assert found.session is None and found.retry_after_s is None, found
    assert found.detail.endswith(".") and len(found.detail) > 10, found
    return found.code


# --- kinds --------------------------------------------------------------------------------

EPISODE = SessionKindConfig("episode", header=TOKEN_HEADER)
RAW_HEADER = SessionKindConfig("task", header="X-Task-Id", token=TokenFormatConfig("raw"))
RESOURCES = SessionKindConfig(
    "resources", cookie=CookieSourceConfig(COOKIE), seed=SEED, close=CLOSE
)
RAW_COOKIE = SessionKindConfig("plain", cookie=CookieSourceConfig("sid", "raw"))
MCP_TOKEN = SessionKindConfig(
    "mcp_token",
    header=MCP_TOKEN_HEADER,
    token=TokenFormatConfig("itsdangerous", "sid"),
    seed=RouteConfig("POST", "/seed_session", (LearnConfig(json_pointer="/mcp/headers/token"),)),
)
MCP = SessionKindConfig("mcp_session", mcp=McpSourceConfig())
BODY = SessionKindConfig("rollout", body_field=BodyFieldConfig("/rollout/id", max_bytes=256))
PATH = SessionKindConfig("run", path=PathSourceConfig("/runs/{key}/step"))


# ============================================================================ each source alone


def test_kind_from_config_keeps_what_reading_needs() -> None:
    kinds = {config.name: kind_from_config(config) for config in (EPISODE, RESOURCES, MCP)}
    resources = kinds["resources"]
    assert (resources.source, resources.format, resources.cookie, resources.field) == (
        "cookie",
        "starlette",
        COOKIE,
        "session_id",
    )
    assert resources.seed is not None and resources.seed.matches("POST", "/seed_session")
    assert resources.close is not None and resources.close.matches("POST", "/close_session")
    assert resources.learn == (LearnConfig(cookie=COOKIE),)
    mcp = kinds["mcp_session"]
    assert (mcp.source, mcp.header, mcp.mcp_path, mcp.not_found_code) == (
        "mcp",
        "Mcp-Session-Id",
        "/mcp",
        "unknown_session",
    )
    assert kinds["episode"].not_found_code == "unknown_episode"
    precedence = {
        name: kind_from_config(config).precedence
        for name, config in [
            ("jws", EPISODE),
            ("raw", RAW_HEADER),
            ("cookie", RESOURCES),
            ("raw cookie", RAW_COOKIE),
            ("itsdangerous", MCP_TOKEN),
            ("mcp", MCP),
            ("body", BODY),
            ("path", PATH),
        ]
    }
    # design §4: header tokens, then itsdangerous tokens and Mcp-Session-Id, then
    # cookies (a jar's), bodies, paths.
    assert precedence == {
        "jws": 1,
        "raw": 1,
        "itsdangerous": 2,
        "mcp": 2,
        "cookie": 3,
        "raw cookie": 3,
        "body": 4,
        "path": 5,
    }


def test_an_episode_token_only_reader_pays_for_no_seeds_bodies_paths_or_learning() -> None:
    reader = reader_of(EPISODE)
    assert (reader.has_seeds, reader.reads_bodies, reader.reads_paths, reader.learns) == (
        False,
        False,
        False,
        False,
    )
    assert reader.max_body_bytes == 0
    full = reader_of(EPISODE, RESOURCES, MCP, BODY, PATH)
    assert (full.has_seeds, full.reads_bodies, full.reads_paths, full.learns) == (
        True,
        True,
        True,
        True,
    )
    assert full.max_body_bytes == 256
    assert reader_of(MCP).learns  # every reply on the MCP path may teach a session


def test_a_jws_header_names_its_episode_key() -> None:
    reader = reader_of(EPISODE)
    assert read(reader, header(TOKEN_HEADER, jws("ep7", 2))) == SessionRef("episode", "ep7-a2")
    assert read(reader, header(TOKEN_HEADER.lower(), jws("ep7"))) == SessionRef("episode", "ep7-a0")
    assert refused(read(reader, header(TOKEN_HEADER, "not-a-token"))) == "invalid_token"
    expired = jws("ep7", exp=NOW - 1)
    assert refused(read(reader, header(TOKEN_HEADER, expired))) == "invalid_token"
    assert read(reader, DEFAULT) is None


def test_a_jws_header_with_edge_verification_refuses_forgeries() -> None:
    verified = replace(
        EPISODE, token=TokenFormatConfig("jws", verify=VerifyConfig("HS256", EPISODE_SECRET))
    )
    reader = reader_of(verified)
    assert read(reader, header(TOKEN_HEADER, jws("ep1"))) == SessionRef("episode", "ep1-a0")
    forged = jws("ep1", key=SigningKey.hs256(b"f" * 32))
    assert refused(read(reader, header(TOKEN_HEADER, forged))) == "bad_signature"
    assert read(reader_of(EPISODE), header(TOKEN_HEADER, forged)) == SessionRef(
        "episode", "ep1-a0"
    )  # verification off: the worker refuses the forgery


def test_a_raw_header_is_the_key_itself() -> None:
    reader = reader_of(RAW_HEADER)
    assert read(reader, header("x-task-id", "task-9")) == SessionRef("task", "task-9")
    assert refused(read(reader, header("X-Task-Id", "x" * 513))) == "invalid_token"
    assert refused(read(reader, header("X-Task-Id", ""))) == "invalid_token"


@dataclass
class StarletteServer:
    """A real Starlette app behind SessionMiddleware, as NeMo Gym's resources servers are."""

    client: TestClient

    def seed(self, session_id: str) -> str:
        """The cookie value SessionMiddleware sets for a new session `session_id`."""
        self.client.cookies.clear()
        reply = self.client.post("/seed_session", json={"session_id": session_id})
        assert reply.status_code == 200, reply.text
        value = set_cookie_value(reply.headers.get_list("set-cookie"), COOKIE, now=NOW)
        assert value is not None
        return value

    def reads(self, cookie_value: str) -> object:
        """The session_id the server reads from a request carrying this cookie."""
        self.client.cookies.clear()
        reply = self.client.get("/whoami", headers={"Cookie": f"{COOKIE}={cookie_value}"})
        return reply.json()["session_id"]


@pytest.fixture(scope="module")
def starlette() -> Iterator[StarletteServer]:
    async def seed(request: Request) -> JSONResponse:
        request.session.update(await request.json())
        return JSONResponse({"ok": True})

    async def whoami(request: Request) -> JSONResponse:
        return JSONResponse({"session_id": request.session.get("session_id")})

    app = Starlette(
        routes=[Route("/seed_session", seed, methods=["POST"]), Route("/whoami", whoami)],
        middleware=[
            Middleware(SessionMiddleware, secret_key=STARLETTE_SECRET, session_cookie=COOKIE)
        ],
    )
    with TestClient(app) as client:
        yield StarletteServer(client)


def test_a_real_starlette_session_cookie_names_the_session_the_server_reads(
    starlette: StarletteServer,
) -> None:
    value = starlette.seed("3f2a9c1e-77b0-4f35")
    reader = reader_of(RESOURCES)
    found = read(reader, header("Cookie", f"other=1; {COOKIE}={value}; theme=dark"))
    assert found == SessionRef("resources", "3f2a9c1e-77b0-4f35")
    assert starlette.reads(value) == "3f2a9c1e-77b0-4f35"
    # The cookies the other tests mint are the ones the server reads too (signed now: the
    # server applies its 14-day max_age).
    minted = starlette_cookie({"session_id": "s9"}, signed_at=int(time.time()))
    assert starlette.reads(minted) == "s9"


def test_a_starlette_cookie_is_refused_when_malformed_forged_or_expired() -> None:
    reader = reader_of(RESOURCES)
    assert refused(read(reader, header("Cookie", f"{COOKIE}=garbage"))) == "invalid_token"
    no_field = starlette_cookie({"user": "u1"})
    assert refused(read(reader, header("Cookie", f"{COOKIE}={no_field}"))) == "invalid_token"
    forged = starlette_cookie({"session_id": "s1"}, secret="not-the-server-secret")
    assert read(reader, header("Cookie", f"{COOKIE}={forged}")) == SessionRef("resources", "s1")

    signature = SignatureConfig(STARLETTE_SECRET.encode(), max_age_s=60)
    checked = replace(RESOURCES, cookie=CookieSourceConfig(COOKIE, signature=signature))
    strict = reader_of(checked)
    assert refused(read(strict, header("Cookie", f"{COOKIE}={forged}"))) == "bad_signature"
    fresh = header("Cookie", f"{COOKIE}={starlette_cookie({'session_id': 's1'})}")
    assert read(strict, fresh, now=NOW + 60) == SessionRef("resources", "s1")
    assert refused(read(strict, fresh, now=NOW + 61)) == "invalid_token"  # expired, not forged


def test_a_raw_cookie_is_the_key_itself() -> None:
    reader = reader_of(RAW_COOKIE)
    assert read(reader, header("Cookie", 'sid="abc-1"')) == SessionRef("plain", "abc-1")
    assert refused(read(reader, header("Cookie", "sid="))) == "invalid_token"
    assert read(reader, header("Cookie", "sidx=abc; xsid=abc")) is None


def test_an_itsdangerous_header_token_names_its_field() -> None:
    reader = reader_of(MCP_TOKEN)
    assert read(reader, header(MCP_TOKEN_HEADER, mcp_token({"sid": "s1", "tools": ["a"]}))) == (
        SessionRef("mcp_token", "s1")
    )
    # NeMo Gym signs the bare session id when a session has no tool restriction.
    assert read(reader, header(MCP_TOKEN_HEADER, mcp_token("s2"))) == SessionRef("mcp_token", "s2")
    # Without a configured key the signature is not checked: any salt, any secret.
    unsalted = mcp_token({"sid": "s3"}, secret="other", salt=None)
    assert read(reader, header(MCP_TOKEN_HEADER, unsalted)) == SessionRef("mcp_token", "s3")
    assert refused(read(reader, header(MCP_TOKEN_HEADER, "garbage"))) == "invalid_token"
    no_field = mcp_token({"session": "s4"})
    assert refused(read(reader, header(MCP_TOKEN_HEADER, no_field))) == "invalid_token"


@pytest.mark.parametrize("salt", [MCP_SALT, None], ids=["own-salt", "default-salt"])
def test_an_itsdangerous_header_token_with_verification_needs_the_secret_and_salt(
    salt: str | None,
) -> None:
    signature = SignatureConfig(MCP_SECRET.encode(), salt=salt)
    verified = replace(MCP_TOKEN, token=TokenFormatConfig("itsdangerous", "sid", None, signature))
    reader = reader_of(verified)
    good = mcp_token({"sid": "s1"}, salt=salt)
    assert read(reader, header(MCP_TOKEN_HEADER, good)) == SessionRef("mcp_token", "s1")
    wrong_secret = mcp_token({"sid": "s1"}, secret="forger", salt=salt)
    assert refused(read(reader, header(MCP_TOKEN_HEADER, wrong_secret))) == "bad_signature"
    other_salt = mcp_token({"sid": "s1"}, salt="some-other-salt" if salt else MCP_SALT)
    assert refused(read(reader, header(MCP_TOKEN_HEADER, other_salt))) == "bad_signature"


def test_an_mcp_session_id_is_the_key_on_any_path() -> None:
    reader = reader_of(MCP)
    for path in ("/mcp", "/tools/add"):
        found = read(reader, merge(Req(path=path), header("mcp-session-id", "a1.b2~C3")))
        assert found == SessionRef("mcp_session", "a1.b2~C3")
    for bad in ("has space", "é", "x" * 513, ""):
        assert refused(read(reader, header("Mcp-Session-Id", bad))) == "invalid_token"


def test_a_body_field_names_its_key() -> None:
    reader = reader_of(BODY)
    assert read(reader, json_body({"rollout": {"id": "r1"}, "x": [1]})) == SessionRef(
        "rollout", "r1"
    )
    # An integer is written in decimal, as the worker would read it.
    assert read(reader, json_body({"rollout": {"id": 42}})) == SessionRef("rollout", "42")
    escaped = reader_of(replace(BODY, body_field=BodyFieldConfig("/a~1b/c~0d")))
    assert read(escaped, json_body({"a/b": {"c~d": "r2"}})) == SessionRef("rollout", "r2")


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"\xff\xfe\x00",
        b"",
        b'{"rollout": {"id": "r1"}',
        b'["r1"]',
        b'"r1"',
        b'{"rollout": {}}',
        b'{"rollout": "r1"}',
        b'{"rollout": {"id": null}}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
    ids=[
        "not-json",
        "not-utf8",
        "empty",
        "truncated",
        "array",
        "string",
        "missing-field",
        "step-into-string",
        "null",
        "deep-nesting",
    ],
)
def test_a_body_without_a_usable_field_names_no_session(body: bytes) -> None:
    assert read(reader_of(BODY), Req(body=body)) is None


@pytest.mark.parametrize(
    "value",
    [b"true", b"false", b"1.5", b'["r1"]', b'{"v": "r1"}', b'""', b'"a\\u0000b"'],
    ids=["true", "false", "float", "list", "object", "empty-key", "control-char"],
)
def test_a_body_field_present_with_a_value_that_is_no_key_is_invalid(value: bytes) -> None:
    found = read(reader_of(BODY), Req(body=b'{"rollout": {"id": ' + value + b"}}"))
    assert isinstance(found, Answer) and found.code == "invalid_token", found


def test_a_body_over_the_kinds_max_bytes_names_no_session() -> None:
    reader = reader_of(BODY)
    document = {"rollout": {"id": "r1"}, "pad": ""}
    size = len(json.dumps(document).encode())
    at_limit = json.dumps({**document, "pad": "p" * (256 - size)}).encode()
    assert len(at_limit) == 256
    assert reader.read_body(at_limit) == SessionRef("rollout", "r1")
    assert reader.read_body(at_limit + b" ") is None


def test_body_kinds_are_read_in_config_order_each_within_its_own_limit() -> None:
    first = SessionKindConfig("small", body_field=BodyFieldConfig("/a", max_bytes=16))
    second = SessionKindConfig("large", body_field=BodyFieldConfig("/b", max_bytes=1024))
    reader = reader_of(first, second)
    assert reader.max_body_bytes == 1024
    assert reader.read_body(b'{"a":"k1","b":"k2"}') == SessionRef("large", "k2")  # 19 > 16
    assert reader.read_body(b'{"a":"k1","b":2}') == SessionRef("small", "k1")
    assert reader.read_body(b'{"b":"k2"}') == SessionRef("large", "k2")


def test_a_path_pattern_names_its_key_segment_raw() -> None:
    reader = reader_of(PATH)
    assert read(reader, Req(path="/runs/r1/step")) == SessionRef("run", "r1")
    # Kept exactly as written: the worker reads the same raw path.
    assert read(reader, Req(path="/runs/a%2Fb%20c/step")) == SessionRef("run", "a%2Fb%20c")
    assert reader.read_path("/runs/r1/step?run=/runs/r2/step") == SessionRef("run", "r1")
    assert reader.read_path("/runs/r1/step?") == SessionRef("run", "r1")


@pytest.mark.parametrize(
    "path",
    [
        "/runs//step",
        "/runs/r1/step/",
        "/runs/r1",
        "/runs/r1/stop",
        "/x/runs/r1/step",
        "runs/r1/step",
        "/runs/" + "k" * 513 + "/step",
    ],
)
def test_a_path_that_does_not_fit_the_pattern_names_no_session(path: str) -> None:
    assert read(reader_of(PATH), Req(path=path)) is None


# ============================================================================ pairs of sources


@dataclass(frozen=True)
class Source:
    """One source of the contract's order, with a request part naming a valid session and
    one carrying an invalid value (None where an invalid value names no session)."""

    name: str
    config: SessionKindConfig
    valid: Req
    ref: SessionRef
    invalid: Req | None = None
    error: str | None = None

    @property
    def kind(self) -> SessionKind:
        return kind_from_config(self.config)


JWS_SOURCE = Source(
    "header-jws",
    EPISODE,
    header(TOKEN_HEADER, jws("ep1")),
    SessionRef("episode", "ep1-a0"),
    header(TOKEN_HEADER, "not.a.token"),
    "invalid_token",
)
COOKIE_SOURCE = Source(
    "cookie",
    RESOURCES,
    header("Cookie", f"{COOKIE}={starlette_cookie({'session_id': 'c1'})}"),
    SessionRef("resources", "c1"),
    header("Cookie", f"{COOKIE}=not-a-starlette-cookie"),
    "invalid_token",
)
ITSDANGEROUS_SOURCE = Source(
    "itsdangerous",
    MCP_TOKEN,
    header(MCP_TOKEN_HEADER, mcp_token({"sid": "t1"})),
    SessionRef("mcp_token", "t1"),
    header(MCP_TOKEN_HEADER, "garbage"),
    "invalid_token",
)
MCP_SOURCE = Source(
    "mcp",
    MCP,
    header("Mcp-Session-Id", "m1"),
    SessionRef("mcp_session", "m1"),
    header("Mcp-Session-Id", "has space"),
    "invalid_token",
)
BODY_SOURCE = Source(
    "body",
    BODY,
    json_body({"rollout": {"id": "b1"}}),
    SessionRef("rollout", "b1"),
    json_body({"rollout": {"id": "b\u0001"}}),  # a control character: no key
)
PATH_SOURCE = Source("path", PATH, Req(path="/runs/p1/step"), SessionRef("run", "p1"))
SOURCES = (JWS_SOURCE, ITSDANGEROUS_SOURCE, MCP_SOURCE, COOKIE_SOURCE, BODY_SOURCE, PATH_SOURCE)
# (stronger, weaker): every pair of sources at different levels of the contract's order.
PAIRS = [
    (a, b) for a, b in itertools.combinations(SOURCES, 2) if a.kind.precedence != b.kind.precedence
]


def test_the_pairs_cover_every_two_levels() -> None:
    assert [s.kind.precedence for s in SOURCES] == [1, 2, 2, 3, 4, 5]
    assert len(PAIRS) == 14


@pytest.mark.parametrize(
    ("stronger", "weaker"), PAIRS, ids=[f"{a.name}-vs-{b.name}" for a, b in PAIRS]
)
def test_the_stronger_source_of_a_pair_decides_whatever_the_config_order(
    stronger: Source, weaker: Source
) -> None:
    for configs in ((stronger.config, weaker.config), (weaker.config, stronger.config)):
        reader = reader_of(*configs)
        assert read(reader, weaker.valid) == weaker.ref
        assert read(reader, stronger.valid) == stronger.ref
        assert read(reader, merge(stronger.valid, weaker.valid)) == stronger.ref
        assert read(reader, merge(weaker.valid, stronger.valid)) == stronger.ref
        if stronger.error is not None:
            # Present but invalid: the stronger source still decides, with its own answer.
            assert stronger.invalid is not None
            found = read(reader, merge(weaker.valid, stronger.invalid))
            assert refused(found) == stronger.error
            assert read(reader, stronger.invalid) == found


@pytest.mark.parametrize(
    "weaker", [BODY_SOURCE, PATH_SOURCE], ids=lambda source: f"head-vs-{source.name}"
)
def test_a_head_source_naming_an_unknown_key_is_still_the_answer(weaker: Source) -> None:
    # The reader does not know claims; it answers the head's key and never looks further.
    reader = reader_of(weaker.config, MCP)
    found = read(reader, merge(weaker.valid, header("Mcp-Session-Id", "never-claimed")))
    assert found == SessionRef("mcp_session", "never-claimed")


@pytest.mark.parametrize(
    "configs",
    [(MCP_TOKEN, MCP), (MCP, MCP_TOKEN)],
    ids=["itsdangerous-listed-first", "mcp-listed-first"],
)
def test_itsdangerous_vs_mcp_share_a_level_so_the_config_order_decides(
    configs: tuple[SessionKindConfig, SessionKindConfig],
) -> None:
    reader = reader_of(*configs)
    first = {MCP_TOKEN.name: ITSDANGEROUS_SOURCE, MCP.name: MCP_SOURCE}[configs[0].name]
    second = ITSDANGEROUS_SOURCE if first is MCP_SOURCE else MCP_SOURCE
    both = merge(ITSDANGEROUS_SOURCE.valid, MCP_SOURCE.valid)
    assert read(reader, both) == first.ref
    assert read(reader, merge(MCP_SOURCE.valid, ITSDANGEROUS_SOURCE.valid)) == first.ref
    assert read(reader, second.valid) == second.ref
    assert first.invalid is not None
    assert refused(read(reader, merge(second.valid, first.invalid))) == "invalid_token"
    assert second.invalid is not None
    assert read(reader, merge(first.valid, second.invalid)) == first.ref


def test_a_body_field_with_an_unusable_key_never_falls_through_to_the_path() -> None:
    reader = reader_of(BODY, PATH)
    assert BODY_SOURCE.invalid is not None
    found = read(reader, merge(BODY_SOURCE.invalid, PATH_SOURCE.valid))
    assert not isinstance(found, SessionRef), found


def test_a_body_without_the_field_lets_the_path_decide() -> None:
    reader = reader_of(BODY, PATH)
    found = read(reader, merge(json_body({"other": "b1"}), PATH_SOURCE.valid))
    assert found == PATH_SOURCE.ref
    assert read(reader, merge(Req(body=b"not json"), PATH_SOURCE.valid)) == PATH_SOURCE.ref


def test_a_weaker_source_is_never_parsed_when_a_stronger_one_decides() -> None:
    # A repeated, conflicting cookie would be ambiguous on its own; the token decides first.
    reader = reader_of(EPISODE, RESOURCES)
    cookies = header("Cookie", f"{COOKIE}=a; {COOKIE}=b")
    assert read(reader, merge(cookies, JWS_SOURCE.valid)) == JWS_SOURCE.ref
    assert refused(read(reader, cookies)) == "ambiguous_session"


# ============================================================================ repeated values


def test_a_session_header_repeated_with_different_values_is_ambiguous() -> None:
    reader = reader_of(EPISODE, MCP)
    two_tokens = merge(header(TOKEN_HEADER, jws("ep1")), header(TOKEN_HEADER, jws("ep2")))
    assert refused(read(reader, two_tokens)) == "ambiguous_session"
    mixed = merge(header(TOKEN_HEADER, "not.a.token"), header(TOKEN_HEADER, jws("ep1")))
    assert refused(read(reader, mixed)) == "ambiguous_session"
    two_ids = merge(header("Mcp-Session-Id", "m1"), header("mcp-session-id", "m2"))
    assert refused(read(reader, two_ids)) == "ambiguous_session"


def test_a_session_header_repeated_with_the_same_value_is_read_once() -> None:
    reader = reader_of(EPISODE, MCP)
    token = jws("ep1")
    same = merge(header(TOKEN_HEADER, token), header(TOKEN_HEADER.upper(), token))
    # ...and forwarded in one line (`one_line`): the worker reads the header once too.
    assert read(reader, same) == SessionRef("episode", "ep1-a0", token)
    ids = merge(header("Mcp-Session-Id", "m1"), header("Mcp-Session-Id", "m1"))
    assert read(reader, ids) == SessionRef("mcp_session", "m1", "m1")
    assert read(reader, header(TOKEN_HEADER, token)) == SessionRef("episode", "ep1-a0", None)


def test_token_values_joined_in_one_line_read_as_repeated_lines() -> None:
    # A proxy may join repeated lines with commas (RFC 9110 §5.3); a token holds none.
    reader = reader_of(EPISODE, MCP)
    one, other = jws("ep1"), jws("ep2")
    assert refused(read(reader, header(TOKEN_HEADER, f"{one}, {other}"))) == "ambiguous_session"
    assert refused(read(reader, header(TOKEN_HEADER, f"{one},{one}x"))) == "ambiguous_session"
    for same in (f"{one}, {one}", f"{one},\t{one}", f" ,{one}, "):
        assert read(reader, header(TOKEN_HEADER, same)) == SessionRef("episode", "ep1-a0", one)
    assert refused(read(reader, header(TOKEN_HEADER, " , "))) == "invalid_token"
    # An empty line reads as it would once a proxy joined it to the other: nothing.
    lines = merge(header(TOKEN_HEADER, ""), header(TOKEN_HEADER, one))
    assert read(reader, lines) == SessionRef("episode", "ep1-a0", one)
    assert refused(read(reader, header(TOKEN_HEADER, ""))) == "invalid_token"
    # An MCP session id may hold a comma: it is one value, read as it stands.
    assert read(reader, header("Mcp-Session-Id", "m1,m2")) == SessionRef("mcp_session", "m1,m2")


def test_a_cookie_repeated_with_different_values_is_ambiguous() -> None:
    reader = reader_of(RESOURCES)
    one = starlette_cookie({"session_id": "c1"})
    other = starlette_cookie({"session_id": "c2"})
    in_one_line = header("Cookie", f"{COOKIE}={one}; {COOKIE}={other}")
    assert refused(read(reader, in_one_line)) == "ambiguous_session"
    in_two_lines = merge(header("Cookie", f"{COOKIE}={one}"), header("Cookie", f"{COOKIE}={other}"))
    assert refused(read(reader, in_two_lines)) == "ambiguous_session"
    same = merge(header("Cookie", f"{COOKIE}={one}"), header("Cookie", f'x=1; {COOKIE}="{one}"'))
    assert read(reader, same) == SessionRef("resources", "c1")


# ============================================================================ seed routes


STALE_COOKIE = COOKIE_SOURCE.valid  # names c1, a session from an earlier episode
SEED_REQUEST = Req("POST", "/seed_session")


def test_a_seed_request_ignores_its_own_kinds_stale_cookie() -> None:
    reader = reader_of(RESOURCES)
    assert reader.seeding("POST", "/seed_session") == frozenset({"resources"})
    assert read(reader, merge(SEED_REQUEST, STALE_COOKIE)) is None
    # An invalid stale cookie is ignored too: it is not read at all.
    assert read(reader, merge(SEED_REQUEST, header("Cookie", f"{COOKIE}=junk"))) is None


def test_only_the_exact_seed_route_skips_the_cookie() -> None:
    reader = reader_of(RESOURCES)
    for method, path in [("GET", "/seed_session"), ("POST", "/seed_session/"), ("POST", "/")]:
        assert reader.seeding(method, path) == frozenset()
        found = read(reader, merge(Req(method, path), STALE_COOKIE))
        assert found == COOKIE_SOURCE.ref, (method, path)


def test_a_seed_request_reads_the_next_source_after_its_own() -> None:
    reader = reader_of(RESOURCES, MCP, BODY)
    with_mcp = merge(SEED_REQUEST, STALE_COOKIE, MCP_SOURCE.valid)
    assert read(reader, with_mcp) == MCP_SOURCE.ref
    with_body = merge(SEED_REQUEST, STALE_COOKIE, BODY_SOURCE.valid)
    assert read(reader, with_body) == BODY_SOURCE.ref


def test_kinds_sharing_a_seed_route_are_all_skipped_and_others_are_not() -> None:
    reader = reader_of(EPISODE, RESOURCES, MCP_TOKEN)
    assert reader.seeding("POST", "/seed_session") == frozenset({"resources", "mcp_token"})
    stale = merge(SEED_REQUEST, STALE_COOKIE, ITSDANGEROUS_SOURCE.valid)
    assert read(reader, stale) is None
    # The episode kind has no seed route: its token still decides on the seed route.
    assert read(reader, merge(stale, JWS_SOURCE.valid)) == JWS_SOURCE.ref


def test_a_seed_route_skips_only_its_own_kind_among_cookies() -> None:
    other = SessionKindConfig(
        "other",
        cookie=CookieSourceConfig("other_session"),
        seed=RouteConfig("POST", "/other/seed", (LearnConfig(cookie="other_session"),)),
    )
    reader = reader_of(RESOURCES, other)
    other_cookie = header("Cookie", f"other_session={starlette_cookie({'session_id': 'o1'})}")
    assert read(reader, merge(SEED_REQUEST, STALE_COOKIE, other_cookie)) == SessionRef(
        "other", "o1"
    )
    on_other_seed = merge(Req("POST", "/other/seed"), STALE_COOKIE, other_cookie)
    assert read(reader, on_other_seed) == COOKIE_SOURCE.ref
