"""End-to-end fixtures: real router and demo worker processes on loopback and Unix sockets.

Every process is started from `sys.executable`, writes its stderr to a file
under the test's temporary directory, and is killed by pid when its fixture
ends, pass or fail (SIGTERM, then SIGKILL; processes the router spawned are
found through /proc and killed too). Every wait has a deadline. A failing test's
report carries the tail of each live process's stderr.

HTTP goes through `Http`: a new connection for every request (`Connection:
close`, no pool reuse), so each request could land anywhere.

With E2E_WORKERS_SKIP_CLAIM=1 every demo worker runs with `--no-claim`: it keeps
its control lease but never claims an episode. The suite must then fail, which
shows that the claims are what routes episodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
import pytest
import yaml
from multidict import CIMultiDict, CIMultiDictProxy

from bench.launch import free_port  # the one port picker (scripts put the repository on sys.path)

SKIP_CLAIM = os.environ.get("E2E_WORKERS_SKIP_CLAIM") == "1"
TOKEN_HEADER = "X-NeMo-Gym-Episode-Token"
LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 20.0  # a cold interpreter importing aiohttp on a busy 2-core machine
STOP_TIMEOUT_S = 5.0  # SIGTERM gets this long before SIGKILL
POLL_S = 0.05
REQUEST_TIMEOUT_S = 10.0
TAIL_LINES = 25

# --- ports and processes ------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a process, or None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # comm may hold spaces and parentheses
    return fields[0], int(fields[1])


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie waiting to be reaped counts as gone)."""
    stat = _proc_stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def cmdline(pid: int) -> list[str]:
    """The argument vector of `pid` ([] once it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")[:-1]


def child_pids(pid: int) -> list[int]:
    """Live children of `pid` (the router's spawned workers run in sessions of their own,
    but they are still its children)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None and stat[1] == pid and stat[0] not in ("Z", "X"):
                children.append(int(entry))
    return sorted(children)


def wait_until(
    what: str, check: Callable[[], bool], timeout: float, *, watch: Process | None = None
) -> None:
    """Poll `check` until it holds; AssertionError at the deadline or if `watch` exits."""
    deadline = time.monotonic() + timeout
    while not check():
        if watch is not None and watch.returncode is not None:
            raise AssertionError(
                f"{watch.name} exited with {watch.returncode} while waiting for {what}\n"
                + watch.tail()
            )
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(POLL_S)


class Process:
    """A process a test started: stderr in a file, stopped by pid."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        folder: Path,
        env: Mapping[str, str],
        *,
        capture_stdout: bool = False,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.stderr_path = folder / f"{name}.stderr"
        self.stdout_path = folder / f"{name}.stdout" if capture_stdout else None
        self.descendants: dict[int, list[str]] = {}  # pid → argv, recorded while alive
        with contextlib.ExitStack() as files:
            stderr = files.enter_context(self.stderr_path.open("ab"))
            stdout: IO[bytes] | int = subprocess.DEVNULL
            if self.stdout_path is not None:
                stdout = files.enter_context(self.stdout_path.open("ab"))
            self.popen = subprocess.Popen(
                self.argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=dict(env)
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        return self.popen.poll()

    def signal(self, signum: signal.Signals) -> None:
        """Send `signum` to this process (by its pid), unless it already exited."""
        if self.popen.poll() is None:
            self.popen.send_signal(signum)

    def kill9(self) -> None:
        """SIGKILL, and reap it: gone from the process table when this returns."""
        self.signal(signal.SIGKILL)
        self.popen.wait(STOP_TIMEOUT_S)

    def wait(self, timeout: float) -> int | None:
        """Its exit status, or None if it still runs after `timeout` seconds."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def remember_descendants(self) -> dict[int, list[str]]:
        """Record the live processes below this one (to kill them if they outlive it)."""
        pending = [self.pid] if self.returncode is None else []
        found: dict[int, list[str]] = {}
        while pending:
            for child in child_pids(pending.pop()):
                found[child] = cmdline(child)
                pending.append(child)
        self.descendants.update(found)
        return found

    def ask_to_stop(self) -> None:
        """SIGTERM, once what runs below it is on record."""
        self.remember_descendants()
        self.signal(signal.SIGTERM)

    def make_sure_stopped(self, deadline: float) -> None:
        """SIGKILL it if it still runs at `deadline`, then what it left running."""
        if self.wait(max(0.0, deadline - time.monotonic())) is None:
            self.kill9()
        for pid, argv in self.descendants.items():
            if argv and cmdline(pid) == argv and pid_alive(pid):  # the same process, not a reuse
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def output(self) -> str:
        """What it wrote on stdout so far (only when started with capture_stdout)."""
        if self.stdout_path is None:
            return ""
        return self.stdout_path.read_text(errors="replace")

    def tail(self, lines: int = TAIL_LINES) -> str:
        text = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        last = "\n".join(text.splitlines()[-lines:])
        return f"--- {self.name} (pid {self.pid}, exit {self.returncode}) stderr tail ---\n{last}"


