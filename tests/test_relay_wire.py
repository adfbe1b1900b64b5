"""The relay's wire format, with no event loop: worker addresses, the request head, and
the reply parser fed scripted bytes (whole, and split at every byte)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from router import relay_wire
from router.forward import keeps_every_reply_header, request_headers_for_worker
from router.relay_wire import (
    CLOSED_BEFORE_REPLY,
    MAX_REPLY_FIELD,
    MAX_REPLY_HEAD,
    SWITCHED,
    ReplyParser,
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
            "http://[::1]:9002/",
            WorkerAddress("[::1]:9002", "http://[::1]:9002", "::1", 9002, tcp_literal=True),
        ),
        ("http://localhost", WorkerAddress("localhost", "http://localhost", "localhost", 80)),
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
        ("ftp://127.0.0.1:1", "only http://host:port and unix:/path"),
        ("127.0.0.1:80", "only http://host:port and unix:/path"),
        ("http://h:1/path", "no path or query"),
        ("http://h:1?q", "no path or query"),
        ("http://u@h:1", "no user or fragment"),
        ("http://h:1#f", "no user or fragment"),
        ("unix:", "needs a socket path"),
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
    """What the relay must send: router.forward's header rules, then the body's framing
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
    # (tests/test_desync.py: the corpus's "\r in value is bad" and obs-fold cases).
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


# --- the reply parser -----------------------------------------------------------------------


def parse(data: bytes, *, head_request: bool = False, split: bool = False) -> ReplyParser:
    """A parser fed `data` whole, or one byte at a time."""
    reply = ReplyParser()
    reply.begin(head_request=head_request)
    for piece in [data[i : i + 1] for i in range(len(data))] if split else [data]:
        reply.feed(piece)
    return reply


def state(reply: ReplyParser) -> tuple[object, ...]:
    return (
        reply.status,
        reply.reason,
        reply.headers,
        reply.peek_body(),
        reply.head_done,
        reply.complete,
        reply.reusable,
        reply.broken,
    )


WHOLE = b"HTTP/1.1 200 OK\r\nDate: x\r\nContent-Length: 2\r\n\r\nok"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"


@pytest.mark.parametrize(
    ("data", "head_request", "split", "whole"),
    [
        (WHOLE, False, False, True),
        (CHUNKED, False, False, False),  # not framed by a length
        (WHOLE, False, True, False),  # in pieces
        (WHOLE + b"HTTP/1.1 200 OK\r\n", False, False, False),  # part of another after it
        (WHOLE + WHOLE, False, False, False),  # a whole other reply after it
        (WHOLE + b"\r\n", False, False, False),  # a line break after it (llhttp skips it)
        (WHOLE[:-7] + b"2\r\n\r\n\r\n", False, False, True),  # a body ending in CRLF
        (WHOLE[:-7] + b"2\r\n\r\n\r\n\r\n", False, False, False),  # ... and one after it
        (WHOLE[:-7] + b"0\r\n\r\n", False, False, True),  # no body
        (WHOLE[:-7] + b"0\r\n\r\n\n", False, False, False),  # no body, a LF after it
        (b"HTTP/1.1 100 Continue\r\n\r\n" + WHOLE, False, False, False),  # an interim head
        (WHOLE.replace(b"1.1", b"1.0"), False, False, False),  # another version
        (WHOLE[: -len(b"ok")], True, False, False),  # the reply to a HEAD
        (WHOLE[:-1], False, False, False),  # not complete
    ],
)
def test_a_reply_is_kept_whole_only_when_it_came_alone_in_one_piece(
    data: bytes, head_request: bool, split: bool, whole: bool
) -> None:
    reply = parse(data, head_request=head_request, split=split)
    assert reply.whole == (data if whole else None)


