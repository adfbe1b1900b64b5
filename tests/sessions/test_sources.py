"""Tests for router.sessions.sources: Cookie and Set-Cookie headers, JSON pointers, path patterns.

Pure: each grammar is checked against the RFCs' examples and the values Python's servers
write. The Set-Cookie headers of a real Starlette app are read in test_formats.
"""

from __future__ import annotations

import json

import pytest

from router.config.patterns import compile_path_pattern, parse_json_pointer
from router.sessions.sources import json_pointer, parse_cookie_header, set_cookie_value

NOW = 1_700_000_000  # Tue, 14 Nov 2023 22:13:20 GMT: the clock the Expires cases are read by


# ---------------------------------------------------------------------------- Cookie header


@pytest.mark.parametrize(
    ("lines", "cookies"),
    [
        ([], {}),
        ([""], {}),
        (["a=1"], {"a": ["1"]}),
        (["a=1; b=2"], {"a": ["1"], "b": ["2"]}),
        (["a=1;b=2"], {"a": ["1"], "b": ["2"]}),
        (["a=1;   b=2;\tc=3 "], {"a": ["1"], "b": ["2"], "c": ["3"]}),
        (["a=1;"], {"a": ["1"]}),
        (["a=1", "b=2; a=3"], {"a": ["1", "3"], "b": ["2"]}),
        (["a=1; a=1"], {"a": ["1", "1"]}),
        (["A=1; a=2"], {"A": ["1"], "a": ["2"]}),
        (['a="quoted"'], {"a": ["quoted"]}),
        (['a=""'], {"a": [""]}),
        (["a="], {"a": [""]}),
        (["a=b=c=="], {"a": ["b=c=="]}),
        (["__Host-x_y=v"], {"__Host-x_y": ["v"]}),
        (["a=e30=.awzAEQ.BPTp_-"], {"a": ["e30=.awzAEQ.BPTp_-"]}),
        # a pair with no "=" or a name no cookie may have is skipped
        (["novalue; b=2"], {"b": ["2"]}),
        (["=x; b=2"], {"b": ["2"]}),
        (["a b=1; b=2"], {"b": ["2"]}),
        (["a(b)=1; b=2"], {"b": ["2"]}),
        # any value is kept, as Starlette (http.cookies) reads it: the worker sees it
        (["a =1; b=2"], {"a": ["1"], "b": ["2"]}),
        (["a= 1 ; b=2"], {"a": ["1"], "b": ["2"]}),
        (["a=x y; b=2"], {"a": ["x y"], "b": ["2"]}),
        (['a=x"y; b=2'], {"a": ['x"y'], "b": ["2"]}),
        (['a="x; b=2'], {"a": ['"x'], "b": ["2"]}),
        (['a="; b=2'], {"a": ['"'], "b": ["2"]}),
        (["a=x\\y; b=2"], {"a": ["x\\y"], "b": ["2"]}),
        (["a=é; b=2"], {"a": ["é"], "b": ["2"]}),
        (["a=x,y; b=2"], {"a": ["x,y"], "b": ["2"]}),
        # a quoted value's escapes, as Python's servers write them
        (['a="a\\054b"'], {"a": ["a,b"]}),
        (['a="x\\"y"'], {"a": ['x"y']}),
        (['a="w1 1"'], {"a": ["w1 1"]}),
    ],
)
def test_cookie_header_parsing(lines: list[str], cookies: dict[str, list[str]]) -> None:
    assert parse_cookie_header(lines) == cookies


# ---------------------------------------------------------------------------- Set-Cookie


