"""Tests for router.sessions.formats: pure parsers, checked against real libraries' values.

Starlette cookies come from a real SessionMiddleware app driven by Starlette's TestClient (no
socket, no event loop in the test), and the server's own reading of each cookie is compared with
the router's. itsdangerous tokens come from URLSafeSerializer, with NeMo Gym's salt.
"""

from __future__ import annotations

import base64
import contextlib
import pickle
import random
import time
import zlib
from collections.abc import Callable, Iterator
from functools import partial

import pytest
from itsdangerous import TimestampSigner, URLSafeSerializer
from itsdangerous.encoding import base64_encode
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.sessions import SessionMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from router.config import SignatureConfig
from router.config.patterns import compile_path_pattern
from router.sessions.formats import (
    MAX_KEY_CHARS,
    FormatError,
    itsdangerous_session_key,
    mcp_session_key,
    raw_session_key,
    starlette_session_key,
)
from router.sessions.sources import json_pointer, parse_cookie_header, set_cookie_value
from tests.sessions.test_sources import RFC_DOCUMENT

SECRET = "resources-server-secret"
COOKIE = "ResourcesServer___resources"
MCP_SALT = "nemo-gym-mcp-session-token"  # NeMo Gym's MCP session token salt
SIGNED_AT = 1_700_000_000
DAY = 86400.0


# ---------------------------------------------------------------------------- a real server


def _starlette_app() -> Starlette:
    async def seed(request: Request) -> JSONResponse:
        body = await request.json()
        request.session.update(body)
        return JSONResponse({"ok": True})

    async def whoami(request: Request) -> JSONResponse:
        return JSONResponse({"session_id": request.session.get("session_id")})

    async def close(request: Request) -> JSONResponse:
        request.session.clear()
        return JSONResponse({"ok": True})

    routes = [
        Route("/seed_session", seed, methods=["POST"]),
        Route("/whoami", whoami),
        Route("/close_session", close, methods=["POST"]),
    ]
    middleware = [Middleware(SessionMiddleware, secret_key=SECRET, session_cookie=COOKIE)]
    return Starlette(routes=routes, middleware=middleware)


class Server:
    """A real Starlette SessionMiddleware app: mints cookies, and says what it reads from one."""

    def __init__(self, client: TestClient) -> None:
        self.client = client

    def seed(self, session: dict[str, object]) -> list[str]:
        """The Set-Cookie headers of POST /seed_session that stores `session`."""
        self.client.cookies.clear()
        reply = self.client.post("/seed_session", json=session)
        assert reply.status_code == 200
        return reply.headers.get_list("set-cookie")

    def cookie(self, session: dict[str, object]) -> str:
        value = set_cookie_value(self.seed(session), COOKIE)
        assert value is not None
        return value

    def reads(self, cookie_value: str) -> object:
        """The session_id the server itself reads from a request carrying this cookie."""
        self.client.cookies.clear()
        reply = self.client.get("/whoami", headers={"Cookie": f"{COOKIE}={cookie_value}"})
        return reply.json()["session_id"]

    def close(self, cookie_value: str) -> list[str]:
        self.client.cookies.clear()
        headers = {"Cookie": f"{COOKIE}={cookie_value}"}
        reply = self.client.post("/close_session", headers=headers)
        return reply.headers.get_list("set-cookie")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with TestClient(_starlette_app()) as client:
        yield Server(client)


def signed_at(ts: int) -> TimestampSigner:
    """SessionMiddleware's signer with a fixed clock, to mint cookies of a known age."""

    class Signer(TimestampSigner):
        def get_timestamp(self) -> int:
            return ts

    return Signer(SECRET)


def starlette_cookie(payload: bytes, ts: int = SIGNED_AT, secret: str = SECRET) -> str:
    """A cookie exactly as SessionMiddleware builds one, from raw JSON bytes."""
    signer = signed_at(ts) if secret == SECRET else TimestampSigner(secret)
    return signer.sign(base64.b64encode(payload)).decode()


