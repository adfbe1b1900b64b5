"""The worker-side control client against a scripted router on a real Unix socket.

The pure protocol helpers are tested without an event loop. The client runs
against `ScriptedRouter` (tests/scripted_router.py), the router's side of the
control contract (design §3); tests drive it (drop connections, restart it with
a new router id, make it go silent) and assert what crossed the wire. Every
hello, the first one included, is followed by a sync of what the worker holds.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from router.client import (
    BOOT_HEADER,
    ASGIBootMiddleware,
    ControlAddress,
    ControlClient,
    ControlError,
    aiohttp_boot_middleware,
    boot_mismatch_answer,
    encode_line,
    parse_control_address,
    sync_messages,
)
from router.protocol.control import decode_reply
from router.worker.connection import ControlConnection
from tests.scripted_router import LINE_LIMIT, Message, ScriptedRouter, eventually


@pytest.fixture
async def router(tmp_path: Path) -> Any:
    scripted = ScriptedRouter(tmp_path / "control.sock")
    await scripted.start()
    yield scripted
    await scripted.close()


def make_client(router: ScriptedRouter, **options: Any) -> ControlClient:
    options.setdefault("worker_id", "w0")
    options.setdefault("url", "http://127.0.0.1:9001")
    options.setdefault("reconnect_max_s", 0.2)
    return ControlClient(f"unix:{router.path}", **options)


@pytest.fixture
async def client(router: ScriptedRouter) -> Any:
    worker = make_client(router)
    await worker.start()
    yield worker
    await worker.stop()


# --- pure parts --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "parsed"),
    [
        ("unix:/run/er/control.sock", ControlAddress("unix", path="/run/er/control.sock")),
        ("unix:relative.sock", ControlAddress("unix", path="relative.sock")),
        ("tcp://127.0.0.1:9902", ControlAddress("tcp", host="127.0.0.1", port=9902)),
        ("tcp://[::1]:9902", ControlAddress("tcp", host="::1", port=9902)),
        ("tcp://localhost:1", ControlAddress("tcp", host="localhost", port=1)),
    ],
)
def test_parse_control_address(address: str, parsed: ControlAddress) -> None:
    assert parse_control_address(address) == parsed


@pytest.mark.parametrize(
    "address",
    ["", "unix:", "/run/control.sock", "tcp://127.0.0.1", "tcp://:9902", "tcp://h:0",
     "tcp://h:65536", "tcp://h:x", "http://127.0.0.1:9902",
     "tcp://a..b:9902", "tcp://h:\u0663", "tcp://[::1:80", "tcp://a:b:80", "tcp://[h]:80",
     "tcp://-h:80"],
)  # fmt: skip
def test_parse_control_address_refuses(address: str) -> None:
    with pytest.raises(ValueError, match="control address"):
        parse_control_address(address)


def test_encode_line_is_compact_ascii_ndjson() -> None:
    line = encode_line({"op": "claim", "key": "é", "id": 3})
    assert line == b'{"op":"claim","key":"\\u00e9","id":3}\n'
    assert json.loads(line) == {"op": "claim", "key": "é", "id": 3}


@pytest.mark.parametrize(
    ("line", "decoded"),
    [
        (b'{"id":1,"ok":true}\n', {"id": 1, "ok": True}),
        (b"[1]\n", None),
        (b"not json\n", None),
        (b"\xff\xfe\n", None),
    ],
)
def test_decode_reply(line: bytes, decoded: Message | None) -> None:
    assert decode_reply(line) == decoded


def wire(messages: list[dict[str, object]]) -> list[Message]:
    """The messages as the router decodes them."""
    return [json.loads(encode_line(message)) for message in messages]


def test_sync_messages_split_at_1000_with_more_on_all_but_last() -> None:
    claims = [("episode", f"ep{i:04d}-a0") for i in range(2001)]
    messages = wire(sync_messages(claims))
    assert [len(m["claims"]) for m in messages] == [1000, 1000, 1]
    assert [m["more"] for m in messages] == [True, True, False]
    assert messages[0]["claims"][0] == {"kind": "episode", "key": "ep0000-a0"}
    assert messages[2]["claims"] == [{"kind": "episode", "key": "ep2000-a0"}]
    assert all(m["op"] == "sync" and "id" not in m for m in messages)


def test_sync_messages_empty_set_is_one_empty_sync() -> None:
    assert sync_messages([]) == [{"op": "sync", "claims": [], "more": False}]


def test_sync_messages_count_the_escapes_json_writes() -> None:
    # A control character is six bytes on the line (\u0001): keys made of them would
    # pass a budget of their UTF-8 length, and the sync would go over the limit.
    claims = [("episode", f"{i:04d}" + "\x01" * 500) for i in range(400)]
    messages = sync_messages(claims)
    assert all(len(encode_line({**m, "id": 2**63})) < LINE_LIMIT for m in messages)
    assert sum(len(m["claims"]) for m in wire(messages)) == 400


def test_a_boot_the_router_would_refuse_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="visible ASCII"):
        ControlClient("unix:/tmp/x.sock", worker_id="w0", url="http://127.0.0.1:1", boot="a b")


def test_sync_messages_stay_under_the_line_limit() -> None:
    claims = [("episode", f"{i:04d}" + "k" * 2000) for i in range(1000)]
    messages = sync_messages(claims)
    assert len(messages) > 1
    assert all(len(encode_line({**m, "id": 1})) < LINE_LIMIT for m in messages)
    assert sum(len(m["claims"]) for m in wire(messages)) == 1000


@pytest.mark.parametrize(
    ("header", "answer"),
    [
        (None, None),
        ("b00t", None),
        ("other", 410),
        ("", 410),
        ("b00t ", 410),
        ("é", 410),
        ("\udcff\udcfe", 410),  # bytes that are not UTF-8, as aiohttp decodes them
    ],
)
def test_boot_mismatch_answer(header: str | None, answer: int | None) -> None:
    result = boot_mismatch_answer("b00t", header)
    if answer is None:
        assert result is None
    else:
        assert result is not None
        status, body = result
        assert status == answer
        assert body["error"] == "worker_exited"
        assert body["session"] is None
        assert isinstance(body["detail"], str) and "b00t" not in body["detail"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ping_interval_s": 5.0}, "ping_interval_s"),
        ({"ping_interval_s": 0}, "ping_interval_s"),
        ({"reconnect_max_s": 0}, "reconnect_max_s"),
        ({"worker_id": ""}, "worker_id"),
    ],
)
def test_client_refuses_bad_settings(options: dict[str, Any], message: str) -> None:
    settings: dict[str, Any] = {"worker_id": "w0", "url": "http://127.0.0.1:1", **options}
    with pytest.raises(ValueError, match=message):
        ControlClient("unix:/x.sock", **settings)


def test_tcp_address_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="secret"):
        ControlClient("tcp://127.0.0.1:9902", worker_id="w0", url="http://127.0.0.1:1")


def test_boots_are_random_per_client() -> None:
    first = ControlClient("unix:/x.sock", worker_id="w0", url="http://127.0.0.1:1")
    second = ControlClient("unix:/x.sock", worker_id="w0", url="http://127.0.0.1:1")
    assert len(first.boot) == 16 and first.boot != second.boot
    assert first.router_id is None and not first.connected and first.held == frozenset()


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPISODE_ROUTER_CONTROL", "tcp://127.0.0.1:9902")
    monkeypatch.setenv("EPISODE_ROUTER_WORKER_ID", "w3")
    monkeypatch.setenv("EPISODE_ROUTER_SECRET", "s3cret")
    client = ControlClient.from_env(url="http://127.0.0.1:9003")
    assert (client.address, client.worker_id, client.url) == (
        ControlAddress("tcp", host="127.0.0.1", port=9902),
        "w3",
        "http://127.0.0.1:9003",
    )
    assert ControlClient.from_env(url="http://127.0.0.1:9003", worker_id="w9").worker_id == "w9"


def test_from_env_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EPISODE_ROUTER_CONTROL", raising=False)
    monkeypatch.delenv("EPISODE_ROUTER_WORKER_ID", raising=False)
    with pytest.raises(ValueError, match="EPISODE_ROUTER_CONTROL"):
        ControlClient.from_env(url="http://127.0.0.1:9003")
    monkeypatch.setenv("EPISODE_ROUTER_CONTROL", "unix:/x.sock")
    with pytest.raises(ValueError, match="EPISODE_ROUTER_WORKER_ID"):
        ControlClient.from_env(url="http://127.0.0.1:9003")


# --- against the scripted router ---------------------------------------------------------------


async def test_first_hello_carries_version_worker_url_and_boot_then_an_empty_sync(
    router: ScriptedRouter, client: ControlClient
) -> None:
    assert router.messages == [
        {"op": "hello", "id": 1, "v": 1, "worker": "w0", "url": "http://127.0.0.1:9001",
         "boot": client.boot},
        {"op": "sync", "id": 2, "claims": [], "more": False},
    ]  # fmt: skip
    assert client.router_id == "r1"
    assert client.connected
    assert client.held == frozenset()


async def test_minted_keys_start_with_the_prefix_the_last_hello_offered(
    router: ScriptedRouter, client: ControlClient
) -> None:
    assert client.key_prefix is None  # none offered
    plain = client.mint_key()
    assert len(plain) == 32 and int(plain, 16) >= 0 and plain != client.mint_key()
    router.key_prefix = "r1:7:"
    await router.drop_connections()
    await eventually(lambda: client.key_prefix == "r1:7:" and client.connected)
    assert client.mint_key().startswith("r1:7:") and len(client.mint_key()) == 5 + 32
    router.key_prefix = "r1:7:../x"  # not a prefix: the keys go without one
    await router.drop_connections()
    await eventually(lambda: len(router.sessions) == 3 and client.connected)
    assert client.key_prefix is None


async def test_claim_and_release_are_acknowledged(
    router: ScriptedRouter, client: ControlClient
) -> None:
    await client.claim("ep7-a0")
    assert client.held == {("episode", "ep7-a0")}
    assert router.holders == {("episode", "ep7-a0"): "w0"}
    await client.claim("sid-1", kind="mcp_session")
    assert client.held == {("episode", "ep7-a0"), ("mcp_session", "sid-1")}
    await client.claim("ep7-a0")  # idempotent
    await client.release("ep7-a0")
    assert client.held == {("mcp_session", "sid-1")}
    assert router.holders == {("mcp_session", "sid-1"): "w0"}
    assert router.tombstones == {("episode", "ep7-a0"): "ended"}
    assert router.messages[1:] == [
        {"op": "sync", "id": 2, "claims": [], "more": False},
        {"op": "claim", "key": "ep7-a0", "kind": "episode", "id": 3},
        {"op": "claim", "key": "sid-1", "kind": "mcp_session", "id": 4},
        {"op": "claim", "key": "ep7-a0", "kind": "episode", "id": 5},
        {"op": "release", "key": "ep7-a0", "kind": "episode", "id": 6},
    ]


async def test_refusals_raise_control_error(router: ScriptedRouter, client: ControlClient) -> None:
    router.holders[("episode", "taken-a0")] = "w9"
    router.tombstones[("episode", "old-a0")] = "ended"
    with pytest.raises(ControlError) as conflict:
        await client.claim("taken-a0")
    assert conflict.value.error == "conflict"
    assert conflict.value.reply == {"id": 3, "ok": False, "error": "conflict", "holder": "w9"}
    with pytest.raises(ControlError) as ended:
        await client.claim("old-a0")
    assert ended.value.error == "ended"
    with pytest.raises(ControlError) as unknown_kind:
        await client.claim("x", kind="cookie")
    assert unknown_kind.value.error == "unknown_kind"
    with pytest.raises(ControlError) as not_holder:
        await client.release("taken-a0")
    assert not_holder.value.error == "not_holder"
    assert client.held == frozenset()
    assert client.connected
    assert router.holders == {("episode", "taken-a0"): "w9"}


async def test_hello_refused_raises_from_start(
    router: ScriptedRouter, client: ControlClient
) -> None:
    impostor = make_client(router, boot="another-boot")
    with pytest.raises(ControlError) as refused:
        await impostor.start()
    assert refused.value.error == "worker_busy"
    assert not impostor.connected
    # A refused first hello stops the client, whatever the code: later calls name it.
    with pytest.raises(ControlError, match="worker_busy") as later:
        await impostor.claim("ep1-a0")
    assert later.value.reply == refused.value.reply
    assert client.connected


async def test_tcp_hello_carries_the_secret(tmp_path: Path) -> None:
    scripted = ScriptedRouter(tmp_path / "unused.sock", secret="s3cret")
    await scripted.start(tcp=True)
    address = f"tcp://127.0.0.1:{scripted.tcp_port}"
    try:
        good = ControlClient(address, worker_id="w0", url="http://127.0.0.1:1", secret="s3cret")
        await good.start()
        assert scripted.messages[0]["auth"] == "s3cret"
        await good.stop()
        bad = ControlClient(address, worker_id="w1", url="http://127.0.0.1:2", secret="wrong")
        with pytest.raises(ControlError) as refused:
            await bad.start()
        assert refused.value.error == "forbidden"
    finally:
        await scripted.close()


async def test_unix_hello_never_carries_the_secret(router: ScriptedRouter) -> None:
    worker = make_client(router, secret="s3cret")
    await worker.start()
    assert "auth" not in router.messages[0]
    await worker.stop()


async def test_call_before_start_is_refused(router: ScriptedRouter) -> None:
    with pytest.raises(ControlError) as refused:
        await make_client(router).claim("ep1-a0")
    assert refused.value.error == "not_started"
    assert router.messages == []


async def test_start_waits_for_the_socket_to_appear(tmp_path: Path) -> None:
    scripted = ScriptedRouter(tmp_path / "late.sock")
    worker = make_client(scripted)
    starting = asyncio.create_task(worker.start(), name="start")
    await asyncio.sleep(0.3)
    assert not starting.done()
    await scripted.start()
    try:
        await asyncio.wait_for(starting, 2)
        assert worker.connected and scripted.ops() == ["hello", "sync"]
    finally:
        await worker.stop()
        await scripted.close()


async def test_pings_arrive_when_idle(router: ScriptedRouter) -> None:
    worker = make_client(router, ping_interval_s=0.1)
    await worker.start()
    await asyncio.sleep(0.65)
    await worker.claim("ep1-a0")
    await asyncio.sleep(0.05)
    await worker.stop()
    times = [at for at, _ in router.arrivals]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    assert router.ops().count("ping") >= 5
    assert max(gaps) < 0.2
    pings = [m for m in router.messages if m["op"] == "ping"]
    assert all(set(m) == {"op", "id"} for m in pings)
    ids = [m["id"] for m in router.messages]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)


async def test_busy_connection_sends_no_pings(router: ScriptedRouter) -> None:
    worker = make_client(router, ping_interval_s=0.2)
    await worker.start()
    for i in range(8):
        await worker.claim(f"ep{i}-a0")
        await asyncio.sleep(0.05)
    await worker.stop()
    assert "ping" not in router.ops()


async def test_reconnect_resyncs_held_claims_with_the_same_boot(
    router: ScriptedRouter, client: ControlClient
) -> None:
    await client.claim("ep1-a0")
    await client.claim("ep2-a0")
    await router.drop_connections()
    await eventually(lambda: len(router.sessions) == 2 and client.connected)
    second = router.sessions[1].messages
    assert second[0] == {**router.sessions[0].messages[0], "id": second[0]["id"]}
    assert second[0]["boot"] == client.boot
    assert second[1] == {
        "op": "sync",
        "id": second[0]["id"] + 1,
        "claims": [{"kind": "episode", "key": "ep1-a0"}, {"kind": "episode", "key": "ep2-a0"}],
        "more": False,
    }
    assert client.held == {("episode", "ep1-a0"), ("episode", "ep2-a0")}
    assert router.held_by("w0") == {("episode", "ep1-a0"), ("episode", "ep2-a0")}
    await client.claim("ep3-a0")
    assert router.ops(1) == ["hello", "sync", "claim"]


async def test_reconnect_with_nothing_held_sends_one_empty_sync(
    router: ScriptedRouter, client: ControlClient
) -> None:
    await router.drop_connections()
    await eventually(lambda: len(router.sessions) == 2 and client.connected)
    assert router.sessions[1].messages[1] == {"op": "sync", "id": 4, "claims": [], "more": False}


async def test_router_restart_resyncs_and_drops_refused_claims(
    router: ScriptedRouter, client: ControlClient
) -> None:
    await client.claim("ep1-a0")
    await client.claim("ep2-a0")
    await router.restart("r2")
    # Another worker got there first on the restarted router.
    router.holders[("episode", "ep2-a0")] = "w9"
    await eventually(lambda: client.router_id == "r2" and client.connected)
    assert router.ops(1) == ["hello", "sync"]
    assert client.held == {("episode", "ep1-a0")}
    assert router.holders == {("episode", "ep1-a0"): "w0", ("episode", "ep2-a0"): "w9"}


async def test_sync_is_split_at_1000_claims(router: ScriptedRouter, client: ControlClient) -> None:
    await asyncio.gather(*(client.claim(f"ep{i:04d}-a0") for i in range(2500)))
    assert len(client.held) == 2500
    await router.drop_connections()
    await eventually(lambda: len(router.sessions) == 2 and client.connected)
    syncs = [m for m in router.sessions[1].messages if m["op"] == "sync"]
    assert [(len(m["claims"]), m["more"]) for m in syncs] == [
        (1000, True),
        (1000, True),
        (500, False),
    ]
    assert {c["key"] for m in syncs for c in m["claims"]} == {f"ep{i:04d}-a0" for i in range(2500)}
    assert len(router.held_by("w0")) == 2500 and len(client.held) == 2500


async def test_claim_during_a_disconnect_completes_after_reconnect(
    router: ScriptedRouter, client: ControlClient
) -> None:
    await client.claim("ep1-a0")
    await router.close()
    await eventually(lambda: not client.connected)
    claiming = asyncio.create_task(client.claim("ep2-a0"), name="claim")
    releasing = asyncio.create_task(client.release("ep1-a0"), name="release")
    await asyncio.sleep(0.3)
    assert not claiming.done() and not releasing.done()
    assert client.held == frozenset()  # the release is intent, the claim not yet acknowledged
    await router.start()
    await asyncio.wait_for(asyncio.gather(claiming, releasing), 3)
    assert client.held == {("episode", "ep2-a0")}
    assert router.ops(1) == ["hello", "sync", "claim", "release"]
    # The sync already declares the waiting claim and leaves out the waiting release.
    assert router.sessions[1].messages[1]["claims"] == [{"kind": "episode", "key": "ep2-a0"}]
    assert router.holders == {("episode", "ep2-a0"): "w0"}
    assert router.tombstones == {("episode", "ep1-a0"): "ended"}


async def test_drain_is_reapplied_after_reconnect(
    router: ScriptedRouter, client: ControlClient
) -> None:
    await client.drain()
    assert router.drained == {"w0": True}
    await router.restart("r2")
    await eventually(lambda: client.connected and router.drained == {"w0": True})
    assert router.ops(1) == ["hello", "sync", "drain"]
    await client.drain(False)
    assert router.drained == {"w0": False}
    await router.drop_connections()
    await eventually(lambda: len(router.sessions) == 3 and client.connected)
    assert router.ops(2) == ["hello", "sync"]


async def test_connection_closed_right_after_the_hello_is_redialled(
    router: ScriptedRouter, client: ControlClient
) -> None:
    await client.claim("ep1-a0")
    router.hangups_after_hello = 1
    await router.drop_connections()
    await eventually(lambda: len(router.sessions) == 3 and client.connected)
    assert router.ops(1) == ["hello"]
    assert router.ops(2) == ["hello", "sync"]
    assert client.held == {("episode", "ep1-a0")}


async def test_silent_router_is_dropped_and_redialled(router: ScriptedRouter) -> None:
    worker = make_client(router, ping_interval_s=0.1)
    await worker.start()
    router.silent = True
    await eventually(lambda: len(router.sessions) == 2, within=3)
    router.silent = False
    await eventually(lambda: worker.connected)
    assert router.sessions[0].writer.is_closing()
    await worker.stop()


async def test_stop_says_bye_and_fails_what_waits(
    router: ScriptedRouter, client: ControlClient
) -> None:
    await client.claim("ep1-a0")
    await client.stop()
    assert router.ops() == ["hello", "sync", "claim", "bye"]
    assert not client.connected
    assert router.holders == {}
    assert router.tombstones == {("episode", "ep1-a0"): "worker_exited"}
    await eventually(lambda: router.sessions[0].writer.is_closing())
    with pytest.raises(ControlError) as stopped:
        await client.claim("ep2-a0")
    assert stopped.value.error == "client_stopped"
    with pytest.raises(RuntimeError, match="already started"):  # not a wait for ever
        await asyncio.wait_for(client.start(), 5.0)


async def test_stop_while_disconnected_fails_pending_calls(
    router: ScriptedRouter, client: ControlClient
) -> None:
    await router.close()
    await eventually(lambda: not client.connected)
    claiming = asyncio.create_task(client.claim("ep1-a0"), name="claim")
    await asyncio.sleep(0.05)
    await client.stop()
    with pytest.raises(ControlError) as stopped:
        await claiming
    assert stopped.value.error == "client_stopped"
    assert "bye" not in router.ops()


async def test_a_line_over_the_limit_fails_without_dropping_the_connection(
    router: ScriptedRouter, client: ControlClient
) -> None:
    with pytest.raises(ControlError) as too_long:
        await client.claim("k" * LINE_LIMIT)
    assert too_long.value.error == "line_too_long"
    await client.claim("ep1-a0")
    assert len(router.sessions) == 1 and client.held == {("episode", "ep1-a0")}


async def test_stray_reply_lines_are_ignored(router: ScriptedRouter, client: ControlClient) -> None:
    router.inject(b'garbage\n[1,2]\n{"id":null,"ok":false,"error":"bad_request"}\n')
    router.inject(b'{"id":99,"ok":true}\n{"id":true,"ok":true}\n')
    await client.claim("ep1-a0")
    assert client.held == {("episode", "ep1-a0")}
    assert client.connected and len(router.sessions) == 1


# --- the boot check in apps --------------------------------------------------------------------


async def test_aiohttp_boot_middleware(aiohttp_client: Any) -> None:
    async def hello(request: web.Request) -> web.Response:
        return web.json_response({"served": True})

    app = web.Application(middlewares=[aiohttp_boot_middleware("b00t")])
    app.router.add_post("/tools/add", hello)
    http: TestClient[web.Request, web.Application] = await aiohttp_client(app)

    absent = await http.post("/tools/add", json={})
    assert (absent.status, await absent.json()) == (200, {"served": True})
    match = await http.post("/tools/add", headers={BOOT_HEADER: "b00t"})
    assert (match.status, await match.json()) == (200, {"served": True})
    mismatch = await http.post("/tools/add", headers={BOOT_HEADER: "dead"}, data=b"x" * 1000)
    assert mismatch.status == 410
    assert mismatch.content_type == "application/json"
    body = await mismatch.json()
    assert (body["error"], body["session"]) == ("worker_exited", None)
    repeated = await http.post("/tools/add", headers=[(BOOT_HEADER, "b00t"), (BOOT_HEADER, "x")])
    assert repeated.status == 410


async def _call_asgi(app: ASGIBootMiddleware, scope: Message) -> list[Message]:
    sent: list[Message] = []

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    await app(scope, receive, send)
    return sent


async def test_asgi_boot_middleware() -> None:
    seen: list[str] = []

    async def inner(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})

    app = ASGIBootMiddleware(inner, "b00t")

    def http(*headers: tuple[bytes, bytes]) -> Message:
        return {"type": "http", "method": "POST", "path": "/", "headers": list(headers)}

    ok_status = {"type": "http.response.start", "status": 200, "headers": []}
    assert (await _call_asgi(app, http()))[0] == ok_status
    assert (await _call_asgi(app, http((b"x-episode-router-boot", b"b00t"))))[0] == ok_status
    assert seen == ["http", "http"]

    refused = await _call_asgi(app, http((b"X-Episode-Router-Boot", b"dead")))
    assert seen == ["http", "http"]
    start, body = refused
    assert start["status"] == 410
    assert dict(start["headers"]) == {
        b"content-type": b"application/json",
        b"content-length": str(len(body["body"])).encode(),
    }
    assert json.loads(body["body"])["error"] == "worker_exited"

    await _call_asgi(app, {"type": "lifespan"})
    assert seen == ["http", "http", "lifespan"]


async def test_a_connect_that_fails_with_no_os_error_is_retried_not_fatal(
    router: ScriptedRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # As the resolver's idna check does for some names: it ended the client's task,
    # left start() waiting for ever and made stop() raise.
    real_connect = ControlConnection.connect
    attempts = 0

    async def once_odd(*args: Any, **kwargs: Any) -> ControlConnection:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise UnicodeError("label empty or too long")
        return await real_connect(*args, **kwargs)

    monkeypatch.setattr(ControlConnection, "connect", once_odd)
    worker = make_client(router)
    await asyncio.wait_for(worker.start(), 5)
    assert worker.connected and attempts == 2
    await worker.stop()
