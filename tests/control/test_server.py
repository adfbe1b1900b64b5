"""The control socket's I/O (design §3) on a real Unix socket under tmp_path and on loopback TCP.

Each test runs a `ControlServer` over its own `RouterCore` and `ControlPolicy`,
so who may say hello can be changed freely, and talks to it with `RawLease`
or with bare stream sockets where the framing is the point.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from router.control.server import ControlServer, ControlSocketInUse
from router.control.session import ControlPolicy
from router.core.machine import CoreSettings, RouterCore
from router.core.workers import Worker
from router.metrics.registry import RouterMetrics
from router.service.journal import JournalFile
from tests.router_fixtures import MiB, RawLease, wait_until

pytestmark = pytest.mark.timeout(30)

URL = "http://127.0.0.1:9001"
SECRET = "s3cret-s3cret-s3cret"


def _policy(
    *,
    own_uid: int | None = None,
    allowed_uids: frozenset[int] = frozenset(),
    secret: str | None = None,
) -> ControlPolicy:
    return ControlPolicy(
        own_uid=os.getuid() if own_uid is None else own_uid,
        allowed_uids=allowed_uids,
        allowed_upstreams=frozenset(),
        secret=secret,
        router_boot="router-boot-1",
    )


@dataclass
class Served:
    core: RouterCore
    server: ControlServer
    address: str
    lost: list[Worker] = field(default_factory=list)


@asynccontextmanager
async def served(
    address: str,
    policy: ControlPolicy | None = None,
    *,
    core: RouterCore | None = None,
    metrics: RouterMetrics | None = None,
) -> AsyncIterator[Served]:
    """A control server for `core` (a fresh one by default) on `address`
    (`tcp://…:0` picks a port)."""
    if core is None:
        core = RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic())
    lost: list[Worker] = []
    server = ControlServer(core, policy or _policy(), on_lease_lost=lost.append, metrics=metrics)
    await server.start(address)
    if address.startswith("tcp://"):
        address = f"tcp://127.0.0.1:{server.tcp_port}"
    try:
        yield Served(core, server, address, lost)
    finally:
        await server.close()


def _no_connections(control: Served) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return control.server.connection_count == 0

    return check


def _connections(control: Served, count: int) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return control.server.connection_count == count

    return check


def _unix(tmp_path: Path) -> str:
    return f"unix:{tmp_path}/control.sock"


async def _hello(lease: RawLease, worker: str = "w0", **fields: object) -> dict[str, object]:
    return await lease.hello(worker, URL, "boot-1", **fields)


# --- the socket file ----------------------------------------------------------------------


async def test_the_socket_is_mode_0660_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        async with served(_unix(tmp_path)):
            mode = os.stat(tmp_path / "control.sock").st_mode
    finally:
        os.umask(old)
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o660


async def test_a_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # a router that died: the file stays, nothing listens
    assert stat.S_ISSOCK(os.stat(path).st_mode)

    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        lease.abort()


async def test_a_live_socket_is_never_stolen(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as first:
        second = ControlServer(
            RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic()),
            _policy(),
            on_lease_lost=lambda worker: None,
        )
        with pytest.raises(ControlSocketInUse):
            await second.start(first.address)

        lease = await RawLease.open(first.address)  # the first one still serves
        assert (await _hello(lease))["ok"] is True
        lease.abort()


async def test_closing_a_server_whose_start_failed_leaves_the_live_socket_alone(
    tmp_path: Path,
) -> None:
    async with served(_unix(tmp_path)) as first:
        second = ControlServer(
            RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic()),
            _policy(),
            on_lease_lost=lambda worker: None,
        )
        with pytest.raises(ControlSocketInUse):
            await second.start(first.address)
        await second.close()  # e.g. a caller's `finally: await service.stop()`

        assert (tmp_path / "control.sock").exists()


async def test_a_regular_file_at_the_path_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "control.sock"
    path.write_text("not a socket")
    server = ControlServer(
        RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic()),
        _policy(),
        on_lease_lost=lambda worker: None,
    )
    with pytest.raises(ControlSocketInUse):
        await server.start(_unix(tmp_path))
    assert path.read_text() == "not a socket"


async def test_close_removes_the_socket_file_and_ends_every_connection(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        await control.server.close()
        assert not (tmp_path / "control.sock").exists()
        assert await lease.closed_by_peer()
        assert control.lost == []  # shutting down is not a lost lease
        assert control.server.connection_count == 0


# --- lines --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "echoed_id"),
    [
        (b"not json\n", None),
        (b"[1, 2]\n", None),
        (b'{"op": "ping", "id": true}\n', None),
        (b'{"op": "ping", "id": 1.5}\n', None),
        (b'{"op": 5, "id": 3}\n', 3),
        (b'{"id": "x"}\n', "x"),
        (b'{"op": "ping", "id": 4, "ok": true}\n', 4),
        (b'\xff\xfe{"op": "ping"}\n', None),
    ],
)
async def test_a_malformed_line_is_bad_request_and_the_connection_stays(
    tmp_path: Path, line: bytes, echoed_id: object
) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        lease.writer.write(line)
        reply = await lease.read_reply()
        assert set(reply) == {"id", "ok", "error", "detail"}
        assert (reply["id"], reply["ok"], reply["error"]) == (echoed_id, False, "bad_request")
        assert (await _hello(lease))["ok"] is True
        lease.abort()


async def test_an_unknown_op_is_unknown_op_and_the_connection_stays(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        reply = await lease.call("dance")
        assert (reply["ok"], reply["error"]) == (False, "unknown_op")
        assert isinstance(reply["detail"], str)
        assert (await _hello(lease))["ok"] is True
        lease.abort()


async def test_ids_are_echoed_whatever_their_type(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        for request_id in ("abc", 0, -7, 2**62, "", None):
            lease.send_line({"op": "ping", "id": request_id})
            reply = await lease.read_reply()
            assert reply["id"] == request_id
            assert reply["error"] == "no_hello"  # nothing but hello before a hello
        lease.send_line({"op": "hello", "v": 1, "worker": "w0", "url": URL, "boot": "b"})
        assert await lease.read_reply() == {"id": None, "ok": True, "router": "router-boot-1"}
        lease.abort()


async def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        lease.writer.write(b"\n  \n\r\n")
        assert (await lease.call("ping"))["error"] == "no_hello"  # the first reply is this
        lease.abort()


async def test_a_thousand_pipelined_claims_are_answered_in_order(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        lines = (
            json.dumps({"op": "claim", "id": i, "key": f"ep{i}-a0"}) + "\n" for i in range(1000)
        )
        lease.writer.write("".join(lines).encode())

        replies = [await lease.read_reply() for _ in range(1000)]

        assert replies == [{"id": i, "ok": True} for i in range(1000)]
        assert control.core.claims.held_count("w0") == 1000
        lease.abort()


async def test_pipelined_lines_of_every_shape_are_answered_in_order(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        lines = [
            b'{"op":"claim","id":2,"key":"ep1"}',  # the fast path, in design §3's order
            b'{"op":"claim","key":"ep2","kind":"episode","id":"c"}',  # in router.client's
            b'{"op": "claim", "id": 4, "key": "ep3"}',  # the general path
            b"",
            b"not json",
            b'{"op":"release","id":5,"key":"ep1"}',
            b'{"op":"claim","id":6,"key":"ep1"}',
            b'{"op":"ping","id":7}',
            b'{"op":"claim","id":8,"key":"ep9","kind":"nope"}',
            b'{"op":"release","key":"ep2","kind":"episode","id":9}',
        ]
        lease.writer.write(b"\n".join(lines) + b"\n")

        replies = [await lease.read_reply() for _ in range(len(lines) - 1)]

        assert [(r["id"], r["ok"], r.get("error")) for r in replies] == [
            (2, True, None),
            ("c", True, None),
            (4, True, None),
            (None, False, "bad_request"),
            (5, True, None),
            (6, False, "ended"),
            (7, True, None),
            (8, False, "unknown_kind"),
            (9, True, None),
        ]
        assert {c.key for c in control.core.claims.held()} == {"ep3"}
        lease.abort()


def _claims_and_releases(pairs: int) -> bytes:
    return b"".join(
        b'{"op":"claim","id":%d,"key":"ep%d"}\n{"op":"release","id":%d,"key":"ep%d"}\n'
        % (2 * i + 2, i, 2 * i + 3, i)
        for i in range(pairs)
    )


async def test_pipelined_claims_are_journaled_by_the_time_they_are_answered(
    tmp_path: Path,
) -> None:
    core = RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic())
    journal = JournalFile(str(tmp_path / "state.journal"), clock=time.time)
    journal.compact(core, time.monotonic())
    core.journal = journal
    async with served(_unix(tmp_path), core=core) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        lease.writer.write(_claims_and_releases(500))

        replies = [await lease.read_reply() for _ in range(1000)]

        assert all(reply["ok"] for reply in replies)
        records = [json.loads(line) for line in (tmp_path / "state.journal").read_bytes().split()]
        changes = [(r["op"], r["key"]) for r in records if r["op"] in ("claim", "release")]
        assert changes == [(op, f"ep{i}") for i in range(500) for op in ("claim", "release")]
        lease.abort()
    journal.close()


class HoldingJournal:
    """A journal sink that records each change and whether it came while held."""

    def __init__(self) -> None:
        self.held = False
        self.changes: list[tuple[str, bool]] = []
        self.flushes = 0

    def hold(self) -> None:
        self.held = True

    def flush(self) -> None:
        self.held = False
        self.flushes += 1

    def _change(self, what: str) -> None:
        self.changes.append((what, self.held))

    def worker(self, worker: Worker) -> None:
        self._change("worker")

    def drain(self, worker: Worker) -> None:
        self._change("drain")

    def claim(self, kind: str, key: str, worker: str) -> None:
        self._change("claim")

    def learn(self, kind: str, key: str, worker: str) -> None:
        self._change("learn")

    def release(self, kind: str, key: str, worker: str) -> None:
        self._change("release")

    def sync(self, worker: str, claims: Iterable[tuple[str, str]]) -> None:
        self._change("sync")

    def link(self, claims: list[tuple[str, str]]) -> None:
        self._change("link")

    def exited(self, worker: str) -> None:
        self._change("exited")


async def test_every_change_a_read_makes_is_held_for_one_journal_write(tmp_path: Path) -> None:
    core = RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic())
    journal = HoldingJournal()
    core.journal = journal
    async with served(_unix(tmp_path), core=core) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        lease.writer.write(_claims_and_releases(500))
        assert [(await lease.read_reply())["ok"] for _ in range(1000)] == [True] * 1000
        lease.abort()

    assert journal.changes == [("worker", True)] + [("claim", True), ("release", True)] * 500
    assert not journal.held
    assert 2 <= journal.flushes <= 1 + 1000  # one per read: the hello's, then at least one


async def test_the_fast_path_counts_its_requests_in_the_metrics(tmp_path: Path) -> None:
    metrics = RouterMetrics(
        claims_by_worker_kind=dict,
        tombstones=lambda: 0,
        workers=list,
        control_connections=lambda: 0,
        recovery_remaining=lambda: None,
    )
    async with served(_unix(tmp_path), metrics=metrics) as control:
        first, second = await RawLease.open(control.address), await RawLease.open(control.address)
        assert (await _hello(first))["ok"] is True
        assert (await second.hello("w1", "http://127.0.0.1:9002", "boot-2"))["ok"] is True
        first.writer.write(_claims_and_releases(3))
        assert [(await first.read_reply())["ok"] for _ in range(6)] == [True] * 6
        first.writer.write(b'{"op":"claim","id":9,"key":"ep9"}\n')
        assert (await first.read_reply())["ok"] is True
        second.writer.write(b'{"op":"claim","id":2,"key":"ep9"}\n')
        assert (await second.read_reply())["error"] == "conflict"
        first.abort()
        second.abort()

    def count(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(f"episode_router_{name}_total", labels)

    assert count("control_ops", op="claim", result="ok") == 4
    assert count("control_ops", op="release", result="ok") == 3
    assert count("control_ops", op="claim", result="conflict") == 1
    assert count("claim_conflicts") == 1


def _padded_ping(total: int) -> bytes:
    """A ping line of exactly `total` bytes, its newline included."""
    empty = b'{"op":"ping","id":1,"pad":""}\n'
    line = empty[:-3] + b"x" * (total - len(empty)) + empty[-3:]
    assert len(line) == total
    return line


async def test_a_line_of_1_mib_is_read(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        lease.writer.write(_padded_ping(MiB))
        assert await lease.read_reply() == {"id": 1, "ok": True}
        lease.abort()


async def _send_ignoring_reset(lease: RawLease, data: bytes) -> None:
    try:
        lease.writer.write(data)
        await lease.writer.drain()
    except ConnectionError:
        pass  # the router closed the connection while we were still writing


async def test_a_line_over_1_mib_closes_the_connection(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        await _send_ignoring_reset(lease, _padded_ping(MiB + 4096))

        assert await lease.closed_by_peer()
        assert control.server.connection_count == 0
        assert [w.id for w in control.lost] == ["w0"]  # its lease went with it


async def test_a_line_one_byte_over_1_mib_closes_the_connection(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        await _send_ignoring_reset(lease, _padded_ping(MiB + 1))
        assert await lease.closed_by_peer(timeout_s=1.0)


async def test_the_router_stops_reading_a_peer_that_does_not_read_its_replies(
    tmp_path: Path,
) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        pad = "x" * 10_000  # ids are echoed: each reply is about as long as its request
        batch = b"".join(b'{"op":"ping","id":"%d%s"}\n' % (i, pad.encode()) for i in range(10))
        sent = 0
        for _ in range(2000):  # bounded: at most 200 MB
            lease.writer.write(batch)
            sent += 10
            try:
                await asyncio.wait_for(lease.writer.drain(), 0.3)
            except TimeoutError:
                break  # the router stopped reading: its unsent replies are over the bound
        else:
            pytest.fail("the router kept reading a peer that never read its replies")
        assert sent * len(pad) >= MiB  # it held at least 1 MiB of replies before stopping

        for i in range(sent):  # reading the replies lets it go on, in order, none lost
            reply = await lease.read_reply()
            assert (reply["id"], reply["error"]) == (f"{i % 10}{pad}", "no_hello")
        lease.abort()


def _unread_socket(address: str) -> socket.socket:
    """A Unix connection with a tiny receive buffer, for a peer that never reads."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MiB)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(address[len("unix:") :])
    sock.setblocking(False)
    return sock