def error(call: Callable[[], object]) -> FormatError:
    with pytest.raises(FormatError) as info:
        call()
    return info.value


SIG = SignatureConfig(SECRET.encode())
SIG_14_DAYS = SignatureConfig(SECRET.encode(), max_age_s=14 * DAY)


def cookie_key(value: str, signature: SignatureConfig | None = None, now: float = SIGNED_AT) -> str:
    return starlette_session_key(value, field="session_id", signature=signature, now=now)


# ---------------------------------------------------------------------------- Starlette


@pytest.mark.parametrize(
    ("session", "key"),
    [
        (
            {"session_id": "3f2a9c1e-77b0-4f35-9a55-0c4f1d2e8b6a"},
            "3f2a9c1e-77b0-4f35-9a55-0c4f1d2e8b6a",
        ),
        ({"session_id": "séance-1", "other": [1, 2]}, "séance-1"),
        ({"session_id": 'quote"back\\slash'}, 'quote"back\\slash'),
        ({"session_id": 42}, "42"),
        ({"session_id": "x" * MAX_KEY_CHARS}, "x" * MAX_KEY_CHARS),
    ],
)
def test_starlette_cookie_gives_the_key_the_server_reads(
    server: Server, session: dict[str, object], key: str
) -> None:
    value = server.cookie(session)
    assert cookie_key(value) == key
    assert cookie_key(value, SIG) == key
    assert str(server.reads(value)) == key


def test_starlette_set_cookie_is_read_from_the_real_reply(server: Server) -> None:
    headers = server.seed({"session_id": "s-1"})
    assert len(headers) == 1
    assert headers[0].startswith(f"{COOKIE}=")
    assert "Max-Age=1209600" in headers[0]
    value = set_cookie_value(headers, COOKIE)
    assert value is not None
    assert cookie_key(value) == "s-1"
    assert parse_cookie_header([f"other=1; {COOKIE}={value}"]) == {
        "other": ["1"],
        COOKIE: [value],
    }


def test_starlette_clearing_a_session_deletes_the_cookie(server: Server) -> None:
    value = server.cookie({"session_id": "s-2"})
    headers = server.close(value)
    assert len(headers) == 1
    assert "expires=Thu, 01 Jan 1970 00:00:00 GMT" in headers[0]
    assert set_cookie_value(headers, COOKIE, now=SIGNED_AT) is None
    assert set_cookie_value(headers, COOKIE) == "null"  # without a clock, Expires is not read
    assert error(lambda: cookie_key("null")).code == "invalid_token"


def test_starlette_cookie_age_uses_the_injected_clock(server: Server) -> None:
    value = starlette_cookie(b'{"session_id": "aged"}')
    assert server.reads(value) is None  # signed in 2023: the server's own 14 days are long past
    assert cookie_key(value, SIG, now=SIGNED_AT) == "aged"
    assert cookie_key(value, SIG_14_DAYS, now=SIGNED_AT + 14 * DAY) == "aged"
    assert cookie_key(value, SIG_14_DAYS, now=SIGNED_AT + 14 * DAY + 0.999) == "aged"
    expired = error(lambda: cookie_key(value, SIG_14_DAYS, now=SIGNED_AT + 14 * DAY + 1))
    assert (expired.code, expired.detail) == (
        "invalid_token",
        "The session cookie expired: signed 1209601 s ago.",
    )
    future = error(lambda: cookie_key(value, SIG_14_DAYS, now=SIGNED_AT - 1))
    assert (future.code, future.detail) == (
        "invalid_token",
        "The session cookie is signed in the future.",
    )
    assert cookie_key(value, SIG, now=SIGNED_AT - 1) == "aged"  # no max age: no age check
    assert cookie_key(value, None, now=0.0) == "aged"


def test_starlette_cookie_fresh_from_the_server_passes_its_max_age(server: Server) -> None:
    value = server.cookie({"session_id": "fresh"})
    assert cookie_key(value, SIG_14_DAYS, now=time.time()) == "fresh"