@pytest.mark.parametrize(
    ("headers", "value"),
    [
        ([], None),
        (["other=1"], None),
        (["sid2=x", "xsid=y"], None),
        (["sid=abc"], "abc"),
        (["sid=abc; Path=/; HttpOnly"], "abc"),
        ([" sid = abc ; Path=/"], "abc"),
        (['sid="abc"; Path=/'], "abc"),
        (['sid="a\\054b"'], "a,b"),  # unquoted as the Cookie header is (http.cookies)
        (['sid="w1 1"; Path=/'], "w1 1"),
        (["sid=a", "sid=b"], "b"),
        (["sid=a", "other=z"], "a"),
        (["sid="], None),
        (['sid=""'], None),
        (["sid=a; Max-Age=0"], None),
        (["sid=a; max-age=-1"], None),
        (["sid=a; MAX-AGE = 0 "], None),
        (["sid=a; Max-Age=60"], "a"),
        (["sid=a; Max-Age=soon"], "a"),
        (["sid=a; Max-Age=0; Max-Age=60"], "a"),
        (["sid=a", "sid=; Max-Age=0"], None),
        (["sid=; Max-Age=0", "sid=c"], "c"),
        (["sid=a; Max-Age=0", "other=1"], None),
        (["novalue", "sid=a"], "a"),
    ],
)
def test_set_cookie_value(headers: list[str], value: str | None) -> None:
    assert set_cookie_value(headers, "sid") == value
    assert set_cookie_value(headers, "sid", now=NOW) == value


@pytest.mark.parametrize(
    ("header", "without_clock", "with_clock"),
    [
        ("sid=a; Expires=Thu, 01 Jan 1970 00:00:00 GMT", "a", None),
        ("sid=a; expires=Thursday, 01-Jan-70 00:00:00 GMT", "a", None),
        ("sid=a; Expires=Tue, 14 Nov 2023 22:13:20 GMT", "a", None),  # exactly now
        ("sid=a; Expires=Tue, 14 Nov 2023 22:13:21 GMT", "a", "a"),
        ("sid=a; Expires=Wed, 21 Oct 2099 07:28:00 GMT", "a", "a"),
        ("sid=a; Expires=Thu, 01 Jan 1970 00:00:00 GMT; Max-Age=60", "a", "a"),
        ("sid=a; Max-Age=60; Expires=Thu, 01 Jan 1970 00:00:00 GMT", "a", "a"),
        ("sid=a; Expires=someday", "a", "a"),
        ("sid=a; Expires=Thu, 01 Jan 99999 00:00:00 GMT", "a", "a"),
        ("sid=a; Expires=" + "x" * 100, "a", "a"),
    ],
)
def test_set_cookie_expires_needs_a_clock(
    header: str, without_clock: str | None, with_clock: str | None
) -> None:
    assert set_cookie_value([header], "sid") == without_clock
    assert set_cookie_value([header], "sid", now=NOW) == with_clock


# ---------------------------------------------------------------------------- JSON pointers

# RFC 6901 §5.
RFC_DOCUMENT = json.loads(
    r"""{"foo": ["bar", "baz"], "": 0, "a/b": 1, "c%d": 2, "e^f": 3, "g|h": 4,
         "i\\j": 5, "k\"l": 6, " ": 7, "m~n": 8}"""
)


@pytest.mark.parametrize(
    ("pointer", "value"),
    [
        ("", RFC_DOCUMENT),
        ("/foo", ["bar", "baz"]),
        ("/foo/0", "bar"),
        ("/", 0),
        ("/a~1b", 1),
        ("/c%d", 2),
        ("/e^f", 3),
        ("/g|h", 4),
        ("/i\\j", 5),
        ('/k"l', 6),
        ("/ ", 7),
        ("/m~0n", 8),
    ],
)
def test_json_pointer_rfc_6901_examples(pointer: str, value: object) -> None:
    assert json_pointer(RFC_DOCUMENT, pointer) == value


def test_json_pointer_in_a_seed_reply() -> None:
    reply = {"mcp": {"server_name": "r", "headers": {"X-NeMo-Gym-Session-Token": "tok"}}}
    assert json_pointer(reply, "/mcp/headers/X-NeMo-Gym-Session-Token") == "tok"
    assert json_pointer({"~1": "tilde-one", "/": "slash"}, "/~01") == "tilde-one"
    assert json_pointer({"~1": "tilde-one", "/": "slash"}, "/~1") == "slash"
    assert json_pointer({"a": [None, False]}, "/a/1") is False
    assert json_pointer([[1, [2, 3]]], "/0/1/1") == 3


