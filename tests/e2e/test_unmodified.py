"""Unmodified servers end to end: session routing learned from replies, with no control socket.

Four single-worker uvicorn processes run `starlette_app`, a Resources server
written as NeMo Gym writes one, which knows nothing of the router. The router
has them as static workers and two session kinds: Starlette's session cookie
(`resources`, with seed and close routes) and the MCP session token
(`mcp_token`, learned from a JSON pointer into the seed reply). Every session
keeps its value in one process's memory, so a misrouted request is a 404 from
the wrong worker. The cookie kind runs with edge verification off and on (the
server's own secret, through secret_env), the token kind with it on. Every
request goes on a new connection and no cookie jar is kept: a cookie is sent
only when a test sends it.

With E2E_DISABLE_LEARNING=1 the router's config loses its seed routes, so it
learns nothing and every session's cookie or token is unknown (401). The suite
must then fail, which shows that learning from replies is what routes sessions.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import sys
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from itsdangerous import TimestampSigner, URLSafeSerializer

from bench.launch import free_port

from .conftest import (
    LOOPBACK,
    START_TIMEOUT_S,
    Http,
    Launcher,
    Process,
    Reply,
    Router,
    assert_router_answer,
    get_json,
    wait_until,
)
from .starlette_app import (
    SECRET_ENV,
    SESSION_COOKIE,
    SESSION_FIELD,
    TOKEN_FIELD,
    TOKEN_HEADER,
    TOKEN_SALT,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]

LEARNING = os.environ.get("E2E_DISABLE_LEARNING") != "1"
SESSIONS = 200
CONCURRENCY = 32
WORKER_IDS = ("w0", "w1", "w2", "w3")
HEALTH_INTERVAL_S = 0.2
# A few probe rounds (two refused probes retire a worker), with room for a busy 2-core machine.
EXIT_NOTICED_WITHIN_S = 15 * HEALTH_INTERVAL_S
APP_DIR = Path(__file__).resolve().parents[2]  # the folder the `tests` package is imported from
SEED = {"method": "POST", "path": "/seed_session"}
CLOSE = {"method": "POST", "path": "/close_session"}
TOKEN_POINTER = f"/mcp/headers/{TOKEN_HEADER}"


# --- the unmodified servers -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Server:
    """One uvicorn process running the Starlette app on a private loopback port."""

    worker_id: str
    port: int
    process: Process

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        """What the app reports as its "worker": uvicorn with one worker serves in-process."""
        return self.process.pid

    def healthy(self) -> bool:
        reply = get_json(f"{self.url}/health")
        return reply is not None and reply[0] == 200


def start_servers(launcher: Launcher, secret: str, prefix: str) -> list[Server]:
    """Four uvicorn processes, started together; returns once each answers /health."""
    started = []
    for worker_id in WORKER_IDS:
        port = free_port()
        argv = [
            *(sys.executable, "-m", "uvicorn", "tests.e2e.starlette_app:create_app", "--factory"),
            *("--app-dir", str(APP_DIR), "--host", LOOPBACK, "--port", str(port)),
            *("--workers", "1", "--no-access-log", "--log-level", "warning"),
        ]
        process = launcher.start(f"{prefix}-{worker_id}", argv, env={SECRET_ENV: secret})
        started.append(Server(worker_id, port, process))
    for server in started:
        what = f"{server.process.name} to answer /health"
        wait_until(what, server.healthy, START_TIMEOUT_S, watch=server.process)
    return started


# --- the router -----------------------------------------------------------------------------------


def session_kinds(*, verify: bool) -> list[dict[str, Any]]:
    """The NeMo Gym-style kinds; `verify` checks signatures at the edge with the server's key."""
    cookie: dict[str, Any] = {"name": SESSION_COOKIE, "format": "starlette", "field": SESSION_FIELD}
    token: dict[str, Any] = {"format": "itsdangerous", "field": TOKEN_FIELD}
    if verify:
        cookie["verify"] = {"secret_env": SECRET_ENV}
        token["verify"] = {"secret_env": SECRET_ENV, "salt": TOKEN_SALT}
    resources: dict[str, Any] = {"name": "resources", "cookie": cookie, "seed": SEED}
    resources["close"] = CLOSE
    mcp_token: dict[str, Any] = {"name": "mcp_token", "header": TOKEN_HEADER, "token": token}
    mcp_token["seed"] = {**SEED, "learn": {"json_pointer": TOKEN_POINTER}}
    if not LEARNING:
        del resources["seed"], mcp_token["seed"]
    return [resources, mcp_token]


