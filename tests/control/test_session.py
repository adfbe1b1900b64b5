"""Pure tests for router.control.session: a connection's session over the core.

Playbook steps send real lines through `decode_line`, `ControlSession.handle` and
`encode`, on named connections, and assert each reply and the whole state after it.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from router.control.session import ControlSession, Peer
from router.control.worker_urls import SocketFacts, SocketLookup
from router.core.machine import CoreSettings, RouterCore
from router.core.workers import WorkerOrigin
from router.protocol.control import MAX_KEY_CHARS, MAX_LINE_BYTES, decode_line, encode_line
from tests.playbook import (
    CONFLICTS,
    OWN_UID,
    Ans,
    At,
    Balance,
    C,
    Close,
    Expect,
    Fwd,
    Learn,
    Playbook,
    R,
    Register,
    Retire,
    Route,
    Send,
    Step,
    Tick,
    Ticked,
    W,
    default_url,
    err,
    hello,
    ok,
    policy,
)

# Hypothesis caches what it learns of the source: not in the work tree.
set_hypothesis_home_dir(Path(tempfile.gettempdir()) / "episode-router-hypothesis")

ROUTER = {"router": "router-boot-1"}
SETTINGS = CoreSettings(
    kinds={"episode": False, "open": True},
    lease_timeout_s=15.0,
    reconnect_grace_s=5.0,
    tombstone_ttl_s=100.0,
    max_tombstones=1000,
    recovery_window_s=30.0,
)
SECRET = "s3cret-shared"
PEERS = {
    "tcp": Peer(uid=None, tcp=True),
    "stranger": Peer(uid=2000, tcp=False),
    "friend": Peer(uid=3000, tcp=False),
}
U0 = default_url("w0")
EXITED_W0 = {W("w0"): "exited", C("ep1"): "exited w0", R("w0"): 1}


def own_sockets(path: str) -> SocketFacts:
    """A filesystem where every unix socket is the playbook's own uid's."""
    return SocketFacts(path, OWN_UID)


def book(*, socket_lookup: SocketLookup = own_sockets, **policy_args: Any) -> Playbook:
    """A core whose recovery is over, and a control policy (unix sockets are the
    peer's own unless `socket_lookup` says otherwise)."""
    settings = replace(SETTINGS, recovery_window_s=0.0)
    control = replace(policy(**policy_args), socket_lookup=socket_lookup)
    playbook = Playbook(settings, control=control, peers=PEERS)
    return playbook.run([(Tick(), Ticked(recovery_ended=True))])


def claim(request_id: object, key: str, **extra: Any) -> dict[str, Any]:
    return {"op": "claim", "id": request_id, "key": key, **extra}


def release(request_id: object, key: str, **extra: Any) -> dict[str, Any]:
    return {"op": "release", "id": request_id, "key": key, **extra}


def sync(request_id: object, *keys: str, more: bool = False) -> dict[str, Any]:
    claims = [{"kind": "episode", "key": key} for key in keys]
    return {"op": "sync", "id": request_id, "claims": claims, "more": more}


def with_w0(conn: str = "a", **policy_args: Any) -> Playbook:
    """w0 said hello on connection `conn` and holds ep1."""
    return book(**policy_args).run(
        [
            (Send(conn, hello(1, "w0")), ok(1, **ROUTER), {W("w0"): f"live @{conn}"}),
            (Send(conn, claim(2, "ep1")), ok(2), {C("ep1"): "held w0"}),
        ]
    )


def with_w0_and_w1() -> Playbook:
    """w0 (connection a) holds ep1; w1 (connection b) holds ep2."""
    return with_w0().run(
        [
            (Send("b", hello(1, "w1")), ok(1, **ROUTER), {W("w1"): "live @b"}),
            (Send("b", claim(2, "ep2")), ok(2), {C("ep2"): "held w1"}),
        ]
    )


# -- hello -----------------------------------------------------------------------


def test_every_op_on_its_happy_path() -> None:
    with_w0().run(
        [
            (Send("a", {"op": "ping", "id": 3}), ok(3)),
            (Send("a", claim(4, "k", kind="open")), ok(4), {C("k", "open"): "held w0"}),
            (Send("a", release(5, "k", kind="open")), ok(5), {C("k", "open"): "ended w0"}),
            (
                Send("a", sync(6, "ep1", "ep2")),
                ok(6, accepted=2, refused=[]),
                {C("ep2"): "held w0"},
            ),
            (Send("a", {"op": "drain", "id": 7, "on": True}), ok(7), {W("w0"): "live draining @a"}),
            (Send("a", {"op": "drain", "id": 8, "on": False}), ok(8), {W("w0"): "live @a"}),
            (
                Send("a", {"op": "bye", "id": 9}),
                ok(9),
                {W("w0"): "exited", C("ep1"): "exited w0", C("ep2"): "exited w0", R("w0"): 1},
            ),
        ]
    )


@pytest.mark.parametrize("request_id", ["req-1", "", 0, 42, -1, 2**53, None])
def test_ids_are_echoed(request_id: object) -> None:
    book().run(
        [
            (Send("a", hello(request_id, "w0")), ok(request_id, **ROUTER), {W("w0"): "live @a"}),
            (Send("a", claim(request_id, "ep1")), ok(request_id), {C("ep1"): "held w0"}),
            (Send("a", {"op": "nope", "id": request_id}), err(request_id, "unknown_op")),
            (Send("a", claim(request_id, "")), err(request_id, "bad_request")),
        ]
    )


def test_a_request_without_an_id_gets_a_null_id() -> None:
    book().run([(Send("a", {"op": "ping"}), err(None, "no_hello"))])


def test_a_bad_line_or_unknown_op_keeps_the_connection_going() -> None:
    with_w0().run(
        [
            (Send("a", b"{garbage"), err(None, "bad_request")),
            (Send("a", b'{"op":"ping","id":true}'), err(None, "bad_request")),
            (Send("a", {"op": "frobnicate", "id": 3}), err(3, "unknown_op")),
            (Send("a", {"op": "HELLO", "id": 4}), err(4, "unknown_op")),
            (Send("a", claim(5, "ep2")), ok(5), {C("ep2"): "held w0"}),
        ]
    )


@pytest.mark.parametrize(
    "message",
    [
        claim(1, "ep1"),
        release(1, "ep1"),
        sync(1, "ep1"),
        {"op": "drain", "id": 1, "on": True},
        {"op": "bye", "id": 1},
        {"op": "ping", "id": 1},
    ],
)
def test_every_op_but_hello_needs_a_hello_first(message: dict[str, Any]) -> None:
    book().run(
        [
            (Send("a", message), err(1, "no_hello")),
            (Send("a", {"op": "frobnicate", "id": 2}), err(2, "unknown_op")),
        ]
    )


BAD_HELLOS: list[tuple[str, object]] = [
    ("worker", None),
    ("worker", 7),
    ("worker", ""),
    ("worker", "w" * 65),
    ("worker", "w 0"),
    ("worker", "w/0"),
    ("worker", "w0\n"),
    ("worker", "wé"),
    ("url", None),
    ("url", 9001),
    ("url", "127.0.0.1:9001"),
    ("url", "http://127.0.0.1"),
    ("url", "https://127.0.0.1:9001"),
    ("url", "http://127.0.0.1:9001/api"),
    ("url", "http://127.0.0.1:9001\n"),
    ("url", "unix:"),
    ("url", "unix:w0.sock"),
    ("url", "http://127.0.0.1:0"),
    ("url", "unix:/tmp/w\ud800.sock"),  # valid JSON text ("\ud800"), but no path to connect to
    ("url", "unix:/" + "w" * 107),  # longer than a unix socket's path can be
    ("boot", None),
    ("boot", ""),
    ("boot", "b" * 129),
    ("boot", 12345),
]


@pytest.mark.parametrize(("field", "value"), BAD_HELLOS)
def test_a_hello_with_a_malformed_field_is_bad_request(field: str, value: object) -> None:
    message = hello(1, "w0")
    if value is None:
        del message[field]
    else:
        message[field] = value
    book().run([(Send("a", message), err(1, "bad_request"))])


@pytest.mark.parametrize(
    ("worker", "url", "boot"),
    [
        ("w" * 64, "http://127.0.0.1:9001", "b0"),
        ("A.b_c:d-9", "http://localhost:9001/", "b0"),
        ("w0", "http://[::1]:9001", "b" * 128),
        ("w0", "unix:/run/w0.sock", "x"),
    ],
)
def test_a_hello_at_the_limits_is_accepted(worker: str, url: str, boot: str) -> None:
    boot_word = "" if boot == "b0" else f" boot={boot}"
    book().run(
        [
            (
                Send("a", hello(1, worker, url=url, boot=boot)),
                ok(1, **ROUTER),
                {W(worker): f"live{boot_word} @a"},
            )
        ]
    )


@pytest.mark.parametrize("version", [None, 0, 2, "1", True, [1]])
def test_a_hello_for_another_protocol_version_is_unsupported_version(version: object) -> None:
    message = hello(1, "w0")
    if version is None:
        del message["v"]
    else:
        message["v"] = version
    book().run([(Send("a", message), err(1, "unsupported_version"))])


@pytest.mark.parametrize(
    "boot", ["boot-café", "abc ", "a b", "tab\t", "", "x" * 129, 7, None], ids=repr
)
def test_a_boot_that_would_not_survive_its_header_is_a_bad_request(boot: object) -> None:
    # It travels in X-Episode-Router-Boot: a worker's HTTP stack may decode it as
    # latin-1 or strip its spaces, and then refuse its own episodes.
    message = hello(1, "w0")
    message["boot"] = boot
    book().run([(Send("a", message), err(1, "bad_request"))])


def test_a_boot_of_visible_ascii_up_to_128_is_taken() -> None:
    boot = "~!" + "x" * 126
    book().run(
        [
            (
                Send("a", {**hello(1, "w0"), "boot": boot}),
                ok(1, **ROUTER),
                {W("w0"): f"live boot={boot} @a"},
            )
        ]
    )


def test_hello_again_on_the_same_connection_is_idempotent() -> None:
    with_w0().run(
        [
            (Send("a", hello(3, "w0")), ok(3, **ROUTER)),
            (Send("a", claim(4, "ep1")), ok(4)),
        ]
    )


def test_hello_again_on_the_same_connection_with_another_boot_or_url_is_worker_busy() -> None:
    with_w0().run(
        [
            (Send("a", claim(3, "ep1")), ok(3), {C("ep1"): "held w0"}),
            (Send("a", hello(4, "w0", boot="b-new")), err(4, "worker_busy")),
            (Send("a", hello(5, "w0", url="http://127.0.0.1:9999")), err(5, "worker_busy")),
            # Nothing changed: same lease, same generation, same claims, same connection.
            (
                Send("a", claim(6, "ep2")),
                ok(6),
                {C("ep1"): "held w0", C("ep2"): "held w0", W("w0"): "live @a"},
            ),
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
            (Send("a", hello(7, "w0")), ok(7, **ROUTER)),
        ]
    )


def test_a_connection_holds_one_lease_only() -> None:
    with_w0().run([(Send("a", hello(3, "w1")), err(3, "forbidden"))])


# -- who may say hello -------------------------------------------------------------


def test_tcp_needs_the_shared_secret() -> None:
    book(secret=SECRET).run(
        [
            (Send("tcp", hello(1, "w0")), err(1, "forbidden")),
            (Send("tcp", hello(2, "w0", auth="wrong")), err(2, "forbidden")),
            (Send("tcp", hello(3, "w0", auth=SECRET + "x")), err(3, "forbidden")),
            (Send("tcp", hello(4, "w0", auth=SECRET[:-1])), err(4, "forbidden")),
            (Send("tcp", hello(5, "w0", auth=["s3cret-shared"])), err(5, "forbidden")),
            (Send("tcp", hello(6, "w0", auth=SECRET)), ok(6, **ROUTER), {W("w0"): "live @tcp"}),
        ]
    )


def test_tcp_without_a_configured_secret_admits_nobody() -> None:
    book().run(
        [
            (Send("tcp", hello(1, "w0")), err(1, "forbidden")),
            (Send("tcp", hello(2, "w0", auth="")), err(2, "forbidden")),
            (Send("tcp", hello(3, "w0", auth="anything")), err(3, "forbidden")),
        ]
    )


def test_unix_peers_need_the_routers_uid_or_an_allowed_one() -> None:
    book(allowed_uids=[3000]).run(
        [
            (Send("stranger", hello(1, "w0")), err(1, "forbidden")),
            (Send("friend", hello(2, "w0")), ok(2, **ROUTER), {W("w0"): "live @friend"}),
            (Send("a", hello(3, "w1")), ok(3, **ROUTER), {W("w1"): "live @a"}),
        ]
    )


def test_a_url_off_this_host_must_be_an_allowed_upstream() -> None:
    book(allowed_upstreams=["http://10.0.0.5:9001"]).run(
        [
            (Send("a", hello(1, "w0", url="http://10.0.0.6:9001")), err(1, "forbidden")),
            (Send("a", hello(2, "w0", url="http://worker.internal:9001")), err(2, "forbidden")),
            (
                Send("a", hello(3, "w0", url="http://10.0.0.5:09001/")),  # the same address
                ok(3, **ROUTER),
                {W("w0"): "live @a"},
            ),
        ]
    )


def test_a_live_worker_id_with_another_boot_or_url_is_worker_busy() -> None:
    with_w0().run(
        [
            (Send("b", hello(1, "w0", boot="other")), err(1, "worker_busy")),
            (Send("b", hello(2, "w0", url="http://127.0.0.1:9999")), err(2, "worker_busy")),
            (Send("b", claim(3, "ep2")), err(3, "no_hello")),
            (Send("a", claim(3, "ep2")), ok(3), {C("ep2"): "held w0"}),
        ]
    )


def test_a_spawned_workers_hello_registers_it_as_spawned() -> None:
    # Its first hello after the router's start (spawned now, or adopted from a last run).
    book(spawned_ids={"w0"}).run(
        [
            (Send("a", hello(1, "w0")), ok(1, **ROUTER), {W("w0"): "live spawned @a"}),
            (Send("b", hello(1, "w1")), ok(1, **ROUTER), {W("w1"): "live @b"}),
        ]
    )


def test_a_static_workers_id_is_worker_busy_live_or_exited() -> None:
    # A hello would retire the configured worker (its sessions 410) and take its traffic.
    static = "http://127.0.0.1:9100"
    book().run(
        [
            (Register("s0", static, WorkerOrigin.STATIC), None, {W("s0"): "live static"}),
            (Learn("s0", "ep9"), None, {C("ep9"): "held s0 learned"}),
            (Send("a", hello(1, "s0")), err(1, "worker_busy")),
            (Send("a", hello(2, "s0", url=static)), err(2, "worker_busy")),
            (Route("ep9"), Fwd("s0", "ep9")),
            (Send("a", claim(3, "ep2")), err(3, "no_hello")),
            (
                Retire("s0"),
                1,
                {W("s0"): "exited static", C("ep9"): "exited s0 learned", R("s0"): 1},
            ),
            (Send("a", hello(4, "s0", url=static)), err(4, "worker_busy")),
        ]
    )


def test_a_retired_workers_lease_is_void_when_its_connection_closes() -> None:
    # A reload made w0's id static (at its own url): the control worker is retired, and
    # its connection's close, which follows, must not mark the static worker lost.
    with_w0().run(
        [
            (
                Register("w0", U0, WorkerOrigin.STATIC),
                None,
                {W("w0"): "live static g1", C("ep1"): "exited w0", R("w0"): 1},
            ),
            (Route("ep1"), Ans("worker_exited", "ep1")),
            (Close("a"), None),
            (Send("a", claim(3, "ep2")), err(3, "no_hello")),
        ]
    )


def test_a_url_held_by_another_live_worker_is_worker_busy() -> None:
    port = U0.rsplit(":", 1)[1]
    with_w0().run(
        [
            (Send("b", hello(1, "w1", url=U0)), err(1, "worker_busy")),
            # Another spelling of the same address is the same address.
            (Send("b", hello(1, "w1", url=f"http://localhost:{port}")), err(1, "worker_busy")),
            (Send("b", hello(1, "w1", url=f"http://127.0.0.1:0{port}")), err(1, "worker_busy")),
            (Close("a"), "w0", {W("w0"): "lost"}),
            # Lost is not live: a new process may have this port now.
            (Send("b", hello(2, "w1", url=U0)), ok(2, **ROUTER), {W("w1"): "live @b"}),
            (Send("c", hello(3, "w2", url=U0)), err(3, "worker_busy")),
            # ...and the lost worker may not come back to an address another worker has.
            (Send("d", hello(4, "w0")), err(4, "worker_busy")),
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
        ]
    )


# -- claims ------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["claim", "release"])
@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({}, "bad_request"),
        ({"key": ""}, "bad_request"),
        ({"key": 7}, "bad_request"),
        ({"key": None}, "bad_request"),
        ({"key": ["ep2"]}, "bad_request"),
        ({"key": "k" * (MAX_KEY_CHARS + 1)}, "bad_request"),
        ({"key": "ep2", "kind": 5}, "bad_request"),
        ({"key": "ep2", "kind": None}, "bad_request"),
        ({"key": "ep2", "kind": "nope"}, "unknown_kind"),
        ({"key": "ep2", "kind": "Episode"}, "unknown_kind"),
    ],
)
def test_malformed_claims_and_releases(op: str, fields: dict[str, Any], error: str) -> None:
    with_w0().run([(Send("a", {"op": op, "id": 3, **fields}), err(3, error))])


