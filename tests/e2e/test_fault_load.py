"""Processes killed with SIGKILL while concurrent clients keep calling, on real processes.

A router process and demo worker processes on loopback (fixtures in conftest). Three
cases, each with processes of its own:

- a worker killed while a request to it is in flight: that request gets the router's
  410 or 502 and is never replayed on another worker;
- a worker killed while concurrent clients call the other workers' episodes: none of
  those calls fails, during the kill or after, and the dead worker's episodes get 410
  within a second;
- the router killed and restarted while concurrent clients call live episodes and start
  new ones: no call gets a wrong 401 (503 `recovering` instead), a 200 only ever comes
  from the episode's own worker with its state, and every episode, old or new, carries on.

Every client loop is bounded in calls and time.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import (
    START_TIMEOUT_S,
    Episode,
    Http,
    Launcher,
    Reply,
    Router,
    assert_router_answer,
    call_tool,
    served_problem,
    start_episode,
    until_gone,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

KILL_TO_410_S = 1.0
CALLS_MAX = 3000  # per client loop
CALLS_MAX_S = 30.0  # per client loop
RECOVERY_WINDOW_S = 10  # long enough for the workers' reconnect backoff
SLEEP_S = 5.0  # the in-flight call's length: the kill lands well inside it
EXITED_WITHIN_S = 5.0  # the e2e routers' reconnect grace is 2 s
UPSTREAM_FAILURES = "episode_router_upstream_failures_total"


async def wait_for(
    check: Callable[[], bool], what: str, timeout_s: float = START_TIMEOUT_S
) -> None:
    """Polls `check` (cheap, synchronous) without blocking the loop; fails at the deadline."""
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.02)


async def until_exited(router: Router, worker_id: str) -> None:
    """Until the admin API shows `worker_id` exited. A probe that reaches the port while the
    killed process is still being torn down may find it open: the worker is then `lost`
    until a refused connect or the end of the reconnect grace (2 s here) retires it."""
    await wait_for(
        lambda: router.workers().get(worker_id, {}).get("state") == "exited",
        f"{worker_id} to be exited",
        timeout_s=EXITED_WITHIN_S,
    )


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def metric(router: Router, name: str, **labels: str) -> float | None:
    """One sample of the router's Prometheus metrics, or None when it has none."""
    with _DIRECT.open(f"{router.admin_url}/metrics", timeout=2.0) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


# --- a worker killed with a request in flight -------------------------------------------------


async def test_a_request_in_flight_to_a_killed_worker_gets_the_routers_answer_once(
    launcher: Launcher, http: Http
) -> None:
    router = launcher.router()
    workers = {w.worker_id: w for w in launcher.workers(router, ["w1", "w2"])}
    router.wait_ready(recovered=True)
    episodes = [await start_episode(http, router.base_url) for _ in range(4)]
    doomed = episodes[0]
    others = [e for e in episodes if e.worker != doomed.worker]
    assert others, f"every episode went to {doomed.worker}"
    survivor = others[0].worker

    slow = asyncio.create_task(
        call_tool(http, router.base_url, doomed, "sleep", {"seconds": SLEEP_S}), name="in-flight"
    )
    await wait_for(
        lambda: router.workers().get(doomed.worker, {}).get("in_flight") == 1,
        "the call to be in flight",
        timeout_s=SLEEP_S / 2,
    )
    workers[doomed.worker].process.kill9()
    killed_at = time.monotonic()
    reply = await slow
    answered_after = time.monotonic() - killed_at

    # The router's own answer, naming the episode: not the worker's reply, nor a replay's.
    assert (reply.status, reply.error) in {(410, "worker_exited"), (502, "upstream_error")}, reply
    assert_router_answer(reply, reply.status, str(reply.error), doomed.key)
    assert answered_after < KILL_TO_410_S, answered_after
    await until_exited(router, doomed.worker)
    views = router.workers()
    assert (views[doomed.worker]["claims"], views[doomed.worker]["in_flight"]) == (0, 0)
    assert (views[survivor]["state"], views[survivor]["in_flight"]) == ("live", 0)
    kinds = ("refused", "error", "timeout")
    failed = {
        w: [metric(router, UPSTREAM_FAILURES, kind=k, worker=w) for k in kinds] for w in workers
    }
    assert sum(n or 0.0 for n in failed[doomed.worker]) == 1.0, failed  # the one call, once
    assert all(n in (None, 0.0) for n in failed[survivor]), failed  # nothing tried on the other
    for episode in others:  # the survivor's episodes: one call each, the first they ever got
        reply = await call_tool(http, router.base_url, episode, "get", None)
        problem = served_problem(reply, episode, 0)
        assert problem is None, problem
    reply = await call_tool(http, router.base_url, doomed, "get", None)
    assert_router_answer(reply, 410, "worker_exited", doomed.key)


# --- a worker killed under concurrent load ----------------------------------------------------


