"""The relay's request wire format, with no event loop: worker addresses and the request
head (the reply parser's tests are tests/relay/test_reply_parser.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from router.relay import wire as relay_wire
from router.relay.contract import keeps_every_reply_header, request_headers_for_worker
from router.relay.wire import (
    WorkerAddress,
    parse_worker_address,
    serialize_request_head,
    worker_request_head,
)

set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "episode-router-hypothesis")
FEW = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)
BOOT = {"X-Episode-Router-Boot": "b1"}

# --- worker addresses -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "address"),
    [
        (
            "http://127.0.0.1:9002",
            WorkerAddress(
                "127.0.0.1:9002", "http://127.0.0.1:9002", "127.0.0.1", 9002, tcp_literal=True
            ),
        ),
        (
            "http://[::1]:9002",
            WorkerAddress("[::1]:9002", "http://[::1]:9002", "::1", 9002, tcp_literal=True),
        ),
        (
            "http://LocalHost:9002",
            WorkerAddress("LocalHost:9002", "http://LocalHost:9002", "localhost", 9002),
        ),
        (
            "unix:/run/w.sock",
            WorkerAddress("localhost", "http://localhost", unix_path="/run/w.sock"),
        ),
    ],
)
def test_worker_addresses(url: str, address: WorkerAddress) -> None:
    assert parse_worker_address(url) == address


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("ftp://127.0.0.1:1", "expected http://host:port or unix:/absolute/path"),
        ("127.0.0.1:80", "expected http://host:port or unix:/absolute/path"),
        ("http://localhost", "expected http://host:port"),  # no port 80 by default
        ("http://[::1]:9002/", "expected http://host:port"),
        ("http://h:1/path", "expected http://host:port"),
        ("http://h:1?q", "expected http://host:port"),
        ("http://u@h:1", "expected http://host:port"),
        ("http://h:1#f", "expected http://host:port"),
        ("unix:", "expected http://host:port or unix:/absolute/path"),
        ("unix:relative.sock", "expected http://host:port or unix:/absolute/path"),
    ],
)
def test_unsupported_worker_addresses_say_why(url: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        parse_worker_address(url)


# --- the request head -----------------------------------------------------------------------


def reference_head(
    method: str,
    headers: list[tuple[str, str]],
    content_length: int | None = None,
    chunked: bool = False,
) -> bytes:
    """What the relay must send: router.relay.contract's header rules, then the body's framing
    set on the result, serialized."""
    out = request_headers_for_worker(
        headers, worker_host="10.0.0.1:9", client_ip="10.0.0.7", scheme="http", extra=BOOT
    )
    if content_length is not None:
        out["Content-Length"] = str(content_length)
    if chunked:
        out["Transfer-Encoding"] = "chunked"
    return serialize_request_head(method, "/t?q=1", out.items())


def as_sent(headers: list[tuple[str, str]]) -> list[tuple[bytes, bytes]]:
    """The pairs as the client's bytes, which the edge decodes as UTF-8 with surrogate
    escapes (so a raw 0xff byte is written "\\udcff" here)."""
    return [(n.encode("latin-1"), v.encode("utf-8", "surrogateescape")) for n, v in headers]


def relay_head(
    method: str,
    headers: list[tuple[str, str]],
    content_length: int | None = None,
    chunked: bool = False,
) -> bytes:
    return worker_request_head(
        method,
        "/t?q=1",
        as_sent(headers),
        worker_host="10.0.0.1:9",
        client_ip="10.0.0.7",
        scheme="http",
        extra=BOOT,
        content_length=content_length,
        chunked=chunked,
    )


def test_request_head_bytes() -> None:
    head = relay_head(
        "POST",
        [
            ("Host", "public:8080"),
            ("Connection", "keep-alive, X-Named"),
            ("X-Named", "1"),
            ("X-Forwarded-For", "6.6.6.6"),
            ("Content_Length", "9"),
            ("X-Token", "t \udcff"),  # a raw 0xff byte, as aiohttp decodes it
            ("content-length", "3"),
            ("Expect", "100-continue"),
        ],
        content_length=3,
    )
    assert head == (
        b"POST /t?q=1 HTTP/1.1\r\n"
        b"Host: 10.0.0.1:9\r\n"
        b"X-Token: t \xff\r\n"
        b"Content-Length: 3\r\n"
        b"X-Forwarded-Host: public:8080\r\n"
        b"X-Forwarded-For: 10.0.0.7\r\n"
        b"X-Forwarded-Proto: http\r\n"
        b"X-Episode-Router-Boot: b1\r\n"
        b"\r\n"
    )


@pytest.mark.parametrize(
    ("headers", "content_length", "chunked"),
    [
        ([("Content-Length", "5"), ("X-A", "1")], 5, False),  # replaced where it stood
        ([("Transfer-Encoding", "chunked"), ("Content-Length", "5")], None, True),
        ([("Transfer-Encoding", "chunked"), ("Content-Length", "5")], 7, False),  # added last
        ([("Connection", "content-length"), ("Content-Length", "5")], 5, False),
        ([("Content-Length", "5"), ("Content-Length", "5")], 5, False),  # one copy stays
        ([("Content-Length", "5"), ("Content-Length", "5")], None, False),  # both stay
        ([], None, False),
    ],
)
def test_request_head_framing_matches_the_header_rules(
    headers: list[tuple[str, str]], content_length: int | None, chunked: bool
) -> None:
    assert relay_head("PUT", headers, content_length, chunked) == reference_head(
        "PUT", headers, content_length, chunked
    )


NAMES = st.sampled_from(
    [
        "Host",
        "Connection",
        "connection",
        "Keep-Alive",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Proxy-Authorization",
        "Proxy-X",
        "Content-Length",
        "content-length",
        "Content_Length",
        "X-Forwarded-For",
        "Forwarded",
        "X-Real-IP",
        "Expect",
        "X-Episode-Router-Boot",
        "X-Named",
        "Accept",
        "X-Rep",
    ]
)
VALUES = st.sampled_from(
    ["1", "keep-alive", "x-named, accept", "Content-Length", "close, te", "chunked", ""]
)


@FEW
@given(
    headers=st.lists(st.tuples(NAMES, VALUES), max_size=10),
    content_length=st.none() | st.integers(0, 10**9),
    chunked=st.booleans(),
)
def test_request_head_is_the_header_rules_serialized(
    headers: list[tuple[str, str]], content_length: int | None, chunked: bool
) -> None:
    assert relay_head("GET", headers, content_length, chunked) == reference_head(
        "GET", headers, content_length, chunked
    )


@pytest.mark.parametrize(
    "added",
    [
        {"extra": {"X-Episode-Router-Boot": "b\r\nX-Smuggled: 1"}},
        {"extra": {"X-Episode-Router-Boot": "b\nX"}},
        {"extra": {"X-A\rX": "1"}},
        {"worker_host": "h\r\nX-Smuggled: 1"},
        {"client_ip": "10.0.0.1\n"},
        {"scheme": "http\r\nX-Smuggled: 1"},
        {"authority": "a\rb"},
    ],
)
def test_a_line_break_in_a_line_the_router_adds_is_refused(added: dict[str, Any]) -> None:
    # The client's own bytes come from llhttp, which refuses a CR or LF in any of them
    # (tests/edge/test_desync.py: the corpus's "\r in value is bad" and obs-fold cases).
    arguments: dict[str, Any] = {"worker_host": "h", "client_ip": None, "scheme": "http"}
    with pytest.raises(ValueError, match="line break"):
        worker_request_head("GET", "/", [(b"X-A", b"1")], **(arguments | added))


def test_a_client_chosen_authority_or_a_long_value_is_written_but_not_kept() -> None:
    authority = "client-chosen.example:8080"
    boot = "b" * 300
    head = worker_request_head(
        "GET",
        "/",
        [],
        worker_host="h",
        client_ip=None,
        scheme="http",
        extra={"X-Episode-Router-Boot": boot},
        authority=authority,
    )
    assert f"X-Forwarded-Host: {authority}\r\n".encode() in head
    assert f"X-Episode-Router-Boot: {boot}\r\n".encode() in head
    assert authority not in relay_wire._LINES.get("X-Forwarded-Host", {})
    assert boot not in relay_wire._LINES.get("X-Episode-Router-Boot", {})


def test_request_lines_are_kept_no_more_than_the_bound() -> None:
    for n in range(relay_wire.MAX_CACHED_TARGETS + 10):
        head = worker_request_head(
            "GET", f"/r/{n}", [], worker_host="h", client_ip=None, scheme="http"
        )
        assert head.startswith(f"GET /r/{n} HTTP/1.1\r\nHost: h\r\n".encode())
        assert len(relay_wire._REQUEST_LINES["GET"]) <= relay_wire.MAX_CACHED_TARGETS
    # A method outside the usual ones is written, never kept.
    head = worker_request_head("MKCOL", "/r", [], worker_host="h", client_ip=None, scheme="http")
    assert head.startswith(b"MKCOL /r HTTP/1.1\r\n")
    assert "MKCOL" not in relay_wire._REQUEST_LINES
    long_target = "/" + "a" * 200  # over the cached length: built each time, never kept
    head = worker_request_head(
        "GET", long_target, [], worker_host="h", client_ip=None, scheme="http"
    )
    assert head.startswith(f"GET {long_target} HTTP/1.1\r\n".encode())
    assert long_target not in relay_wire._REQUEST_LINES["GET"]


def test_the_lines_the_router_adds_are_kept_no_more_than_the_bound() -> None:
    for n in range(relay_wire.MAX_CACHED_LINES + 10):
        head = worker_request_head(
            "GET", "/", [], worker_host="h", client_ip=f"10.0.{n // 256}.{n % 256}", scheme="http"
        ).decode()
        assert f"X-Forwarded-For: 10.0.{n // 256}.{n % 256}\r\n" in head
        assert len(relay_wire._FORWARDED_FOR_LINES) <= relay_wire.MAX_CACHED_LINES


# --- roles by the last message's names ------------------------------------------------------


def test_a_request_named_as_the_last_but_for_one_header_gets_that_headers_role() -> None:
    # Roles are reused while the names are the same, in the same order: one name that
    # differs (same count) is looked up afresh, and so is the next request.
    def head(second: bytes) -> bytes:
        pairs = [(b"Host", b"c"), (second, b"x-drop"), (b"X-Drop", b"1"), (b"X-Keep", b"1")]
        return worker_request_head(
            "GET", "/", pairs, worker_host="w", client_ip=None, scheme="http"
        )

    for _ in range(2):
        assert b"X-Drop: 1\r\n" in head(b"X-Other")
        plain = head(b"Connection")
        assert b"X-Drop" not in plain and b"Connection" not in plain
        assert b"X-Keep: 1\r\n" in plain
        assert b"X-Forwarded-For" not in head(b"X-Forwarded-For")


def test_a_reply_named_as_the_last_but_for_one_header_is_judged_afresh() -> None:
    kept = [(b"Content-Type", b"a/b"), (b"Date", b"d")]
    for _ in range(2):
        assert keeps_every_reply_header(kept)
        assert not keeps_every_reply_header([(b"Content-Type", b"a/b"), (b"Connection", b"x")])
        assert keeps_every_reply_header(list(kept))
        assert not keeps_every_reply_header([(b"Location", b"/x"), (b"Date", b"d")])
        assert not keeps_every_reply_header([(b"Content-Type", b"a/b")] * 2 + [(b"TE", b"x")])
        assert keeps_every_reply_header([])


def test_a_whole_body_follows_the_head_in_the_same_piece() -> None:
    pairs = [(b"Host", b"c"), (b"Content-Length", b"3")]
    head = worker_request_head("POST", "/", pairs, worker_host="w", client_ip=None, scheme="http")
    whole = worker_request_head(
        "POST", "/", pairs, worker_host="w", client_ip=None, scheme="http", body=b"abc"
    )
    assert head.endswith(b"\r\n\r\n")
    assert whole == head + b"abc"
