"""Config reload: what changes live, what waits for a restart, and nothing dropped."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from bench.launch import free_port
from router.config import (
    Config,
    ConfigError,
    HealthConfig,
    LimitsConfig,
    ListenConfig,
    StaticWorkerConfig,
    default_config,
    load_config,
    parse_config,
)
from router.core.claims import ClaimState
from router.core.workers import WorkerOrigin, WorkerState
from router.service import router_service as router_service_module
from router.service.reload import effective_config, plan_reload
from tests.metrics.test_registry import scrape, series
from tests.router_fixtures import (
    EchoWorker,
    RawLease,
    Rig,
    open_rig,
    router_config,
    token,
    wait_until,
)

# --- pure -----------------------------------------------------------------------------------


def test_an_unchanged_config_changes_nothing() -> None:
    plan = plan_reload(default_config(), default_config())
    assert (plan.applied, plan.needs_restart, plan.changes_anything) == ((), (), False)


def test_live_sections_apply_and_bound_ones_wait_for_a_restart() -> None:
    old = default_config()
    new = dataclasses.replace(
        old,
        listen=ListenConfig("127.0.0.1", 9999),
        limits=dataclasses.replace(LimitsConfig(), max_body_bytes=10),
        control=dataclasses.replace(old.control, socket="unix:/tmp/other.sock", lease_timeout_s=3),
    )
    plan = plan_reload(old, new)
    assert plan.applied == ("control.lease_timeout_s", "limits")
    assert plan.needs_restart == (
        "listen: the public listener is bound at start",
        "control.socket: the control socket is bound at start",
    )
    running = effective_config(old, new)
    assert running.listen == old.listen
    assert running.control.socket == old.control.socket
    assert running.control.lease_timeout_s == 3
    assert running.limits.max_body_bytes == 10


RUNNING = """
listen: {host: 127.0.0.1, port: 8100}
admin: {host: 127.0.0.1, port: 8101}
control: {socket: "tcp://127.0.0.1:8102", secret_env: SECRET}
spawn: {command: "srv --port {port}", count: 2, base_port: 8110}
"""
SECRET_ENV = {"SECRET": "control-secret-0123"}
CONTROL = 'control: {socket: "tcp://127.0.0.1:8102", secret_env: SECRET}\n'


def _running_and_new(new_text: str) -> tuple[Config, Config]:
    return (
        parse_config(RUNNING, source="old.yaml", env=SECRET_ENV),
        parse_config(new_text, source="new.yaml", env=SECRET_ENV),
    )


@pytest.mark.parametrize(
    ("new_text", "key_path", "reason"),
    [
        (  # the public port moves only at a restart: until then this is the router itself
            CONTROL + "listen: {host: 127.0.0.1, port: 8200}\n"
            "workers: [{id: s0, url: 'http://127.0.0.1:8100'}]",
            "workers[0].url",
            "is the router's own listen.port address",
        ),
        (  # spawn goes at a restart: until then w1 is a running spawned worker
            CONTROL + "workers: [{id: w1, url: 'http://127.0.0.1:8300'}]",
            "workers[0].id",
            "'w1' is also a spawned worker's id",
        ),
    ],
)
def test_a_reload_whose_mix_with_the_running_sections_fails_the_checks_is_refused(
    new_text: str, key_path: str, reason: str
) -> None:
    running, new = _running_and_new(new_text)
    with pytest.raises(ConfigError) as info:
        effective_config(running, new, source="new.yaml")
    error = info.value
    assert (error.source, error.key_path) == ("new.yaml", key_path)
    assert reason in error.reason
    assert error.reason.endswith(
        "(with the running listen, admin, spawn, state, directory, peer, control.socket, "
        "which only a restart changes)"
    )


@pytest.mark.parametrize(
    "new_text",
    [
        'listen: {host: 127.0.0.1, port: 8100}\ncontrol: {socket: "unix:/tmp/r.sock"}',
        "listen: {host: 127.0.0.1, port: 8100}\n"
        'control: {socket: "unix:/tmp/r.sock", allowed_uids: [1000]}',
    ],
    ids=["no-uids", "uids"],
)
def test_a_move_to_the_other_socket_kind_keeps_the_running_authentication_until_restart(
    new_text: str,
) -> None:
    # The running tcp:// socket stays until the restart, and its secret with it: the new
    # file's (none) and its uids go with the unix: socket it moves to.
    running, new = _running_and_new(new_text)
    target = effective_config(running, new, source="new.yaml")
    assert target.control.socket == running.control.socket
    assert target.control.secret == running.control.secret is not None
    assert target.control.allowed_uids == running.control.allowed_uids
    plan = plan_reload(running, new)
    assert not any(key.startswith("control.") for key in plan.applied)
    waiting = {line.split(":")[0] for line in plan.needs_restart}
    assert {"control.socket", "control.secret"} <= waiting


def test_a_reload_may_not_drop_an_allowed_upstream_the_running_spawn_host_needs() -> None:
    running = parse_config(
        """