def test_a_reply_nobody_asked_for_after_a_whole_one_changes_nothing_of_it() -> None:
    """A worker that sends a second reply in the same read spoils the link, not the
    reply already parsed: its status, reason and headers stay, and the connection is
    not reused."""
    reply = parse(WHOLE + b"HTTP/1.1 404 Injected\r\nX-Other: 1\r\nContent-Length: 0\r\n\r\n")
    assert (reply.status, reply.raw_reason, reply.raw_headers) == (
        200,
        b"OK",
        [(b"Date", b"x"), (b"Content-Length", b"2")],
    )
    assert reply.complete and not reply.reusable and reply.peek_body() == b"ok"


def test_a_reply_whose_body_is_taken_is_no_longer_kept_whole() -> None:
    reply = parse(WHOLE)
    assert reply.whole == WHOLE
    assert reply.take_body() == b"ok" and reply.whole is None


def test_a_reply_notes_its_date_header_and_forgets_an_interim_one() -> None:
    assert parse(WHOLE).has_date
    assert not parse(WHOLE.replace(b"Date", b"Data")).has_date
    interim = b"HTTP/1.1 103 Early Hints\r\nDate: x\r\n\r\n"
    assert not parse(interim + WHOLE.replace(b"Date", b"Data")).has_date


@pytest.mark.parametrize("split", [False, True])
def test_a_reply_with_a_length(split: bool) -> None:
    reply = parse(
        b"HTTP/1.1 201 Made It\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\nX: \xc3\xa9\xff\r\n"
        b"Content-Length: 5\r\n\r\nhello",
        split=split,
    )
    assert state(reply) == (
        201,
        "Made It",
        [("Set-Cookie", "a=1"), ("Set-Cookie", "b=2"), ("X", "é\udcff"), ("Content-Length", "5")],
        b"hello",
        True,
        True,
        True,
        None,
    )
    assert reply.content_length == 5 and not reply.until_close


@pytest.mark.parametrize("split", [False, True])
def test_a_chunked_reply_drops_its_trailers(split: bool) -> None:
    reply = parse(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n3\r\n!!!\r\n0\r\nX-Trailer: 1\r\n\r\n",
        split=split,
    )
    assert state(reply) == (
        200,
        "OK",
        [("Transfer-Encoding", "chunked")],
        b"ok!!!",
        True,
        True,
        True,
        None,
    )
    assert reply.content_length is None and not reply.until_close


def test_the_body_is_taken_in_pieces_as_it_arrives() -> None:
    reply = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nabc")
    assert (reply.head_done, reply.complete, reply.buffered) == (True, False, 3)
    assert reply.take_body() == b"abc"
    assert (reply.buffered, reply.take_body()) == (0, b"")
    reply.feed(b"def")
    assert (reply.take_body(), reply.complete, reply.reusable) == (b"def", True, True)


def test_interim_replies_are_skipped() -> None:
    reply = parse(
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    )
    assert state(reply) == (200, "OK", [("Content-Length", "2")], b"ok", True, True, True, None)


def test_an_interim_reply_alone_is_no_head() -> None:
    reply = parse(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert (reply.head_done, reply.broken) == (False, None)
    reply.feed_eof()
    assert (reply.head_done, reply.broken) == (False, CLOSED_BEFORE_REPLY)


@pytest.mark.parametrize(
    ("data", "broken"),
    [
        (b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n", SWITCHED),
        (b"HTTP/1.1 abc nope\r\n\r\n", "invalid reply: Invalid status code"),
        (b"NOT HTTP AT ALL\r\n\r\n", "invalid reply: Expected HTTP/"),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
            "invalid reply: Transfer-Encoding can't be present with Content-Length",
        ),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n",
            "invalid reply: Duplicate Content-Length",
        ),
        (b"HTTP/1.1 200 OK\r\nX: a\r\n b\r\n\r\n", "invalid reply: Unexpected whitespace"),
        (
            b"HTTP/1.1 200 OK\r\nX: " + b"v" * MAX_REPLY_FIELD + b"\r\n\r\n",
            "invalid reply: a header line over 64 KiB",
        ),
        (  # taken off with chunked, it would reach the client undone and unnamed
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nabc",
            "invalid reply: a transfer coding other than chunked",
        ),
        (b"HTTP/1.1 099 Odd\r\nContent-Length: 0\r\n\r\n", "invalid reply: status 99"),
    ],
)
def test_an_invalid_reply_head_breaks_the_reply(data: bytes, broken: str) -> None:
    reply = parse(data)
    assert reply.broken is not None and reply.broken.startswith(broken)
    assert (reply.head_done, reply.complete, reply.reusable) == (False, False, False)