async def _send_until_unread(sock: socket.socket, data: bytes) -> int:
    """Sends `data` until it is all sent or the router stops reading; returns the bytes sent."""
    sent, stuck_since = 0, None
    for _ in range(2000):  # bounded: a few seconds at most
        try:
            sent += sock.send(data[sent : sent + 65536])
            stuck_since = None
            await asyncio.sleep(0)  # the router reads as it would from a real peer
        except BlockingIOError:
            stuck_since = stuck_since or time.monotonic()
            if time.monotonic() - stuck_since > 0.3:
                break
            await asyncio.sleep(0.01)
        if sent >= len(data):
            break
    return sent


def _pings(count: int) -> bytes:
    return b"".join(b'{"op":"ping","id":%d}\n' % i for i in range(count))


async def test_unsent_replies_stay_within_the_bound_and_the_rest_waits_in_order(
    tmp_path: Path,
) -> None:
    async with served(_unix(tmp_path)) as control:
        sock = _unread_socket(control.address)
        lines = 100_000  # 2.2 MB of short lines, each answered with ~80 bytes
        data = _pings(lines)
        sent = await _send_until_unread(sock, data)
        await asyncio.sleep(0.2)  # the router answers what it has read, then stops
        (connection,) = control.server.connections
        assert connection.transport is not None
        held = connection.transport.get_write_buffer_size()
        assert 0 < held <= 1 * MiB + 200  # over the bound by one reply at most

        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=4 * MiB)
        writer.write(data[sent:])
        for i in range(lines):  # every line answered once, in order, none lost
            reply = json.loads(await asyncio.wait_for(reader.readline(), 5.0))
            assert (reply["id"], reply["error"]) == (i, "no_hello")
        writer.close()


