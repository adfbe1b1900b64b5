"""MCP through the router, end to end, with the real MCP SDK on both sides.

Worker processes (`mcp_worker.py`) run the SDK's Streamable HTTP server behind a
real router; every client is the SDK's own `Client`, given the episode token as
an extra header, with no connection reuse: each request goes on a new
connection, so each could land on any worker.

- Stateless servers, JSON and SSE replies: 50 episodes each discover (2026-07-28)
  or initialize (the legacy handshake, every other episode), list their tools
  and make four calls. Each worker shows an episode's tools only to requests for
  an episode it holds, so a misrouted tools/list lists nothing.
- A stateful server: `Mcp-Session-Id` is learned from replies, later requests
  follow it, DELETE releases it, a killed worker's sessions get 410, an unknown
  id 404; with a token too, the token and the session id agree.
- Streaming: SSE events reach the client as the worker sends them; a stream
  outlives the idle timeout while events flow and is cut when they stop; a
  client that leaves mid-stream frees the worker's request.
- `episode-router demo`, tried with the SDK client as docs/guides/mcp.md shows.

With E2E_MCP_NO_ROUTING=1 the workers claim nothing and the router reads no
episode token (its config has no episode kind), so every MCP request is
balanced like a sessionless one. The tests that rely on the token then fail
(tools/list on the other workers lists no tools, calls are refused there),
which shows the token is what routes MCP; those on `Mcp-Session-Id` alone, and
the demo's (it configures its own router), still pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
import yaml
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult
from mcp_types.version import LATEST_HANDSHAKE_VERSION, LATEST_MODERN_VERSION
from multidict import CIMultiDict

from bench.launch import free_port, free_port_range

from .conftest import (
    LOOPBACK,
    REQUEST_TIMEOUT_S,
    SKIP_CLAIM,
    START_TIMEOUT_S,
    TOKEN_HEADER,
    Http,
    Launcher,
    Reply,
    Router,
    Worker,
    assert_router_answer,
    get_json,
    wait_until,
)
from .mcp_worker import MCP_PATH, SESSION_PREFIX, tool_names

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

NO_ROUTING = os.environ.get("E2E_MCP_NO_ROUTING") == "1"
WORKER_SCRIPT = Path(__file__).with_name("mcp_worker.py")
WORKER_IDS = ("w1", "w2", "w3", "w4")
EPISODES = 50
CONCURRENCY = 16
SESSIONS = 12
SESSION_HEADER = "Mcp-Session-Id"
STREAM_IDLE_S = 1.0  # the streaming router's idle bound on a reply stream
EXIT_NOTICED_WITHIN_S = 5.0


# --- processes ------------------------------------------------------------------------------------


def start_router(
    launcher: Launcher, name: str, *, timeouts: dict[str, float] | None = None
) -> Router:
    """A router with the episode kind (unless NO_ROUTING) and the MCP session kind."""
    folder = launcher.root / name
    folder.mkdir()
    socket_path = folder / "control.sock"
    public_port, admin_port = free_port(), free_port()
    sessions: list[dict[str, Any]] = [{"name": "mcp_session", "mcp": {"path": MCP_PATH}}]
    if not NO_ROUTING:
        sessions.insert(0, {"name": "episode", "header": TOKEN_HEADER})
    config: dict[str, Any] = {
        "listen": {"host": LOOPBACK, "port": public_port},
        "admin": {"host": LOOPBACK, "port": admin_port},
        "control": {"socket": f"unix:{socket_path}", "lease_timeout_s": 3, "reconnect_grace_s": 2},
        "claims": {"recovery_window_s": 1},
        "sessions": sessions,
        "timeouts": {"shutdown_grace_s": 5, **(timeouts or {})},
        "log": {"format": "json"},
    }
    config_path = folder / "router.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    process = launcher.run_router(name, config_path)
    router = Router(
        launcher, name, folder, config, config_path, socket_path, public_port, admin_port, process
    )
    router.wait_ready()
    return router


def start_workers(
    launcher: Launcher, router: Router, mode: str, worker_ids: Sequence[str] = WORKER_IDS
) -> list[Worker]:
    """MCP workers on `router`'s control socket, started together; returns once it has them
    live and its recovery window is over."""
    started = []
    for worker_id in worker_ids:
        port = free_port()
        argv = [
            *(sys.executable, str(WORKER_SCRIPT), "--host", LOOPBACK, "--port", str(port)),
            *("--worker-id", worker_id, "--control", f"unix:{router.socket_path}"),
            *("--mode", mode),
        ]
        if NO_ROUTING or SKIP_CLAIM:
            argv.append("--no-claim")
        process = launcher.start(f"{router.name}-{worker_id}", argv)
        started.append(Worker(worker_id, port, process))
    for worker in started:
        what = f"{worker.process.name} to answer /health"
        wait_until(what, worker.healthy, START_TIMEOUT_S, watch=worker.process)
    router.wait_live(worker_ids)
    router.wait_ready(recovered=True)
    return started


# --- the SDK client, one connection per request ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Seen:
    """One reply as the client's HTTP layer received it (before its body)."""

    method: str
    body_method: str | None  # the JSON-RPC method of the POST it answers
    status: int
    content_type: str
    content_length: str | None
    connection: str | None


