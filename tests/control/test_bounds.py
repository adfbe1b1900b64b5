"""The control socket's bounds (design §3 "Bounds"): claims per worker, one sync's
claims, and what a connection may hold before its hello.

The claim cap is checked on the pure session (both the fast path's line shapes and the
general path); the bounds before hello on a real Unix socket under tmp_path.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from router.control.connection import HELLO_LINE_BYTES
from router.control.server import ControlServer
from router.control.session import ControlPolicy, ControlSession, Peer
from router.core.machine import CoreSettings, RouterCore
from router.protocol.control import decode_line, encode_line
from tests.router_fixtures import RawLease, wait_until

pytestmark = pytest.mark.timeout(30)

URL = "http://127.0.0.1:9001"


def _policy(**bounds: int) -> ControlPolicy:
    return ControlPolicy(os.getuid(), frozenset(), frozenset(), None, "router-boot", **bounds)


def _session(cap: int) -> tuple[RouterCore, ControlSession]:
    core = RouterCore(CoreSettings(kinds={"episode": False}, recovery_window_s=0.0), 0.0)
    session = ControlSession(
        core, _policy(max_claims_per_worker=cap), Peer(uid=os.getuid(), tcp=False)
    )
    hello = {"op": "hello", "id": 0, "v": 1, "worker": "w0", "url": URL, "boot": "boot-1"}
    assert session.handle(hello, 0.0)["ok"] is True
    return core, session


def _answer(session: ControlSession, message: dict[str, object]) -> dict[str, object]:
    """The reply to `message` as the connection would give it: fast path first."""
    line = json.dumps(message, separators=(",", ":")).encode()
    fast = session.answer_claim_or_release(line, 1.0)
    raw = fast[2] if fast is not None else encode_line(session.handle(decode_line(line), 1.0))
    reply = json.loads(raw)
    assert isinstance(reply, dict)
    return reply


def _claim(request_id: int, key: str, *, general: bool = False) -> dict[str, object]:
    # `"kind"` first is a shape the fast path does not take: the general path answers it.
    if general:
        return {"kind": "episode", "op": "claim", "id": request_id, "key": key}
    return {"op": "claim", "id": request_id, "key": key}


@pytest.mark.parametrize("general", [False, True], ids=["fast_path", "general_path"])
def test_a_claim_past_the_cap_is_refused_and_not_held(general: bool) -> None:
    core, session = _session(cap=3)
    for i in range(3):
        assert _answer(session, _claim(i, f"ep{i}", general=general))["ok"] is True
    reply = _answer(session, _claim(9, "ep9", general=general))
    assert reply["ok"] is False and reply["error"] == "too_many_claims"
    assert reply["limit"] == 3 and reply["id"] == 9
    assert core.claims.lookup("episode", "ep9") is None
    assert core.claims.held_count("w0") == 3
    # A key it holds is claimed again (idempotent), and a release makes room.
    assert _answer(session, _claim(10, "ep0", general=general))["ok"] is True
    assert _answer(session, {"op": "release", "id": 11, "key": "ep0"})["ok"] is True
    assert _answer(session, _claim(12, "ep9", general=general))["ok"] is True
    assert core.claims.held_count("w0") == 3


def test_a_claim_at_the_cap_of_a_key_that_ended_is_still_told_ended() -> None:
    _core, session = _session(cap=1)
    assert _answer(session, _claim(1, "old"))["ok"] is True
    assert _answer(session, {"op": "release", "id": 2, "key": "old"})["ok"] is True
    assert _answer(session, _claim(3, "ep1"))["ok"] is True
    assert _answer(session, _claim(4, "old"))["error"] == "ended"


def _sync(request_id: int, keys: range, *, more: bool) -> dict[str, object]:
    claims = [{"kind": "episode", "key": f"ep{i}"} for i in keys]
    return {"op": "sync", "id": request_id, "claims": claims, "more": more}


def test_a_sync_that_never_ends_is_refused_once_it_lists_more_than_the_cap() -> None:
    core, session = _session(cap=10)
    assert _answer(session, _sync(1, range(0, 6), more=True))["ok"] is True
    reply = _answer(session, _sync(2, range(6, 12), more=True))
    assert reply["ok"] is False and reply["error"] == "too_many_claims"
    assert reply["limit"] == 10
    assert core.claims.held_count("w0") == 0  # nothing of it was applied
    # What it listed so far is dropped: the next sync starts afresh.
    reply = _answer(session, _sync(3, range(100, 102), more=False))
    assert reply == {"id": 3, "ok": True, "accepted": 2, "refused": []}
    assert core.claims.held_count("w0") == 2


def test_a_sync_of_exactly_the_cap_is_applied() -> None:
    core, session = _session(cap=10)
    assert _answer(session, _sync(1, range(0, 5), more=True))["ok"] is True
    assert _answer(session, _sync(2, range(5, 10), more=False))["accepted"] == 10
    assert core.claims.held_count("w0") == 10


# --- before hello, on a real socket -----------------------------------------------------


async def _served(tmp_path: Path, **bounds: int) -> ControlServer:
    core = RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic())
    server = ControlServer(core, _policy(**bounds), on_lease_lost=lambda _worker: None)
    await server.start(f"unix:{tmp_path}/control.sock")
    return server


def _ping_of(total: int) -> bytes:
    """A ping line of exactly `total` bytes, its newline included."""
    empty = b'{"op":"ping","id":1,"pad":""}\n'
    return empty[:-3] + b"x" * (total - len(empty)) + empty[-3:]


async def test_a_line_before_hello_is_bounded_far_below_the_line_limit(tmp_path: Path) -> None:
    server = await _served(tmp_path)
    address = f"unix:{tmp_path}/control.sock"
    try:
        fits = await RawLease.open(address)
        fits.writer.write(_ping_of(HELLO_LINE_BYTES))
        assert (await fits.read_reply())["error"] == "no_hello"
        fits.abort()

        # A partial line one byte over: closed without waiting for the newline.
        over = await RawLease.open(address)
        over.writer.write(b'{"op":"hello","pad":"' + b"x" * HELLO_LINE_BYTES)
        reply = await over.read_reply()
        assert reply["error"] == "bad_request" and "before a hello" in reply["detail"]
        assert await over.closed_by_peer()
    finally:
        await server.close()


async def test_after_hello_a_connection_may_send_lines_up_to_the_line_limit(
    tmp_path: Path,
) -> None:
    server = await _served(tmp_path)
    try:
        lease = await RawLease.open(f"unix:{tmp_path}/control.sock")
        assert (await lease.hello("w0", URL, "boot-1"))["ok"] is True
        lease.writer.write(_ping_of(4 * HELLO_LINE_BYTES))
        assert await lease.read_reply() == {"id": 1, "ok": True}
        # A bye puts the bound before hello back.
        assert (await lease.call("bye"))["ok"] is True
        lease.writer.write(b'{"op":"hello","pad":"' + b"x" * HELLO_LINE_BYTES)
        assert (await lease.read_reply())["error"] == "bad_request"
        assert await lease.closed_by_peer()
    finally:
        await server.close()


async def test_connections_past_the_cap_of_those_waiting_for_hello_are_refused(
    tmp_path: Path,
) -> None:
    server = await _served(tmp_path, max_connections_before_hello=2)
    address = f"unix:{tmp_path}/control.sock"
    try:
        waiting = [await RawLease.open(address) for _ in range(2)]
        assert (await waiting[0].call("ping"))["error"] == "no_hello"  # both are served
        assert (await waiting[1].call("ping"))["error"] == "no_hello"
        refused = await RawLease.open(address)
        reply = await refused.read_reply()
        assert reply["error"] == "too_many_connections" and reply["id"] is None
        assert await refused.closed_by_peer()
        # Once one of them says hello, it no longer waits: a new one is taken.
        assert (await waiting[0].hello("w0", URL, "boot-1"))["ok"] is True
        taken = await RawLease.open(address)
        assert (await taken.call("ping"))["error"] == "no_hello"
        for lease in (*waiting, taken):
            lease.abort()
    finally:
        await server.close()


async def test_a_bye_when_as_many_wait_for_a_hello_as_may_closes_the_connection(
    tmp_path: Path,
) -> None:
    server = await _served(tmp_path, max_connections_before_hello=1)
    address = f"unix:{tmp_path}/control.sock"
    try:
        leased = await RawLease.open(address)
        assert (await leased.hello("w0", URL, "boot-1"))["ok"] is True
        waiting = await RawLease.open(address)  # the one place before hello is taken
        assert (await waiting.call("ping"))["error"] == "no_hello"
        assert (await leased.call("bye"))["ok"] is True  # answered, then closed
        assert await leased.closed_by_peer()
        assert len(server.waiting_for_hello) == 1
        waiting.abort()
    finally:
        await server.close()


async def test_connections_past_the_cap_of_open_ones_are_refused_leased_or_not(
    tmp_path: Path,
) -> None:
    server = await _served(tmp_path, max_connections=2)
    address = f"unix:{tmp_path}/control.sock"
    try:
        leased = await RawLease.open(address)
        assert (await leased.hello("w0", URL, "boot-1"))["ok"] is True
        waiting = await RawLease.open(address)
        assert (await waiting.call("ping"))["error"] == "no_hello"
        refused = await RawLease.open(address)
        reply = await refused.read_reply()
        assert reply["error"] == "too_many_connections"
        assert "control.max_connections" in reply["detail"]
        assert await refused.closed_by_peer()
        assert (await leased.call("ping"))["ok"] is True  # the others carry on
        waiting.abort()
        await wait_until(_fewer_than(server, 2), "the aborted connection to be forgotten")
        again = await RawLease.open(address)
        assert (await again.call("ping"))["error"] == "no_hello"
        for lease in (leased, again):
            lease.abort()
    finally:
        await server.close()


def _fewer_than(server: ControlServer, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return server.connection_count < count

    return check
