"""Stress: thousands of episodes and cookie sessions through real router and worker processes.

Two rigs run at once, each a router process with four worker processes on loopback:

- episodes: four demo workers that claim their episodes over the control socket. Each
  episode starts (`POST /episodes`, balanced by the router), makes eight tool calls that
  must all run on its own worker with the expected results (`add` sums accumulate, `get`
  returns them, `echo` its arguments), and ends (`POST /episodes/end`); every eighth is
  called once more after its end and must get the router's own 410 `episode_ended`.
- cookie sessions: four unmodified Starlette workers (`tests/e2e/starlette_app.py`, static
  workers: the router learns each session from its seed reply's Set-Cookie). Each session
  is seeded, verified three times by its cookie (served by the process that holds it,
  with its value), closed, and verified once more: the router's 410 `episode_ended`.

Every reply is judged: `misrouted` when a worker other than the session's holder served
or refused it, `unexpected` for any other departure from the exact expected status and
body. The run passes with none of either, and with both routers holding no claims at the
end (every episode and session ended) and every worker still live.

    EPISODE_ROUTER_STRESS=1 python stress/stress.py [--scale 1.0] [--concurrency 32]

The variable keeps it from being started by accident; `--scale` multiplies the counts
(4,000 episodes and 1,000 sessions at 1.0; 0.02 is a smoke run). Clients use keep-alive
connections, every request has a timeout and the whole run a deadline. Every process is
started here and stopped by its pid at the end (SIGTERM, then SIGKILL), pass or fail;
their logs stay in the printed folder when the run fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parents[1]
APP_DIR = ROOT / "tests"  # the e2e helpers are imported as the suite imports them
for folder in (ROOT, APP_DIR):  # and `bench`, whose port picker the e2e helpers use
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from e2e.conftest import (  # noqa: E402
    LOOPBACK,
    START_TIMEOUT_S,
    Launcher,
    Process,
    Router,
    get_json,
    wait_until,
)
from e2e.starlette_app import SECRET_ENV, SESSION_COOKIE, SESSION_FIELD  # noqa: E402

from bench.launch import free_port  # noqa: E402

GATE_ENV = "EPISODE_ROUTER_STRESS"
EPISODES = 4000
SESSIONS = 1000
CALLS = ("add", "add", "get", "echo", "add", "get", "add", "get")  # eight per episode
VERIFIES = 3  # cookie verifies per session before its close
PROBE_EVERY = 8  # every eighth episode is called once after its end
WORKER_IDS = ("w0", "w1", "w2", "w3")
CONCURRENCY = 32  # clients in flight per rig
REQUEST_TIMEOUT_S = 30.0
RUN_DEADLINE_S = 1800.0  # the whole run, at any scale: a wedged rig fails, it never hangs
SHOWN_PROBLEMS = 10
TOKEN_HEADER = "X-NeMo-Gym-Episode-Token"
ROUTER_ANSWER_KEYS = {"error", "detail", "session"}


# --- judging replies ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    set_cookies: tuple[str, ...]

    def json(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return None

    def router_answer(self) -> tuple[str, Any] | None:
        """(code, session) of the router's own JSON answer, None for a worker's reply."""
        body = self.json()
        if isinstance(body, dict) and set(body) == ROUTER_ANSWER_KEYS:
            return body["error"], body["session"]
        return None

    def __str__(self) -> str:
        return f"{self.status} {self.body[:200].decode(errors='replace')}"


@dataclass(slots=True)
class Tally:
    """One rig's counts, and the first problems in full."""

    name: str
    requests: int = 0
    misrouted: int = 0
    unexpected: int = 0
    problems: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    end_state: str = ""  # why the routers' end state is wrong; empty when it is right

    def judge(self, problem: str | None, *, misrouted: bool = False) -> bool:
        """Counts one reply; True when it was the expected one."""
        self.requests += 1
        if problem is None:
            return True
        if misrouted:
            self.misrouted += 1
        else:
            self.unexpected += 1
        if len(self.problems) < SHOWN_PROBLEMS:
            self.problems.append(problem)
        return False

    @property
    def passed(self) -> bool:
        return not (self.misrouted or self.unexpected or self.end_state)

    def render(self) -> str:
        rate = self.requests / self.elapsed_s if self.elapsed_s else 0.0
        lines = [
            f"{self.name}: {self.requests} requests in {self.elapsed_s:.1f} s ({rate:.0f}/s),"
            f" {self.misrouted} misrouted, {self.unexpected} unexpected",
            *(f"  {problem}" for problem in self.problems),
        ]
        if self.end_state:
            lines.append(f"  end state: {self.end_state}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class Report:
    """The whole run: one tally per rig."""

    scale: float
    episodes: Tally
    sessions: Tally

    @property
    def passed(self) -> bool:
        return self.episodes.passed and self.sessions.passed

    def render(self) -> str:
        verdict = "PASSED" if self.passed else "FAILED"
        return "\n".join(
            [
                f"stress at scale {self.scale:g}: {verdict}",
                self.episodes.render(),
                self.sessions.render(),
            ]
        )


class Client:
    """Keep-alive HTTP to one router; every request bounded by REQUEST_TIMEOUT_S."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self.session = session
        self.base_url = base_url

    async def post(
        self, path: str, body: object = None, headers: dict[str, str] | None = None
    ) -> Reply:
        async with self.session.post(
            self.base_url + path,
            json=body,
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            allow_redirects=False,
        ) as reply:
            data = await reply.read()
            return Reply(reply.status, data, tuple(reply.headers.getall("Set-Cookie", [])))


def ended_problem(reply: Reply, key: str) -> str | None:
    """Why `reply` is not the router's own 410 for an ended session `key`."""
    if reply.status == 410 and reply.router_answer() == ("episode_ended", key):
        return None
    return f"{key} after its end: {reply}"


# --- episodes on demo workers ---------------------------------------------------------------


@dataclass(slots=True)
class Episode:
    key: str
    token: str
    worker: str
    counter: int = 0
    calls: int = 0


def next_call(name: str, index: int, step: int, episode: Episode) -> tuple[object, object]:
    """(arguments, expected result) of call `step` of episode `index`."""
    if name == "add":
        value = index * 10 + step  # a different sum for every episode: a mix-up shows
        episode.counter += value
        return {"value": value}, episode.counter
    if name == "echo":
        args = {"episode": index, "step": step}
        return args, args
    return None, episode.counter


def call_problem(reply: Reply, episode: Episode, result: object) -> tuple[str | None, bool]:
    """(why the call went wrong or None, whether another worker took it)."""
    body = reply.json()
    holder = body.get("worker") if isinstance(body, dict) else None
    if holder is not None and holder != episode.worker:
        return f"{episode.key} of {episode.worker} reached {holder}: {reply}", True
    expected = {
        "worker": episode.worker,
        "episode": episode.key,
        "result": result,
        "calls": episode.calls,
    }
    if reply.status == 200 and body == expected:
        return None, False
    return f"{episode.key} expected {expected}, got {reply}", False


async def run_episode(client: Client, run: str, index: int, tally: Tally) -> None:
    """One episode: start, eight calls, end, and maybe one call after its end."""
    reply = await client.post("/episodes", {"ep": f"stress-{run}-{index}"})
    body = reply.json()
    started = reply.status == 200 and isinstance(body, dict) and {"token", "episode"} <= set(body)
    if not tally.judge(None if started else f"start {index}: {reply}"):
        return
    episode = Episode(body["episode"], body["token"], body["worker"])
    headers = {TOKEN_HEADER: episode.token}
    for step, name in enumerate(CALLS, start=1):
        args, result = next_call(name, index, step, episode)
        episode.calls += 1
        reply = await client.post(f"/tools/{name}", args, headers)
        problem, misrouted = call_problem(reply, episode, result)
        if not tally.judge(problem, misrouted=misrouted):
            return  # its later calls would only repeat the first fault
    reply = await client.post("/episodes/end", None, headers)
    ended = {"ended": True, "counter": episode.counter}
    problem, misrouted = call_problem(reply, episode, ended)
    if tally.judge(problem, misrouted=misrouted) and index % PROBE_EVERY == 0:
        reply = await client.post("/tools/get", None, headers)
        tally.judge(ended_problem(reply, episode.key))


def start_episode_rig(launcher: Launcher) -> Router:
    """A router and four demo workers with control-socket claims, ready and recovered."""
    router = launcher.router(
        "episodes",
        control={"lease_timeout_s": 15, "reconnect_grace_s": 5},
        log={"level": "warning"},
    )
    launcher.workers(router, WORKER_IDS)
    router.wait_ready(recovered=True)
    return router


# --- cookie sessions on unmodified Starlette workers ----------------------------------------


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    value: str
    worker: int  # the pid of the process that holds it
    cookie: str


def session_cookie(reply: Reply) -> str | None:
    jar: SimpleCookie = SimpleCookie()
    for header in reply.set_cookies:
        jar.load(header)
    morsel = jar.get(SESSION_COOKIE)
    return morsel.value if morsel is not None and morsel.value else None


def verify_problem(reply: Reply, session: Session) -> tuple[str | None, bool]:
    body = reply.json()
    expected = {"session_id": session.session_id, "worker": session.worker, "value": session.value}
    if reply.status == 200 and body == expected:
        return None, False
    holder = body.get("worker") if isinstance(body, dict) else None
    # A worker that does not hold the session answers 404 "no such session here".
    wrong = (holder is not None and holder != session.worker) or (
        reply.status == 404 and body == {"error": "no such session here"}
    )
    return f"{session.session_id} (pid {session.worker}): {reply}", wrong


async def run_session(client: Client, run: str, index: int, tally: Tally) -> None:
    """One cookie session: seed, verify three times, close, verify once more."""
    value = f"{run}-{index}"
    reply = await client.post("/seed_session", {"value": value})
    body, cookie = reply.json(), session_cookie(reply)
    seeded = reply.status == 200 and isinstance(body, dict) and cookie is not None
    if not tally.judge(None if seeded else f"seed {index}: {reply}"):
        return
    assert cookie is not None
    session = Session(body["session_id"], value, body["worker"], cookie)
    headers = {"Cookie": f"{SESSION_COOKIE}={session.cookie}"}
    for _ in range(VERIFIES):
        problem, misrouted = verify_problem(await client.post("/verify", None, headers), session)
        if not tally.judge(problem, misrouted=misrouted):
            return
    reply = await client.post("/close_session", None, headers)
    closed = reply.status == 200 and reply.json() == {
        "closed": session.session_id,
        "worker": session.worker,
    }
    if tally.judge(None if closed else f"close {session.session_id}: {reply}"):
        reply = await client.post("/verify", None, headers)
        tally.judge(ended_problem(reply, session.session_id))


def start_session_rig(launcher: Launcher, secret: str) -> Router:
    """Four uvicorn processes running the Starlette app, and a router with them as static
    workers and their session cookie as its session kind, ready and recovered."""
    servers = []
    for worker_id in WORKER_IDS:
        port = free_port()
        argv = [
            *(sys.executable, "-m", "uvicorn", "e2e.starlette_app:create_app", "--factory"),
            *("--app-dir", str(APP_DIR), "--host", LOOPBACK, "--port", str(port)),
            *("--workers", "1", "--no-access-log", "--log-level", "warning"),
        ]
        process = launcher.start(f"sessions-{worker_id}", argv, env={SECRET_ENV: secret})
        servers.append((worker_id, port, process))
    for worker_id, port, process in servers:
        url = f"http://{LOOPBACK}:{port}/health"
        healthy = _answers(url)
        wait_until(f"{worker_id} to answer /health", healthy, START_TIMEOUT_S, watch=process)
    workers = [{"id": w, "url": f"http://{LOOPBACK}:{port}"} for w, port, _ in servers]
    return _session_router(launcher, workers)


def _answers(url: str) -> Callable[[], bool]:
    def check() -> bool:
        reply = get_json(url)
        return reply is not None and reply[0] == 200

    return check


def _session_router(launcher: Launcher, workers: list[dict[str, str]]) -> Router:
    folder = launcher.root / "sessions"
    folder.mkdir()
    socket_path = folder / "control.sock"
    public_port, admin_port = free_port(), free_port()
    cookie = {"name": SESSION_COOKIE, "format": "starlette", "field": SESSION_FIELD}
    kind = {
        "name": "resources",
        "cookie": cookie,
        "seed": {"method": "POST", "path": "/seed_session"},
        "close": {"method": "POST", "path": "/close_session"},
    }
    config: dict[str, Any] = {
        "listen": {"host": LOOPBACK, "port": public_port},
        "admin": {"host": LOOPBACK, "port": admin_port},
        "control": {"socket": f"unix:{socket_path}"},
        "workers": workers,
        "health": {"path": "/health", "interval_s": 1, "timeout_s": 2},
        "sessions": [kind],
        "timeouts": {"connect_s": 2, "shutdown_grace_s": 2},
        "log": {"format": "json", "level": "warning"},
    }
    config_path = folder / "router.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    process: Process = launcher.run_router("sessions", config_path)
    router = Router(
        launcher,
        "sessions",
        folder,
        config,
        config_path,
        socket_path,
        public_port,
        admin_port,
        process,
    )
    router.wait_ready(recovered=True)
    router.wait_live(WORKER_IDS)
    return router


# --- the run --------------------------------------------------------------------------------


def end_state_problem(router: Router) -> str:
    """Empty when every worker is live and no claim is left; else what is wrong."""
    views = router.workers()
    states = {worker_id: view.get("state") for worker_id, view in views.items()}
    claims = {worker_id: view.get("claims") for worker_id, view in views.items()}
    if states != dict.fromkeys(WORKER_IDS, "live") or any(claims.values()):
        return f"workers {states}, claims {claims}"
    return ""


async def drive(
    tally: Tally,
    base_url: str,
    count: int,
    concurrency: int,
    one: Callable[[Client, str, int, Tally], Awaitable[None]],
) -> None:
    """Runs `one` for indices 0..count-1, `concurrency` at a time, on one keep-alive pool."""
    run = secrets.token_hex(4)
    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    started = time.monotonic()
    async with aiohttp.ClientSession(
        connector=connector, cookie_jar=aiohttp.DummyCookieJar()
    ) as http:
        client = Client(http, base_url)

        async def gated(index: int) -> None:
            async with gate:
                try:
                    await one(client, run, index, tally)
                except (aiohttp.ClientError, TimeoutError) as exc:
                    tally.judge(f"{tally.name} {index}: {type(exc).__name__}: {exc}")

        await asyncio.gather(*(gated(index) for index in range(count)))
    tally.elapsed_s = time.monotonic() - started


async def run_stress(launcher: Launcher, *, scale: float, concurrency: int = CONCURRENCY) -> Report:
    """Starts both rigs with `launcher` (which stops them), runs them at once, and reports.
    Raises TimeoutError past RUN_DEADLINE_S."""
    if not 0 < scale <= 100:
        raise ValueError(f"scale must be in (0, 100], not {scale}")
    secret = secrets.token_urlsafe(32)
    episode_router = await asyncio.to_thread(start_episode_rig, launcher)
    session_router = await asyncio.to_thread(start_session_rig, launcher, secret)
    episodes, sessions = Tally("episodes"), Tally("cookie sessions")
    async with asyncio.timeout(RUN_DEADLINE_S):
        await asyncio.gather(
            drive(
                episodes,
                episode_router.base_url,
                _scaled(EPISODES, scale),
                concurrency,
                run_episode,
            ),
            drive(
                sessions,
                session_router.base_url,
                _scaled(SESSIONS, scale),
                concurrency,
                run_session,
            ),
        )
    episodes.end_state = await asyncio.to_thread(end_state_problem, episode_router)
    sessions.end_state = await asyncio.to_thread(end_state_problem, session_router)
    return Report(scale, episodes, sessions)


def _scaled(count: int, scale: float) -> int:
    return max(1, round(count * scale))


def expected_requests(scale: float) -> tuple[int, int]:
    """Requests a clean run makes: (episodes rig, cookie sessions rig)."""
    episodes, sessions = _scaled(EPISODES, scale), _scaled(SESSIONS, scale)
    probes = len(range(0, episodes, PROBE_EVERY))
    return episodes * (len(CALLS) + 2) + probes, sessions * (VERIFIES + 3)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the counts")
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help="clients per rig")
    args = parser.parse_args(argv)
    if os.environ.get(GATE_ENV) != "1":
        print(f"set {GATE_ENV}=1 to run the stress test (it starts ten processes)", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="episode-router-stress-"))
    launcher = Launcher(root)
    try:
        report = asyncio.run(run_stress(launcher, scale=args.scale, concurrency=args.concurrency))
    finally:
        launcher.stop_all()
    print(report.render())
    if report.passed:
        shutil.rmtree(root, ignore_errors=True)
        return 0
    print(f"process logs: {root}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