@dataclass(slots=True)
class Wire:
    """What one client saw on the wire."""

    replies: list[Seen] = field(default_factory=list)
    session_ids: set[str] = field(default_factory=set)
    progress: list[tuple[float, float]] = field(default_factory=list)  # (arrival, progress)

    async def record(self, response: httpx2.Response) -> None:
        request = response.request
        body_method = None
        if request.method == "POST":
            with contextlib.suppress(ValueError, AttributeError):
                body_method = json.loads(request.content).get("method")
        self.replies.append(
            Seen(
                request.method,
                body_method,
                response.status_code,
                response.headers.get("content-type", ""),
                response.headers.get("content-length"),
                response.headers.get("connection"),
            )
        )
        session_id = response.headers.get(SESSION_HEADER)
        if session_id:
            self.session_ids.add(session_id)

    async def on_progress(self, progress: float, total: float | None, message: str | None) -> None:
        self.progress.append((time.monotonic(), progress))


@contextlib.asynccontextmanager
async def mcp_client(
    url: str, wire: Wire, *, token: str | None = None, mode: str = "auto"
) -> AsyncIterator[Client]:
    """The SDK's Client on `url`: the token (if any) on every request, no keep-alive."""
    headers = {"Connection": "close"}
    if token is not None:
        headers[TOKEN_HEADER] = token
    http = httpx2.AsyncClient(
        headers=headers,
        limits=httpx2.Limits(max_keepalive_connections=0),
        timeout=httpx2.Timeout(REQUEST_TIMEOUT_S),
        event_hooks={"response": [wire.record]},
        trust_env=False,  # loopback only: never an environment proxy
    )
    async with http, Client(streamable_http_client(url, http_client=http), mode=mode) as client:
        yield client


def structured(result: CallToolResult) -> dict[str, Any]:
    """A tool result's structured content (what the worker reports)."""
    assert not result.is_error, result.content
    assert isinstance(result.structured_content, dict), result
    return result.structured_content


# --- raw JSON-RPC, for requests an SDK client would not send --------------------------------------


async def rpc(
    http: Http, url: str, method: str, params: dict[str, Any], *, session_id: str
) -> Reply:
    """One legacy-protocol request naming `session_id` (and no episode token)."""
    headers = {
        SESSION_HEADER: session_id,
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": LATEST_HANDSHAKE_VERSION,
    }
    message = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
    return await http.request("POST", url, body=message, headers=headers)


def rpc_result(reply: Reply) -> dict[str, Any]:
    """The JSON-RPC result of a 200 reply, whether it came as JSON or as SSE."""
    assert reply.status == 200, str(reply)
    if reply.headers.get("Content-Type", "").startswith("text/event-stream"):
        data = [line[5:] for line in reply.body.splitlines() if line.startswith(b"data:")]
        message = json.loads(data[-1])
    else:
        message = reply.json()
    assert "result" in message, message
    result: dict[str, Any] = message["result"]
    return result


# --- stateless servers: 50 episodes over the SDK --------------------------------------------------


@dataclass(slots=True)
class EpisodeRun:
    """One episode's start and what its client saw."""

    index: int
    key: str = ""
    worker: str = ""
    protocol: str = ""
    calls: int = 0
    wire: Wire = field(default_factory=Wire)
    problem: str | None = None