def start_router(
    launcher: Launcher, servers: Sequence[Server], secret: str, *, verify: bool = False
) -> Router:
    """A router with `servers` as static workers; returns once it has probed them all live."""
    name = "router-verify" if verify else "router"
    folder = launcher.root / name
    folder.mkdir()
    socket_path = folder / "control.sock"
    public_port, admin_port = free_port(), free_port()
    config: dict[str, Any] = {
        "listen": {"host": LOOPBACK, "port": public_port},
        "admin": {"host": LOOPBACK, "port": admin_port},
        "control": {"socket": f"unix:{socket_path}"},
        "workers": [{"id": server.worker_id, "url": server.url} for server in servers],
        "health": {"path": "/health", "interval_s": HEALTH_INTERVAL_S, "timeout_s": 1},
        "sessions": session_kinds(verify=verify),
        "timeouts": {"connect_s": 2, "shutdown_grace_s": 2},
        "log": {"format": "json"},
    }
    config_path = folder / "router.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    argv = [sys.executable, "-m", "router.cli", "run", "--config", str(config_path)]
    process = launcher.start(name, argv, env={SECRET_ENV: secret} if verify else None)
    router = Router(
        launcher, name, folder, config, config_path, socket_path, public_port, admin_port, process
    )
    router.wait_ready(recovered=True)  # recovery ends once every static worker answered a probe
    router.wait_live(WORKER_IDS)
    return router


# --- sessions -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Session:
    """A session as its seed reply described it."""

    session_id: str
    value: str
    worker: int  # the pid of the process that holds it
    cookie: str  # the value of the Set-Cookie the seed reply carried
    token: str  # the MCP session token from the seed reply's body


def set_cookie_value(reply: Reply) -> str:
    jar: SimpleCookie = SimpleCookie()
    for header in reply.headers.getall("Set-Cookie", []):
        jar.load(header)
    morsel = jar.get(SESSION_COOKIE)
    assert morsel is not None and morsel.value, f"no {SESSION_COOKIE} cookie: {reply.headers}"
    return morsel.value


async def seed(http: Http, base_url: str, value: str) -> Session:
    """POST /seed_session with no cookie and no token: a new session on whichever worker."""
    reply = await http.post(f"{base_url}/seed_session", body={"value": value})
    assert reply.status == 200, f"POST /seed_session: {reply}"
    data = reply.json()
    token = data["mcp"]["headers"][TOKEN_HEADER]
    return Session(data["session_id"], value, data["worker"], set_cookie_value(reply), token)


def credentials(session: Session, via: str) -> dict[str, str]:
    """The one header that names `session`: its cookie, or its MCP token."""
    if via == "cookie":
        return {"Cookie": f"{SESSION_COOKIE}={session.cookie}"}
    return {TOKEN_HEADER: session.token}


async def call(http: Http, base_url: str, path: str, headers: dict[str, str]) -> Reply:
    return await http.request("POST", f"{base_url}{path}", headers=headers)


async def verify(http: Http, base_url: str, session: Session, via: str) -> Reply:
    return await call(http, base_url, "/verify", credentials(session, via))


def served_problem(reply: Reply, session: Session, via: str) -> str | None:
    """Why `reply` is not the session's own worker returning its value (None when it is)."""
    expected = {"session_id": session.session_id, "worker": session.worker, "value": session.value}
    if reply.status == 200 and reply.json() == expected:
        return None
    return f"{session.session_id} (pid {session.worker}) by {via}: {reply}"


