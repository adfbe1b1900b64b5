"""RouterService: start and stop (SIGTERM semantics), and the lease rules it wires together
(design §3 "Leases, exits and in-flight requests"), on real sockets.

Leases are `RawLease`s, so each test decides exactly when a worker speaks, goes
silent or breaks off; the worker's HTTP side stays up unless the test closes it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import shlex
import signal
import socket
import stat
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from bench.launch import free_port
from router.config import AdminConfig, HealthConfig, ListenConfig, SpawnConfig, StateConfig
from router.service import journal as journal_module
from router.service import spawner as spawn_module
from router.service.router_service import RouterService
from tests.metrics.test_registry import scrape, series
from tests.router_fixtures import (
    BOOT_HEADER,
    EchoWorker,
    RawHttp,
    RawLease,
    Rig,
    open_rig,
    router_config,
    token,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


async def _refuses(port: int) -> bool:
    """True when nothing listens on `port` (a reset means it was closing: not yet)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False
    writer.close()
    return False


# --- start and stop -----------------------------------------------------------------------


async def test_start_opens_every_listener_and_stop_closes_them(rig: Rig, tmp_path: Path) -> None:
    router = await rig.start_router()
    socket_path = tmp_path / "c.sock"
    assert router.public_port > 0 and router.admin_port > 0
    assert router.public_port != router.admin_port
    assert stat.S_ISSOCK(os.stat(socket_path).st_mode)
    assert (await rig.admin("GET", "/healthz")).status == 200
    public, admin = router.public_port, router.admin_port

    await rig.stop_router()

    assert not socket_path.exists()
    assert await _refuses(public)
    assert await _refuses(admin)


@pytest.mark.parametrize(
    ("lease_s", "warned"), [(3.0, True), (5.0, True), (9.5, True), (10.0, False)]
)
async def test_a_lease_under_two_of_the_protocols_pings_is_warned_of_at_start(
    rig: Rig, tmp_path: Path, caplog: pytest.LogCaptureFixture, lease_s: float, warned: bool
) -> None:
    # Allowed (workers that ping more often, as tests do), but a worker pinging every
    # 5 s, as the protocol allows, would be taken as lost again and again.
    with caplog.at_level(logging.WARNING, logger="episode_router"):
        await rig.start_router(router_config(tmp_path, lease_timeout_s=lease_s))
    said = [r for r in caplog.records if "lease_timeout_s is under 10 s" in r.getMessage()]
    assert bool(said) is warned


async def test_stop_lets_an_in_flight_request_finish_and_refuses_new_connections(
    rig: Rig, tmp_path: Path
) -> None:
    router = await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    in_flight = asyncio.create_task(rig.request("POST", "/slow", episode=token("ep"), data=b"x"))

    async def parked() -> bool:
        return worker.parked == 1

    await wait_until(parked, "the slow request to reach the worker")
    stopping = asyncio.create_task(rig.stop_router())
    port = router.public_port

    async def refused() -> bool:
        return await _refuses(port)

    await wait_until(refused, "the public port to stop accepting")
    assert not stopping.done()  # it waits for the request in flight
    assert not in_flight.done()

    worker.release.set()
    reply = await asyncio.wait_for(in_flight, 5)
    await asyncio.wait_for(stopping, 5)

    assert reply.status == 200 and reply.worker == "w0"
    assert not (tmp_path / "c.sock").exists()