def test_keys_up_to_the_limit_and_the_default_kind() -> None:
    longest = "k" * MAX_KEY_CHARS
    with_w0().run(
        [
            (Send("a", claim(3, longest)), ok(3), {C(longest): "held w0"}),
            (Send("a", claim(4, "ep1", kind="episode")), ok(4)),
            (Send("a", claim(5, "é/🙂 ")), ok(5), {C("é/🙂 "): "held w0"}),
        ]
    )


def test_claim_conflicts_name_the_holder() -> None:
    with_w0_and_w1().run(
        [
            (Send("b", claim(3, "ep1")), err(3, "conflict", holder="w0"), {CONFLICTS: 1}),
            (Send("a", claim(3, "ep2")), err(3, "conflict", holder="w1"), {CONFLICTS: 2}),
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
        ]
    )


def test_ended_and_exited_keys_refuse_claims() -> None:
    with_w0_and_w1().run(
        [
            (Send("a", release(3, "ep1")), ok(3), {C("ep1"): "ended w0"}),
            (Send("a", claim(4, "ep1")), err(4, "ended")),
            (Send("b", claim(4, "ep1")), err(4, "ended")),
            (
                Send("b", {"op": "bye", "id": 5}),
                ok(5),
                {W("w1"): "exited", C("ep2"): "exited w1", R("w1"): 1},
            ),
            (Send("a", claim(5, "ep2")), err(5, "worker_exited")),
        ]
    )