def test_forged_starlette_cookies(server: Server) -> None:
    value = server.cookie({"session_id": "victim"})
    payload, ts, sig = value.split(".")
    # The first character: the last one of an unpadded base64 signature carries padding
    # bits, so changing it can leave the signature's bytes as they were.
    flipped = ("A" if sig[0] != "A" else "B") + sig[1:]
    other = base64.b64encode(b'{"session_id": "attacker"}').decode()
    wrong_key = starlette_cookie(b'{"session_id": "victim"}', secret="not-the-secret")
    forged = {
        "tampered signature": (f"{payload}.{ts}.{flipped}", "victim"),
        "tampered payload": (f"{other}.{ts}.{sig}", "attacker"),
        "tampered timestamp": (f"{payload}.{ts}A.{sig}", "victim"),
        "wrong secret": (wrong_key, "victim"),
    }
    for cookie, unverified_key in forged.values():
        assert server.reads(cookie) is None  # the server refuses it too
        assert cookie_key(cookie) == unverified_key  # read, not verified, without a key
        failure = error(partial(cookie_key, cookie, SIG))
        assert (failure.code, failure.detail) == (
            "bad_signature",
            "The session cookie's signature does not verify.",
        )
        assert failure.status == 403


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        ("", "The session cookie is not a signed Starlette session."),
        ("garbage", "The session cookie is not a signed Starlette session."),
        ("a.b", "The session cookie is not a signed Starlette session."),
        ("a.b.c.d", "The session cookie is not a signed Starlette session."),
        ("e30=..sig", "The session cookie is not a signed Starlette session."),
        ("e30=.ts.", "The session cookie is not a signed Starlette session."),
        ("e3-_.ts.sig", "The session cookie is not a signed Starlette session."),
        ("e30.ts.sig", "The session cookie's payload is not valid base64."),
        ("e3=0.ts.sig", "The session cookie is not a signed Starlette session."),
        ("e30===.ts.sig", "The session cookie is not a signed Starlette session."),
        ("x" * 16385, "The session cookie is longer than 16384 characters."),
    ],
)
def test_malformed_starlette_cookies(value: str, detail: str) -> None:
    for signature in (None, SIG):
        failure = error(partial(cookie_key, value, signature))
        assert (failure.code, failure.detail) == ("invalid_token", detail)
        assert failure.status == 401


@pytest.mark.parametrize(
    ("payload", "detail"),
    [
        (b"{", "The session cookie's payload is not valid JSON."),
        (b"\xff\xfe{", "The session cookie's payload is not valid JSON."),
        (b"[" * 5000, "The session cookie's payload is not valid JSON."),
        (b'["session_id"]', "The session cookie is an array, not a JSON object."),
        (b'"session_id"', "The session cookie is a string, not a JSON object."),
        (b"null", "The session cookie is null, not a JSON object."),
        (b"{}", "The session cookie has no 'session_id' field."),
        (b'{"sid": "x"}', "The session cookie has no 'session_id' field."),
        (
            b'{"session_id": null}',
            "The session cookie's 'session_id' field is null, not a string or an integer.",
        ),
        (
            b'{"session_id": true}',
            "The session cookie's 'session_id' field is a boolean, not a string or an integer.",
        ),
        (
            b'{"session_id": 1.5}',
            "The session cookie's 'session_id' field is a number, not a string or an integer.",
        ),
        (
            b'{"session_id": {"a": 1}}',
            "The session cookie's 'session_id' field is an object, not a string or an integer.",
        ),
        (
            b'{"session_id": ""}',
            "The session cookie's 'session_id' field is not a usable session key: "
            "The session key is empty.",
        ),
        (
            b'{"session_id": "a\\u0000b"}',
            "The session cookie's 'session_id' field is not a usable session key: "
            "The session key contains a control character.",
        ),
        (
            b'{"session_id": "' + b"x" * 513 + b'"}',
            "The session cookie's 'session_id' field is not a usable session key: "
            "The session key is longer than 512 characters.",
        ),
    ],
)
def test_starlette_payloads_that_name_no_key(payload: bytes, detail: str) -> None:
    value = starlette_cookie(payload)  # genuinely signed: the payload alone is at fault
    for signature in (None, SIG):
        failure = error(partial(cookie_key, value, signature))
        assert (failure.code, failure.detail) == ("invalid_token", detail)