async def test_a_request_pipelined_during_shutdown_never_reaches_a_worker(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    conn = await RawHttp.open(router.public_port)
    ep = token("ep")
    request = f"POST /slow HTTP/1.1\r\nHost: x\r\nX-NeMo-Gym-Episode-Token: {ep}\r\n"
    try:
        conn.send((request + "Content-Length: 0\r\n\r\n").encode())

        async def parked() -> bool:
            return worker.parked == 1

        await wait_until(parked, "the slow request to reach the worker")
        stopping = asyncio.create_task(rig.stop_router())
        await asyncio.sleep(0)  # stop() has begun: the handler is shutting down
        conn.send(b"GET /late HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        worker.release.set()
        status, _, _ = await conn.read_reply()
        assert status == 200
        rest = await conn.read_to_end()
        await asyncio.wait_for(stopping, 5)
    finally:
        conn.close()
    # The connection ends after the reply in flight; the late request is never read.
    assert rest == b""
    assert worker.paths_seen() == ["/slow"]


async def test_a_restarted_router_answers_recovering_until_its_journaled_worker_syncs(
    rig: Rig, tmp_path: Path
) -> None:
    config = router_config(
        tmp_path, recovery_window_s=30.0, state=StateConfig(path=str(tmp_path / "journal"))
    )
    await rig.start_router(config)
    worker = await rig.add_worker("w0", lease="raw")
    await worker.claim("ep-a0")
    await worker.claim("done-a0")
    await worker.release_key("done-a0")
    await rig.stop_router()

    await rig.start_router(config)  # the worker has not reconnected yet

    (await rig.request("GET", "/", episode=token("unknown"))).assert_answer(
        503, "recovering", "unknown-a0"
    )
    (await rig.request("GET", "/", episode=token("done"))).assert_answer(
        410, "episode_ended", "done-a0"
    )
    view = (await rig.worker_views())["w0"]
    assert (view["state"], view["origin"], view["claims"]) == ("lost", "journal", 1)
    reply = await rig.request("GET", "/journaled", episode=token("ep"))
    assert reply.worker == "w0" and reply.seen_headers(BOOT_HEADER) == [worker.boot]

    lease = await RawLease.open(rig.control_address)
    worker.lease = lease
    assert (await lease.hello("w0", worker.url, worker.boot))["ok"] is True
    synced = await lease.call("sync", claims=[{"kind": "episode", "key": "ep-a0"}], more=False)
    assert (synced["accepted"], synced["refused"]) == (1, [])

    readiness = (await rig.admin("GET", "/readyz")).json()
    assert (readiness["recovering"], readiness["live_workers"]) == (False, 1)
    (await rig.request("GET", "/", episode=token("unknown"))).assert_answer(
        401, "unknown_episode", "unknown-a0"
    )
    assert (await rig.request("GET", "/", episode=token("ep"))).worker == "w0"


async def test_a_journaled_worker_that_never_comes_back_exits_when_recovery_ends(
    rig: Rig, tmp_path: Path
) -> None:
    config = router_config(
        tmp_path, recovery_window_s=0.5, state=StateConfig(path=str(tmp_path / "journal"))
    )
    await rig.start_router(config)
    worker = await rig.add_worker("w0", lease="raw")
    await worker.claim("ep-a0")
    await rig.stop_router()
    restarted_at = time.monotonic()
    await rig.start_router(config)

    await rig.wait_worker_state("w0", "exited")

    # The window, not a probe (its HTTP side still listens), retired it.
    assert time.monotonic() - restarted_at >= 0.5
    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )
    (await rig.request("GET", "/", episode=token("unknown"))).assert_answer(
        401, "unknown_episode", "unknown-a0"
    )


@pytest.mark.parametrize("same_socket", [True, False])
async def test_a_second_router_on_the_same_journal_is_refused_and_leaves_it_alone(
    rig: Rig, tmp_path: Path, same_socket: bool
) -> None:
    # On the same control socket it fails there; on another, the journal's lock stops it.
    journal = tmp_path / "journal"
    config = router_config(tmp_path, state=StateConfig(path=str(journal)))
    await rig.start_router(config)
    worker = await rig.add_worker("w0", lease="raw")
    await worker.claim("before-a0")
    inode = journal.stat().st_ino

    if same_socket:
        second, refusal = RouterService(config), "another process listens"
    else:
        other_socket = dataclasses.replace(config.control, socket=f"unix:{tmp_path}/other.sock")
        second = RouterService(dataclasses.replace(config, control=other_socket))
        refusal = "another router uses this journal"
    with pytest.raises(OSError, match=refusal):
        await second.start()
    await second.stop()
    await worker.claim("after-a0")  # the live router journals it, in the same file

    assert journal.stat().st_ino == inode
    assert b"before-a0" in journal.read_bytes() and b"after-a0" in journal.read_bytes()
    assert not (tmp_path / "other.sock").exists()


@pytest.mark.parametrize("taken", ["listen", "admin"])
async def test_a_start_that_fails_to_bind_stops_the_workers_it_spawned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken: str
) -> None:
    """Workers are spawned before the listeners bind: a taken port must not leave them
    running (they would be re-parented to init), nor the control socket file behind."""
    spawned: list[int] = []
    real_exec = asyncio.create_subprocess_exec

    async def recording_exec(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        process = await real_exec(*args, **kwargs)
        spawned.append(process.pid)
        return process

    monkeypatch.setattr(spawn_module.asyncio, "create_subprocess_exec", recording_exec)
    with socket.create_server(("127.0.0.1", 0)) as holder:  # listening: the port is taken
        port = holder.getsockname()[1]
        sleeper = f"{shlex.quote(sys.executable)} -c 'import time; time.sleep(60)' {{port}}"
        config = router_config(
            tmp_path,
            spawn=SpawnConfig(sleeper, count=1, base_port=free_port(), stop_timeout_s=2.0),
            **{taken: (ListenConfig if taken == "listen" else AdminConfig)("127.0.0.1", port)},
        )
        service = RouterService(config)
        try:
            with pytest.raises(OSError, match=f"^{taken} 127.0.0.1:{port}: Address already in use"):
                await service.start()
            [pid] = spawned
            assert not _running(pid), "a spawned worker outlived the failed start"
            assert not (tmp_path / "c.sock").exists()
            assert service.public_port == 0 or await _refuses(service.public_port)
        finally:
            for pid in spawned:
                if _running(pid):
                    os.killpg(pid, signal.SIGKILL)  # its own group: start_new_session


def _running(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not reaped yet) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            stat_line = stat_file.read()
    except FileNotFoundError:
        return False
    return stat_line[stat_line.rfind(")") + 2] not in "ZX"


async def test_a_compaction_that_fails_leaves_the_tick_running(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal_module, "COMPACT_MIN_LINES", 5)  # due after a few claims
    journal = tmp_path / "journal"
    service = await rig.start_router(
        router_config(tmp_path, reconnect_grace_s=0.5, state=StateConfig(path=str(journal)))
    )
    (tmp_path / "journal.tmp").mkdir()  # no snapshot can be written (as on a full disk)
    worker = await rig.add_worker("w0", lease="raw")
    await worker.claim("ep0-a0")
    assert worker.lease is not None
    for i in range(20):  # journal lines that hold nothing: the file is due for compaction
        assert (await worker.lease.call("drain", on=i % 2 == 0))["ok"] is True
    assert service.journal is not None
    errors = service.journal

    async def compaction_failed() -> bool:
        return errors.compact_errors >= 1

    await wait_until(compaction_failed, "a compaction to fail")
    worker.lease.abort()

    # Only the tick ends a grace (the worker still listens, so no probe retires it).
    await rig.wait_worker_state("w0", "exited")
    assert "tick" in {task.get_name() for task in service._tasks}
    assert errors.compact_errors == 1  # tried once, not on every tick since
    assert b'"op":"exited"' in journal.read_bytes()  # the old file is still appended to
    (await rig.request("GET", "/", episode=token("ep0"))).assert_answer(
        410, "worker_exited", "ep0-a0"
    )


async def test_an_unexpected_error_in_one_tick_does_not_stop_the_next(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = await rig.start_router(reconnect_grace_s=0.3)
    failures: list[int] = []

    def fails_once() -> None:
        if not failures:
            failures.append(1)
            raise RuntimeError("a bug")

    monkeypatch.setattr(service, "_maybe_compact_journal", fails_once)
    worker = await rig.add_worker("w0", lease="raw")
    await wait_until(_async(lambda: bool(failures)), "the failing tick")
    assert worker.lease is not None
    worker.lease.abort()

    await rig.wait_worker_state("w0", "exited")  # a later tick ended the grace
    assert "tick" in {task.get_name() for task in service._tasks}


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def run() -> bool:
        return check()

    return run


# --- leases -------------------------------------------------------------------------------


async def test_a_closed_lease_with_a_listening_worker_is_lost_then_restored(rig: Rig) -> None:
    await rig.start_router(reconnect_grace_s=30.0)
    worker = await rig.add_worker("w0", lease="raw")
    await worker.claim("ep-a0")
    assert worker.lease is not None

    worker.lease.abort()
    await rig.wait_worker_state("w0", "lost")

    view = (await rig.worker_views())["w0"]
    assert (view["claims"], view["draining"]) == (1, False)
    reply = await rig.request("GET", "/while-lost", episode=token("ep"))
    assert reply.status == 200 and reply.worker == "w0"
    assert reply.seen_headers(BOOT_HEADER) == [worker.boot]
    (await rig.request("POST", "/seed")).assert_answer(503, "no_worker", None)

    lease = await RawLease.open(rig.control_address)  # the same process comes back
    assert (await lease.hello("w0", worker.url, worker.boot))["ok"] is True
    worker.lease = lease

    view = (await rig.worker_views())["w0"]
    assert (view["state"], view["claims"], view["generation"]) == ("live", 1, 0)
    assert (await rig.request("GET", "/restored", episode=token("ep"))).worker == "w0"
    assert (await rig.request("POST", "/seed")).worker == "w0"
    synced = await lease.call("sync", claims=[{"kind": "episode", "key": "ep-a0"}], more=False)
    assert (synced["ok"], synced["accepted"], synced["refused"]) == (True, 1, [])


async def test_a_process_restarted_on_a_lost_workers_port_refuses_its_episodes(
    rig: Rig,
) -> None:
    await rig.start_router(reconnect_grace_s=30.0)
    old = await rig.add_worker("w0", lease="raw")
    await old.claim("ep-a0")
    assert old.lease is not None
    old.lease.abort()
    await rig.wait_worker_state("w0", "lost")

    await old.close_http()  # the old process is gone; a new one takes its port
    new = EchoWorker("w0", rig.control_address)
    new.port = old.port
    await new.serve()
    rig.stack.push_async_callback(new.close)

    reply = await rig.request("POST", "/tools/add", episode=token("ep"), data=b"{}")

    # Forwarded with the old boot, the new process answers 410 itself (the boot check).
    assert reply.status == 410
    assert reply.json() == {
        "error": "worker_exited",
        "detail": reply.json()["detail"],
        "session": None,
    }
    assert old.boot.encode() not in reply.body and new.boot.encode() not in reply.body
    assert new.seen == []


async def test_the_grace_ending_makes_a_lost_workers_episodes_410(rig: Rig) -> None:
    await rig.start_router(reconnect_grace_s=0.5)
    worker = await rig.add_worker("w0", lease="raw")
    await worker.claim("ep-a0")
    assert worker.lease is not None

    worker.lease.abort()
    await rig.wait_worker_state("w0", "lost")
    took = await rig.wait_worker_state("w0", "exited")

    assert took >= 0.3  # the grace, not the probe (the worker still listens)
    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )
    assert worker.seen == []
    lease = await RawLease.open(rig.control_address)  # too late: its episodes stay gone
    assert (await lease.hello("w0", worker.url, worker.boot))["ok"] is True
    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )
    refused = await lease.call("claim", key="ep-a0")
    assert (refused["ok"], refused["error"]) == (False, "worker_exited")
    lease.abort()