def test_releases_are_idempotent_and_only_the_holder_may_release() -> None:
    with_w0_and_w1().run(
        [
            (Send("b", release(3, "ep1")), err(3, "not_holder")),
            (Send("a", release(4, "ep1")), ok(4), {C("ep1"): "ended w0"}),
            (Send("a", release(5, "ep1")), ok(5)),
            (Send("b", release(5, "ep1")), ok(5)),
            (Send("a", release(6, "never")), ok(6), {C("never"): "ended w0"}),
            (Send("b", claim(7, "never")), err(7, "ended")),
            (Send("a", claim(8, "ep1")), err(8, "ended")),
        ]
    )


# -- sync --------------------------------------------------------------------------


def test_sync_replaces_the_workers_claims() -> None:
    with_w0_and_w1().run(
        [
            (Send("a", release(3, "gone")), ok(3), {C("gone"): "ended w0"}),
            (Send("a", claim(4, "old")), ok(4), {C("old"): "held w0"}),
            (
                Send("a", sync(5, "ep1", "ep2", "gone", "new")),
                ok(
                    5,
                    accepted=2,
                    refused=[
                        {"kind": "episode", "key": "ep2", "error": "conflict"},
                        {"kind": "episode", "key": "gone", "error": "ended"},
                    ],
                ),
                {C("old"): "ended w0", C("new"): "held w0"},
            ),
            (Route("old"), Ans("episode_ended", "old")),
            (Route("ep2"), Fwd("w1", "ep2", "b0")),
        ]
    )


