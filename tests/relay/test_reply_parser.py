"""The relay's reply parser, with no event loop: a worker's replies fed as scripted bytes
(whole, and split at every byte)."""

from __future__ import annotations

import pytest

from router.relay.reply_parser import (
    CLOSED_BEFORE_REPLY,
    MAX_REPLY_FIELD,
    MAX_REPLY_HEAD,
    MAX_REPLY_TRAILERS,
    SWITCHED,
    ReplyParser,
)


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
        (b"HTTP/1.1 999 Weird\r\nContent-Length: 0\r\n\r\n", "invalid reply: status 999"),
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


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n"


def test_a_trailer_field_that_never_ends_breaks_the_reply_past_a_line() -> None:
    reply = parse(CHUNKED_HEAD + b"X-T: ")
    for _ in range(MAX_REPLY_FIELD // 4096):  # as a worker streaming it would
        reply.feed(b"a" * 4096)
        assert reply.broken is None
    reply.feed(b"a" * 4096)
    assert reply.broken == "invalid reply: a chunk or trailer line over 64 KiB"
    assert (reply.complete, reply.reusable) == (False, False)


def test_trailer_fields_past_their_count_break_the_reply() -> None:
    fine = parse(CHUNKED_HEAD + b"X-T: a\r\n" * MAX_REPLY_TRAILERS + b"\r\n")
    assert (fine.complete, fine.broken, fine.peek_body()) == (True, None, b"hello")
    over = parse(CHUNKED_HEAD + b"X-T: a\r\n" * (MAX_REPLY_TRAILERS + 1) + b"\r\n")
    assert over.broken == "invalid reply: trailer fields over the limits"


def test_a_long_body_in_many_reads_is_no_stall() -> None:
    reply = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n")
    for _ in range(256):
        reply.feed(b"b" * 4096)
    assert (reply.complete, reply.broken, reply.buffered) == (True, None, 1 << 20)


def test_a_reset_breaks_even_a_reply_that_ends_at_close() -> None:
    reply = parse(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\npartial")
    reply.feed_reset("its connection broke (reset)")
    assert (reply.complete, reply.broken) == (False, "its connection broke (reset)")
    whole = parse(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    whole.feed_reset("its connection broke (reset)")
    assert (whole.complete, whole.broken, whole.reusable) == (True, None, False)


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