async def test_a_connection_dropped_at_the_hello_deadline_is_aborted_if_its_peer_does_not_read(
    tmp_path: Path,
) -> None:
    async with served(_unix(tmp_path)) as control:
        control.server.hello_deadline_s = 0.3
        sock = _unread_socket(control.address)
        await wait_until(_connections(control, 1), "the connection to be accepted")
        await _send_until_unread(sock, _pings(100_000))
        started = time.monotonic()

        (connection,) = control.server.connections
        assert connection.transport is not None
        assert connection.transport.get_write_buffer_size() > 0  # replies it cannot send

        await wait_until(_no_connections(control), "the connection to be aborted")

        assert time.monotonic() - started < 0.3 + 1.0 + 1.0  # deadline + drain time + slack
        sock.close()


async def test_a_lease_closed_by_the_router_is_aborted_if_its_peer_does_not_read(
    tmp_path: Path,
) -> None:
    async with served(_unix(tmp_path)) as control:
        sock = _unread_socket(control.address)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        hello = {"op": "hello", "id": 0, "v": 1, "worker": "w0", "url": URL, "boot": "b"}
        writer.write(json.dumps(hello).encode() + b"\n")
        assert json.loads(await reader.readline())["ok"] is True
        transport = writer.transport
        transport.pause_reading()  # from now on this peer reads nothing
        await _send_until_unread(sock, _pings(100_000))
        await asyncio.sleep(0.2)  # the router answers what it has read, then stops
        worker = control.core.workers.get("w0")
        assert worker is not None
        (connection,) = control.server.connections
        assert connection.transport is not None
        assert connection.transport.get_write_buffer_size() > 0  # replies it cannot send

        control.server.close_lease(worker)  # what a silent lease or a retired worker gets

        await wait_until(_no_connections(control), "the connection to be aborted")
        assert [w.id for w in control.lost] == ["w0"]
        transport.abort()