async def test_a_new_boot_for_the_same_worker_id_retires_the_old_claims(rig: Rig) -> None:
    await rig.start_router(reconnect_grace_s=30.0)
    worker = await rig.add_worker("w0", lease="raw")
    await worker.claim("ep-a0")
    assert worker.lease is not None

    intruder = await RawLease.open(rig.control_address)
    busy = await intruder.hello("w0", worker.url, "another-boot")
    assert (busy["ok"], busy["error"]) == (False, "worker_busy")  # the live lease is kept
    assert (await rig.request("GET", "/", episode=token("ep"))).worker == "w0"

    worker.lease.abort()
    await rig.wait_worker_state("w0", "lost")
    restarted = await intruder.hello("w0", worker.url, "another-boot")
    assert restarted["ok"] is True

    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )
    view = (await rig.worker_views())["w0"]
    assert (view["state"], view["claims"], view["generation"]) == ("live", 0, 1)
    refused = await intruder.call("claim", key="ep-a0")
    assert (refused["ok"], refused["error"]) == (False, "worker_exited")
    intruder.abort()


async def test_a_worker_id_back_at_a_new_address_with_a_new_boot_is_forwarded_there(
    rig: Rig,
) -> None:
    """The router keeps where each worker's forwards go (its address, its boot header)
    between requests: a worker id that comes back elsewhere, with another boot, gets
    the next request at its new address, carrying its new boot."""
    await rig.start_router(reconnect_grace_s=30.0)
    first = await rig.add_worker("w0", lease="raw")
    reply = await rig.request("GET", "/before")
    assert reply.seen_headers(BOOT_HEADER) == [first.boot] and first.paths_seen() == ["/before"]
    assert first.lease is not None
    first.lease.abort()
    await rig.wait_worker_state("w0", "lost")

    second = await rig.add_worker("w0", lease="raw")
    assert (second.url, second.boot) != (first.url, first.boot)
    reply = await rig.request("GET", "/after")
    assert reply.worker == "w0" and reply.seen_headers(BOOT_HEADER) == [second.boot]
    assert second.paths_seen() == ["/after"] and first.paths_seen() == ["/before"]