def test_starlette_duplicate_keys_read_as_the_server_reads_them(server: Server) -> None:
    payload = base64.b64encode(b'{"session_id": "first", "session_id": "last"}')
    value = TimestampSigner(SECRET).sign(payload).decode()  # signed now, so the server reads it
    assert server.reads(value) == "last"
    assert cookie_key(value) == "last"


def test_starlette_other_field() -> None:
    value = starlette_cookie(b'{"session_id": "a", "rollout": "r-7"}')
    assert starlette_session_key(value, field="rollout", signature=SIG, now=SIGNED_AT) == "r-7"


# ---------------------------------------------------------------------------- itsdangerous

NEMO = URLSafeSerializer(SECRET, salt=MCP_SALT)
SIG_NEMO = SignatureConfig(SECRET.encode(), salt=MCP_SALT)


def token_key(token: str, signature: SignatureConfig | None = None, field: str = "sid") -> str:
    return itsdangerous_session_key(token, field=field, signature=signature)


@pytest.mark.parametrize(
    ("payload", "key"),
    [
        ({"sid": "3f2a9c1e", "tools": None}, "3f2a9c1e"),
        ({"sid": "3f2a9c1e", "tools": ["search", "open"]}, "3f2a9c1e"),
        ({"sid": 7}, "7"),
        ("bare-session-id", "bare-session-id"),  # NeMo Gym's token without a tool restriction
        (12345, "12345"),
        ({"sid": "ünïcode"}, "ünïcode"),
    ],
)
def test_itsdangerous_tokens_give_their_key(payload: object, key: str) -> None:
    token = NEMO.dumps(payload)
    assert not token.startswith(".")
    assert token_key(token) == key
    assert token_key(token, SIG_NEMO) == key
    assert NEMO.loads(token) == payload


def test_itsdangerous_compressed_token() -> None:
    tools = [f"tool_number_{i}" for i in range(300)]
    token = NEMO.dumps({"sid": "big", "tools": tools})
    assert token.startswith(".")  # itsdangerous chose zlib
    assert token_key(token) == "big"
    assert token_key(token, SIG_NEMO) == "big"


def test_itsdangerous_default_salt() -> None:
    token = URLSafeSerializer(SECRET).dumps({"sid": "plain"})
    assert token_key(token, SignatureConfig(SECRET.encode())) == "plain"
    assert error(lambda: token_key(token, SIG_NEMO)).code == "bad_signature"


def test_forged_itsdangerous_tokens() -> None:
    token = NEMO.dumps({"sid": "victim"})
    payload, sig = token.split(".")
    # The first character: the last one of an unpadded base64 signature carries padding
    # bits, so changing it can leave the signature's bytes as they were.
    flipped = ("A" if sig[0] != "A" else "B") + sig[1:]
    other = NEMO.dumps({"sid": "attacker"}).split(".")[0]
    forged = {
        "tampered signature": (f"{payload}.{flipped}", "victim"),
        "tampered payload": (f"{other}.{sig}", "attacker"),
        "wrong secret": (URLSafeSerializer("other", salt=MCP_SALT).dumps({"sid": "v"}), "v"),
        "wrong salt": (URLSafeSerializer(SECRET, salt="other").dumps({"sid": "v"}), "v"),
    }
    for token, unverified_key in forged.values():
        assert token_key(token) == unverified_key
        failure = error(partial(token_key, token, SIG_NEMO))
        assert (failure.code, failure.detail) == (
            "bad_signature",
            "The session token's signature does not verify.",
        )