# --- who may say hello ----------------------------------------------------------------------


async def test_a_peer_uid_that_is_not_allowed_is_forbidden(tmp_path: Path) -> None:
    other_uid = os.getuid() + 4242
    async with served(_unix(tmp_path), _policy(own_uid=other_uid)) as control:
        lease = await RawLease.open(control.address)
        reply = await _hello(lease)
        assert (reply["ok"], reply["error"]) == (False, "forbidden")
        assert (await lease.call("claim", key="k"))["error"] == "no_hello"
        assert len(control.core.workers) == 0
        lease.abort()


async def test_a_peer_uid_listed_in_allowed_uids_may_say_hello(tmp_path: Path) -> None:
    policy = _policy(own_uid=os.getuid() + 4242, allowed_uids=frozenset({os.getuid()}))
    async with served(_unix(tmp_path), policy) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        assert (await lease.call("claim", key="k"))["ok"] is True
        lease.abort()


async def test_tcp_control_needs_the_shared_secret(tmp_path: Path) -> None:
    async with served("tcp://127.0.0.1:0", _policy(secret=SECRET)) as control:
        assert control.server.tcp_port
        for auth in (None, "wrong", SECRET.upper(), 7):
            lease = await RawLease.open(control.address)
            reply = await (_hello(lease) if auth is None else _hello(lease, auth=auth))
            assert (reply["ok"], reply["error"]) == (False, "forbidden"), auth
            lease.abort()
        lease = await RawLease.open(control.address)
        assert (await _hello(lease, auth=SECRET)) == {
            "id": 1,
            "ok": True,
            "router": "router-boot-1",
        }
        assert (await lease.call("claim", key="ep-a0"))["ok"] is True
        assert control.core.claims.held_count("w0") == 1
        lease.abort()