async def test_a_new_boot_does_not_inherit_a_drain_its_predecessor_asked_for(rig: Rig) -> None:
    await rig.start_router(reconnect_grace_s=30.0)
    worker = await rig.add_worker("w0", lease="raw")
    assert worker.lease is not None
    assert (await worker.lease.call("drain", on=True))["ok"] is True
    worker.lease.abort()
    await rig.wait_worker_state("w0", "lost")

    restarted = await RawLease.open(rig.control_address)
    assert (await restarted.hello("w0", worker.url, "new-boot"))["ok"] is True
    try:
        assert (await rig.worker_views())["w0"]["draining"] is False
    finally:
        restarted.abort()


async def test_a_silent_lease_is_lost_after_the_lease_timeout(rig: Rig) -> None:
    await rig.start_router(lease_timeout_s=0.5, reconnect_grace_s=30.0)
    worker = await rig.add_worker("w0", lease="raw")  # speaks, then says nothing more
    await worker.claim("ep-a0")
    silent_since = time.monotonic()
    assert worker.lease is not None

    await rig.wait_worker_state("w0", "lost")

    assert time.monotonic() - silent_since >= 0.4
    assert await worker.lease.closed_by_peer()  # the router hung up on it
    reply = await rig.request("GET", "/", episode=token("ep"))
    assert reply.worker == "w0" and reply.seen_headers(BOOT_HEADER) == [worker.boot]


