"""Fuzz target: the session formats of servers the router cannot change (`router.sessions.formats`,
`router.sessions.sources`).

The input's first byte picks a reader, the rest is its input: Starlette session cookies
and itsdangerous tokens (without and with the server's key), raw keys and
`Mcp-Session-Id`s, Cookie and Set-Cookie lines, JSON pointers, path patterns. Each must
keep its documented error contract: a key parser raises nothing but `FormatError`, the
cookie readers never raise, a JSON pointer raises only LookupError or ValueError, a path
pattern only ValueError and its matcher nothing. A value that passes edge verification
must be one the server's own library accepts, naming the same key. Anything else is a
finding.

Coverage-guided, with atheris (libFuzzer flags; crashes are written as `crash-*` files
in the working directory unless `-artifact_prefix=` says otherwise):

    python fuzz/fuzz_formats.py -runs=100000 [corpus_dir ...]

An empty corpus directory is first filled with the seeds below; without one, a folder in
the system's temporary directory is used (and kept for later runs). Without atheris,
`python fuzz/fuzz_formats.py --replay [file ...]` runs the seeds (and the files) once.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sys
from collections.abc import Callable

from fuzz_harness import instrumented, run
from itsdangerous import TimestampSigner, URLSafeSerializer

with instrumented():
    from router.config import SignatureConfig
    from router.config.patterns import compile_path_pattern, parse_json_pointer
    from router.sessions.formats import (
        MAX_KEY_CHARS,
        FormatError,
        itsdangerous_session_key,
        mcp_session_key,
        raw_session_key,
        starlette_session_key,
    )
    from router.sessions.sources import json_pointer, parse_cookie_header, set_cookie_value

NAME = "formats"
NOW = 1_700_000_000.0
SECRET = "the-servers-own-secret"
SALT = "nemo-gym-mcp-session-token"
FIELD = "session_id"
SIGNED = SignatureConfig(SECRET.encode())
SIGNED_RECENTLY = SignatureConfig(SECRET.encode(), max_age_s=60.0)
SALTED = SignatureConfig(SECRET.encode(), salt=SALT)
EXPIRED = "Expires=Thu, 01 Jan 1970 00:00:00 GMT"


def _key(read: Callable[[], str]) -> str | None:
    """The key a parser reads, or None when it refused with a well-formed FormatError."""
    try:
        key = read()
    except FormatError as exc:
        assert exc.code in ("invalid_token", "bad_signature") and exc.detail, exc
        return None
    assert isinstance(key, str) and 1 <= len(key) <= MAX_KEY_CHARS, key
    return key


def _starlette(text: str) -> None:
    _key(lambda: starlette_session_key(text, field=FIELD, signature=None, now=NOW))
    _key(lambda: starlette_session_key(text, field=FIELD, signature=SIGNED_RECENTLY, now=NOW))
    key = _key(lambda: starlette_session_key(text, field=FIELD, signature=SIGNED, now=NOW))
    if key is not None:  # SessionMiddleware would read the same session
        payload = TimestampSigner(SECRET).unsign(text)
        assert _as_key(json.loads(base64.b64decode(payload))[FIELD]) == key, text


def _itsdangerous(text: str) -> None:
    _key(lambda: itsdangerous_session_key(text, field="sid", signature=None))
    key = _key(lambda: itsdangerous_session_key(text, field="sid", signature=SALTED))
    if key is not None:  # the server's serializer would read the same session
        payload = URLSafeSerializer(SECRET, salt=SALT).loads(text)
        assert _as_key(payload["sid"] if isinstance(payload, dict) else payload) == key, text


def _as_key(value: object) -> str:
    return value if isinstance(value, str) else str(value)


def _plain(text: str) -> None:
    _key(lambda: raw_session_key(text))
    key = _key(lambda: mcp_session_key(text))
    assert key is None or all("!" <= c <= "~" for c in key), key


def _cookies(text: str) -> None:
    lines = text.split("\n")
    cookies = parse_cookie_header(lines)
    assert all(isinstance(values, list) and values for values in cookies.values()), cookies
    found = set_cookie_value(lines, "session", now=NOW)
    assert found is None or isinstance(found, str)


def _pointer(text: str) -> None:
    source, _, pointer = text.partition("\n")
    try:
        document: object = json.loads(source)
    except (ValueError, RecursionError):
        document = source
    try:
        parse_json_pointer(pointer)
    except ValueError:
        try:
            json_pointer(document, pointer)
        except ValueError:
            return
        raise AssertionError(f"a malformed pointer found a value: {pointer!r}") from None
    with contextlib.suppress(LookupError):
        json_pointer(document, pointer)


def _pattern(text: str) -> None:
    pattern, *paths = text.split("\n")
    try:
        match = compile_path_pattern(pattern)
    except ValueError:
        return
    for path in paths:
        key = match(path)
        assert key is None or (key and "/" not in key), (pattern, path, key)


READERS = (_starlette, _itsdangerous, _plain, _cookies, _pointer, _pattern)


def check(data: bytes) -> None:
    """One input: its first byte picks the reader, the rest (as UTF-8 with surrogate escapes,
    as header values are decoded) is what it reads."""
    if not data:
        return
    READERS[data[0] % len(READERS)](data[1:].decode("utf-8", "surrogateescape"))


def seeds() -> list[bytes]:
    """Real values of every format, each behind the byte that picks its reader."""
    session = base64.b64encode(json.dumps({FIELD: "s-1", "n": 2}).encode())
    cookie = TimestampSigner(SECRET).sign(session).decode()
    token = URLSafeSerializer(SECRET, salt=SALT).dumps({"sid": "s-2"})
    packed = URLSafeSerializer(SECRET, salt=SALT).dumps({"sid": "s-3", "pad": "a" * 300})
    bare = URLSafeSerializer(SECRET, salt=SALT).dumps(42)
    inputs = [
        (0, cookie),
        (1, token),
        (1, packed),
        (1, bare),
        (2, "key-1"),
        (3, f'a=1; session="{cookie}"; b\nsession=x; Max-Age=0\nsession=y; {EXPIRED}'),
        (4, '{"a": [{"b~/c": 1}]}\n/a/0/b~0~1c'),
        (5, "/rollouts/{key}/stop\n/rollouts/r1/stop\n/rollouts//stop?x"),
    ]
    return [bytes([index]) + text.encode() for index, text in inputs]


def main(argv: list[str]) -> int:
    """Fuzz with atheris, or with --replay run the seeds and the given files once."""
    return run(argv, NAME, check, seeds)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