async def seed_and_verify(
    http: Http, base_url: str, value: str, via: str, gate: asyncio.Semaphore
) -> tuple[Session, str | None]:
    async with gate:
        session = await seed(http, base_url, value)
        reply = await verify(http, base_url, session, via)
        return session, served_problem(reply, session, via)


async def run_sessions(http: Http, base_url: str, via: str, count: int) -> list[Session]:
    """`count` sessions, each seeded then verified by `via`; every verify must be served by
    the session's own worker with its own value."""
    gate = asyncio.Semaphore(CONCURRENCY)
    run = secrets.token_hex(4)
    results = await asyncio.gather(
        *(seed_and_verify(http, base_url, f"{run}-{i}", via, gate) for i in range(count))
    )
    problems = [problem for _, problem in results if problem is not None]
    assert not problems, (
        f"{len(problems)} of {count} sessions were refused or misrouted by {via}; first ones:\n"
        + "\n".join(problems[:8])
    )
    return [session for session, _ in results]


def assert_spread_and_claims(
    router: Router, servers: Sequence[Server], sessions: Sequence[Session]
) -> Counter[int]:
    """Sessions spread over at least three workers, and the router holds exactly the
    claims their seed replies taught it. Returns sessions per worker pid."""
    spread = Counter(session.worker for session in sessions)
    assert set(spread) <= {server.pid for server in servers}, spread
    assert len(spread) >= 3, f"sessions were not spread over the workers: {spread}"
    views = router.workers()
    # Each seed reply teaches two claims: its cookie (resources) and its token (mcp_token).
    held = {worker_id: view["claims"] for worker_id, view in views.items()}
    assert held == {server.worker_id: 2 * spread[server.pid] for server in servers}
    assert {view["state"] for view in views.values()} == {"live"}
    return spread


def starlette_cookie(session: dict[str, str], secret: str) -> str:
    """A SessionMiddleware cookie for `session`, signed with `secret` as Starlette signs."""
    data = base64.b64encode(json.dumps(session).encode())
    return TimestampSigner(secret).sign(data).decode()


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def secret() -> str:
    """The servers' secret key (SessionMiddleware and the MCP token serializer)."""
    return secrets.token_urlsafe(32)


@pytest.fixture(scope="module")
def servers(module_launcher: Launcher, secret: str) -> list[Server]:
    """Four servers shared by the module's tests that kill none of them."""
    return start_servers(module_launcher, secret, "shared")


@pytest.fixture
async def client() -> AsyncIterator[Http]:
    """A client that never reuses a connection and never keeps a cookie."""
    connector = aiohttp.TCPConnector(force_close=True, limit=CONCURRENCY * 2)
    jar = aiohttp.DummyCookieJar()
    async with aiohttp.ClientSession(connector=connector, cookie_jar=jar) as session:
        yield Http(session)


# --- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("edge_verify", [False, True], ids=["verify-off", "verify-on"])
async def test_cookie_sessions_reach_their_worker(
    launcher: Launcher, servers: list[Server], secret: str, client: Http, edge_verify: bool
) -> None:
    router = start_router(launcher, servers, secret, verify=edge_verify)

    sessions = await run_sessions(client, router.base_url, "cookie", SESSIONS)

    assert_spread_and_claims(router, servers, sessions)
    victim = sessions[0]
    forged = starlette_cookie({SESSION_FIELD: victim.session_id}, "not-" + secret)
    reply = await call(client, router.base_url, "/verify", {"Cookie": f"{SESSION_COOKIE}={forged}"})
    if edge_verify:
        assert_router_answer(reply, 403, "bad_signature", None)
    else:  # forwarded: the worker's own 404 (its SessionMiddleware drops the forged cookie)
        assert (reply.status, reply.json()) == (404, {"error": "no such session here"})