def test_sync_may_span_several_messages() -> None:
    with_w0_and_w1().run(
        [
            (Send("a", claim(3, "old")), ok(3), {C("old"): "held w0"}),
            (
                Send("a", sync(4, "s1", "ep2", more=True)),
                ok(4, accepted=0, refused=[], more=True),
            ),
            # Nothing changes until the last message.
            (Route("old"), Fwd("w0", "old", "b0")),
            (Send("a", {"op": "ping", "id": 5}), ok(5)),
            (
                Send(
                    "a",
                    {
                        "op": "sync",
                        "id": 6,
                        "claims": [{"key": "s2"}, {"key": ""}, "s3", {"key": "s4", "kind": "x"}],
                        "more": True,
                    },
                ),
                # Malformed entries are refused in their own message's reply.
                ok(
                    6,
                    accepted=0,
                    refused=[
                        {"kind": "episode", "key": "", "error": "bad_request"},
                        {"kind": None, "key": None, "error": "bad_request"},
                        {"kind": "x", "key": "s4", "error": "unknown_kind"},
                    ],
                    more=True,
                ),
            ),
            (
                Send("a", sync(7, "ep1", "s1")),
                ok(7, accepted=3, refused=[{"kind": "episode", "key": "ep2", "error": "conflict"}]),
                {C("old"): "ended w0", C("s1"): "held w0", C("s2"): "held w0"},
            ),
            # A later sync starts afresh.
            (
                Send("a", sync(8, "s1")),
                ok(8, accepted=1, refused=[]),
                {C("ep1"): "ended w0", C("s2"): "ended w0"},
            ),
        ]
    )


def _wire_size(reply: dict[str, Any]) -> int:
    return len(encode_line(reply))