async def test_a_lease_that_pings_stays_live_past_the_lease_timeout(rig: Rig) -> None:
    await rig.start_router(lease_timeout_s=0.5)
    worker = await rig.add_worker("w0", lease="raw")
    assert worker.lease is not None

    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        assert (await worker.lease.call("ping"))["ok"] is True
        assert (await rig.worker_views())["w0"]["state"] == "live"
        await asyncio.sleep(0.1)


async def test_a_dead_workers_lease_closing_retires_it_without_waiting_for_the_grace(
    rig: Rig,
) -> None:
    await rig.start_router(reconnect_grace_s=30.0)
    worker = await rig.add_worker("w0", lease="raw")
    await worker.claim("ep-a0")
    await worker.close_http()
    assert worker.lease is not None

    worker.lease.abort()

    assert await rig.wait_worker_state("w0", "exited") < 1.0
    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )


async def test_a_hello_that_changes_no_state_is_no_transition(rig: Rig) -> None:
    # Said again on its connection, or taking its lease over from another: the worker
    # was live and stays live; only its first hello made it so.
    await rig.start_router()
    first, second = (
        await RawLease.open(rig.control_address),
        await RawLease.open(rig.control_address),
    )
    try:
        for lease in (first, first, first, second):
            assert (await lease.hello("w0", "http://127.0.0.1:1", "boot-1"))["ok"] is True
        transitions = series(scrape(rig.router.metrics), "episode_router_worker_transitions_total")
    finally:
        first.abort()
        second.abort()
    assert transitions == {"state=live": 1}, transitions


PROBED_SERVER = """
import http.server, os, time
time.sleep(0.3)  # a server that takes a moment to listen, as a real one imports its world
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(os.environ["PORT"])), Health).serve_forever()
"""