# --- sync HTTP, for readiness polls --------------------------------------------------------------


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy


def get_json(url: str, timeout: float = 2.0) -> tuple[int, Any] | None:
    """GET `url` on a new connection: (status, JSON body or None), or None if unreachable."""
    request = urllib.request.Request(url, headers={"Connection": "close"})
    try:
        with _DIRECT.open(request, timeout=timeout) as reply:
            return int(reply.status), _json_or_none(reply.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), _json_or_none(exc.read())
    except (OSError, ValueError):
        return None


def _json_or_none(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


# --- the router and its workers ------------------------------------------------------------------


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without the suite's and the router's own variables."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("E2E_", "EPISODE_ROUTER_", "EPISODE_TOKEN_"))
        and not key.lower().endswith("_proxy")  # everything here is loopback
    }
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def demo_worker_command() -> str:
    """The spawn-mode template for a demo worker (the router fills in the placeholders)."""
    command = (
        f"{shlex.quote(sys.executable)} -m router.demo"
        " --host {host} --port {port} --worker-id {worker_id}"
    )
    return command + (" --no-claim" if SKIP_CLAIM else "")


@dataclass(slots=True)
class Worker:
    """A demo worker process on a private loopback port."""

    worker_id: str
    port: int
    process: Process

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def healthy(self) -> bool:
        reply = get_json(f"{self.url}/health")
        return reply is not None and reply[0] == 200


@dataclass(slots=True)
class Router:
    """A router process and the config file it runs with (kept for a restart)."""

    launcher: Launcher
    name: str
    folder: Path
    config: dict[str, Any]
    config_path: Path
    socket_path: Path
    public_port: int
    admin_port: int
    process: Process
    starts: int = 1

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.public_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{LOOPBACK}:{self.admin_port}"

    def admin(self, path: str) -> tuple[int, Any] | None:
        return get_json(self.admin_url + path)

    def workers(self) -> dict[str, dict[str, Any]]:
        """The admin API's view of every worker, by id ({} while unreachable)."""
        reply = self.admin("/admin/workers")
        if reply is None or reply[0] != 200:
            return {}
        return {view["id"]: view for view in reply[1]["workers"]}

    def readiness(self) -> dict[str, Any] | None:
        reply = self.admin("/readyz")
        return reply[1] if reply is not None and isinstance(reply[1], dict) else None

    def wait_ready(self, *, recovered: bool = False, timeout: float = START_TIMEOUT_S) -> None:
        """Until /readyz answers (and, with `recovered`, says the recovery window is over)."""

        def ready() -> bool:
            body = self.readiness()
            return body is not None and not (recovered and body.get("recovering"))

        what = f"{self.name} to be ready" + (" and recovered" if recovered else "")
        wait_until(what, ready, timeout, watch=self.process)

    def wait_live(self, worker_ids: Sequence[str], timeout: float = START_TIMEOUT_S) -> None:
        """Until the admin API shows every one of `worker_ids` live."""

        def live() -> bool:
            views = self.workers()
            return all(views.get(w, {}).get("state") == "live" for w in worker_ids)

        wait_until(f"workers {list(worker_ids)} live on {self.name}", live, timeout)

    def restart(self, timeout: float = START_TIMEOUT_S) -> Process:
        """A new router process with the same config; returns once it is ready."""
        self.starts += 1
        self.process = self.launcher.run_router(f"{self.name}-{self.starts}", self.config_path)
        self.wait_ready(timeout=timeout)
        return self.process