def test_a_syncs_malformed_entries_are_refused_in_its_own_reply_and_not_kept() -> None:
    playbook = with_w0()
    junk = {"op": "sync", "id": 3, "claims": [0] * 100_000, "more": True}
    for request_id in (3, 4, 5):  # a peer repeating it grows nothing the router keeps
        reply = playbook.perform(Send("a", junk | {"id": request_id}))
        assert isinstance(reply, dict) and reply["more"] is True
        assert len(reply["refused"]) + reply["refused_omitted"] == 100_000
        assert reply["refused"][0] == {"kind": None, "key": None, "error": "bad_request"}
        assert _wire_size(reply) <= MAX_LINE_BYTES

    assert playbook.perform(Send("a", sync(6, "s1"))) == ok(6, accepted=1, refused=[])


def test_a_sync_reply_lists_what_fits_in_one_line_and_counts_the_rest() -> None:
    playbook = with_w0_and_w1()
    keys = [f"ep{i:06d}-{'x' * 40}" for i in range(30_000)]  # about 2 MB of refusals
    taken = playbook.perform(
        Send("b", {"op": "sync", "id": 3, "claims": [{"key": k} for k in keys]})
    )
    assert taken == ok(3, accepted=30_000, refused=[])

    reply = playbook.perform(
        Send("a", {"op": "sync", "id": 4, "claims": [{"key": k} for k in keys]})
    )

    assert isinstance(reply, dict) and reply["accepted"] == 0
    listed = reply["refused"]
    assert 0 < len(listed) < 30_000
    assert len(listed) + reply["refused_omitted"] == 30_000
    assert {r["error"] for r in listed} == {"conflict"}
    assert MAX_LINE_BYTES - 200 < _wire_size(reply) <= MAX_LINE_BYTES  # as many as fit


def test_a_malformed_entrys_long_or_odd_fields_are_not_echoed() -> None:
    long_key = "\U0001f600" * (MAX_KEY_CHARS + 1)  # twelve bytes each once escaped
    reply = with_w0().perform(
        Send(
            "a",
            {
                "op": "sync",
                "id": 3,
                "claims": [{"key": long_key}, {"kind": ["x"], "key": 7}, {"kind": "x", "key": "k"}],
            },
        )
    )
    assert reply == ok(
        3,
        accepted=0,
        refused=[
            {"kind": "episode", "key": None, "error": "bad_request"},
            {"kind": None, "key": None, "error": "bad_request"},
            {"kind": "x", "key": "k", "error": "unknown_kind"},
        ],
    )


def test_a_new_hello_or_bye_drops_an_unfinished_sync() -> None:
    with_w0().run(
        [
            (Send("a", sync(3, "s1", more=True)), ok(3, accepted=0, refused=[], more=True)),
            (Send("a", hello(4, "w0")), ok(4, **ROUTER)),
            # The hello began afresh: s1 was never part of this sync.
            (
                Send("a", sync(5, "s2")),
                ok(5, accepted=1, refused=[]),
                {C("ep1"): "ended w0", C("s2"): "held w0"},
            ),
            (Send("a", sync(6, "s3", more=True)), ok(6, accepted=0, refused=[], more=True)),
            (
                Send("a", {"op": "bye", "id": 7}),
                ok(7),
                {W("w0"): "exited", C("s2"): "exited w0", R("w0"): 1},
            ),
            (Send("a", hello(8, "w0")), ok(8, **ROUTER), {W("w0"): "live g1 @a"}),
            (Send("a", sync(9, "s4")), ok(9, accepted=1, refused=[]), {C("s4"): "held w0"}),
            (Route("s1"), Ans("unknown_episode", "s1")),
            (Route("s3"), Ans("unknown_episode", "s3")),
        ]
    )


@pytest.mark.parametrize(
    "message",
    [
        {"op": "sync", "id": 3},
        {"op": "sync", "id": 3, "claims": {"key": "ep1"}},
        {"op": "sync", "id": 3, "claims": "ep1"},
        {"op": "sync", "id": 3, "claims": [], "more": "yes"},
        {"op": "sync", "id": 3, "claims": [], "more": 1},
    ],
)
def test_malformed_syncs_are_bad_request_and_change_nothing(message: dict[str, Any]) -> None:
    with_w0().run(
        [
            (Send("a", message), err(3, "bad_request")),
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
        ]
    )


def test_an_expected_workers_sync_ends_recovery() -> None:
    Playbook(SETTINGS).run(
        [
            (Expect("w0"), None),
            (Send("a", hello(1, "w0")), ok(1, **ROUTER), {W("w0"): "live @a"}),
            (Send("a", claim(2, "ep1")), ok(2), {C("ep1"): "held w0"}),
            (Route("ep9"), Ans("recovering", "ep9", 30.0)),
            (Send("a", sync(3, "ep1", more=True)), ok(3, accepted=0, refused=[], more=True)),
            (Route("ep9"), Ans("recovering", "ep9", 30.0)),
            (Send("a", sync(4)), ok(4, accepted=1, refused=[])),
            (Route("ep9"), Ans("unknown_episode", "ep9")),
        ]
    )


# -- drain, bye, leases --------------------------------------------------------------


def test_drain_stops_new_sessions_but_not_held_ones() -> None:
    with_w0_and_w1().run(
        [
            (Send("a", {"op": "drain", "id": 3}), ok(3), {W("w0"): "live draining @a"}),
            (Route(None, None), Fwd("w1", None, "b0")),
            (Balance(frozenset({"w1"})), Ans("no_worker", None, 1.0)),
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
            (Send("a", claim(4, "ep3")), ok(4), {C("ep3"): "held w0"}),
            (Send("a", {"op": "drain", "id": 5, "on": "no"}), err(5, "bad_request")),
            (Send("a", {"op": "drain", "id": 6, "on": 0}), err(6, "bad_request")),
            (Send("a", {"op": "drain", "id": 7, "on": False}), ok(7), {W("w0"): "live @a"}),
            (Balance(frozenset({"w1"})), Fwd("w0", None, "b0")),
        ]
    )


