"""Routing end to end: every episode's calls reach its own worker, on real processes.

A router and four demo worker processes on private ports: 200 episodes make
eight tool calls each through the public port, every request on a new
connection, and every call must run on the worker that created its episode.
Then the `episode-router demo` command: its printed curl flow is run as printed.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import shlex
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from bench.launch import free_port, free_port_range

from .conftest import (
    START_TIMEOUT_S,
    Episode,
    Http,
    Launcher,
    Reply,
    assert_router_answer,
    call_tool,
    clean_env,
    get_json,
    pid_alive,
    served_problem,
    start_episode,
    wait_until,
)

pytestmark = pytest.mark.e2e

EPISODES = 200
CONCURRENCY = 32
# One episode's eight calls: `add` results accumulate, `get` returns the sum, `echo` its args.
PLAN = ("add", "add", "get", "echo", "add", "get", "add", "get")


def next_call(name: str, index: int, step: int, episode: Episode) -> tuple[object, object]:
    """(arguments, expected result) of call `step` of episode number `index`."""
    if name == "add":
        value = index * 10 + step  # a different sum for every episode: a mix-up shows
        episode.counter += value
        return {"value": value}, episode.counter
    if name == "echo":
        args = {"episode": index, "step": step}
        return args, args
    return None, episode.counter


async def run_episode(
    http: Http, base_url: str, index: int, gate: asyncio.Semaphore
) -> tuple[Episode, str | None]:
    """Start episode `index` and make its eight calls; the first problem stops it."""
    async with gate:
        episode = await start_episode(http, base_url, ep=f"route-{index}")
        for step, name in enumerate(PLAN, start=1):
            args, result = next_call(name, index, step, episode)
            reply = await call_tool(http, base_url, episode, name, args)
            problem = served_problem(reply, episode, result)
            if problem is not None:
                return episode, f"call {step} ({name}) of {problem}"
        return episode, None


async def test_every_call_runs_on_its_episodes_worker(launcher: Launcher, http: Http) -> None:
    router = launcher.router()
    launcher.workers(router, ["w1", "w2", "w3", "w4"])
    router.wait_ready(recovered=True)
    gate = asyncio.Semaphore(CONCURRENCY)

    results = await asyncio.gather(
        *(run_episode(http, router.base_url, index, gate) for index in range(EPISODES))
    )

    problems = [problem for _, problem in results if problem is not None]
    assert not problems, (
        f"{len(problems)} of {EPISODES} episodes had a call refused or misrouted; first ones:\n"
        + "\n".join(problems[:8])
    )
    episodes = [episode for episode, _ in results]
    assert sum(episode.calls for episode in episodes) == EPISODES * len(PLAN)
    spread = Counter(episode.worker for episode in episodes)
    assert len(spread) >= 3, f"episodes were not spread over the workers: {spread}"
    views = router.workers()
    held = {worker_id: view["claims"] for worker_id, view in views.items()}
    assert held == {w: spread.get(w, 0) for w in ("w1", "w2", "w3", "w4")}
    assert {view["state"] for view in views.values()} == {"live"}


# --- the demo command -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Curl:
    """One curl command line as the demo prints it."""

    method: str
    url: str
    headers: dict[str, str] = field(default_factory=dict)
    data: str | None = None


def parse_curl(line: str) -> Curl:
    """The request a printed `curl` line makes (only the flags the banner uses)."""
    words = shlex.split(line)
    assert words[0] == "curl", line
    method, url, headers, data = "GET", "", {}, None
    rest = iter(words[1:])
    for word in rest:
        if word == "-X":
            method = next(rest)
        elif word == "-H":
            name, _, value = next(rest).partition(":")
            headers[name.strip()] = value.strip()
        elif word == "-d":
            data = next(rest)
        elif word.startswith("http://"):
            url = word
        else:
            assert word in ("-s", "-i"), f"unexpected curl argument {word!r} in {line!r}"
    return Curl(method, url, headers, data)


def banner_commands(banner: str) -> list[str]:
    """The curl command lines of the banner, in order (the one inside TOKEN=$(...) too)."""
    commands = []
    for line in banner.splitlines():
        line = line.strip()
        captured = re.match(r"TOKEN=\$\((curl [^|]*)\|", line)
        if captured:
            commands.append(captured.group(1).strip())
        elif line.startswith("curl "):
            commands.append(line)
    return commands


def cli_argv(command: str) -> list[str]:
    """The argument vector of a printed `episode-router ...` (or `python -m router.cli ...`)."""
    words = shlex.split(command)
    if words[0] == "episode-router":
        return [sys.executable, "-m", "router.cli", *words[1:]]
    assert words[1:3] == ["-m", "router.cli"], f"not an episode-router command: {command!r}"
    return [sys.executable, *words[1:]]


def run_cli(command: str) -> str:
    """Run a printed episode-router command line as a user would; its stdout."""
    done = subprocess.run(
        cli_argv(command),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        env=clean_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def expand(command: str, token: str) -> str:
    """The shell's substitutions in a banner line: $TOKEN and $(episode-router ...)."""
    command = command.replace("$TOKEN", token)
    return re.sub(r"\$\(([^)]*)\)", lambda found: run_cli(found.group(1)).strip(), command)