async def test_tcp_control_without_a_configured_secret_forbids_everyone(tmp_path: Path) -> None:
    async with served("tcp://127.0.0.1:0") as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease, auth=""))["error"] == "forbidden"
        lease.abort()


# --- leases ---------------------------------------------------------------------------------


async def test_a_lease_closed_without_bye_is_reported_lost(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        idle = await RawLease.open(control.address)  # no hello: no lease to lose
        idle.abort()
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        lease.abort()

        await wait_until(_no_connections(control), "the connection to end")
        assert [(w.id, w.state.value) for w in control.lost] == [("w0", "lost")]


async def test_a_connection_whose_lease_another_took_over_is_closed(tmp_path: Path) -> None:
    # The worker reconnected (same boot) while its old connection still looked open: the
    # old one can do nothing more, and is closed rather than held for as long as its
    # peer stays silent. The lease is not lost: the new connection holds it.
    async with served(_unix(tmp_path)) as control:
        old = await RawLease.open(control.address)
        assert (await _hello(old))["ok"] is True
        new = await RawLease.open(control.address)
        assert (await _hello(new))["ok"] is True

        assert await old.closed_by_peer(timeout_s=5.0)
        await wait_until(_connections(control, 1), "the old connection to end")
        assert (await new.call("claim", key="ep-a0"))["ok"] is True
        assert control.lost == []
        new.abort()


async def test_bye_retires_the_worker_and_is_not_a_lost_lease(tmp_path: Path) -> None:
    async with served(_unix(tmp_path)) as control:
        lease = await RawLease.open(control.address)
        assert (await _hello(lease))["ok"] is True
        assert (await lease.call("claim", key="ep-a0"))["ok"] is True
        assert await lease.call("bye") == {"id": 3, "ok": True}
        worker = control.core.workers.get("w0")
        assert worker is not None and worker.state.value == "exited"
        assert (await lease.call("claim", key="ep-a1"))["error"] == "no_hello"
        lease.abort()

        await wait_until(_no_connections(control), "the connection to end")
        assert control.lost == []


async def test_a_connection_that_never_says_hello_is_closed_at_the_deadline(
    tmp_path: Path,
) -> None:
    core = RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic())
    policy = ControlPolicy(
        own_uid=os.getuid(),
        allowed_uids=frozenset(),
        allowed_upstreams=frozenset(),
        secret=None,
        router_boot="r1",
    )
    server = ControlServer(core, policy, on_lease_lost=lambda worker: None, hello_deadline_s=0.3)
    path = tmp_path / "c.sock"
    await server.start(f"unix:{path}")
    try:
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(b'{"op":"ping","id":1}\n')  # not a hello: it does not count
        started = time.monotonic()
        first = json.loads(await reader.readline())
        assert first["error"] == "no_hello"
        last = json.loads(await asyncio.wait_for(reader.readline(), 2.0))
        assert (last["error"], last["id"]) == ("no_hello", None)
        assert await reader.read() == b""
        assert 0.25 <= time.monotonic() - started < 2.0
        assert server.connection_count == 0
        writer.close()
    finally:
        await server.close()


async def test_a_connection_that_said_bye_must_say_hello_again_in_time(tmp_path: Path) -> None:
    # With no lease left, it is like a new connection: silent past the hello deadline,
    # it is closed rather than held for ever.
    core = RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic())
    server = ControlServer(core, _policy(), on_lease_lost=lambda worker: None, hello_deadline_s=0.3)
    await server.start(_unix(tmp_path))
    try:
        lease = await RawLease.open(_unix(tmp_path))
        assert (await _hello(lease))["ok"] is True
        await asyncio.sleep(0.5)  # past the deadline while it holds a lease: kept
        assert await lease.call("bye") == {"id": 2, "ok": True}
        started = time.monotonic()
        assert await lease.closed_by_peer(timeout_s=5.0)
        assert 0.25 <= time.monotonic() - started < 3.0
        lease.abort()
    finally:
        await server.close()