def signed_token(payload: bytes, *, compressed: bool = False) -> str:
    """A token signed exactly as URLSafeSerializer signs, around an arbitrary payload."""
    body = base64_encode(zlib.compress(payload) if compressed else payload)
    return NEMO.make_signer().sign((b"." if compressed else b"") + body).decode()


NOT_URLSAFE = "The session token is not an itsdangerous URL-safe token."


@pytest.mark.parametrize(
    ("token", "detail"),
    [
        ("", NOT_URLSAFE),
        ("garbage", NOT_URLSAFE),
        (".", NOT_URLSAFE),
        ("..", NOT_URLSAFE),
        ("abc.", NOT_URLSAFE),
        (".abc", NOT_URLSAFE),
        ("a.b.c", NOT_URLSAFE),  # a URLSafeTimedSerializer token is another format
        ("..abc.sig", NOT_URLSAFE),
        ("ab+c.sig", NOT_URLSAFE),
        ("abc=.sig", NOT_URLSAFE),
        ("abcde.sig", "The session token's payload is not valid base64."),
        ("x" * 16385, "The session token is longer than 16384 characters."),
    ],
)
def test_malformed_itsdangerous_tokens(token: str, detail: str) -> None:
    for signature in (None, SIG_NEMO):
        failure = error(partial(token_key, token, signature))
        assert (failure.code, failure.detail) == ("invalid_token", detail)


@pytest.mark.parametrize(
    ("token", "detail"),
    [
        (signed_token(b"\xff"), "The session token's payload is not valid UTF-8."),
        (signed_token(b"{"), "The session token's payload is not valid JSON."),
        (signed_token(b"[" * 5000), "The session token's payload is not valid JSON."),
        (
            signed_token(b"[1]"),
            "The session token's payload is an array, not a string or an integer.",
        ),
        (signed_token(b"null"), "The session token's payload is null, not a string or an integer."),
        (
            signed_token(b"true"),
            "The session token's payload is a boolean, not a string or an integer.",
        ),
        (signed_token(b'{"tools": []}'), "The session token has no 'sid' field."),
        (
            signed_token(b'{"sid": ["x"]}'),
            "The session token's 'sid' field is an array, not a string or an integer.",
        ),
        (
            signed_token(b'""'),
            "The session token's payload is not a usable session key: The session key is empty.",
        ),
        (
            "." + NEMO.make_signer().sign(base64_encode(b"not zlib")).decode(),
            "The session token's payload is not valid zlib data.",
        ),
        (
            "." + NEMO.make_signer().sign(base64_encode(zlib.compress(b'"abc"')[:-3])).decode(),
            "The session token's payload is not one complete zlib stream.",
        ),
        (
            "." + NEMO.make_signer().sign(base64_encode(zlib.compress(b'"abc"') + b"x")).decode(),
            "The session token's payload is not one complete zlib stream.",
        ),
        (
            signed_token(b'"' + b"a" * 70_000 + b'"', compressed=True),
            "The session token's payload inflates past 65536 bytes.",
        ),
    ],
)
def test_itsdangerous_payloads_that_name_no_key(token: str, detail: str) -> None:
    for signature in (None, SIG_NEMO):
        failure = error(partial(token_key, token, signature))
        assert (failure.code, failure.detail) == ("invalid_token", detail)


def test_inflated_payload_limit_is_exact() -> None:
    def padded(size: int) -> bytes:
        head = b'{"sid": "k", "pad": "'
        return head + b"a" * (size - len(head) - 2) + b'"}'

    assert len(padded(65536)) == 65536
    assert token_key(signed_token(padded(65536), compressed=True), SIG_NEMO) == "k"
    failure = error(partial(token_key, signed_token(padded(65537), compressed=True)))
    assert failure.detail == "The session token's payload inflates past 65536 bytes."


