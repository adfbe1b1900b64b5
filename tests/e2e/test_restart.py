"""Restarts end to end: the router killed and restarted under load, its socket, spawn mode.

The router is killed with SIGKILL and started again with the same config while
a client keeps calling live episodes: the new router replaces the stale socket
file, the workers reconnect and re-sync, the episodes carry on on their own
workers with their state, and no call gets a wrong 401 (with and without the
state journal). A second router never steals a live socket. In spawn mode the
router starts the workers itself, restarts one that is killed, stops them all on
SIGTERM, and after a crash adopts the ones still running.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import yaml

from bench.launch import free_port_range

from .conftest import (
    LOOPBACK,
    START_TIMEOUT_S,
    Episode,
    Http,
    Launcher,
    Router,
    add,
    assert_router_answer,
    call_tool,
    child_pids,
    cmdline,
    demo_worker_command,
    get,
    pid_alive,
    start_episode,
    until_gone,
    wait_until,
)

pytestmark = pytest.mark.e2e

LIVE_EPISODES = 9  # three on each of three workers (new episodes go to the emptiest)
# Long enough for the workers' reconnect backoff: an episode whose worker has not
# re-synced yet must get 503 `recovering`, never 401.
RECOVERY_WINDOW_S = 10
TRAFFIC_MAX_CALLS = 5000
TRAFFIC_MAX_S = 30.0
SPAWN_STOP_TIMEOUT_S = 3
KILL_TO_410_S = 1.0
# Bounds waits for what takes well under a second on a warm machine (a router restart,
# the end of a recovery window that every expected worker has closed).
SETTLE_S = 5.0


@dataclass(slots=True)
class Traffic:
    """What a client calling `get` on live episodes saw across a router restart."""

    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    last_ok: dict[str, float] = field(default_factory=dict)  # episode key → monotonic time

    def served_since(self, episodes: list[Episode], since: float) -> bool:
        return all(self.last_ok.get(e.key, 0.0) > since for e in episodes)


async def keep_calling(
    http: Http, base_url: str, episodes: list[Episode], stop: asyncio.Event, traffic: Traffic
) -> None:
    """`get` on each episode in turn until `stop` (bounded in calls and time).

    A refused or broken connection, or a reply cut short (the router is down or
    was killed while answering), is counted and retried;
    503 `recovering` is allowed; a 200 must come from the episode's own worker
    with its counter. Anything else is a problem.
    """
    ends_at = time.monotonic() + TRAFFIC_MAX_S
    for call in range(TRAFFIC_MAX_CALLS):
        if stop.is_set() or time.monotonic() > ends_at:
            return
        episode = episodes[call % len(episodes)]
        try:
            reply = await call_tool(http, base_url, episode, "get", None)
        except (aiohttp.ClientError, TimeoutError):  # refused, or cut off by the SIGKILL
            traffic.outcomes["connection failed"] += 1
            await asyncio.sleep(0.02)
            continue
        traffic.outcomes[f"{reply.status} {reply.error or ''}".strip()] += 1
        if reply.status == 200:
            body = reply.json()
            seen = (body["worker"], body["episode"], body["result"])
            if seen == (episode.worker, episode.key, episode.counter):
                traffic.last_ok[episode.key] = time.monotonic()
            else:
                traffic.problems.append(f"{episode} got {body}")
        elif (reply.status, reply.error) != (503, "recovering"):
            traffic.problems.append(f"{episode.key} on {episode.worker}: {reply}")
        await asyncio.sleep(0.005)


async def restart_under_traffic(router: Router, http: Http, episodes: list[Episode]) -> Traffic:
    """Kill the router with SIGKILL while `episodes` are called, start it again, and wait
    until their workers are back and every episode was served after that."""
    worker_ids = sorted({e.worker for e in episodes})
    traffic, stop = Traffic(), asyncio.Event()
    caller = asyncio.create_task(keep_calling(http, router.base_url, episodes, stop, traffic))
    try:
        await wait_for(lambda: traffic.served_since(episodes, 0.0), "traffic", caller)
        router.process.kill9()
        assert router.socket_path.exists(), "a SIGKILLed router cannot remove its socket file"
        await asyncio.sleep(0.3)  # calls meet a closed port meanwhile
        await asyncio.to_thread(router.restart)
        # With the journal, the router forwards to the workers it remembers (as lost) before
        # they reconnect: a served call does not yet mean the workers re-synced.
        await asyncio.to_thread(router.wait_live, worker_ids)
        back_at = time.monotonic()
        await wait_for(lambda: traffic.served_since(episodes, back_at), "service again", caller)
    finally:
        stop.set()
        await caller
    return traffic


async def wait_for(check: Callable[[], bool], what: str, caller: asyncio.Task[None]) -> None:
    """Poll `check` until it holds (START_TIMEOUT_S at most), without blocking the loop;
    stop early if `caller`, the task that makes it hold, ended."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while not check():
        if caller.done():
            await caller  # raises what ended it
            raise AssertionError(f"the calls stopped before {what}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("journal", [False, True], ids=["no-journal", "journal"])
async def test_router_killed_and_restarted_under_traffic(
    launcher: Launcher, http: Http, tmp_path: Path, journal: bool
) -> None:
    state = {"path": str(tmp_path / "journal")} if journal else {}
    router = launcher.router(claims={"recovery_window_s": RECOVERY_WINDOW_S}, state=state)
    workers = {w.worker_id: w for w in launcher.workers(router, ["w1", "w2", "w3"])}
    episodes = [await start_episode(http, router.base_url) for _ in range(LIVE_EPISODES)]
    for value, episode in enumerate(episodes, start=1):
        await add(http, router.base_url, episode, value * 7)
    ended = await start_episode(http, router.base_url)
    reply = await http.post(f"{router.base_url}/episodes/end", token=ended.token)
    assert reply.status == 200, str(reply)
    workers["w3"].process.kill9()  # before the router's crash: its episodes are 410 already
    exited = [e for e in episodes if e.worker == "w3"]
    live = [e for e in episodes if e.worker != "w3"]
    assert exited and {e.worker for e in live} == {"w1", "w2"}
    for episode in exited:
        reply = await until_gone(http, router.base_url, episode, KILL_TO_410_S)
        assert_router_answer(reply, 410, "worker_exited", episode.key)

    traffic = await restart_under_traffic(router, http, live)

    assert not traffic.problems, "\n".join(traffic.problems[:10]) + f"\n{traffic.outcomes}"
    assert set(traffic.outcomes) <= {"200", "503 recovering", "connection failed"}
    assert traffic.outcomes["connection failed"] >= 1, "the calls never met the router down"
    assert workers["w1"].process.returncode is None and workers["w2"].process.returncode is None
    views = router.workers()
    assert {w: (views[w]["state"], views[w]["claims"]) for w in ("w1", "w2")} == {
        w: ("live", sum(1 for e in live if e.worker == w)) for w in ("w1", "w2")
    }
    for episode in live:  # state intact, on the same worker
        reply = await call_tool(http, router.base_url, episode, "add", {"value": 1})
        episode.counter += 1
        body = reply.json()
        assert (reply.status, body["worker"], body["result"]) == (
            200,
            episode.worker,
            episode.counter,
        ), str(reply)
    gone = [(ended, "episode_ended")] + [(e, "worker_exited") for e in exited]
    for episode, error in gone:
        reply = await call_tool(http, router.base_url, episode, "get", None)
        if journal:  # remembered across the restart
            assert_router_answer(reply, 410, error, episode.key)
        else:  # forgotten: unknown (503 while the router still waits for workers to re-sync)
            assert (reply.status, reply.error) in {(503, "recovering"), (401, "unknown_episode")}


# --- the control socket file --------------------------------------------------------------------


async def test_a_second_router_never_steals_a_live_control_socket(
    launcher: Launcher, http: Http
) -> None:
    router = launcher.router()
    launcher.workers(router, ["w1"])
    episode = await start_episode(http, router.base_url)

    second = launcher.run_router("second-router", router.config_path)
    exit_code = await asyncio.to_thread(second.wait, START_TIMEOUT_S)
    assert exit_code not in (None, 0), second.tail()

    assert router.socket_path.exists()
    launcher.workers(router, ["w2"])  # the first router still takes hellos on its socket
    await add(http, router.base_url, episode, 4)
    assert router.process.returncode is None


def test_a_second_router_says_clearly_that_the_socket_is_in_use(launcher: Launcher) -> None:
    router = launcher.router()
    second = launcher.run_router("second-router", router.config_path)
    exit_code = second.wait(START_TIMEOUT_S)

    stderr = second.stderr_path.read_text()
    assert exit_code not in (None, 0)
    assert "Traceback" not in stderr, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("episode-router: ") and str(router.socket_path) in last, stderr


# --- spawn mode ----------------------------------------------------------------------------------


def spawned(router: Router) -> dict[str, int]:
    """The router's spawned workers now: worker id → pid."""
    found = {}
    for pid in child_pids(router.process.pid):
        argv = cmdline(pid)
        if "router.demo" in argv and "--worker-id" in argv:
            found[argv[argv.index("--worker-id") + 1]] = pid
    router.process.remember_descendants()  # teardown kills them should the router not
    return found


def origins_and_pids(router: Router) -> dict[str, tuple[str, int | None]]:
    """(origin, pid) of every worker, as the admin API shows them."""
    return {w: (view["origin"], view["pid"]) for w, view in router.workers().items()}


async def test_spawned_workers_route_restart_and_stop_with_the_router(
    launcher: Launcher, http: Http
) -> None:
    base_port = free_port_range(3)
    spawn = {
        "command": demo_worker_command(),
        "count": 3,
        "base_port": base_port,
        "stop_timeout_s": SPAWN_STOP_TIMEOUT_S,
    }
    router = launcher.router(spawn=spawn, claims={"recovery_window_s": RECOVERY_WINDOW_S})
    router.wait_live(["w0", "w1", "w2"])
    router.wait_ready(recovered=True, timeout=SETTLE_S)  # all spawned workers synced: it ends
    pids = spawned(router)
    assert sorted(pids) == ["w0", "w1", "w2"]
    episodes = [await start_episode(http, router.base_url) for _ in range(6)]
    assert {e.worker for e in episodes} == {"w0", "w1", "w2"}
    for value, episode in enumerate(episodes, start=1):
        await add(http, router.base_url, episode, value)
    generation = router.workers()["w0"]["generation"]

    os.kill(pids["w0"], signal.SIGKILL)  # the router, its parent, reaps it
    killed_at = time.monotonic()
    for episode in (e for e in episodes if e.worker == "w0"):
        waited = time.monotonic() - killed_at
        reply = await until_gone(http, router.base_url, episode, KILL_TO_410_S - waited)
        assert_router_answer(reply, 410, "worker_exited", episode.key)
    for episode in (e for e in episodes if e.worker != "w0"):
        await get(http, router.base_url, episode)

    def w0_back() -> bool:
        view = router.workers().get("w0", {})
        return view.get("state") == "live" and view.get("generation", generation) > generation

    await asyncio.to_thread(wait_until, "w0 respawned and live", w0_back, START_TIMEOUT_S)
    respawned = spawned(router)
    assert respawned["w0"] != pids["w0"] and not pid_alive(pids["w0"])
    assert str(base_port) in cmdline(respawned["w0"])  # on its own port again
    assert {w: respawned[w] for w in ("w1", "w2")} == {w: pids[w] for w in ("w1", "w2")}
    newcomer = await start_episode(http, router.base_url)  # w0 holds the fewest episodes
    assert newcomer.worker == "w0"
    await add(http, router.base_url, newcomer, 3)
    for episode in (e for e in episodes if e.worker == "w0"):  # the new process never serves them
        reply = await call_tool(http, router.base_url, episode, "get", None)
        assert_router_answer(reply, 410, "worker_exited", episode.key)

    router.process.signal(signal.SIGTERM)
    await asyncio.sleep(0.1)
    for again in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # as impatient callers do
        router.process.signal(again)
    exit_code = await asyncio.to_thread(router.process.wait, SPAWN_STOP_TIMEOUT_S + 5.0)
    assert exit_code == 0, router.process.tail()
    assert not [w for w, pid in respawned.items() if pid_alive(pid)], "spawned workers outlived it"
    assert not router.socket_path.exists()


async def test_spawned_workers_are_adopted_after_a_router_crash(
    launcher: Launcher, http: Http
) -> None:
    spawn = {
        "command": demo_worker_command(),
        "count": 2,
        "base_port": free_port_range(2),
        "stop_timeout_s": SPAWN_STOP_TIMEOUT_S,
    }
    router = launcher.router(spawn=spawn, claims={"recovery_window_s": RECOVERY_WINDOW_S})
    router.wait_live(["w0", "w1"])
    pids = spawned(router)
    assert origins_and_pids(router) == {w: ("spawned", pid) for w, pid in pids.items()}
    episodes = [await start_episode(http, router.base_url) for _ in range(4)]
    for value, episode in enumerate(episodes, start=1):
        await add(http, router.base_url, episode, value)

    router.process.kill9()
    assert all(pid_alive(pid) for pid in pids.values()), "spawned workers died with the router"
    await asyncio.to_thread(router.restart, SETTLE_S)
    await asyncio.to_thread(router.wait_live, ["w0", "w1"])
    for episode in episodes:  # adopted: the same processes, their state intact
        await get(http, router.base_url, episode)
    assert spawned(router) == {}, "the restarted router started workers on ports still served"
    assert all(pid_alive(pid) for pid in pids.values())
    # Still spawned workers, and their pids are their control connections' peers'.
    assert origins_and_pids(router) == {w: ("spawned", pid) for w, pid in pids.items()}

    router.process.signal(signal.SIGTERM)
    exit_code = await asyncio.to_thread(router.process.wait, SPAWN_STOP_TIMEOUT_S + 5.0)
    assert exit_code == 0, router.process.tail()
    assert not [w for w, pid in pids.items() if pid_alive(pid)], "adopted workers outlived it"
    assert not router.socket_path.exists()


async def test_an_adopted_worker_behind_a_wrapper_shell_is_stopped_whole(
    launcher: Launcher,
) -> None:
    """The pid on an adopted worker's control connection is the server, a child of the
    wrapper shell that leads the group the crashed router started: SIGTERM stops that
    group, wrapper and server both."""
    wrapped = shlex.quote(demo_worker_command() + "; echo worker-ended")
    spawn = {
        "command": f"/bin/sh -c {wrapped}",
        "count": 1,
        "base_port": free_port_range(1),
        "stop_timeout_s": SPAWN_STOP_TIMEOUT_S,
    }
    router = launcher.router(spawn=spawn, claims={"recovery_window_s": RECOVERY_WINDOW_S})
    router.wait_live(["w0"])  # the server said hello: the wrapper has started it
    router.process.remember_descendants()  # teardown kills them should the router not
    [wrapper] = child_pids(router.process.pid)
    [server] = child_pids(wrapper)
    assert os.getpgid(server) == wrapper != server

    router.process.kill9()
    await asyncio.to_thread(router.restart, SETTLE_S)
    await asyncio.to_thread(router.wait_live, ["w0"])
    assert child_pids(router.process.pid) == [], "it respawned instead of adopting"

    router.process.signal(signal.SIGTERM)
    exit_code = await asyncio.to_thread(router.process.wait, SPAWN_STOP_TIMEOUT_S + 5.0)
    assert exit_code == 0, router.process.tail()
    assert not pid_alive(server), "the adopted server outlived the router"
    assert not pid_alive(wrapper), "the adopted wrapper outlived the router"


def _processes_with(marker: str) -> list[int]:
    """Live processes whose argument vector holds `marker` (found, never signalled, by it)."""
    return [
        int(entry)
        for entry in os.listdir("/proc")
        if entry.isdigit() and marker in cmdline(int(entry)) and pid_alive(int(entry))
    ]


@pytest.mark.parametrize("taken", ["listen", "admin"])
async def test_a_router_that_cannot_bind_stops_the_workers_it_spawned_and_exits(
    launcher: Launcher, tmp_path: Path, taken: str
) -> None:
    """Workers are spawned before the listeners bind: when a port is taken, `run` exits 1
    with the section and address, and leaves no worker and no socket file behind."""
    base_port = free_port_range(1)
    marker = str(base_port)  # an argument of this test's worker ({port}), nobody else's
    socket_path = tmp_path / "c.sock"
    with socket.create_server((LOOPBACK, 0)) as holder:
        port = holder.getsockname()[1]
        config = {
            "listen": {"host": LOOPBACK, "port": 0},
            "admin": {"host": LOOPBACK, "port": 0},
            taken: {"host": LOOPBACK, "port": port},
            "control": {"socket": f"unix:{socket_path}"},
            "spawn": {
                "command": demo_worker_command(),
                "base_port": base_port,
                "stop_timeout_s": SPAWN_STOP_TIMEOUT_S,
            },
        }
        config_path = tmp_path / "router.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        process = launcher.run_router("router", config_path)
        exit_code = await asyncio.to_thread(process.wait, START_TIMEOUT_S)
    left = _processes_with(marker)
    for pid in left:  # the bug this guards against: clean up what it left, by pid
        os.kill(pid, signal.SIGKILL)

    assert exit_code == 1, process.tail()
    assert f"episode-router: {taken} {LOOPBACK}:{port}: Address already in use" in process.tail()
    assert left == [], "spawned workers outlived the router that failed to start"
    assert not socket_path.exists()