def status_table(text: str) -> list[dict[str, str]]:
    """The rows of `episode-router status` output, by column name (cells may be empty)."""
    header, *rows = text.splitlines()
    names = header.split()
    starts = [header.index(name) for name in names] + [None]
    return [
        {
            name: row[start:end].strip()
            for name, (start, end) in zip(names, itertools.pairwise(starts), strict=True)
        }
        for row in rows
    ]


async def send(http: Http, curl: Curl) -> Reply:
    headers = dict(curl.headers)
    if curl.data is not None:
        headers.setdefault("Content-Type", "application/x-www-form-urlencoded")  # as curl -d
    return await http.request(curl.method, curl.url, headers=headers, data=curl.data)


async def test_demo_command_flow_works_and_sigint_stops_it(
    launcher: Launcher, http: Http, tmp_path: Path
) -> None:
    port, admin_port, base_port = free_port(), free_port(), free_port_range(2)
    admin = f"http://127.0.0.1:{admin_port}"
    demo = launcher.start(
        "demo",
        [
            *(sys.executable, "-m", "router.cli", "demo", "--workers", "2"),
            *("--port", str(port), "--admin-port", str(admin_port), "--base-port", str(base_port)),
        ],
        env={"TMPDIR": str(tmp_path)},  # its control socket's folder goes under tmp_path
        capture_stdout=True,
    )

    def workers_live() -> bool:
        reply = get_json(f"{admin}/admin/workers")
        views = reply[1]["workers"] if reply is not None and reply[0] == 200 else []
        return sorted((v["id"], v["state"]) for v in views) == [("w0", "live"), ("w1", "live")]

    def recovered() -> bool:
        reply = get_json(f"{admin}/readyz")
        return reply is not None and reply[0] == 200 and reply[1]["recovering"] is False

    wait_until("the demo's 2 workers live", workers_live, START_TIMEOUT_S, watch=demo)
    wait_until("the demo's recovery window to end", recovered, START_TIMEOUT_S, watch=demo)
    workers = demo.remember_descendants()
    assert len(workers) == 2 and all("router.demo" in argv for argv in workers.values())
    sockets = await asyncio.to_thread(
        lambda: list(tmp_path.glob("episode-router-demo-*/control.sock"))
    )
    assert len(sockets) == 1

    banner = demo.output()  # printed (and flushed) before the router starts
    commands = banner_commands(banner)
    paths = [parse_curl(c).url.removeprefix(f"http://127.0.0.1:{port}") for c in commands]
    assert paths == [
        *("/episodes", "/tools/add", "/tools/get"),  # start, add 5, get 5 on the same worker
        *("/episodes/end", "/tools/get", "/tools/get"),  # end → 410; a stranger's token → 401
    ]
    started = await send(http, parse_curl(commands[0]))
    assert started.status == 200, str(started)
    token, key, worker = (started.json()[name] for name in ("token", "episode", "worker"))
    episode = Episode(token, key, worker)
    replies = [await send(http, parse_curl(expand(c, token))) for c in commands[1:]]
    assert served_problem(replies[0], episode, 5) is None, str(replies[0])  # add 5
    assert served_problem(replies[1], episode, 5) is None, str(replies[1])  # get: same worker
    ended = {"worker": worker, "episode": key, "result": {"ended": True, "counter": 5}}
    assert (replies[2].status, replies[2].json()) == (200, {**ended, "calls": 2})
    assert_router_answer(replies[3], 410, "episode_ended", key)
    assert_router_answer(replies[4], 401, "unknown_episode", "nobody-a0")

    status = re.search(r"^\s*((?:episode-router|\S+ -m router\.cli) status .*)$", banner, re.M)
    assert status is not None, banner
    rows = status_table(run_cli(status.group(1)))
    assert sorted((row["id"], row["state"], row["claims"]) for row in rows) == [
        ("w0", "live", "0"),
        ("w1", "live", "0"),
    ]

    demo.signal(signal.SIGINT)
    assert await asyncio.to_thread(demo.wait, 15.0) == 0, demo.tail()
    assert not [pid for pid in workers if pid_alive(pid)], "demo workers outlived the demo"
    assert not sockets[0].exists()