def test_zlib_bomb_is_refused_before_it_inflates() -> None:
    bomb = signed_token(b'"' + b"a" * (8 << 20) + b'"', compressed=True)
    assert len(bomb) < 16384  # fits in one request header
    assert error(lambda: token_key(bomb)).detail.endswith("inflates past 65536 bytes.")


# ---------------------------------------------------------------------------- plain keys


@pytest.mark.parametrize("value", ["a", "x" * 512, "ep7-a0", "séance 1", "a;b,c=d", "汉字"])
def test_raw_keys(value: str) -> None:
    assert raw_session_key(value) == value


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        ("", "The session key is empty."),
        ("x" * 513, "The session key is longer than 512 characters."),
        ("a\x00b", "The session key contains a control character."),
        ("a\tb", "The session key contains a control character."),
        ("a\x7fb", "The session key contains a control character."),
        ("a\x85b", "The session key contains a control character."),
    ],
)
def test_bad_raw_keys(value: str, detail: str) -> None:
    failure = error(lambda: raw_session_key(value))
    assert (failure.code, failure.detail) == ("invalid_token", detail)


@pytest.mark.parametrize("value", ["a", "!", "~" * 512, "0123abcd-EF", "s=1;x"])
def test_mcp_session_ids(value: str) -> None:
    assert mcp_session_key(value) == value


@pytest.mark.parametrize(
    ("value", "detail"),
    [
        ("", "The Mcp-Session-Id must be 1 to 512 characters."),
        ("x" * 513, "The Mcp-Session-Id must be 1 to 512 characters."),
        ("a b", "The Mcp-Session-Id must be visible ASCII (0x21 to 0x7E)."),
        ("a\x7f", "The Mcp-Session-Id must be visible ASCII (0x21 to 0x7E)."),
        ("é", "The Mcp-Session-Id must be visible ASCII (0x21 to 0x7E)."),
    ],
)
def test_bad_mcp_session_ids(value: str, detail: str) -> None:
    failure = error(lambda: mcp_session_key(value))
    assert (failure.code, failure.detail) == ("invalid_token", detail)


def test_format_error_carries_its_parts_and_pickles() -> None:
    failure = FormatError("bad_signature", "The session cookie's signature does not verify.")
    assert (failure.code, failure.detail, failure.status) == (
        "bad_signature",
        "The session cookie's signature does not verify.",
        403,
    )
    assert str(failure) == failure.detail
    copy = pickle.loads(pickle.dumps(failure))
    assert (copy.code, copy.detail) == (failure.code, failure.detail)


# ---------------------------------------------------------------------------- hostile input


def test_only_format_errors_escape_the_key_parsers() -> None:
    """Bounded random values built from the characters these formats split on."""
    rng = random.Random(6265)
    alphabet = "ab09+/=_-.~%\"' ;,\\\x00\x7fé{}[]:"
    valid = [starlette_cookie(b'{"session_id": "k"}'), NEMO.dumps({"sid": "k"})]
    values = [v[:cut] + c + v[cut:] for v in valid for cut in range(len(v)) for c in ".=A"]
    values += ["".join(rng.choices(alphabet, k=rng.randrange(40))) for _ in range(2000)]
    parsers: list[Callable[[str], object]] = [
        raw_session_key,
        mcp_session_key,
        lambda v: cookie_key(v),
        lambda v: cookie_key(v, SIG_14_DAYS),
        lambda v: token_key(v),
        lambda v: token_key(v, SIG_NEMO),
    ]
    for value in values:
        for parse in parsers:
            try:
                key = parse(value)
            except FormatError as exc:
                assert exc.code in ("invalid_token", "bad_signature")
            else:
                assert isinstance(key, str) and 1 <= len(key) <= MAX_KEY_CHARS
        assert isinstance(parse_cookie_header([value]), dict)
        set_cookie_value([value], "a", now=0.0)
        with contextlib.suppress(LookupError, ValueError):
            json_pointer(RFC_DOCUMENT, value)
        with contextlib.suppress(ValueError):
            compile_path_pattern(value)