def test_a_reply_head_is_bounded_in_all() -> None:
    reply = parse(b"HTTP/1.1 200 OK\r\n" + b"X: 1234567890\r\n" * (MAX_REPLY_HEAD // 15 + 1))
    assert reply.broken == "invalid reply: a reply head over 256 KiB"
    assert not reply.head_done


def test_a_body_ended_by_close() -> None:
    reply = parse(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nabc")
    assert (reply.until_close, reply.complete) == (True, False)
    reply.feed_eof()
    assert (reply.peek_body(), reply.complete, reply.reusable, reply.broken) == (
        b"abc",
        True,
        False,
        None,
    )


@pytest.mark.parametrize(
    ("data", "broken"),
    [
        (b"", CLOSED_BEFORE_REPLY),
        (b"HTTP/1.1 200 OK\r\nContent-Le", CLOSED_BEFORE_REPLY),
        (
            b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc",
            "it closed the connection in the middle of its reply",
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
            "it closed the connection in the middle of its reply",
        ),
    ],
)
def test_a_close_before_the_end_breaks_the_reply(data: bytes, broken: str) -> None:
    reply = parse(data)
    reply.feed_eof()
    assert (reply.complete, reply.reusable, reply.broken) == (False, False, broken)
    assert reply.received == len(data)


@pytest.mark.parametrize(
    "data",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n",  # unasked reply
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokgarbage",
    ],
)
def test_a_whole_reply_on_a_connection_that_cannot_go_on(data: bytes) -> None:
    reply = parse(data)
    assert (reply.peek_body(), reply.complete, reply.reusable, reply.broken) == (
        b"ok",
        True,
        False,
        None,
    )


def test_bytes_after_a_complete_reply_spoil_only_the_connection() -> None:
    reply = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert reply.reusable
    reply.feed(b"late")
    assert (reply.complete, reply.reusable, reply.broken) == (True, False, None)


@pytest.mark.parametrize("status", [204, 304])
def test_no_body_replies_end_with_their_head(status: int) -> None:
    reply = parse(b"HTTP/1.1 %d X\r\nContent-Length: 5\r\n\r\n" % status)
    assert (reply.status, reply.complete, reply.reusable) == (status, True, True)


def test_a_head_reply_ends_with_its_head_and_the_next_reply_parses() -> None:
    reply = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", head_request=True)
    assert (reply.complete, reply.reusable, reply.peek_body()) == (True, True, b"")
    # The same parser object carries the next exchange on the connection.
    reply.begin(head_request=False)
    reply.feed(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    assert (reply.complete, reply.reusable, reply.take_body()) == (True, True, b"ok")


def test_body_bytes_after_a_head_reply_spoil_the_connection() -> None:
    reply = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", head_request=True)
    assert (reply.complete, reply.reusable, reply.peek_body()) == (True, False, b"")


def test_a_head_reply_without_a_length_is_not_reused() -> None:
    reply = parse(b"HTTP/1.1 200 OK\r\n\r\n", head_request=True)
    assert (reply.complete, reply.reusable) == (True, False)


def test_the_next_exchange_starts_clean() -> None:
    reply = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    reply.begin(head_request=False)
    assert state(reply) == (0, "", [], b"", False, False, False, None)
    assert (reply.received, reply.buffered, reply.content_length) == (0, 0, None)
    reply.feed(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
    assert state(reply) == (
        404,
        "Not Found",
        [("Content-Length", "0")],
        b"",
        True,
        True,
        True,
        None,
    )


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