control: {allowed_upstreams: ["http://10.0.0.7:9001"]}
spawn: {command: "srv --port {port}", host: 10.0.0.7}
"""
    )
    new = parse_config("control: {allowed_upstreams: []}")
    with pytest.raises(ConfigError, match=re.escape("spawn.host: '10.0.0.7' is not loopback")):
        effective_config(running, new)


# --- a running router -------------------------------------------------------------------------


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


def write_config(path: Path, tmp_path: Path, extra: str = "") -> None:
    path.write_text(
        f"""
listen: {{host: 127.0.0.1, port: 0}}
admin: {{host: 127.0.0.1, port: 0}}
control: {{socket: "unix:{tmp_path}/c.sock"}}
claims: {{recovery_window_s: 0.001}}
timeouts: {{shutdown_grace_s: 3}}
{extra}
"""
    )


async def start_from_file(rig: Rig, tmp_path: Path) -> Path:
    path = tmp_path / "router.yaml"
    write_config(path, tmp_path)
    service = await rig.start_router(load_config(path))
    service.config_path = str(path)
    return path


async def test_a_reload_under_load_changes_kinds_and_limits_and_drops_nothing(
    rig: Rig, tmp_path: Path
) -> None:
    path = await start_from_file(rig, tmp_path)
    workers = [await rig.add_worker(f"w{i}") for i in range(2)]
    for i in range(20):
        await workers[i % 2].claim(f"ep{i}-a0")
    failures: list[tuple[int, str]] = []
    stop = asyncio.Event()

    async def load(lane: int) -> int:
        sent = 0
        while not stop.is_set() and sent < 2000:
            ep = (lane + sent) % 20
            reply = await rig.request("POST", "/tool", episode=token(f"ep{ep}"), data=b"x" * 100)
            if reply.status != 200 or reply.worker != f"w{ep % 2}":
                failures.append((reply.status, reply.body[:200].decode(errors="replace")))
            sent += 1
        return sent

    lanes = [asyncio.create_task(load(lane), name=f"load-{lane}") for lane in range(4)]
    await asyncio.sleep(0.2)
    write_config(
        path,
        tmp_path,
        extra="""
sessions:
  - {name: episode, header: X-NeMo-Gym-Episode-Token, token: {format: jws}}
  - {name: chat, header: X-Chat, token: {format: raw}, unclaimed: forward}
