"""Pure tests for router.protocol.control: one line to a request or an error reply, and one
reply to a line."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.protocol.control import decode_line, encode_line


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"   ",
        b"not json",
        b"{",
        b'{"op":"ping","id":1',
        b'{"op":"ping","id":1}{"op":"ping","id":2}',
        b"[]",
        b'[{"op":"ping","id":1}]',
        b'"ping"',
        b"1",
        b"null",
        b"true",
        b'{"op":"ping","id":"\xff"}',  # not UTF-8
        b'{"op":"ping","id":"\xed\xa0\x80"}',  # an encoded surrogate is not UTF-8
        b'\xef\xbb\xbf{"op":"ping","id":1}',  # a BOM: the protocol is plain UTF-8
        '{"op":"ping","id":1}'.encode("utf-16"),
        '{"op":"ping","id":1}'.encode("utf-16-le"),
        '{"op":"ping","id":1}'.encode("utf-32"),
        b"[" * 100_000 + b"]" * 100_000,  # deeper than the parser recurses
        b'{"op":"ping","id":' + b"1" * 5000 + b"}",  # more digits than Python parses
        b'{"op":"ping","id":true}',
        b'{"op":"ping","id":false}',
        b'{"op":"ping","id":1.5}',
        b'{"op":"ping","id":1e3}',
        b'{"op":"ping","id":[1]}',
        b'{"op":"ping","id":{"a":1}}',
        b'{"op":"ping","id":NaN}',
    ],
)
def test_unparsable_lines_are_bad_request_with_a_null_id(line: bytes) -> None:
    reply = decode_line(line)
    assert set(reply) == {"id", "ok", "error", "detail"}
    assert (reply["id"], reply["ok"], reply["error"]) == (None, False, "bad_request")
    assert isinstance(reply["detail"], str) and reply["detail"].endswith(".")


@pytest.mark.parametrize(
    ("line", "request_id"),
    [
        (b'{"id":7}', 7),
        (b'{"op":null,"id":"x"}', "x"),
        (b'{"op":5,"id":7}', 7),
        (b'{"op":["ping"]}', None),
        (b'{"op":"ping","id":3,"ok":true}', 3),  # a reply sent back is not a request
    ],
)
def test_requests_without_a_string_op_are_bad_request_with_their_id(
    line: bytes, request_id: object
) -> None:
    reply = decode_line(line)
    assert (reply["id"], reply["ok"], reply["error"]) == (request_id, False, "bad_request")


@pytest.mark.parametrize(
    "message",
    [
        {"op": "ping", "id": 1},
        {"op": "ping", "id": "req-1"},
        {"op": "ping", "id": 0},
        {"op": "ping", "id": -5},
        {"op": "ping", "id": 2**62},
        {"op": "ping", "id": None},
        {"op": "ping"},
        {"op": "whatever", "id": "é", "extra": [1, {"a": None}]},
    ],
)
def test_well_formed_lines_decode_to_the_request(message: dict[str, Any]) -> None:
    line = json.dumps(message).encode() + b"\r\n"
    assert decode_line(line) == message


def test_encode_writes_one_compact_line() -> None:
    assert encode_line({"id": 1, "ok": True}) == b'{"id":1,"ok":true}\n'
    reply = {"id": "x\ny", "ok": False, "error": "bad_request", "detail": "Line\u2028two."}
    wire = encode_line(reply)
    assert wire.count(b"\n") == 1 and wire.endswith(b"\n")
    assert json.loads(wire) == reply