async def test_a_spawned_server_that_never_says_hello_is_probed_listed_and_retired(
    rig: Rig, tmp_path: Path
) -> None:
    """spawn.register: probe (design §3): the router registers the worker at its start,
    gives it new sessions once its health probe answers, and retires it the moment its
    process exits; a restart is a new generation."""
    script = tmp_path / "server.py"
    script.write_text(PROBED_SERVER)
    spawn = SpawnConfig(
        f"{shlex.quote(sys.executable)} {shlex.quote(str(script))}",
        count=1,
        base_port=free_port(),
        stop_timeout_s=2.0,
        register="probe",
        env=(("PORT", "{port}"),),
    )
    service = await rig.start_router(
        router_config(tmp_path, spawn=spawn, health=HealthConfig("/health", 0.1, 1.0, 2))
    )
    views = await rig.worker_views()
    assert views["w0"]["state"] in ("unhealthy", "live")  # listed from its start
    assert views["w0"]["origin"] == "spawned" and views["w0"]["pid"] is not None
    await rig.wait_worker_state("w0", "live")
    reply = await rig.request("GET", "/anything")
    assert reply.status == 200 and reply.body == b"ok"  # balanced to it

    worker = service.core.workers.get("w0")
    assert worker is not None
    generation = worker.generation
    assert service.core.claim(worker, "episode", "ep1-a0", time.monotonic()) is None
    os.kill(views["w0"]["pid"], signal.SIGKILL)  # the process this test's router started

    async def restarted() -> bool:
        return worker.generation == generation + 1

    await wait_until(restarted, "w0 to be started again")
    await rig.wait_worker_state("w0", "live")  # probed again
    # The session of the process that died is 410: the new one never serves it.
    (await rig.request("GET", "/t", episode=token("ep1"))).assert_answer(
        410, "worker_exited", "ep1-a0"
    )

    # A hello cannot take a probed worker's id.
    lease = await RawLease.open(service.config.control.socket)
    try:
        reply_line = await lease.call(
            "hello", v=1, worker="w0", url="http://127.0.0.1:1", boot="intruder"
        )
        assert (reply_line["ok"], reply_line["error"]) == (False, "worker_busy")
    finally:
        lease.abort()


async def test_a_damaged_journal_does_not_stop_a_start_and_its_refused_workers_are_dropped(
    rig: Rig, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    journal = tmp_path / "journal"
    with socket.socket() as probe:  # a port free now, for the admin listener to bind
        probe.bind(("127.0.0.1", 0))
        admin_port = probe.getsockname()[1]
    config = router_config(
        tmp_path, admin=AdminConfig("127.0.0.1", admin_port), state=StateConfig(path=str(journal))
    )
    admin_url = f"http://127.0.0.1:{config.admin.port}"
    journal.write_bytes(
        b"\n".join(
            [
                b'{"op":"worker","id":"w0","url":"http://127.0.0.1:9","boot":"b0"}',
                b'{"op":"claim","kind":"episode","key":"ep-a0","worker":"w0"}',
                b"[" * 1000 + b"]" * 1000,  # the router used to exit here (RecursionError)
                b'{"op":"worker","id":"loop","url":"' + admin_url.encode() + b'","boot":"b1"}',
                b'{"op":"claim","kind":"episode","key":"lp-a0","worker":"loop"}',
                b'{"op":"claim","kind":"episode","key":"tor',
            ]
        )
    )
    with caplog.at_level(logging.WARNING, logger="episode_router"):
        router = await rig.start_router(config)

    assert router.core.workers.get("loop") is None
    assert router.core.claims.lookup("episode", "lp-a0") is None
    assert {c.key for c in router.core.claims.held_by("w0")} == {"ep-a0"}
    named = [(getattr(r, "line", 0), getattr(r, "reason", "")) for r in caplog.records]
    named = [(line, reason) for line, reason in named if line]
    assert [line for line, _ in named] == [3, 4, 6]
    assert "own listeners" in named[1][1] and named[0][1] == "nested too deeply"


async def test_a_hello_naming_the_routers_own_ports_is_forbidden(rig: Rig) -> None:
    """The loop: a worker url at the public port sent one request through about 256
    router connections before a 504. Ports the kernel picked (port 0) count too."""
    router = await rig.start_router()
    lease = await RawLease.open(rig.control_address)
    for port in (router.public_port, router.admin_port):
        for host in ("127.0.0.1", "localhost"):
            reply = await lease.hello("w0", f"http://{host}:{port}", "b0")
            assert reply["error"] == "forbidden", reply
            assert "own listeners" in reply["detail"]
    socket_url = f"unix:{router.config.control.unix_path}"
    assert (await lease.hello("w0", socket_url, "b0"))["error"] == "forbidden"
    lease.abort()