limits: {max_body_bytes: 1000}
""",
    )
    reply = await rig.admin("POST", "/admin/reload")
    status, body = reply.status, reply.json()
    assert status == 200, body
    assert body == {"ok": True, "applied": ["sessions", "limits"], "needs_restart": []}
    await asyncio.sleep(0.2)
    stop.set()
    sent = sum(await asyncio.gather(*lanes))
    assert sent > 40 and failures == []

    too_big = await rig.request("POST", "/tool", episode=token("ep1"), data=b"x" * 2000)
    too_big.assert_answer(413, "payload_too_large", None)
    chat = await rig.request("POST", "/tool", headers={"X-Chat": "conversation-1"})
    assert chat.status == 200 and chat.worker in ("w0", "w1")
    assert rig.router.core.claims.held_total == 20  # the claim table went through untouched
    forwarded = series(scrape(rig.router.metrics), "episode_router_requests_total")
    assert forwarded["kind=chat,outcome=forwarded,status_class=2xx"] == 1  # its own label


async def test_a_broken_config_is_refused_and_the_old_one_keeps_serving(
    rig: Rig, tmp_path: Path
) -> None:
    path = await start_from_file(rig, tmp_path)
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    before = rig.router.config
    write_config(path, tmp_path, extra="limits: {max_body_bytes: -1, no_such_key: 1}")

    reply = await rig.admin("POST", "/admin/reload")
    status, body = reply.status, reply.json()
    assert status == 400 and body["error"] == "invalid_config"
    assert "the running config stays" in body["detail"]
    with pytest.raises(ConfigError):
        await rig.router.reload_from_file()  # what SIGHUP calls
    assert rig.router.config is before
    reply = await rig.request("GET", "/still", episode=token("ep"))
    assert reply.status == 200 and reply.worker == "w0"


async def test_what_needs_a_restart_is_said_and_left_as_it_is(rig: Rig, tmp_path: Path) -> None:
    path = await start_from_file(rig, tmp_path)
    port = rig.router.public_port
    write_config(path, tmp_path, extra="")
    text = path.read_text().replace("listen: {host: 127.0.0.1, port: 0}", "listen: {port: 1}")
    path.write_text(text)
    reply = await rig.admin("POST", "/admin/reload")
    status, body = reply.status, reply.json()
    assert status == 200
    assert body["needs_restart"] == ["listen: the public listener is bound at start"]
    assert rig.router.public_port == port
    assert rig.router.config.listen == ListenConfig("127.0.0.1", 0)


async def test_a_router_without_a_config_file_says_so(rig: Rig) -> None:
    await rig.start_router()
    reply = await rig.admin("POST", "/admin/reload")
    status, body = reply.status, reply.json()
    assert status == 409 and body["error"] == "no_config_file"


def _kinds(config: Config) -> list[str]:
    return [kind.name for kind in config.sessions]


async def test_static_workers_come_and_go_with_the_config(rig: Rig, tmp_path: Path) -> None:
    path = await start_from_file(rig, tmp_path)
    extra = "workers: [{id: s0, url: 'http://127.0.0.1:1'}]\nhealth: {interval_s: 0.05}"
    write_config(path, tmp_path, extra=extra)
    await rig.router.reload_from_file()
    assert rig.router.core.workers.get("s0") is not None
    write_config(path, tmp_path)
    await rig.router.reload_from_file()
    assert rig.router.core.workers.get("s0") is None  # retired and forgotten: never probed again
    assert _kinds(rig.router.config) == ["episode"]


async def test_a_static_worker_removed_by_a_reload_is_not_probed_back_to_life(
    rig: Rig, tmp_path: Path
) -> None:
    kept, removed = EchoWorker("s0", "unix:/nonexistent"), EchoWorker("s1", "unix:/nonexistent")
    for worker in (kept, removed):  # HTTP only: static workers never say hello
        await worker.serve()
        rig.stack.push_async_callback(worker.close_http)
    probes = HealthConfig(path="/health", interval_s=0.05, timeout_s=0.3, failures=2)
    both = (StaticWorkerConfig("s0", kept.url), StaticWorkerConfig("s1", removed.url))
    config = router_config(tmp_path, workers=both, health=probes)
    await rig.start_router(config)
    core = rig.router.core
    assert core.claims.claim("episode", "ep-a0", "s1", time.monotonic()) is None
    await wait_until(_async(lambda: "/health" in removed.paths_seen()), "s1 to be probed")

    rig.router.reload(dataclasses.replace(config, workers=both[:1]))
    probed = len(removed.paths_seen())
    await asyncio.sleep(10 * probes.interval_s)  # ten probe rounds; s1 still listens

    assert core.workers.get("s1") is None
    assert len(removed.paths_seen()) <= probed + 1  # at most the round already in flight
    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )
    for _ in range(4):  # new sessions only go to the worker the config lists
        assert (await rig.request("POST", "/seed")).worker == "s0"


@pytest.mark.parametrize("same_url", [True, False])
async def test_a_reload_that_makes_a_live_workers_id_static_retires_the_one_that_said_hello(
    rig: Rig, tmp_path: Path, same_url: bool
) -> None:
    path = await start_from_file(rig, tmp_path)
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    static = worker if same_url else EchoWorker("w0", "unix:/nonexistent")
    if not same_url:
        await static.serve()
        rig.stack.push_async_callback(static.close_http)
    write_config(path, tmp_path, extra=f"workers: [{{id: w0, url: '{static.url}'}}]")

    reply = await rig.admin("POST", "/admin/reload")

    assert reply.json()["applied"] == ["workers"], reply.json()
    w0 = rig.router.core.workers.get("w0")
    assert w0 is not None and (w0.origin, w0.state) == (WorkerOrigin.STATIC, WorkerState.LIVE)
    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )
    await asyncio.sleep(0.3)  # the retired lease's connection closes meanwhile
    assert (w0.state, w0.lease) == (WorkerState.LIVE, None)  # not lost with it
    reply = await rig.request("POST", "/seed")
    assert (reply.status, reply.worker) == (200, "w0")


def _async(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def run() -> bool:
        return check()

    return run


async def test_a_reload_that_moves_the_control_socket_keeps_the_running_secret_until_restart(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The new file moves to a unix socket (a restart) and drops the secret with it: the
    running tcp:// socket keeps its secret until the restart, so hellos still work."""
    secret = "control-secret-0123"
    monkeypatch.setenv("RELOAD_TEST_SECRET", secret)
    address = f"tcp://127.0.0.1:{free_port()}"
    path = tmp_path / "router.yaml"
    write_config(path, tmp_path)
    text = path.read_text()
    unix_control = f'control: {{socket: "unix:{tmp_path}/c.sock"}}'
    tcp_control = f'control: {{socket: "{address}", secret_env: RELOAD_TEST_SECRET}}'
    path.write_text(text.replace(unix_control, tcp_control))
    service = await rig.start_router(load_config(path))
    service.config_path = str(path)
    before = service.config
    path.write_text(text)  # unix:, no secret

    reply = await rig.admin("POST", "/admin/reload")

    body = reply.json()
    assert reply.status == 200, body
    waiting = {line.split(":")[0] for line in body["needs_restart"]}
    assert {"control.socket", "control.secret"} <= waiting
    assert service.config.control.secret == before.control.secret is not None
    lease = await RawLease.open(address)
    try:
        hello = await lease.hello("w0", "http://127.0.0.1:1", "boot-1", auth=secret)
    finally:
        lease.abort()
    assert hello["ok"] is True, hello