def test_bye_retires_at_once_without_grace() -> None:
    with_w0().run(
        [
            (
                Send("a", {"op": "bye", "id": 3}),
                ok(3),
                EXITED_W0,
            ),
            (Route("ep1"), Ans("worker_exited", "ep1")),
            (Send("a", {"op": "ping", "id": 4}), err(4, "no_hello")),
            (Send("a", {"op": "bye", "id": 5}), err(5, "no_hello")),
            (Close("a"), None),
            At(60.0),
            (Tick(), Ticked()),
        ]
    )


def test_a_closed_lease_is_lost_then_exits_when_the_grace_ends() -> None:
    with_w0().run(
        [
            At(1.0),
            (Close("a"), "w0", {W("w0"): "lost"}),
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
            (Close("a"), None),
            At(5.999),
            (Tick(), Ticked()),
            At(6.0),
            (
                Tick(),
                Ticked(exited=("w0",)),
                EXITED_W0,
            ),
            (Route("ep1"), Ans("worker_exited", "ep1")),
        ]
    )


def test_a_same_boot_hello_within_the_grace_restores_the_claims() -> None:
    with_w0().run(
        [
            At(1.0),
            (Close("a"), "w0", {W("w0"): "lost"}),
            At(5.0),
            (Send("b", hello(1, "w0")), ok(1, **ROUTER), {W("w0"): "live @b"}),
            (Send("b", claim(2, "ep1")), ok(2)),
            (Send("b", sync(3, "ep1")), ok(3, accepted=1, refused=[])),
            At(19.0),  # long past the grace, not yet silent
            (Tick(), Ticked()),
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
        ]
    )


def test_a_new_boot_hello_retires_the_old_claims() -> None:
    with_w0().run(
        [
            At(1.0),
            (Close("a"), "w0", {W("w0"): "lost"}),
            (
                Send("b", hello(1, "w0", boot="b1")),
                ok(1, **ROUTER),
                {W("w0"): "live g1 boot=b1 @b", C("ep1"): "exited w0", R("w0"): 1},
            ),
            (
                Send("b", sync(2, "ep1")),
                ok(
                    2,
                    accepted=0,
                    refused=[{"kind": "episode", "key": "ep1", "error": "worker_exited"}],
                ),
            ),
            (Route("ep1"), Ans("worker_exited", "ep1")),
        ]
    )


def test_a_hello_after_the_worker_exited_starts_a_new_generation() -> None:
    with_w0().run(
        [
            (Close("a"), "w0", {W("w0"): "lost"}),
            At(10.0),
            (
                Tick(),
                Ticked(exited=("w0",)),
                EXITED_W0,
            ),
            (Send("b", hello(1, "w0")), ok(1, **ROUTER), {W("w0"): "live g1 @b"}),
            (Send("b", claim(2, "ep1")), err(2, "worker_exited")),
        ]
    )


def test_a_second_connection_takes_over_a_same_boot_lease() -> None:
    with_w0().run(
        [
            (Send("b", hello(1, "w0")), ok(1, **ROUTER), {W("w0"): "live @b"}),
            (Send("a", claim(3, "ep2")), err(3, "no_hello")),
            (Send("a", {"op": "bye", "id": 4}), err(4, "no_hello")),
            (Close("a"), None),  # the old connection's close loses nothing
            At(14.0),  # long past the grace, not yet silent
            (Tick(), Ticked()),
            (Send("b", claim(2, "ep2")), ok(2), {C("ep2"): "held w0"}),
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
            (Close("b"), "w0", {W("w0"): "lost"}),
        ]
    )


def test_any_request_keeps_the_lease_from_going_silent() -> None:
    with_w0().run(
        [
            At(10.0),
            (Send("a", {"op": "ping", "id": 3}), ok(3)),
            At(24.999),
            (Tick(), Ticked()),
            At(25.0),
            (Tick(), Ticked(lost=("w0",)), {W("w0"): "lost @a"}),
            # The I/O layer closes the silent connection: the worker stays lost.
            (Close("a"), None, {W("w0"): "lost"}),
            At(30.0),
            (
                Tick(),
                Ticked(exited=("w0",)),
                EXITED_W0,
            ),
        ]
    )


def test_a_rejected_hello_leaves_no_trace() -> None:
    steps: list[Step] = [
        (Send("a", hello(1, "w0", v=2)), err(1, "unsupported_version")),
        (Send("a", hello(2, "w0", url="http://10.1.1.1:80")), err(2, "forbidden")),
        (Send("a", claim(3, "ep1")), err(3, "no_hello")),
        (Route(None, None), Ans("no_worker", None, 1.0)),
    ]
    book().run(steps)


# -- the claim/release fast path -----------------------------------------------------
#
# `ControlSession.answer_claim_or_release` must answer exactly as the general path
# (decode_line, handle, encode) would, or decline having changed nothing. Each test
# drives two cores through the same lines: one the way the server does (fast path
# first), one through the general path only, and compares every reply and the whole
# state after it.


class _Side:
    """One core and four control connections on it, a to d."""

    def __init__(self) -> None:
        self.core = RouterCore(replace(SETTINGS, recovery_window_s=0.0), 0.0)
        self.core.tick(0.0)
        self.sessions = {
            conn: ControlSession(self.core, policy(), Peer(uid=None, tcp=False))
            for conn in ("a", "b", "c", "d")
        }

    def general(self, conn: str, line: bytes, now: float) -> bytes:
        request = decode_line(line)
        reply = request if "ok" in request else self.sessions[conn].handle(request, now)
        return encode_line(reply)

    def state(self) -> tuple[object, ...]:
        claims = [*self.core.claims.held(), *self.core.claims.tombstones()]
        return (
            sorted((c.kind, c.key, c.state.value, c.worker, c.since, c.last_used) for c in claims),
            sorted((w.id, w.state.value, w.last_heard) for w in self.core.workers),
            self.core.conflicts,
        )