@dataclass(slots=True)
class Load:
    """What the concurrent clients saw: every call's end time and any problem."""

    problems: list[str] = field(default_factory=list)
    served_at: list[float] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def keep_adding(self, http: Http, base_url: str, episode: Episode) -> None:
        """`add 1` on one episode, call after call: each must be its own worker's next call
        with the running counter. Anything else, a failed connection included, is a problem."""
        ends_at = time.monotonic() + CALLS_MAX_S
        for _ in range(CALLS_MAX):
            if self.stop.is_set() or time.monotonic() > ends_at:
                return
            try:
                reply = await call_tool(http, base_url, episode, "add", {"value": 1})
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.problems.append(f"{episode.key}: {exc!r}")
                return
            episode.counter += 1
            problem = served_problem(reply, episode, episode.counter)
            if problem is not None:
                self.problems.append(problem)
                return
            self.served_at.append(time.monotonic())

    def served_between(self, start: float, end: float) -> int:
        return sum(1 for at in self.served_at if start <= at <= end)


async def test_a_killed_workers_episodes_get_410_while_concurrent_calls_to_others_all_succeed(
    launcher: Launcher, http: Http
) -> None:
    router = launcher.router()
    workers = {w.worker_id: w for w in launcher.workers(router, ["w1", "w2", "w3"])}
    router.wait_ready(recovered=True)
    episodes = [await start_episode(http, router.base_url) for _ in range(9)]
    victim = episodes[0].worker
    doomed = [e for e in episodes if e.worker == victim]
    survivors = [e for e in episodes if e.worker != victim]
    assert len(survivors) >= 4, [e.worker for e in episodes]

    load = Load()
    clients = [  # one client per surviving episode, all at once
        asyncio.create_task(load.keep_adding(http, router.base_url, e), name=f"client-{e.key}")
        for e in survivors
    ]
    try:
        await wait_for(lambda: len(load.served_at) >= 4 * len(survivors), "the load to run")
        workers[victim].process.kill9()
        killed_at = time.monotonic()
        gone = await asyncio.gather(
            *(until_gone(http, router.base_url, e, KILL_TO_410_S) for e in doomed)
        )
        gone_at = time.monotonic()
        await wait_for(lambda: load.served_between(gone_at, time.monotonic()) >= 20, "load after")
    finally:
        load.stop.set()
        await asyncio.gather(*clients)

    assert not load.problems, "\n".join(load.problems[:10])
    for episode, reply in zip(doomed, gone, strict=True):
        assert_router_answer(reply, 410, "worker_exited", episode.key)
    assert gone_at - killed_at < KILL_TO_410_S + 0.5, gone_at - killed_at
    # Calls were served while the router learnt of the kill (the second the contract gives it).
    assert load.served_between(killed_at, killed_at + KILL_TO_410_S) >= 1, load.served_at[-5:]
    await until_exited(router, victim)
    views = router.workers()
    assert (views[victim]["claims"], views[victim]["in_flight"]) == (0, 0)
    for worker_id in sorted(set(workers) - {victim}):
        mine = [e for e in survivors if e.worker == worker_id]
        assert (views[worker_id]["state"], views[worker_id]["claims"]) == ("live", len(mine))
    for episode in survivors:  # every call counted once, on its own worker
        reply = await call_tool(http, router.base_url, episode, "get", None)
        problem = served_problem(reply, episode, episode.counter)
        assert problem is None, problem


# --- the router killed and restarted under concurrent clients ---------------------------------

CALLERS = 3  # each calls `get` on its own share of the episodes started before the kill
STARTERS = 2  # each keeps starting new episodes and calling them
START_EVERY = 8  # a starter's turns: one start, then calls on the episodes it started