def plan(index: int, prefix: str) -> list[tuple[str, dict[str, Any], object]]:
    """Episode `index`'s four calls: (tool, arguments, expected result)."""
    first, second = index * 10 + 1, index * 10 + 3  # a different sum for every episode
    echoed = {"episode": index, "step": 2}
    return [
        (f"{prefix}_add", {"value": first}, first),
        (f"{prefix}_echo", echoed, echoed),
        (f"{prefix}_add", {"value": second}, first + second),
        (f"{prefix}_get", {}, first + second),
    ]


async def run_episode(http: Http, router: Router, run: EpisodeRun, gate: asyncio.Semaphore) -> None:
    """Start episode `run.index`, then speak MCP for it; the first problem stops it."""
    async with gate:
        ep = f"ep{run.index}"
        started = await http.post(f"{router.base_url}/episodes", body={"ep": ep})
        assert started.status == 200, f"POST /episodes: {started}"
        run.key, run.worker = started.json()["episode"], started.json()["worker"]
        connect = "auto" if run.index % 2 == 0 else "legacy"  # discover, or initialize
        where = f"{run.key} (on {run.worker}, {connect})"
        try:
            async with mcp_client(
                router.base_url + MCP_PATH, run.wire, token=started.json()["token"], mode=connect
            ) as client:
                run.protocol = client.protocol_version
                listed = [tool.name for tool in (await client.list_tools()).tools]
                if listed != tool_names(ep):
                    run.problem = f"{where}: tools/list listed {listed}"
                    return
                for name, args, result in plan(run.index, ep):
                    reply = await client.call_tool(
                        name, args, progress_callback=run.wire.on_progress
                    )
                    expected = {
                        "worker": run.worker,
                        "owner": run.key,
                        "result": result,
                        "calls": run.calls + 1,
                    }
                    if reply.is_error or reply.structured_content != expected:
                        run.problem = f"{where}: {name} expected {expected}, got {reply.content}"
                        return
                    run.calls += 1
        except Exception as exc:  # one episode's failure is reported with all the others
            run.problem = f"{where}: {type(exc).__name__}: {exc}"


@pytest.mark.parametrize("replies", ["json", "sse"])
async def test_every_episode_lists_its_own_tools_and_runs_on_its_worker(
    launcher: Launcher, http: Http, replies: str
) -> None:
    router = start_router(launcher, f"router-{replies}")
    start_workers(launcher, router, replies)
    gate = asyncio.Semaphore(CONCURRENCY)
    runs = [EpisodeRun(index) for index in range(EPISODES)]

    await asyncio.gather(*(run_episode(http, router, run, gate) for run in runs))

    problems = [run.problem for run in runs if run.problem is not None]
    assert not problems, (
        f"{len(problems)} of {EPISODES} episodes were misrouted or refused; first ones:\n"
        + "\n".join(problems[:8])
    )
    assert sum(run.calls for run in runs) == EPISODES * 4
    assert {run.index: run.protocol for run in runs} == {
        index: LATEST_MODERN_VERSION if index % 2 == 0 else LATEST_HANDSHAKE_VERSION
        for index in range(EPISODES)
    }
    spread = Counter(run.worker for run in runs)
    assert len(spread) >= 3, f"episodes were not spread over the workers: {spread}"
    held = {worker_id: view["claims"] for worker_id, view in router.workers().items()}
    assert held == {w: spread.get(w, 0) for w in WORKER_IDS}

    seen = [reply for run in runs for reply in run.wire.replies]
    assert not any(run.wire.session_ids for run in runs)  # stateless: no protocol session
    # Every reply ended its connection: no request rode on another's connection.
    assert {reply.connection for reply in seen} == {"close"}
    calls = [reply for reply in seen if reply.body_method == "tools/call"]
    assert len(calls) == EPISODES * 4
    progress = sum(len(run.wire.progress) for run in runs)
    if replies == "sse":
        # Relayed as streams, with no length added: every call's notification reached the
        # client ahead of its result.
        assert {(reply.content_type, reply.content_length) for reply in calls} == {
            ("text/event-stream", None)
        }
        assert progress == EPISODES * 4
    else:
        assert {reply.content_type for reply in calls} == {"application/json"}
        assert progress == 0


# --- a stateful server: sessions learned from Mcp-Session-Id --------------------------------------