class Twins:
    """Two cores in the same state, answered the server's way and the general way.

    w0 said hello on a and holds ep1, ended ep4; w1 said hello on b and holds ep2;
    w2 claimed ep3 on c, then said bye; nobody said hello on d yet.
    """

    def __init__(self) -> None:
        self.served, self.reference = _Side(), _Side()
        setup = [
            ("a", hello(1, "w0")),
            ("b", hello(1, "w1")),
            ("c", hello(1, "w2")),
            ("a", claim(2, "ep1")),
            ("b", claim(2, "ep2")),
            ("c", claim(2, "ep3")),
            ("c", {"op": "bye", "id": 3}),
            ("a", release(3, "ep4")),
        ]
        for conn, message in setup:
            line = json.dumps(message).encode()
            for side in (self.served, self.reference):
                assert json.loads(side.general(conn, line, 0.5))["ok"] is True

    def send(self, conn: str, line: bytes, now: float = 1.0) -> tuple[str, str, bytes] | None:
        """Both answers must be the same bytes, and both states alike after them.
        Returns what the fast path gave (None: it declined)."""
        fast = self.served.sessions[conn].answer_claim_or_release(line, now)
        served = fast[2] if fast is not None else self.served.general(conn, line, now)
        reference = self.reference.general(conn, line, now)
        assert served == reference, line
        assert self.served.state() == self.reference.state(), line
        if fast is not None:
            reply = json.loads(reference)
            assert fast[:2] == (json.loads(line)["op"], "ok" if reply["ok"] else reply["error"])
        return fast

    def close(self, conn: str, now: float = 1.0) -> None:
        for side in (self.served, self.reference):
            side.sessions[conn].closed(now)

    def retire(self, worker_id: str, now: float = 1.0) -> None:
        for side in (self.served, self.reference):
            worker = side.core.workers.get(worker_id)
            assert worker is not None
            side.core.retire(worker, now)


@pytest.mark.parametrize(
    "line",
    [
        b'{"op":"claim","id":7,"key":"ep9-a0"}',  # design §3's order, the default kind
        b'{"op":"claim","id":7,"key":"ep9-a0","kind":"open"}',
        b'{"op":"release","id":7,"key":"ep9-a0","kind":"episode"}',
        b'{"op":"claim","key":"ep9-a0","kind":"episode","id":7}',  # router.client's order
        b'{"op":"release","key":"ep9-a0","kind":"open","id":7}',
        b'{"op":"claim","id":0,"key":"k"}',
        b'{"op":"claim","id":-42,"key":"k"}',
        b'{"op":"claim","id":999999999999999999,"key":"k"}',
        b'{"op":"claim","id":"","key":"k"}',
        b'{"op":"claim","id":"req/7 #a~","key":"k"}',
        b'{"op":"claim","id":7,"key":" !#$%&()*+,-./09:;<=>?@AZ[]^_`az{|}~"}',
        b'{"op":"claim","id":7,"key":"' + b"k" * MAX_KEY_CHARS + b'"}',
    ],
)
def test_the_usual_claim_and_release_lines_take_the_fast_path(line: bytes) -> None:
    assert Twins().send("a", line) is not None


@pytest.mark.parametrize(
    "line",
    [
        b'{"op": "claim", "id": 7, "key": "ep9-a0"}',  # spaces
        b' {"op":"claim","id":7,"key":"ep9-a0"}',
        b'{"op":"claim","id":7,"key":"ep9-a0"}\r',
        b'{"op":"claim","key":"ep9-a0","id":7}',  # another order
        b'{"id":7,"op":"claim","key":"ep9-a0"}',
        b'{"op":"claim","id":7,"key":"ep9-a0","kind":"episode","x":1}',  # one field more
        b'{"op":"claim","id":7,"key":"ep9-a0","ok":true}',
        b'{"op":"claim","key":"ep9-a0"}',  # no id
        b'{"op":"claim","id":null,"key":"ep9-a0"}',
        b'{"op":"claim","id":true,"key":"ep9-a0"}',
        b'{"op":"claim","id":07,"key":"ep9-a0"}',  # not JSON
        b'{"op":"claim","id":-0,"key":"ep9-a0"}',  # echoed as 0
        b'{"op":"claim","id":7.0,"key":"ep9-a0"}',
        b'{"op":"claim","id":1e3,"key":"ep9-a0"}',
        b'{"op":"claim","id":1234567890123456789,"key":"ep9-a0"}',
        b'{"op":"claim","id":"a\\"b","key":"ep9-a0"}',  # escapes
        b'{"op":"claim","id":"\\u0041","key":"ep9-a0"}',
        b'{"op":"claim","id":"\xc3\xa9","key":"ep9-a0"}',  # not ASCII
        b'{"op":"claim","id":"\x7f","key":"ep9-a0"}',  # json.dumps escapes DEL
        b'{"op":"claim","id":7,"key":"ep9\\u002da0"}',
        b'{"op":"claim","id":7,"key":"\xc3\xa9"}',
        b'{"op":"claim","id":7,"key":"\t"}',
        b'{"op":"claim","id":7,"key":""}',
        b'{"op":"claim","id":7,"key":"' + b"k" * (MAX_KEY_CHARS + 1) + b'"}',
        b'{"op":"claim","id":7,"key":"ep9-a0","kind":"nope"}',
        b'{"op":"claim","id":7,"key":"ep9-a0","kind":""}',
        b'{"op":"claim","id":7,"key":"ep9-a0","kind":"episod\\u0065"}',
        b'{"op":"claim","id":7,"key":"ep9-a0","kind":null}',
        b'{"op":"claim","key":"ep9-a0","kind":"nope","id":7}',
        b'{"op":"Claim","id":7,"key":"ep9-a0"}',
        b'{"op":"ping","id":7}',
        b'{"op":"claim","id":7,"key":"ep9-a0"}{"op":"claim","id":8,"key":"x"}',
        b'{"op":"claim","id":7,"key":ep9}',
    ],
)
def test_other_lines_are_left_to_the_general_path(line: bytes) -> None:
    assert Twins().send("a", line) is None