@pytest.mark.parametrize(
    "pointer",
    ["/foo/2", "/foo/-", "/foo/01", "/foo/-1", "/foo/bar", "/foo/ 1", "/nope", "/foo/0/x", "/ /x"],
)
def test_json_pointer_to_nothing_is_a_lookup_error(pointer: str) -> None:
    with pytest.raises(LookupError):
        json_pointer(RFC_DOCUMENT, pointer)


@pytest.mark.parametrize("pointer", ["foo", "#/foo", "/m~2n", "/m~", "/~a"])
def test_malformed_json_pointer_is_a_value_error(pointer: str) -> None:
    with pytest.raises(ValueError):
        parse_json_pointer(pointer)
    with pytest.raises(ValueError):
        json_pointer(RFC_DOCUMENT, pointer)


def test_parse_json_pointer_unescapes_in_order() -> None:
    assert parse_json_pointer("") == ()
    assert parse_json_pointer("/") == ("",)
    assert parse_json_pointer("/a~1b/~0/~01//x") == ("a/b", "~", "~1", "", "x")


# ---------------------------------------------------------------------------- path patterns


@pytest.mark.parametrize(
    ("pattern", "path", "key"),
    [
        ("/rollouts/{key}/stop", "/rollouts/abc/stop", "abc"),
        ("/rollouts/{key}/stop", "/rollouts/abc/stop?force=1", "abc"),
        ("/rollouts/{key}/stop", "/rollouts/a%2Fb/stop", "a%2Fb"),
        ("/rollouts/{key}/stop", "/rollouts/a;b=c/stop", "a;b=c"),
        ("/rollouts/{key}/stop", "/rollouts//stop", None),
        ("/rollouts/{key}/stop", "/rollouts/abc/stop/", None),
        ("/rollouts/{key}/stop", "/rollouts/abc", None),
        ("/rollouts/{key}/stop", "/rollouts/a/b/stop", None),
        ("/rollouts/{key}/stop", "/rollouts/abc/start", None),
        ("/rollouts/{key}/stop", "/Rollouts/abc/stop", None),
        ("/rollouts/{key}/stop", "/rollout%73/abc/stop", None),
        ("/rollouts/{key}/stop", "rollouts/abc/stop", None),
        ("/rollouts/{key}/stop", "", None),
        ("/rollouts/{key}/stop", "/", None),
        ("/{key}/events", "/e-1/events", "e-1"),
        ("/{key}/events", "//events", None),
        ("/api/v1/{key}", "/api/v1/k", "k"),
        ("/api/v1/{key}", "/api/v1/k?", "k"),
        ("/api/v1/{key}", "/api/v1/?k", None),
        ("/api/v1/{key}", "/api/v2/k", None),
        ("/a/{key}", "/a/{key}", "{key}"),
    ],
)
def test_path_patterns(pattern: str, path: str, key: str | None) -> None:
    assert compile_path_pattern(pattern)(path) == key


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("rollouts/{key}", "starts with '/'"),
        ("", "starts with '/'"),
        ("/rollouts", "exactly one {key} segment"),
        ("/a/{key}/{key}", "exactly one {key} segment"),
        ("/{key}", "needs a literal segment"),
        ("/a/{key}x", "exactly one {key} segment"),
        ("/a/{id}/{key}", "{key} must be a whole segment"),
        ("/a/*/{key}", "'*' is not supported"),
        ("/a//{key}", "not a path segment"),
        ("/a/{key}/", "not a path segment"),
        ("/a b/{key}", "not a path segment"),
        ("/a/%zz/{key}", "not a path segment"),
        ("/a?/{key}", "not a path segment"),
    ],
)
def test_bad_path_patterns(pattern: str, reason: str) -> None:
    with pytest.raises(ValueError) as info:
        compile_path_pattern(pattern)
    assert reason in str(info.value)