def session_view(router: Router, session_id: str) -> dict[str, Any]:
    reply = router.admin(f"/admin/sessions/mcp_session/{session_id}")
    assert reply is not None and reply[0] == 200, reply
    view: dict[str, Any] = reply[1]
    return {key: view[key] for key in ("worker", "state", "learned")}


class OpenSession:
    """A legacy-protocol SDK client (initialize handshake) held open in a task of its own:
    the SDK's task groups must close in the task, and the order, that opened them."""

    def __init__(self, url: str, token: str | None = None) -> None:
        self.url = url
        self.token = token
        self.wire = Wire()
        self._client: Client | None = None
        self._leave = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def client(self) -> Client:
        assert self._client is not None, "the session is not open"
        return self._client

    @property
    def session_id(self) -> str:
        (session_id,) = self.wire.session_ids
        return session_id

    async def open(self) -> None:
        """Initialize; returns once the session is open (raises what opening raised)."""
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._hold(ready), name=f"mcp-session {self.url}")
        await asyncio.wait_for(asyncio.shield(ready), REQUEST_TIMEOUT_S)
        assert self.client.protocol_version == LATEST_HANDSHAKE_VERSION

    async def close(self) -> None:
        """Leave the client: the SDK sends DELETE with the session id."""
        self._leave.set()
        if self._task is not None:
            await asyncio.wait_for(self._task, REQUEST_TIMEOUT_S)

    async def _hold(self, ready: asyncio.Future[None]) -> None:
        try:
            async with mcp_client(self.url, self.wire, token=self.token, mode="legacy") as client:
                self._client = client
                ready.set_result(None)
                await self._leave.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc)
            raise


async def open_session(
    outer: contextlib.AsyncExitStack, url: str, *, token: str | None = None
) -> OpenSession:
    """Open a session; `outer` closes it if the test does not."""
    session = OpenSession(url, token)
    outer.push_async_callback(session.close)
    await session.open()
    return session


async def session_calls(client: Client, prefix: str, worker: str, owner: str, value: int) -> None:
    """tools/list shows `prefix`'s tools; four calls all run on `worker`, in order."""
    listed = [tool.name for tool in (await client.list_tools()).tools]
    assert listed == tool_names(prefix)
    results = [
        structured(await client.call_tool(f"{prefix}_add", {"value": value})),
        structured(await client.call_tool(f"{prefix}_echo", {"n": value})),
        structured(await client.call_tool(f"{prefix}_add", {"value": 1})),
        structured(await client.call_tool(f"{prefix}_get", {})),
    ]
    assert results == [
        {"worker": worker, "owner": owner, "result": result, "calls": calls}
        for calls, result in enumerate([value, {"n": value}, value + 1, value + 1], start=1)
    ]