@dataclass(slots=True)
class Restart:
    """What the clients saw across the router's SIGKILL and restart."""

    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    last_ok: dict[str, float] = field(default_factory=dict)  # episode key → when it was served
    started: list[Episode] = field(default_factory=list)  # new episodes whose token came back
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def judge(self, episode: Episode, reply: Reply) -> None:
        """A 200 must be the episode's own worker with its counter; 503 `recovering` is
        allowed; anything else (a 401 above all) is a problem."""
        self.outcomes[f"{reply.status} {reply.error or ''}".strip()] += 1
        if reply.status == 200:
            body = reply.json()
            seen = (body["worker"], body["episode"], body["result"])
            if seen == (episode.worker, episode.key, episode.counter):
                self.last_ok[episode.key] = time.monotonic()
            else:
                self.problems.append(f"{episode.key} on {episode.worker}: got {body}")
        elif (reply.status, reply.error) != (503, "recovering"):
            self.problems.append(f"{episode.key} on {episode.worker}: {reply}")

    def served_since(self, episodes: list[Episode], since: float) -> bool:
        return all(self.last_ok.get(e.key, 0.0) > since for e in episodes)

    async def call(self, http: Http, base_url: str, episode: Episode) -> None:
        try:
            reply = await call_tool(http, base_url, episode, "get", None)
        except (aiohttp.ClientError, TimeoutError):  # the router is down, or was killed mid-call
            self.outcomes["connection failed"] += 1
            await asyncio.sleep(0.02)
            return
        self.judge(episode, reply)

    async def keep_calling(self, http: Http, base_url: str, episodes: list[Episode]) -> None:
        ends_at = time.monotonic() + CALLS_MAX_S
        for call in range(CALLS_MAX):
            if self.stop.is_set() or time.monotonic() > ends_at:
                return
            await self.call(http, base_url, episodes[call % len(episodes)])
            await asyncio.sleep(0.005)

    async def keep_starting(self, http: Http, base_url: str) -> None:
        """Every START_EVERY-th turn start an episode (and call it), otherwise call one of
        the episodes this client started. A start may fail while the router is down, or
        find no worker yet after the restart, and is then tried again."""
        mine: list[Episode] = []
        ends_at = time.monotonic() + CALLS_MAX_S
        for turn in range(CALLS_MAX):
            if self.stop.is_set() or time.monotonic() > ends_at:
                return
            if mine and turn % START_EVERY:
                await self.call(http, base_url, mine[turn % len(mine)])
            else:
                episode = await self.start(http, base_url)
                if episode is not None:
                    mine.append(episode)
                    await self.call(http, base_url, episode)
            await asyncio.sleep(0.005)

    async def start(self, http: Http, base_url: str) -> Episode | None:
        try:
            reply = await http.post(f"{base_url}/episodes")
        except (aiohttp.ClientError, TimeoutError):
            self.outcomes["start: connection failed"] += 1
            await asyncio.sleep(0.02)
            return None
        self.outcomes[f"start: {reply.status} {reply.error or ''}".strip()] += 1
        if reply.status != 200:
            if (reply.status, reply.error) != (503, "no_worker"):
                self.problems.append(f"POST /episodes: {reply}")
            await asyncio.sleep(0.02)
            return None
        data = reply.json()
        episode = Episode(data["token"], data["episode"], data["worker"])
        self.started.append(episode)
        return episode


async def test_router_killed_and_restarted_under_concurrent_callers_and_starters(
    launcher: Launcher, http: Http
) -> None:
    router = launcher.router(claims={"recovery_window_s": RECOVERY_WINDOW_S})
    workers = {w.worker_id: w for w in launcher.workers(router, ["w1", "w2", "w3"])}
    episodes = [await start_episode(http, router.base_url) for _ in range(6)]
    for value, episode in enumerate(episodes, start=1):
        reply = await call_tool(http, router.base_url, episode, "add", {"value": value})
        episode.counter += value
        assert reply.status == 200, str(reply)

    seen = Restart()
    clients = [
        asyncio.create_task(
            seen.keep_calling(http, router.base_url, episodes[i::CALLERS]), name=f"caller-{i}"
        )
        for i in range(CALLERS)
    ] + [
        asyncio.create_task(seen.keep_starting(http, router.base_url), name=f"starter-{i}")
        for i in range(STARTERS)
    ]
    try:
        await wait_for(lambda: seen.served_since(episodes, 0.0), "the calls to run")
        await wait_for(lambda: len(seen.started) >= 2, "new episodes before the kill")
        before_kill = list(seen.started)
        router.process.kill9()
        await asyncio.sleep(0.3)  # calls and starts meet a closed port meanwhile
        await asyncio.to_thread(router.restart)
        await asyncio.to_thread(router.wait_live, sorted(workers))
        back_at = time.monotonic()
        await wait_for(
            lambda: len(seen.started) >= len(before_kill) + 2, "new episodes after the restart"
        )
        await wait_for(lambda: seen.served_since(episodes + before_kill, back_at), "service again")
    finally:
        seen.stop.set()
        await asyncio.gather(*clients)

    assert not seen.problems, "\n".join(seen.problems[:10]) + f"\n{seen.outcomes}"
    allowed = {
        "200",
        "503 recovering",
        "connection failed",
        "start: 200",
        "start: 503 no_worker",
        "start: connection failed",
    }
    assert set(seen.outcomes) <= allowed, seen.outcomes
    assert seen.outcomes["connection failed"] + seen.outcomes["start: connection failed"] >= 1
    assert all(w.process.returncode is None for w in workers.values())
    new = seen.started
    assert {e.worker for e in new} <= set(workers)
    views = router.workers()
    for worker_id in sorted(workers):
        mine = sum(1 for e in episodes + new if e.worker == worker_id)
        # A start cut off by the kill may have claimed an episode whose token never came back.
        assert views[worker_id]["state"] == "live" and views[worker_id]["claims"] >= mine
    for episode in episodes + new:  # every episode a client got a token for is held
        view = router.admin(f"/admin/sessions/episode/{episode.key}")
        assert view is not None and view[0] == 200, view
        assert (view[1]["worker"], view[1]["state"]) == (episode.worker, "held"), view
    for episode in episodes + new:  # state intact, on the same worker
        reply = await call_tool(http, router.base_url, episode, "add", {"value": 1})
        episode.counter += 1
        body = reply.json()
        assert (reply.status, body["worker"], body["result"]) == (
            200,
            episode.worker,
            episode.counter,
        ), str(reply)