class Launcher:
    """Starts the processes of one test (or module), and stops every one of them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.processes: list[Process] = []

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        capture_stdout: bool = False,
    ) -> Process:
        process = Process(name, argv, self.root, clean_env(env), capture_stdout=capture_stdout)
        self.processes.append(process)
        return process

    def router(self, name: str = "router", **sections: dict[str, Any]) -> Router:
        """Write a config (short timeouts; `sections` override keys per section), start the
        router and wait until it is ready."""
        folder = self.root / name
        folder.mkdir()
        socket_path = folder / "control.sock"
        public_port, admin_port = free_port(), free_port()
        config: dict[str, Any] = {
            "listen": {"host": LOOPBACK, "port": public_port},
            "admin": {"host": LOOPBACK, "port": admin_port},
            "control": {
                "socket": f"unix:{socket_path}",
                "lease_timeout_s": 3,
                "reconnect_grace_s": 2,
            },
            "claims": {"recovery_window_s": 1},
            "timeouts": {"shutdown_grace_s": 5},
            "log": {"format": "json"},
        }
        for section, values in sections.items():
            config[section] = {**config.get(section, {}), **values}
        router = self.router_from(name, folder, config)
        router.wait_ready()
        return router

    def router_from(self, name: str, folder: Path, config: dict[str, Any]) -> Router:
        """Write `config` (its listen, admin and control.socket as the router will bind
        them) to `folder` and start a router with it; the caller waits for what it needs."""
        config_path = folder / "router.yaml"
        config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        return Router(
            launcher=self,
            name=name,
            folder=folder,
            config=config,
            config_path=config_path,
            socket_path=Path(config["control"]["socket"].removeprefix("unix:")),
            public_port=config["listen"]["port"],
            admin_port=config["admin"]["port"],
            process=self.run_router(name, config_path),
        )

    def run_router(self, name: str, config_path: Path) -> Process:
        """`episode-router run --config config_path`, as a process of its own."""
        argv = [sys.executable, "-m", "router.cli", "run", "--config", str(config_path)]
        return self.start(name, argv)

    def workers(
        self, router: Router, worker_ids: Sequence[str], *, env: Mapping[str, str] | None = None
    ) -> list[Worker]:
        """Start demo workers on `router`'s control socket; return once the router has them
        live. They start together, so their interpreters warm up in parallel."""
        started = []
        for worker_id in worker_ids:
            port = free_port()
            argv = [
                sys.executable,
                "-m",
                "router.demo",
                "--host",
                LOOPBACK,
                "--port",
                str(port),
                "--worker-id",
                worker_id,
                "--control",
                f"unix:{router.socket_path}",
            ]
            if SKIP_CLAIM:
                argv.append("--no-claim")
            process = self.start(f"{router.name}-{worker_id}", argv, env=env)
            started.append(Worker(worker_id, port, process))
        for worker in started:
            wait_until(
                f"{worker.worker_id} to answer /health",
                worker.healthy,
                START_TIMEOUT_S,
                watch=worker.process,
            )
        router.wait_live(worker_ids)
        return started

    def stop_all(self) -> None:
        """Stop every process (SIGTERM to all, then SIGKILL to whatever still runs after
        STOP_TIMEOUT_S); never raises, so every one gets its turn."""
        for process in self.processes:
            with contextlib.suppress(Exception):
                process.ask_to_stop()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self.processes:
            with contextlib.suppress(Exception):
                process.make_sure_stopped(deadline)

    def tails(self) -> str:
        return "\n".join(process.tail() for process in self.processes)


_ACTIVE: list[Launcher] = []


@contextlib.contextmanager
def _launched(root: Path) -> Iterator[Launcher]:
    launcher = Launcher(root)
    _ACTIVE.append(launcher)
    try:
        yield launcher
    finally:
        _ACTIVE.remove(launcher)
        launcher.stop_all()


@pytest.fixture
def launcher(tmp_path: Path) -> Iterator[Launcher]:
    """Starts processes for one test; stops them all when it ends."""
    with _launched(tmp_path) as started:
        yield started


@pytest.fixture(scope="module")
def module_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launcher]:
    """Starts processes shared by the tests of one module; stops them all after the last."""
    with _launched(tmp_path_factory.mktemp("e2e")) as started:
        yield started


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing test's report carries the stderr tails of the processes it ran with."""
    report = yield
    if report.failed and _ACTIVE:
        report.sections.append(("process stderr", "\n".join(x.tails() for x in _ACTIVE)))
    return report


# --- async HTTP with a new connection per request ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Reply:
    """One HTTP reply, read whole."""

    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def json(self) -> dict[str, Any]:
        value = json.loads(self.body)
        assert isinstance(value, dict), f"not a JSON object: {self}"
        return value

    @property
    def error(self) -> str | None:
        """The `error` code of a JSON refusal (the router's or a worker's)."""
        with contextlib.suppress(ValueError, AssertionError):
            error = self.json().get("error")
            return error if isinstance(error, str) else None
        return None

    def __str__(self) -> str:
        return f"{self.status} {self.body[:300].decode(errors='replace')}"