async def test_sessions_are_learned_followed_released_and_end_with_their_worker(
    launcher: Launcher, http: Http
) -> None:
    router = start_router(launcher, "router-stateful")
    workers = {worker.worker_id: worker for worker in start_workers(launcher, router, "stateful")}
    url = router.base_url + MCP_PATH
    async with contextlib.AsyncExitStack() as outer:
        # No token: initialize is balanced, and its reply teaches the router the session.
        opened = [await open_session(outer, url) for _ in range(SESSIONS)]
        holders: dict[str, str] = {}
        for index, session in enumerate(opened):
            view = session_view(router, session.session_id)
            assert view["state"] == "held" and view["learned"] is True, view
            holders[session.session_id] = view["worker"]
            owner = f"session:{session.session_id}"
            await session_calls(session.client, SESSION_PREFIX, view["worker"], owner, index)
        assert len(set(holders.values())) >= 2, f"sessions were not spread: {holders}"

        # DELETE (the client leaving) releases: the id is then unknown, 404 from the router.
        closing, staying = opened[: SESSIONS // 2], opened[SESSIONS // 2 :]
        for session in closing:
            await session.close()
            deletes = [seen.status for seen in session.wire.replies if seen.method == "DELETE"]
            assert deletes == [200]
            assert session_view(router, session.session_id)["state"] == "episode_ended"
            reply = await rpc(http, url, "tools/list", {}, session_id=session.session_id)
            assert_router_answer(reply, 404, "unknown_session", session.session_id)

        # A killed worker's sessions get 410; the others go on.
        victim = Counter(holders[s.session_id] for s in staying).most_common(1)[0][0]
        workers[victim].process.kill9()
        for session in staying:
            if holders[session.session_id] != victim:
                continue
            reply = await until_410(http, url, session.session_id)
            assert_router_answer(reply, 410, "worker_exited", session.session_id)
            assert session_view(router, session.session_id)["state"] == "worker_exited"
            with pytest.raises(MCPError):
                await session.client.call_tool(f"{SESSION_PREFIX}_get", {})
        for session in staying:
            worker = holders[session.session_id]
            if worker == victim:
                continue
            result = structured(await session.client.call_tool(f"{SESSION_PREFIX}_get", {}))
            assert (result["worker"], result["calls"]) == (worker, 5)
            # The id alone (no SDK client) reaches the same worker's session.
            listed = await rpc(http, url, "tools/list", {}, session_id=session.session_id)
            names = [tool["name"] for tool in rpc_result(listed)["tools"]]
            assert names == tool_names(SESSION_PREFIX)


async def until_410(http: Http, url: str, session_id: str) -> Reply:
    """Call the session (whose worker was just killed) until the router answers 410; no call
    may be served meanwhile."""
    deadline = time.monotonic() + EXIT_NOTICED_WITHIN_S
    while True:
        reply = await rpc(
            http, url, "tools/call", {"name": f"{SESSION_PREFIX}_get"}, session_id=session_id
        )
        assert reply.status != 200, f"a killed worker's session was served: {reply}"
        if reply.status == 410 or time.monotonic() >= deadline:
            return reply
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def stateful_router(module_launcher: Launcher) -> Router:
    """A router in front of four stateful workers, shared by the tests that kill none."""
    router = start_router(module_launcher, "router-stateful-shared")
    start_workers(module_launcher, router, "stateful")
    return router


async def start_episode(http: Http, router: Router, ep: str) -> dict[str, Any]:
    """POST /episodes through the router: the worker that answers holds the episode."""
    reply = await http.post(f"{router.base_url}/episodes", body={"ep": ep})
    assert reply.status == 200, f"POST /episodes: {reply}"
    return reply.json()


async def test_an_unknown_session_id_is_404_and_a_repeated_one_400(
    stateful_router: Router, http: Http
) -> None:
    url = stateful_router.base_url + MCP_PATH
    for session_id in ("never-issued", "0" * 32):
        reply = await rpc(http, url, "tools/list", {}, session_id=session_id)
        assert_router_answer(reply, 404, "unknown_session", session_id)
    twice = CIMultiDict([(SESSION_HEADER, "one"), (SESSION_HEADER, "other")])
    reply = await http.request("POST", url, body={}, headers=twice)
    assert_router_answer(reply, 400, "ambiguous_session", None)


async def test_the_token_and_the_session_id_name_the_same_worker(
    stateful_router: Router, http: Http
) -> None:
    router = stateful_router
    url = router.base_url + MCP_PATH
    episodes = [await start_episode(http, router, f"tok{index}") for index in range(8)]
    workers = {started["worker"] for started in episodes}
    async with contextlib.AsyncExitStack() as outer:
        # In reverse order, so initialize reaches each episode's worker only by its token.
        for index, started in reversed(list(enumerate(episodes))):
            worker, key = started["worker"], started["episode"]
            # initialize carries the token: the episode's worker answers, and the session id
            # its reply carries is learned for that same worker.
            session = await open_session(outer, url, token=started["token"])
            assert session_view(router, session.session_id) == {
                "worker": worker,
                "state": "held",
                "learned": True,
            }
            await session_calls(session.client, f"tok{index}", worker, key, index)
            # The id alone (no token) reaches the same worker, whose SDK knows the session.
            call = {"name": f"{SESSION_PREFIX}_get", "arguments": {}}
            reply = await rpc(http, url, "tools/call", call, session_id=session.session_id)
            assert rpc_result(reply)["structuredContent"] == {
                "worker": worker,
                "owner": f"session:{session.session_id}",
                "result": 0,
                "calls": 1,
            }
    assert len(workers) >= 2, f"episodes were not spread over the workers: {workers}"


async def test_delete_carrying_the_token_releases_the_session_too(
    stateful_router: Router, http: Http
) -> None:
    # The token routes the DELETE (it decides, design §4); the session id it carries ends.
    router = stateful_router
    url = router.base_url + MCP_PATH
    started = await start_episode(http, router, "tok-delete")
    async with contextlib.AsyncExitStack() as outer:
        session = await open_session(outer, url, token=started["token"])
        assert session_view(router, session.session_id)["state"] == "held"
        await session.close()
    assert [seen.status for seen in session.wire.replies if seen.method == "DELETE"] == [200]
    assert session_view(router, session.session_id)["state"] == "episode_ended"
    reply = await rpc(http, url, "tools/list", {}, session_id=session.session_id)
    assert_router_answer(reply, 404, "unknown_session", session.session_id)


# --- streaming ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Streaming:
    """A router whose reply streams have a short idle bound, and its SSE workers."""

    router: Router
    workers: dict[str, Worker]


@pytest.fixture(scope="module")
def streaming(module_launcher: Launcher) -> Streaming:
    router = start_router(
        module_launcher, "router-stream", timeouts={"stream_idle_s": STREAM_IDLE_S}
    )
    workers = start_workers(module_launcher, router, "sse", WORKER_IDS[:2])
    return Streaming(router, {worker.worker_id: worker for worker in workers})


async def start_on_second_worker(http: Http, streaming: Streaming, ep: str) -> dict[str, Any]:
    """Start `ep` on the second worker itself (not through the router, which would balance
    the start to the first): a request balanced rather than routed would miss it."""
    worker = streaming.workers[WORKER_IDS[1]]
    reply = await http.post(f"{worker.url}/episodes", body={"ep": ep})
    assert reply.status == 200, f"POST /episodes: {reply}"
    return reply.json()


def stream_states(worker: Worker, owner: str) -> list[tuple[str, int]]:
    """(state, ticks sent) of each `ticks` call `owner` made on `worker`, asked directly."""
    reply = get_json(f"{worker.url}/streams")
    assert reply is not None and reply[0] == 200, reply
    return [(s["state"], s["sent"]) for s in reply[1]["streams"] if s["owner"] == owner]


async def until_freed(streaming: Streaming, worker_id: str, owner: str) -> list[tuple[str, int]]:
    """Until the worker's stream for `owner` was cancelled and the router has no request in
    flight to it; returns the stream states. Polls off the event loop, which the SDK client
    needs meanwhile to close its side."""

    def freed() -> bool:
        states = stream_states(streaming.workers[worker_id], owner)
        in_flight = streaming.router.workers().get(worker_id, {}).get("in_flight")
        return [state for state, _ in states] == ["cancelled"] and in_flight == 0

    deadline = time.monotonic() + EXIT_NOTICED_WITHIN_S
    while not await asyncio.to_thread(freed):
        assert time.monotonic() < deadline, f"{owner}'s stream on {worker_id} was not freed"
        await asyncio.sleep(0.05)
    return await asyncio.to_thread(stream_states, streaming.workers[worker_id], owner)


@pytest.mark.parametrize("protocol", ["auto", "legacy"])
async def test_sse_events_reach_the_client_as_the_worker_sends_them(
    streaming: Streaming, http: Http, protocol: str
) -> None:
    ep = f"stream-{protocol}"
    started = await start_on_second_worker(http, streaming, ep)
    wire = Wire()
    url = streaming.router.base_url + MCP_PATH
    async with mcp_client(url, wire, token=started["token"], mode=protocol) as client:
        args = {"count": 6, "interval_s": 0.3}
        result = await client.call_tool(f"{ep}_ticks", args, progress_callback=wire.on_progress)
    sent = structured(result)["result"]["sent"]
    arrived = [at for at, _ in wire.progress]
    assert [progress for _, progress in wire.progress] == [1, 2, 3, 4, 5, 6]
    assert arrived[0] < sent[-1], "the first event waited for the last one"
    # Each event reached the client before the worker sent the next one: nothing buffered.
    assert all(at < following for at, following in zip(arrived, sent[1:], strict=False))
    # The stream lasted longer than the idle bound: it is an idle timeout, not a total one.
    assert sent[-1] - sent[0] > STREAM_IDLE_S
    calls = [seen for seen in wire.replies if seen.body_method == "tools/call"]
    assert [(s.status, s.content_type, s.content_length) for s in calls] == [
        (200, "text/event-stream", None)
    ]


async def test_a_stream_silent_past_the_idle_timeout_is_cut(
    streaming: Streaming, http: Http
) -> None:
    started = await start_on_second_worker(http, streaming, "stream-stall")
    wire = Wire()
    url = streaming.router.base_url + MCP_PATH
    async with mcp_client(url, wire, token=started["token"]) as client:
        began = time.monotonic()
        with pytest.raises(MCPError):
            args = {"count": 2, "interval_s": 3 * STREAM_IDLE_S}
            await client.call_tool("stream-stall_ticks", args, progress_callback=wire.on_progress)
        assert time.monotonic() - began < 3 * STREAM_IDLE_S
    assert [progress for _, progress in wire.progress] == [1]
    states = await until_freed(streaming, started["worker"], started["episode"])
    assert states == [("cancelled", 1)]


async def test_a_client_that_leaves_mid_stream_frees_the_worker(
    streaming: Streaming, http: Http
) -> None:
    started = await start_on_second_worker(http, streaming, "stream-leave")
    wire = Wire()
    first = anyio.Event()

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        await wire.on_progress(progress, total, message)
        first.set()

    url = streaming.router.base_url + MCP_PATH
    async with mcp_client(url, wire, token=started["token"]) as client:

        async def call() -> None:
            args = {"count": 50, "interval_s": 0.1}
            await client.call_tool("stream-leave_ticks", args, progress_callback=on_progress)

        async with anyio.create_task_group() as group:
            group.start_soon(call)
            with anyio.fail_after(REQUEST_TIMEOUT_S):
                await first.wait()
            group.cancel_scope.cancel()  # the SDK closes the reply stream: its cancellation
        states = await until_freed(streaming, started["worker"], started["episode"])
    ((state, ticks),) = states
    assert state == "cancelled" and ticks < 50, states


# --- the demo -------------------------------------------------------------------------------------


async def test_the_demo_serves_its_tools_over_mcp_through_the_router(
    launcher: Launcher, http: Http, tmp_path: Path
) -> None:
    """`episode-router demo`, tried as docs/guides/mcp.md shows: the SDK client with the token."""
    port, admin_port, base_port = free_port(), free_port(), free_port_range(2)
    demo = launcher.start(
        "demo",
        [
            *(sys.executable, "-m", "router.cli", "demo", "--workers", "2", "--port", str(port)),
            *("--admin-port", str(admin_port), "--base-port", str(base_port)),
        ],
        env={"TMPDIR": str(tmp_path)},  # its control socket's folder goes under tmp_path
    )
    admin = f"http://{LOOPBACK}:{admin_port}"

    def ready() -> bool:
        reply = get_json(f"{admin}/readyz")
        body = reply[1] if reply is not None else None
        return isinstance(body, dict) and (body["recovering"], body["live_workers"]) == (False, 2)

    wait_until("the demo's 2 workers live and recovered", ready, START_TIMEOUT_S, watch=demo)
    base = f"http://{LOOPBACK}:{port}"
    reply = await http.post(f"{base}/episodes")
    assert reply.status == 200, str(reply)
    token, key, worker = (reply.json()[name] for name in ("token", "episode", "worker"))
    wire = Wire()
    async with mcp_client(base + MCP_PATH, wire, token=token) as client:
        assert client.protocol_version == LATEST_HANDSHAKE_VERSION  # the demo: no 2026-07-28
        listed = [tool.name for tool in (await client.list_tools()).tools]
        added = structured(await client.call_tool("add", {"value": 5}))
        got = structured(await client.call_tool("get", {}))
        args = {"events": 3, "interval_s": 0.2}
        streamed = structured(
            await client.call_tool("stream", args, progress_callback=wire.on_progress)
        )
    assert listed == ["add", "get", "echo", "sleep", "stream"]
    reply_of = {"worker": worker, "episode": key}
    assert [added, got, streamed] == [
        {**reply_of, "result": 5, "calls": 1},
        {**reply_of, "result": 5, "calls": 2},
        {**reply_of, "result": {"events": 3}, "calls": 3},
    ]
    assert [progress for _, progress in wire.progress] == [1, 2, 3]
    calls = [seen.content_type for seen in wire.replies if seen.body_method == "tools/call"]
    assert calls[-1] == "text/event-stream"
