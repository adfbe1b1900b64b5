"""The worker client pinned against the router's own codec and control session (design §3).

The wire contract has one home, router.protocol, and both ends import it; these tests
drive the worker side's messages through the router's decoder and session, and the
router's replies through the worker's decoder, so a change to either end that the other
does not follow fails here.
"""

from __future__ import annotations

import os

from router.control.session import ControlPolicy, ControlSession, Peer
from router.core.claims import ClaimState
from router.core.machine import CoreSettings, RouterCore
from router.protocol.control import (
    MAX_LINE_BYTES,
    PROTOCOL_VERSION,
    decode_line,
    decode_reply,
    encode_line,
)
from router.worker.lines import (
    FINAL_HELLO_REFUSALS,
    claims_within_limit,
    hello_message,
    sync_messages,
    sync_refusals,
)


def test_a_worker_hello_decodes_as_the_router_reads_it() -> None:
    line = encode_line({"id": 1, **hello_message("w0", "http://127.0.0.1:9001", "b" * 16, None)})
    request = decode_line(line.rstrip(b"\n"))
    assert "ok" not in request  # not an error reply
    assert request["op"] == "hello" and request["v"] == PROTOCOL_VERSION
    assert request["id"] == 1


def test_sync_messages_stay_under_the_routers_line_limit() -> None:
    claims = [("episode", f"ep{i}-" + "k" * 400) for i in range(5000)]
    messages = sync_messages(claims)
    assert len(messages) > 1 and all(m["more"] for m in messages[:-1])
    assert not messages[-1]["more"]
    for i, message in enumerate(messages):
        line = encode_line({"id": i, **message})
        assert len(line) < MAX_LINE_BYTES
        assert decode_line(line.rstrip(b"\n"))["op"] == "sync"
    sent = {(c["kind"], c["key"]) for m in messages for c in m["claims"]}
    assert sent == set(claims)


def test_router_replies_decode_as_the_worker_reads_them() -> None:
    reply = {"id": 4, "ok": True, "accepted": 1, "refused": [{"kind": "episode", "key": "é"}]}
    decoded = decode_reply(encode_line(reply))
    assert decoded == reply
    assert sync_refusals(decoded) == ([("episode", "é", None)], 0)
    assert decode_reply(b"\xff\n") is None and decode_reply(b"[1]\n") is None


def test_the_worker_clients_lines_are_accepted_by_the_routers_session() -> None:
    """hello, claim (in the field order the client writes), sync and release, as the
    worker client encodes them, each answered ok by the router's own session and read
    back by the worker's decoder."""
    core = RouterCore(CoreSettings(kinds={"episode": False}, recovery_window_s=0.0), 0.0)
    policy = ControlPolicy(os.getuid(), frozenset(), frozenset(), None, "router-boot")
    session = ControlSession(core, policy, Peer(uid=os.getuid(), tcp=False))
    lines = [
        {"id": 1, **hello_message("w0", "http://127.0.0.1:9001", "b" * 16, None)},
        {"op": "claim", "key": "ep1-a0", "kind": "episode", "id": 2},
        *({"id": 3 + i, **m} for i, m in enumerate(sync_messages([("episode", "ep1-a0")]))),
        {"op": "release", "key": "ep1-a0", "kind": "episode", "id": 9},
    ]
    for message in lines:
        line = encode_line(message).rstrip(b"\n")
        fast = session.answer_claim_or_release(line, 1.0)
        raw = fast[2] if fast is not None else encode_line(session.handle(decode_line(line), 1.0))
        reply = decode_reply(raw)
        assert reply is not None and reply["ok"] is True, (message, reply)
        assert reply["id"] == message["id"]
    claim = core.claims.lookup("episode", "ep1-a0")
    assert claim is not None and claim.state is ClaimState.ENDED  # released, remembered


def test_a_hello_of_another_version_is_refused_as_the_worker_expects() -> None:
    core = RouterCore(CoreSettings(kinds={"episode": False}, recovery_window_s=0.0), 0.0)
    policy = ControlPolicy(os.getuid(), frozenset(), frozenset(), None, "router-boot")
    session = ControlSession(core, policy, Peer(uid=os.getuid(), tcp=False))
    hello = {"id": 1, **hello_message("w0", "http://127.0.0.1:9001", "b" * 16, None)}
    hello["v"] = PROTOCOL_VERSION + 1
    reply = decode_reply(encode_line(session.handle(decode_line(encode_line(hello)), 0.0)))
    assert reply is not None and reply["error"] == "unsupported_version"
    assert reply["error"] in FINAL_HELLO_REFUSALS  # the client gives up, as it must


def test_a_sync_over_the_cap_is_refused_so_the_worker_can_keep_the_first_claims() -> None:
    core = RouterCore(CoreSettings(kinds={"episode": False}, recovery_window_s=0.0), 0.0)
    policy = ControlPolicy(
        os.getuid(), frozenset(), frozenset(), None, "router-boot", max_claims_per_worker=3
    )
    session = ControlSession(core, policy, Peer(uid=os.getuid(), tcp=False))
    hello = {"id": 1, **hello_message("w0", "http://127.0.0.1:9001", "b" * 16, None)}
    assert session.handle(decode_line(encode_line(hello).rstrip(b"\n")), 0.0)["ok"] is True
    claims = {("episode", f"ep{i}") for i in range(5)}

    def sync(declared: set[tuple[str, str]]) -> dict[str, object]:
        (message,) = sync_messages(declared)
        line = encode_line({"id": 2, **message}).rstrip(b"\n")
        reply = decode_reply(encode_line(session.handle(decode_line(line), 0.0)))
        assert reply is not None
        return reply

    refused = sync(claims)
    assert refused["error"] == "too_many_claims"
    kept = claims_within_limit(claims, refused)
    assert kept == {("episode", "ep0"), ("episode", "ep1"), ("episode", "ep2")}
    assert sync(kept)["accepted"] == 3
    assert claims_within_limit(claims, {"error": "conflict", "limit": 3}) is None
    assert claims_within_limit(claims, {"error": "too_many_claims", "limit": True}) is None