def test_refusals_on_the_fast_path_are_the_general_paths() -> None:
    twins = Twins()
    results = [
        twins.send(conn, line)
        for conn, line in [
            ("b", b'{"op":"claim","id":4,"key":"ep1"}'),
            ("b", b'{"op":"release","key":"ep1","kind":"episode","id":"r"}'),
            ("a", b'{"op":"claim","id":5,"key":"ep4"}'),
            ("a", b'{"op":"claim","id":6,"key":"ep3"}'),
            ("a", b'{"op":"release","id":7,"key":"ep3"}'),
            ("a", b'{"op":"release","id":8,"key":"never"}'),
            ("a", b'{"op":"claim","id":9,"key":"ep1"}'),
        ]
    ]
    assert [r[:2] if r is not None else None for r in results] == [
        ("claim", "conflict"),
        ("release", "not_holder"),
        ("claim", "ended"),
        ("claim", "worker_exited"),
        ("release", "ok"),
        ("release", "ok"),
        ("claim", "ok"),
    ]
    assert twins.served.core.conflicts == 1


def test_without_a_live_lease_the_fast_path_declines() -> None:
    twins = Twins()
    line = b'{"op":"claim","id":4,"key":"ep9"}'
    assert twins.send("d", line) is None  # never said hello: no_hello
    assert twins.send("c", line) is None  # said bye
    twins.close("a")
    assert twins.send("a", line) is None  # the connection closed: its lease is gone


def test_a_lease_taken_over_or_a_retired_worker_declines_the_fast_path() -> None:
    twins = Twins()
    line = b'{"op":"claim","id":4,"key":"ep9"}'
    assert twins.send("d", json.dumps(hello(4, "w0")).encode()) is None  # same boot: d takes over
    assert twins.send("a", line) is None  # no_hello: a no longer holds the lease
    assert twins.send("d", line) is not None
    twins.retire("w1")  # e.g. its spawned process exited; the connection is still open
    assert twins.send("b", line) is None


_PLAIN_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=8)
_ID_SLOT = "\x00id\x00"  # stands for the id, then swapped for a raw JSON token
_RAW_IDS = [b"-0", b"00", b"07", b"1.0", b"1e3", b"-", b'"\x7f"', b'"\\u0041"', b'"a\\"b"']


@st.composite
def near_fast_lines(draw: st.DrawFn) -> bytes:
    """Claim and release lines in and around the shapes the fast path takes."""
    fields: dict[str, Any] = {"op": draw(st.sampled_from(["claim", "release", "ping", "Claim"]))}
    raw_id = draw(st.none() | st.sampled_from(_RAW_IDS))
    request_id = (
        _ID_SLOT
        if raw_id is not None
        else draw(st.integers(-(2**70), 2**70) | _PLAIN_TEXT | st.text(max_size=4) | st.none())
    )
    key = draw(st.sampled_from(["ep1", "ep2", "ep3", "ep4", "new"]) | _PLAIN_TEXT | st.text())
    kind = draw(st.sampled_from([None, "episode", "open", "nope", ""]))
    if draw(st.booleans()):
        fields.update(id=request_id, key=key)
        if kind is not None:
            fields["kind"] = kind
    else:
        fields.update(key=key, kind=kind or "episode", id=request_id)
    compact = draw(st.booleans())
    line = json.dumps(
        fields,
        ensure_ascii=draw(st.booleans()),
        separators=(",", ":") if compact else None,
    ).encode()
    if raw_id is not None:
        line = line.replace(json.dumps(_ID_SLOT).encode(), raw_id)
    if draw(st.integers(0, 3)) == 0:  # now and then, one byte changed or lost
        at = draw(st.integers(0, len(line) - 1))
        line = line[:at] + draw(st.binary(max_size=1)) + line[at + 1 :]
    return line


# Besides lines: d takes over w0's lease (same boot), w1 is retired, a closes.
_EVENTS = st.sampled_from(["takeover", "retire", "close"])


@settings(max_examples=300, deadline=None, database=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), near_fast_lines() | _EVENTS), max_size=20))
def test_the_fast_path_answers_any_line_as_the_general_path_does(
    script: list[tuple[str, bytes | str]],
) -> None:
    twins = Twins()
    for step, (conn, line) in enumerate(script):
        now = 1.0 + step
        if line == "takeover":
            twins.send("d", json.dumps(hello(step, "w0")).encode(), now)
        elif line == "retire":
            twins.retire("w1", now)
        elif line == "close":
            twins.close("a", now)
        elif isinstance(line, bytes) and line.strip():
            twins.send(conn, line, now)


def test_ipv4_and_ipv6_loopback_on_one_port_are_two_workers_and_localhost_clashes_with_both() -> (
    None
):
    v4, v6 = "http://127.0.0.1:9001", "http://[::1]:9001"
    book().run(
        [
            (Send("a", hello(1, "w0", url=v4)), ok(1, **ROUTER), {W("w0"): "live @a"}),
            (Send("b", hello(2, "w1", url=v6)), ok(2, **ROUTER), {W("w1"): "live @b"}),
            (Send("c", hello(3, "w2", url="http://localhost:9001")), err(3, "worker_busy")),
        ]
    )