class Http:
    """HTTP/1.1 with `Connection: close` and a new connection for every request.

    Each request gets REQUEST_TIMEOUT_S in all; a request that takes longer fails.
    """

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def request(
        self,
        method: str,
        url: str,
        *,
        tokens: Sequence[str] = (),
        body: object = None,
        data: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """Send one request; each of `tokens` becomes one token header line."""
        sent: CIMultiDict[str] = CIMultiDict(headers or {})
        sent["Connection"] = "close"
        for token in tokens:
            sent.add(TOKEN_HEADER, token)
        payload = data
        if body is not None:
            payload = json.dumps(body)
            sent["Content-Type"] = "application/json"
        async with self.session.request(
            method,
            url,
            data=payload,
            headers=sent,
            timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            allow_redirects=False,
        ) as reply:
            return Reply(reply.status, reply.headers, await reply.read())

    async def post(self, url: str, *, token: str | None = None, body: object = None) -> Reply:
        tokens = (token,) if token is not None else ()
        return await self.request("POST", url, tokens=tokens, body=body)


@pytest.fixture
async def http() -> AsyncIterator[Http]:
    """A client that never reuses a connection."""
    connector = aiohttp.TCPConnector(force_close=True, limit=64)
    async with aiohttp.ClientSession(connector=connector) as session:
        yield Http(session)


# --- episodes on the demo workers ----------------------------------------------------------------


@dataclass(slots=True)
class Episode:
    """An episode as the test expects it: its token, its worker and its toy state."""

    token: str
    key: str
    worker: str
    counter: int = 0
    calls: int = 0


async def start_episode(http: Http, base_url: str, **body: object) -> Episode:
    """POST /episodes (through the router): the worker that answers holds the episode."""
    reply = await http.post(f"{base_url}/episodes", body=body or None)
    assert reply.status == 200, f"POST /episodes: {reply}"
    data = reply.json()
    return Episode(data["token"], data["episode"], data["worker"])


async def call_tool(http: Http, base_url: str, episode: Episode, name: str, args: object) -> Reply:
    return await http.post(f"{base_url}/tools/{name}", token=episode.token, body=args)


def served_problem(reply: Reply, episode: Episode, result: object) -> str | None:
    """Why `reply` is not the episode's own worker running its next call with `result`.

    Counts the call in `episode.calls` when the reply is 200. None when all is right.
    """
    if reply.status != 200:
        return f"{episode.key} (on {episode.worker}): {reply}"
    episode.calls += 1
    data = reply.json()
    expected = {
        "worker": episode.worker,
        "episode": episode.key,
        "result": result,
        "calls": episode.calls,
    }
    return None if data == expected else f"{episode.key}: expected {expected}, got {data}"


async def add(http: Http, base_url: str, episode: Episode, value: int) -> None:
    """`add` on the episode's own worker; the counter accumulates."""
    reply = await call_tool(http, base_url, episode, "add", {"value": value})
    episode.counter += value
    problem = served_problem(reply, episode, episode.counter)
    assert problem is None, problem


async def get(http: Http, base_url: str, episode: Episode) -> None:
    """`get` on the episode's own worker returns the accumulated counter."""
    reply = await call_tool(http, base_url, episode, "get", None)
    problem = served_problem(reply, episode, episode.counter)
    assert problem is None, problem


async def until_gone(http: Http, base_url: str, episode: Episode, within_s: float) -> Reply:
    """Call the episode (whose worker was just killed) until it is answered 410, for at most
    `within_s`; returns the last reply. No call may be served meanwhile."""
    deadline = time.monotonic() + within_s
    while True:
        reply = await call_tool(http, base_url, episode, "get", None)
        assert reply.status != 200, f"a killed worker's episode was served: {reply}"
        if reply.status == 410 or time.monotonic() >= deadline:
            return reply
        await asyncio.sleep(0.02)


def assert_router_answer(reply: Reply, status: int, error: str, session: str | None) -> None:
    """`reply` is the router's own JSON answer (design §1), not a worker's."""
    assert reply.status == status, str(reply)
    assert reply.headers.get("Content-Type", "").startswith("application/json"), reply.headers
    body = reply.json()
    assert set(body) == {"error", "detail", "session"}, body  # a worker's names its "worker"
    assert (body["error"], body["session"]) == (error, session), body
    assert isinstance(body["detail"], str) and body["detail"], body
    if status == 401:
        assert reply.headers.getall("WWW-Authenticate") == [f'EpisodeToken error="{error}"']