async def test_a_reloaded_control_policy_holds_for_connections_opened_before_it(
    rig: Rig, tmp_path: Path
) -> None:
    """A hello is a request: a connection open since before the reload says it under
    the new policy, not the one its connection began with."""
    path = tmp_path / "router.yaml"
    write_config(path, tmp_path)
    narrow = path.read_text()
    control = f'control: {{socket: "unix:{tmp_path}/c.sock"'
    path.write_text(
        narrow.replace(control, control + ', allowed_upstreams: ["http://10.0.0.5:80"]')
    )
    service = await rig.start_router(load_config(path))
    service.config_path = str(path)
    assert service.config.control.allowed_upstreams == ("http://10.0.0.5:80",)
    opened_before = await RawLease.open(service.config.control.socket)
    rig.stack.callback(opened_before.abort)
    path.write_text(narrow)  # no allowed upstreams

    reply = await rig.admin("POST", "/admin/reload")

    assert reply.json()["applied"] == ["control.allowed_upstreams"], reply.json()
    hello = await opened_before.hello("wx", "http://10.0.0.5:80", "boot-1")
    assert (hello["ok"], hello["error"]) == (False, "forbidden"), hello
    assert service.core.workers.get("wx") is None
    assert (await opened_before.hello("wx", "http://127.0.0.1:1", "boot-1"))["ok"] is True


async def test_a_claim_under_a_kind_a_reload_removed_can_still_be_released(
    rig: Rig, tmp_path: Path
) -> None:
    path = await start_from_file(rig, tmp_path)
    chat_kind = "- {name: chat, header: X-Chat, token: {format: raw}}"
    episode_kind = "- {name: episode, header: X-NeMo-Gym-Episode-Token, token: {format: jws}}"
    write_config(path, tmp_path, extra=f"sessions:\n  {episode_kind}\n  {chat_kind}")
    await rig.router.reload_from_file()
    lease = await RawLease.open(rig.control_address)
    rig.stack.callback(lease.abort)
    assert (await lease.hello("w0", "http://127.0.0.1:1", "boot-1"))["ok"] is True
    assert (await lease.call("claim", key="c1", kind="chat"))["ok"] is True
    write_config(path, tmp_path)  # the chat kind is gone
    await rig.router.reload_from_file()

    assert (await lease.call("claim", key="c2", kind="chat"))["error"] == "unknown_kind"
    assert (await lease.call("release", key="c1", kind="chat"))["ok"] is True
    claim = rig.router.core.claims.lookup("chat", "c1")
    assert claim is not None and claim.state is ClaimState.ENDED