async def test_mcp_token_sessions_reach_their_worker(
    launcher: Launcher, servers: list[Server], secret: str, client: Http
) -> None:
    router = start_router(launcher, servers, secret, verify=True)

    sessions = await run_sessions(client, router.base_url, "token", SESSIONS)

    assert_spread_and_claims(router, servers, sessions)
    forged = URLSafeSerializer("not-" + secret, salt=TOKEN_SALT).dumps(
        {TOKEN_FIELD: sessions[0].session_id}
    )
    reply = await call(client, router.base_url, "/verify", {TOKEN_HEADER: forged})
    assert_router_answer(reply, 403, "bad_signature", None)


async def test_killed_worker_sessions_get_410_and_the_others_carry_on(
    launcher: Launcher, secret: str, client: Http
) -> None:
    servers = start_servers(launcher, secret, "doomed")
    router = start_router(launcher, servers, secret)
    sessions = await run_sessions(client, router.base_url, "cookie", 40)
    spread = assert_spread_and_claims(router, servers, sessions)
    pid, _ = spread.most_common(1)[0]
    victim = next(server for server in servers if server.pid == pid)

    victim.process.kill9()

    def victim_exited() -> bool:  # noticed by the health probes alone: no request goes there
        return router.workers().get(victim.worker_id, {}).get("state") == "exited"

    wait_until(f"the router to retire {victim.worker_id}", victim_exited, EXIT_NOTICED_WITHIN_S)
    problems = []
    for session in sessions:
        for via in ("cookie", "token"):
            reply = await verify(client, router.base_url, session, via)
            if session.worker == victim.pid:
                assert_router_answer(reply, 410, "worker_exited", session.session_id)
            elif (problem := served_problem(reply, session, via)) is not None:
                problems.append(problem)
    assert not problems, f"sessions of live workers failed after the kill: {problems[:8]}"
    fresh = await run_sessions(client, router.base_url, "token", 12)
    assert victim.pid not in {session.worker for session in fresh}
    states = {worker_id: view["state"] for worker_id, view in router.workers().items()}
    assert states == {s.worker_id: "exited" if s is victim else "live" for s in servers}


async def test_close_route_ends_the_session(
    launcher: Launcher, servers: list[Server], secret: str, client: Http
) -> None:
    router = start_router(launcher, servers, secret)
    sessions = await run_sessions(client, router.base_url, "cookie", 20)
    spread = assert_spread_and_claims(router, servers, sessions)
    closing, kept = sessions[:10], sessions[10:]

    for session in closing:
        reply = await call(
            client, router.base_url, "/close_session", credentials(session, "cookie")
        )
        closed = {"closed": session.session_id, "worker": session.worker}
        assert (reply.status, reply.json()) == (200, closed), str(reply)

    for session in closing:
        reply = await verify(client, router.base_url, session, "cookie")
        assert_router_answer(reply, 410, "episode_ended", session.session_id)
        # A repeated close reaches the worker that held the session (design §4): its own
        # contract answers (this server's: 404, it holds no such session).
        reply = await call(
            client, router.base_url, "/close_session", credentials(session, "cookie")
        )
        assert (reply.status, reply.json()) == (404, {"error": "no such session here"}), str(reply)
    for session in kept:
        problem = served_problem(
            await verify(client, router.base_url, session, "cookie"), session, "cookie"
        )
        assert problem is None, problem
    for session in sessions:
        state = "episode_ended" if session in closing else "held"
        # One seed reply taught the session under both kinds: a close ends both.
        for kind in ("resources", "mcp_token"):
            view = router.admin(f"/admin/sessions/{kind}/{session.session_id}")
            assert view is not None and view[1]["state"] == state, (kind, view)
    for session in closing:
        reply = await verify(client, router.base_url, session, "token")
        assert_router_answer(reply, 410, "episode_ended", session.session_id)
    held = {worker_id: view["claims"] for worker_id, view in router.workers().items()}
    ended = Counter(session.worker for session in closing)
    assert held == {s.worker_id: 2 * (spread[s.pid] - ended[s.pid]) for s in servers}
