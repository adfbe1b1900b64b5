"""The control client's book of requests in flight, step by step, with no socket.

Each test writes into a list instead of a connection and asserts the whole
state after each step: the lines written, which futures are settled, and with
what. The two pure sync/hello helpers it works with are checked here too.
"""

from __future__ import annotations

import json

import pytest

from router.protocol.control import MAX_LINE_BYTES
from router.worker.lines import FINAL_HELLO_REFUSALS, hello_message, sync_refusals
from router.worker.requests import ConnectionGone, ControlError, RequestBook


def written(lines: list[bytes]) -> list[dict[str, object]]:
    return [json.loads(line) for line in lines]


async def test_send_numbers_lines_and_answer_settles_the_matching_request() -> None:
    book, lines = RequestBook(), []
    seen: list[object] = []
    claim = book.new({"op": "claim", "key": "k"}, replay=True, on_reply=seen.append)
    ping = book.new({"op": "ping"}, replay=False)
    book.send(claim, lines.append, now=10.0)
    book.send(ping, lines.append, now=11.0)
    assert written(lines) == [{"op": "claim", "key": "k", "id": 1}, {"op": "ping", "id": 2}]
    assert book.last_sent == 11.0 and book.oldest_unanswered(12.0) == 10.0

    book.answer({"id": 2, "ok": True})
    book.answer({"id": 99, "ok": True})  # answers nothing: dropped
    assert ping.future.result() == {"id": 2, "ok": True}
    assert not claim.future.done() and book.oldest_unanswered(12.0) == 10.0

    book.answer({"id": 1, "ok": False, "error": "conflict"})
    assert claim.future.result()["error"] == "conflict"
    assert seen == [{"id": 1, "ok": False, "error": "conflict"}]
    assert book.oldest_unanswered(12.0) == 12.0


async def test_a_lost_connection_keeps_callers_ops_and_fails_the_clients_own() -> None:
    book, lines = RequestBook(), []
    claim = book.new({"op": "claim", "key": "k"}, replay=True)
    sync = book.new({"op": "sync", "claims": [], "more": False}, replay=False)
    book.send(claim, lines.append, now=1.0)
    book.send(sync, lines.append, now=1.0)

    book.connection_lost()
    assert isinstance(sync.future.exception(), ConnectionGone)
    assert not claim.future.done() and book.oldest_unanswered(5.0) == 5.0

    release = book.new({"op": "release", "key": "k"}, replay=True)
    book.send(release, None, now=2.0)  # no connection: it waits, in call order
    lines.clear()
    book.send_parked(lines.append, now=3.0)
    assert written(lines) == [
        {"op": "claim", "key": "k", "id": 4},
        {"op": "release", "key": "k", "id": 5},
    ]


async def test_the_clients_own_request_fails_at_once_without_a_connection() -> None:
    book = RequestBook()
    ping = book.new({"op": "ping"}, replay=False)
    book.send(ping, None, now=1.0)
    assert isinstance(ping.future.exception(), ConnectionGone)


async def test_a_line_over_the_limit_fails_its_request_and_is_not_written() -> None:
    book, lines = RequestBook(), []
    claim = book.new({"op": "claim", "key": "k" * MAX_LINE_BYTES}, replay=True)
    book.send(claim, lines.append, now=1.0)
    error = claim.future.exception()
    assert isinstance(error, ControlError) and error.error == "line_too_long"
    assert lines == [] and book.oldest_unanswered(2.0) == 2.0


async def test_fail_all_gives_each_request_its_own_copy_of_the_error() -> None:
    book, lines = RequestBook(), []
    first = book.new({"op": "claim", "key": "a"}, replay=True)
    second = book.new({"op": "claim", "key": "b"}, replay=True)
    book.send(first, lines.append, now=1.0)
    book.park(second)
    refusal = ControlError.from_reply({"id": 5, "ok": False, "error": "forbidden"})

    book.fail_all(refusal)
    errors = [first.future.exception(), second.future.exception()]
    assert all(isinstance(e, ControlError) and e.error == "forbidden" for e in errors)
    assert errors[0] is not errors[1] and errors[0] is not refusal
    book.answer({"id": 1, "ok": True})  # too late: dropped
    assert book.claims_after_waiting_ops(frozenset()) == set()


async def test_claims_after_waiting_ops_apply_them_in_call_order() -> None:
    book = RequestBook()
    for op, key in [("claim", "a"), ("release", "held"), ("release", "a"), ("claim", "b")]:
        book.park(book.new({"op": op, "key": key, "kind": "episode"}, replay=True))
    book.park(book.new({"op": "drain", "on": True}, replay=True))
    held = frozenset({("episode", "held"), ("episode", "kept")})
    assert book.claims_after_waiting_ops(held) == {("episode", "kept"), ("episode", "b")}


def test_hello_message_carries_auth_only_with_a_secret() -> None:
    assert hello_message("w0", "http://127.0.0.1:1", "b0", None) == {
        "op": "hello",
        "v": 1,
        "worker": "w0",
        "url": "http://127.0.0.1:1",
        "boot": "b0",
    }
    assert hello_message("w0", "unix:/w.sock", "b0", "s3")["auth"] == "s3"


@pytest.mark.parametrize(
    ("reply", "refused", "omitted"),
    [
        ({"ok": True, "accepted": 1, "refused": []}, [], 0),
        (
            {"refused": [{"kind": "mcp_session", "key": "s", "error": "conflict"}, {"key": "e"}]},
            [("mcp_session", "s", "conflict"), ("episode", "e", None)],
            0,
        ),
        ({"refused": "not a list", "refused_omitted": 3}, [], 3),
        ({"refused": [7], "refused_omitted": True}, [], 0),
        ({"refused_omitted": -1}, [], 0),
    ],
)
def test_sync_refusals(reply: dict[str, object], refused: list[object], omitted: int) -> None:
    assert sync_refusals(reply) == (refused, omitted)


def test_only_worker_busy_of_the_hello_refusals_may_clear() -> None:
    refusals = {"forbidden", "unsupported_version", "bad_request", "worker_busy"}
    assert refusals - FINAL_HELLO_REFUSALS == {"worker_busy"}


def test_control_error_names_the_code_and_the_routers_detail() -> None:
    refused = ControlError.from_reply({"id": 1, "ok": False, "error": "forbidden", "detail": "No."})
    assert (refused.error, str(refused), str(refused.again())) == ("forbidden",) + (
        "forbidden: No.",
    ) * 2
    assert ControlError.from_reply({"id": 1, "ok": False}).error == "unknown_error"
    assert ControlError("client_stopped").reply == {"ok": False, "error": "client_stopped"}