# A spawned worker that records its pid and the secret it was given, then sleeps.
SECRET_RECORDER = """
import os, sys, time

path = os.path.join(sys.argv[1], "%d.secret" % os.getpid())
with open(path + ".tmp", "w") as f:
    f.write(os.environ.get("EPISODE_ROUTER_SECRET", "<none>"))
os.replace(path + ".tmp", path)
time.sleep(60)
"""


async def test_a_spawned_worker_restarted_after_a_reload_gets_the_rotated_secret(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RELOAD_TEST_OLD", "old-secret-0123456789")
    monkeypatch.setenv("RELOAD_TEST_NEW", "new-secret-9876543210")
    (tmp_path / "recorder.py").write_text(SECRET_RECORDER)
    out = tmp_path / "out"
    out.mkdir()
    command = shlex.join([sys.executable, str(tmp_path / "recorder.py"), str(out)]) + " {port}"
    control_port, base_port = free_port(), free_port()
    path = tmp_path / "router.yaml"

    def write(secret_env: str) -> None:
        write_config(path, tmp_path)
        unix = f'control: {{socket: "unix:{tmp_path}/c.sock"}}'
        tcp = f'control: {{socket: "tcp://127.0.0.1:{control_port}", secret_env: {secret_env}}}'
        spawn = f"spawn: {{command: '{command}', base_port: {base_port}, stop_timeout_s: 2}}"
        path.write_text(path.read_text().replace(unix, f"{tcp}\n{spawn}"))

    def started() -> dict[int, str]:
        return {int(p.stem): p.read_text() for p in out.glob("*.secret")}

    write("RELOAD_TEST_OLD")
    service = await rig.start_router(load_config(path))
    service.config_path = str(path)
    await wait_until(_async(lambda: len(started()) == 1), "the spawned worker to start")
    [(first, secret)] = started().items()
    assert (secret, service.worker_pid("w0")) == ("old-secret-0123456789", first)

    write("RELOAD_TEST_NEW")
    reply = await rig.admin("POST", "/admin/reload")
    assert (reply.status, reply.json()["applied"]) == (200, ["control.secret"]), reply.json()
    os.kill(first, signal.SIGKILL)  # our child: the spawner reaps it and starts another
    await wait_until(_async(lambda: len(started()) == 2), "the worker to be restarted")

    [(second, secret)] = [(pid, s) for pid, s in started().items() if pid != first]
    assert secret == "new-secret-9876543210"
    assert service.worker_pid("w0") == second


async def test_a_reload_from_a_fifo_is_refused_and_the_router_goes_on_serving(
    rig: Rig, tmp_path: Path
) -> None:
    """The config used to be read on the event loop: a FIFO with no writer at the
    config path stopped every listener until something wrote to it."""
    path = await start_from_file(rig, tmp_path)
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    before = rig.router.config
    path.unlink()
    os.mkfifo(path)

    reply = await asyncio.wait_for(rig.admin("POST", "/admin/reload"), 5)
    status, body = reply.status, reply.json()
    assert status == 400 and body["error"] == "invalid_config"
    assert "not a regular file (a FIFO)" in body["detail"]
    assert "the running config stays" in body["detail"]
    with pytest.raises(ConfigError, match="a FIFO"):
        await asyncio.wait_for(rig.router.reload_from_file(), 5)  # what SIGHUP calls
    assert rig.router.config is before
    reply = await rig.request("GET", "/still", episode=token("ep"))
    assert reply.status == 200 and reply.worker == "w0"


async def test_a_reload_reads_the_file_off_the_event_loop(
    rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow read (a network file system) must not stall the loop: while it reads,
    the loop answers the public port."""
    await start_from_file(rig, tmp_path)
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    before = rig.router.config
    reading, release = threading.Event(), threading.Event()
    real_load = router_service_module.load_config

    def slow_load(config_path: str) -> Config:
        reading.set()
        release.wait(5)
        return real_load(config_path)

    monkeypatch.setattr(router_service_module, "load_config", slow_load)
    reloading = asyncio.create_task(rig.router.reload_from_file(), name="reload")
    try:
        assert await asyncio.to_thread(reading.wait, 5)
        reply = await asyncio.wait_for(rig.request("GET", "/during", episode=token("ep")), 5)
        assert reply.status == 200 and not reloading.done()
    finally:
        release.set()
    await asyncio.wait_for(reloading, 5)
    assert rig.router.config is not before  # the file was read and applied
