"""Session routing for servers we cannot change, through a real RouterService (design §4, §7).

The workers here are unmodified servers: static `workers:` that never speak on the control
socket. Each `GymWorker` is a small aiohttp app on a loopback port that behaves as a NeMo
Gym-style server does: a Starlette SessionMiddleware session cookie (signed with
itsdangerous' TimestampSigner over base64 JSON), an MCP session token (an itsdangerous
URLSafeSerializer payload) handed out in the seed reply's JSON body, MCP protocol sessions
(`Mcp-Session-Id`), and rollouts named in JSON bodies and paths. Every worker keeps its
sessions in its own memory and answers 409 to a session it does not hold, so a request
routed to the wrong worker is seen at once. The router learns every claim from replies.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gzip
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from email.utils import formatdate
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from itsdangerous import BadSignature, TimestampSigner, URLSafeSerializer

from router.config import (
    ClaimsConfig,
    Config,
    HealthConfig,
    SessionKindConfig,
    StaticWorkerConfig,
    parse_config,
)
from router.sessions.learning import MAX_LEARN_BODY_BYTES
from router.sessions.sources import set_cookie_value
from tests.router_fixtures import (
    TOKEN_HEADER,
    RawHttp,
    Reply,
    Rig,
    open_rig,
    router_config,
    token,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)

COOKIE = "ResourcesServer___resources"
SECRET = "resources-server-secret"
MCP_TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
MCP_SECRET = "mcp-token-secret"
MCP_SALT = "nemo-gym-mcp-session-token"
FIXED_DATE = formatdate(1_700_000_000, usegmt=True)  # replies a test compares byte for byte
SIGNED_AT = int(time.time())  # every cookie's timestamp: fresh, and the same across replies
# Refused probes are seen within 100 ms; a generous timeout keeps a busy machine from
# making a worker unhealthy (which would change where seeds are balanced).
FAST_PROBES = HealthConfig(path="/health", interval_s=0.05, timeout_s=2.0, failures=2)

# The worked example of docs/guides/unmodified-servers.md (NeMo Gym behind the router), with
# the rollout kinds added.
SESSIONS_YAML = """
sessions:
  - name: episode
    header: X-NeMo-Gym-Episode-Token
    token: {format: jws}
  - name: resources
    cookie: {name: ResourcesServer___resources, format: starlette, field: session_id}
    seed: {method: POST, path: /seed_session}
    close: {method: POST, path: /close_session}
  - name: mcp_token
    header: X-NeMo-Gym-Session-Token
    token: {format: itsdangerous, field: sid}
    seed:
      method: POST
      path: /seed_session
      learn: {json_pointer: /mcp/headers/X-NeMo-Gym-Session-Token}
  - name: mcp_session
    mcp: {path: /mcp}
  - name: rollout
    body_field: {pointer: /rollout_id, max_bytes: 1024}
    seed: {method: POST, path: /rollouts, learn: {json_pointer: /id}}
  - name: rollout_path
    path: /rollouts/{key}/step
    seed: {method: POST, path: /rollouts, learn: {json_pointer: /id}}
"""
KINDS = {kind.name: kind for kind in parse_config(SESSIONS_YAML).sessions}


def kinds(*names: str) -> tuple[SessionKindConfig, ...]:
    return tuple(KINDS[name] for name in names)


NEMO = kinds("episode", "resources", "mcp_token", "mcp_session")


# --- what an unmodified server sends ----------------------------------------------------------


class _Signer(TimestampSigner):
    """SessionMiddleware's signer, with the timestamp fixed so equal replies are equal."""

    def get_timestamp(self) -> int:
        return SIGNED_AT


def session_cookie(session_id: str) -> str:
    """SessionMiddleware's cookie value: TimestampSigner(secret).sign(b64encode(json))."""
    payload = base64.b64encode(json.dumps({"session_id": session_id}).encode())
    return _Signer(SECRET).sign(payload).decode()


def read_session_cookie(value: str) -> str | None:
    """What SessionMiddleware reads back: None for a cookie it does not accept."""
    try:
        payload = TimestampSigner(SECRET).unsign(value, max_age=14 * 86400)
    except BadSignature:
        return None
    session_id = json.loads(base64.b64decode(payload)).get("session_id")
    return session_id if isinstance(session_id, str) else None


def mcp_token(session_id: str) -> str:
    value = URLSafeSerializer(MCP_SECRET, salt=MCP_SALT).dumps({"sid": session_id})
    assert isinstance(value, str)
    return value


def read_mcp_token(value: str) -> str | None:
    try:
        payload = URLSafeSerializer(MCP_SECRET, salt=MCP_SALT).loads(value)
    except BadSignature:
        return None
    sid = payload.get("sid") if isinstance(payload, dict) else None
    return sid if isinstance(sid, str) else None


SET_COOKIE_FLAGS = "path=/; Max-Age=1209600; httponly; samesite=lax"
CLEARED = f"{COOKIE}=null; path=/; expires=Thu, 01 Jan 1970 00:00:00 GMT; httponly; samesite=lax"


class GymWorker:
    """One unmodified server process on a loopback port (see the module docstring).

    Test-only knobs, read from the request: `X-Test-Session-Id` fixes the id a seed or an
    MCP initialize creates (so two replies can be compared byte for byte), and
    `X-Test-Reply` frames the seed reply's body: `json` (Content-Length), `oversize`
    (Content-Length, over the router's learning budget), `chunked`, `chunked-oversize`,
    `gzip` or `stalled` (half the body, then silence).
    """

    def __init__(self, worker_id: str) -> None:
        self.id = worker_id
        self.sessions: dict[str, int] = {}  # Starlette session id → tool calls
        self.mcp_sessions: set[str] = set()
        self.rollouts: dict[str, int] = {}
        self.seed_bodies: list[bytes] = []  # each seed reply's body as sent on the wire
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self) -> None:
        app = web.Application()
        app.router.add_post("/seed_session", self._seed)
        app.router.add_post("/close_session", self._close)
        app.router.add_post("/tools/{name}", self._tool)
        app.router.add_get("/health", self._health)
        app.router.add_route("*", "/mcp", self._mcp)
        app.router.add_post("/rollouts", self._start_rollout)
        app.router.add_post("/rollouts/step", self._step_by_body)
        app.router.add_post("/rollouts/{key}/step", self._step_by_path)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        """The process is gone: its port refuses connections from now on."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # -- Starlette-style sessions --

    async def _seed(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        sid = request.headers.get("X-Test-Session-Id") or secrets.token_hex(8)
        self.sessions[sid] = 0
        document: dict[str, object] = {
            "worker": self.id,
            "mcp": {"headers": {MCP_TOKEN_HEADER: mcp_token(sid)}},
        }
        mode = request.headers.get("X-Test-Reply", "json")
        if mode in ("oversize", "chunked-oversize"):
            document["padding"] = "p" * MAX_LEARN_BODY_BYTES
        body = json.dumps(document).encode()
        headers = {
            "Set-Cookie": f"{COOKIE}={session_cookie(sid)}; {SET_COOKIE_FLAGS}",
            "Date": FIXED_DATE,
            "Content-Type": "application/json",
        }
        if mode == "gzip":
            body = gzip.compress(body, mtime=0)
            headers["Content-Encoding"] = "gzip"
        self.seed_bodies.append(body)
        if mode == "stalled":  # half the body, then nothing until the test ends
            response = web.StreamResponse(headers={**headers, "Content-Length": str(len(body))})
            await response.prepare(request)
            await response.write(body[: len(body) // 2])
            await asyncio.sleep(60)
            return response
        if not mode.startswith("chunked"):
            return web.Response(body=body, headers=headers)
        response = web.StreamResponse(headers=headers)
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, len(body), 16384):
            await response.write(body[start : start + 16384])
        await response.write_eof()
        return response

    def _session_of(self, request: web.Request) -> str | None:
        cookie = request.cookies.get(COOKIE)
        if cookie is not None:
            return read_session_cookie(cookie)
        header = request.headers.get(MCP_TOKEN_HEADER)
        return read_mcp_token(header) if header is not None else None

    async def _tool(self, request: web.Request) -> web.Response:
        await request.read()
        sid = self._session_of(request)
        if sid is None or sid not in self.sessions:
            return self._not_mine("session", sid)
        self.sessions[sid] += 1
        return self._json({"session": sid, "calls": self.sessions[sid]})

    async def _close(self, request: web.Request) -> web.Response:
        sid = self._session_of(request)
        if sid is None or sid not in self.sessions:
            return self._not_mine("session", sid)
        del self.sessions[sid]
        return self._json({"closed": sid}, headers={"Set-Cookie": CLEARED})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    # -- MCP protocol sessions --

    async def _mcp(self, request: web.Request) -> web.Response:
        await request.read()
        sid = request.headers.get("Mcp-Session-Id")
        if request.method == "DELETE":
            if sid not in self.mcp_sessions:
                return self._not_mine("mcp session", sid, status=404)
            self.mcp_sessions.discard(sid)
            return web.Response(status=200, headers={"Date": FIXED_DATE})
        if sid is None:  # initialize: a new protocol session
            sid = request.headers.get("X-Test-Session-Id") or f"mcp-{secrets.token_hex(8)}"
            self.mcp_sessions.add(sid)
            return self._json({"initialized": sid}, headers={"Mcp-Session-Id": sid})
        if sid not in self.mcp_sessions:
            return self._not_mine("mcp session", sid, status=404)
        return self._json({"mcp_session": sid}, headers={"Mcp-Session-Id": sid})

    # -- rollouts named in bodies and paths --

    async def _start_rollout(self, request: web.Request) -> web.Response:
        rid = f"r-{secrets.token_hex(6)}"
        self.rollouts[rid] = 0
        return self._json({"id": rid})

    async def _step_by_body(self, request: web.Request) -> web.Response:
        try:
            rid = json.loads(await request.read()).get("rollout_id")
        except ValueError:
            rid = None
        return self._step(rid if isinstance(rid, str) else None)

    async def _step_by_path(self, request: web.Request) -> web.Response:
        return self._step(request.match_info["key"])

    def _step(self, rid: str | None) -> web.Response:
        if rid is None or rid not in self.rollouts:
            return self._not_mine("rollout", rid)
        self.rollouts[rid] += 1
        return self._json({"rollout": rid, "steps": self.rollouts[rid]})

    # -- replies --

    def _json(self, body: dict[str, object], headers: dict[str, str] | None = None) -> web.Response:
        return web.json_response(
            {"worker": self.id, **body}, headers={"Date": FIXED_DATE, **(headers or {})}
        )

    def _not_mine(self, what: str, key: str | None, status: int = 409) -> web.Response:
        body = {"worker": self.id, "error": f"no such {what} in this process", "key": key}
        return web.json_response(body, status=status)


# --- the rig ---------------------------------------------------------------------------------


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


async def start(
    rig: Rig, count: int, sessions: Iterable[SessionKindConfig], **fields: Any
) -> dict[str, GymWorker]:
    """`count` static GymWorkers (w0..) and a router in front of them."""
    workers = {}
    for i in range(count):
        worker = GymWorker(f"w{i}")
        await worker.serve()
        rig.stack.push_async_callback(worker.stop)
        workers[worker.id] = worker
    statics = tuple(StaticWorkerConfig(w.id, w.url) for w in workers.values())
    config: Config = router_config(
        rig.tmp_path, workers=statics, health=FAST_PROBES, sessions=tuple(sessions), **fields
    )
    await rig.start_router(config)
    return workers


@dataclasses.dataclass(frozen=True)
class Seeded:
    """One session a seed reply created."""

    worker: str
    sid: str
    cookie: str
    token: str

    @property
    def with_cookie(self) -> dict[str, str]:
        return {"Cookie": f"{COOKIE}={self.cookie}"}

    @property
    def with_token(self) -> dict[str, str]:
        return {MCP_TOKEN_HEADER: self.token}


async def seed(rig: Rig, headers: dict[str, str] | None = None) -> Seeded:
    reply = await rig.request("POST", "/seed_session", headers=headers, data=b"{}")
    assert reply.status == 200, reply.body
    cookie = set_cookie_value(reply.headers.getall("Set-Cookie", []), COOKIE)
    assert cookie is not None
    sid = read_session_cookie(cookie)
    assert sid is not None
    body = reply.json()
    return Seeded(reply.worker, sid, cookie, body["mcp"]["headers"][MCP_TOKEN_HEADER])


async def session_view(rig: Rig, kind: str, key: str) -> dict[str, Any]:
    reply = await rig.admin("GET", f"/admin/sessions/{kind}/{key}")
    assert reply.status == 200, reply.body
    view = reply.json()
    assert isinstance(view, dict)
    return view


async def claims_by_worker(rig: Rig) -> dict[str, int]:
    return {wid: view["claims"] for wid, view in (await rig.worker_views()).items()}


def assert_tool_reply(reply: Reply, session: Seeded, calls: int) -> None:
    assert reply.status == 200, reply.body
    assert reply.json() == {"worker": session.worker, "session": session.sid, "calls": calls}


# ============================================================================ cookie sessions


async def test_thirty_cookie_sessions_each_reach_the_worker_that_seeded_them(rig: Rig) -> None:
    workers = await start(rig, 3, kinds("resources"))

    seeded = [await seed(rig) for _ in range(30)]

    # Each seed went to the worker with the fewest claims: an even spread.
    per_worker = {wid: [s.sid for s in seeded if s.worker == wid] for wid in workers}
    assert {wid: len(sids) for wid, sids in per_worker.items()} == {"w0": 10, "w1": 10, "w2": 10}
    assert await claims_by_worker(rig) == {"w0": 10, "w1": 10, "w2": 10}
    for wid, worker in workers.items():
        assert sorted(worker.sessions) == sorted(per_worker[wid])

    for calls in (1, 2):
        replies = await asyncio.gather(
            *(rig.request("POST", "/tools/add", headers=s.with_cookie, data=b"{}") for s in seeded)
        )
        for session, reply in zip(seeded, replies, strict=True):
            assert_tool_reply(reply, session, calls)

    view = await session_view(rig, "resources", seeded[0].sid)
    assert (view["worker"], view["state"], view["learned"]) == (seeded[0].worker, "held", True)


async def test_a_closed_cookie_session_is_episode_ended(rig: Rig) -> None:
    workers = await start(rig, 2, kinds("resources"))
    first, second = await seed(rig), await seed(rig)

    reply = await rig.request("POST", "/close_session", headers=first.with_cookie)

    assert reply.status == 200 and reply.json() == {"worker": first.worker, "closed": first.sid}
    assert reply.headers.getall("Set-Cookie") == [CLEARED]  # relayed as the worker sent it
    assert first.sid not in workers[first.worker].sessions
    after = await rig.request("POST", "/tools/add", headers=first.with_cookie)
    after.assert_answer(410, "episode_ended", first.sid)
    # A repeated close reaches the worker that held the session: its own contract
    # answers (this one's: 409), not the router's 410 (design §4).
    again = await rig.request("POST", "/close_session", headers=first.with_cookie)
    assert (again.status, again.json()["worker"]) == (409, first.worker)
    assert_tool_reply(
        await rig.request("POST", "/tools/add", headers=second.with_cookie), second, 1
    )
    assert await claims_by_worker(rig) == {first.worker: 0, second.worker: 1}


async def test_a_seed_carrying_a_stale_cookie_is_balanced_not_pinned(rig: Rig) -> None:
    await start(rig, 3, kinds("resources"))
    sessions = [await seed(rig) for _ in range(3)]
    assert [s.worker for s in sessions] == ["w0", "w1", "w2"]
    closed = await rig.request("POST", "/close_session", headers=sessions[0].with_cookie)
    assert closed.status == 200

    fresh = await seed(rig, sessions[2].with_cookie)  # w2's cookie, from an earlier episode

    assert fresh.worker == "w0"  # the fewest claims, not the stale cookie's worker
    assert await claims_by_worker(rig) == {"w0": 1, "w1": 1, "w2": 1}


async def _seed_one_id_on_two_workers(rig: Rig) -> Seeded:
    """w0 and w1 both hand out session `dup`: w0 first, then w1 (it has fewer claims)."""
    same = {"X-Test-Session-Id": "dup"}
    first, second = await seed(rig, same), await seed(rig, same)
    assert (first.worker, second.worker, first.sid, second.sid) == ("w0", "w1", "dup", "dup")
    return first


async def test_a_session_id_another_worker_holds_is_not_learned(rig: Rig) -> None:
    workers = await start(rig, 2, kinds("resources"))

    first = await _seed_one_id_on_two_workers(rig)

    assert await claims_by_worker(rig) == {"w0": 1, "w1": 0}
    assert (await session_view(rig, "resources", "dup"))["worker"] == "w0"
    assert_tool_reply(await rig.request("POST", "/tools/add", headers=first.with_cookie), first, 1)
    assert workers["w1"].sessions == {"dup": 0}  # w1's copy is never reached


def _sample(metrics: str, name: str, kind: str) -> float | None:
    prefix = f'{name}{{kind="{kind}"}} '
    lines = [line for line in metrics.splitlines() if line.startswith(prefix)]
    return float(lines[0][len(prefix) :]) if lines else None


async def test_learned_and_refused_claims_show_in_the_metrics(rig: Rig) -> None:
    await start(rig, 2, kinds("resources"))
    await _seed_one_id_on_two_workers(rig)

    metrics = (await rig.admin("GET", "/metrics")).body.decode()

    assert _sample(metrics, "episode_router_learned_claims_total", "resources") == 1.0
    assert _sample(metrics, "episode_router_learn_conflicts_total", "resources") == 1.0


async def test_a_cookie_session_unused_for_the_idle_ttl_ends(rig: Rig) -> None:
    claims = ClaimsConfig(recovery_window_s=0.0, learned_idle_ttl_s=1.0)
    await start(rig, 1, kinds("resources"), claims=claims)
    session = await seed(rig)
    used_at = time.monotonic()  # the claim's last use is the request below, after this
    assert_tool_reply(
        await rig.request("POST", "/tools/add", headers=session.with_cookie), session, 1
    )
    assert (await session_view(rig, "resources", session.sid))["state"] == "held"

    async def ended() -> bool:  # the admin view reads the claim without using it
        view = await session_view(rig, "resources", session.sid)
        return bool(view["state"] == "episode_ended")

    await wait_until(ended, "the idle learned claim to end")

    assert time.monotonic() - used_at >= 1.0
    reply = await rig.request("POST", "/tools/add", headers=session.with_cookie)
    reply.assert_answer(410, "episode_ended", session.sid)


# ============================================================================ NeMo Gym config


async def test_one_seed_reply_teaches_the_cookie_and_the_mcp_token(rig: Rig) -> None:
    workers = await start(rig, 3, NEMO)

    seeded = [await seed(rig) for _ in range(6)]

    assert [s.worker for s in seeded] == ["w0", "w1", "w2"] * 2
    assert await claims_by_worker(rig) == {"w0": 4, "w1": 4, "w2": 4}  # 2 kinds x 2 sessions
    for session in seeded:
        for kind in ("resources", "mcp_token"):
            view = await session_view(rig, kind, session.sid)
            assert (view["worker"], view["learned"]) == (session.worker, True)
    for calls, carried in enumerate(["token", "cookie", "both"], start=1):
        for session in seeded:
            headers = {
                "token": session.with_token,
                "cookie": session.with_cookie,
                "both": session.with_token | session.with_cookie,
            }[carried]
            reply = await rig.request("POST", "/tools/search", headers=headers)
            assert_tool_reply(reply, session, calls)
    assert sum(sum(w.sessions.values()) for w in workers.values()) == 18

    closed = seeded[0]
    reply = await rig.request("POST", "/close_session", headers=closed.with_cookie)
    assert reply.status == 200
    # The close ends the session under both kinds its seed reply taught.
    for kind, headers in (("resources", closed.with_cookie), ("mcp_token", closed.with_token)):
        assert (await session_view(rig, kind, closed.sid))["state"] == "episode_ended"
        after = await rig.request("POST", "/tools/search", headers=headers)
        after.assert_answer(410, "episode_ended", closed.sid)
    assert await claims_by_worker(rig) == {"w0": 2, "w1": 4, "w2": 4}


async def test_a_token_for_a_session_no_seed_taught_is_refused(rig: Rig) -> None:
    await start(rig, 2, NEMO)
    reply = await rig.request("POST", "/tools/add", headers={MCP_TOKEN_HEADER: mcp_token("nope")})
    reply.assert_answer(401, "unknown_episode", "nope")
    garbage = await rig.request("POST", "/tools/add", headers={MCP_TOKEN_HEADER: "garbage"})
    garbage.assert_answer(401, "invalid_token", None)


async def test_a_session_token_decides_beside_a_cookie_a_jar_kept(rig: Rig) -> None:
    """design §4: a header the client sets outranks a cookie: the MCP SDK's default
    client keeps whatever cookie a reply set (NeMo Gym's sets a new session's on every
    reply to a request without one) and sends it beside the session token."""
    await start(rig, 2, NEMO)
    sessions = [await seed(rig), await seed(rig)]
    assert {s.worker for s in sessions} == {"w0", "w1"}
    for session in sessions:
        for jar_cookie in ("not-a-session-cookie", session_cookie("a-session-nobody-seeded")):
            headers = {"Cookie": f"{COOKIE}={jar_cookie}", **session.with_token}
            reply = await rig.request("POST", "/tools/add", headers=headers)
            # Routed by the token to its worker (which reads the cookie: it answers
            # for itself), never refused by the router for the unknown cookie.
            assert reply.json()["worker"] == session.worker, reply.body


async def test_an_invalid_token_decides_even_beside_a_valid_cookie(rig: Rig) -> None:
    workers = await start(rig, 2, NEMO)
    session = await seed(rig)
    headers = {**session.with_cookie, "X-NeMo-Gym-Session-Token": "not-a-token"}

    reply = await rig.request("POST", "/tools/add", headers=headers)

    reply.assert_answer(401, "invalid_token", None)  # never routed by the weaker cookie
    assert workers[session.worker].sessions[session.sid] == 0


# ============================================================================ MCP sessions


async def test_mcp_sessions_are_learned_routed_and_released(rig: Rig) -> None:
    workers = await start(rig, 2, kinds("mcp_session"))

    ids: dict[str, str] = {}
    for _ in range(4):
        reply = await rig.request("POST", "/mcp", data=b'{"method": "initialize"}')
        assert reply.status == 200, reply.body
        ids[reply.headers["Mcp-Session-Id"]] = reply.worker
    assert sorted(ids.values()) == ["w0", "w0", "w1", "w1"]
    for sid, wid in ids.items():
        assert sid in workers[wid].mcp_sessions
        reply = await rig.request("POST", "/mcp", headers={"Mcp-Session-Id": sid}, data=b"{}")
        assert reply.status == 200 and reply.json() == {"worker": wid, "mcp_session": sid}

    sid, wid = next(iter(ids.items()))
    deleted = await rig.request("DELETE", "/mcp", headers={"Mcp-Session-Id": sid})

    assert deleted.status == 200 and sid not in workers[wid].mcp_sessions
    assert (await session_view(rig, "mcp_session", sid))["state"] == "episode_ended"
    after = await rig.request("POST", "/mcp", headers={"Mcp-Session-Id": sid}, data=b"{}")
    after.assert_answer(404, "unknown_session", sid)
    unknown = await rig.request("GET", "/mcp", headers={"Mcp-Session-Id": "never-issued"})
    unknown.assert_answer(404, "unknown_session", "never-issued")
    assert await claims_by_worker(rig) == {wid: 1, ("w1" if wid == "w0" else "w0"): 2}


async def test_a_refused_mcp_delete_keeps_the_session(rig: Rig) -> None:
    workers = await start(rig, 1, kinds("mcp_session"))
    reply = await rig.request("POST", "/mcp", data=b"{}")
    sid = reply.headers["Mcp-Session-Id"]
    workers["w0"].mcp_sessions.discard(sid)  # the server forgot it: its DELETE answers 404

    deleted = await rig.request("DELETE", "/mcp", headers={"Mcp-Session-Id": sid})

    assert deleted.status == 404 and deleted.json()["worker"] == "w0"
    assert (await session_view(rig, "mcp_session", sid))["state"] == "held"


async def test_an_mcp_delete_that_also_carries_the_episode_token_releases_the_session(
    rig: Rig,
) -> None:
    await start(rig, 1, kinds("episode", "mcp_session"))
    worker = rig.router.core.workers.get("w0")
    assert worker is not None
    assert rig.router.core.claim(worker, "episode", "ep1-a0", time.monotonic()) is None
    episode = {TOKEN_HEADER: token("ep1")}
    reply = await rig.request("POST", "/mcp", headers=episode, data=b"{}")
    sid = reply.headers["Mcp-Session-Id"]
    assert (await session_view(rig, "mcp_session", sid))["worker"] == "w0"

    deleted = await rig.request("DELETE", "/mcp", headers={**episode, "Mcp-Session-Id": sid})

    assert deleted.status == 200
    assert (await session_view(rig, "mcp_session", sid))["state"] == "episode_ended"


async def test_a_close_that_also_carries_the_episode_token_ends_the_cookie_session(
    rig: Rig,
) -> None:
    # The token routes the close (design §7: it travels on every request); the cookie
    # beside it names the session the close ends, with the MCP token its seed taught.
    await start(rig, 1, kinds("episode", "resources", "mcp_token"))
    worker = rig.router.core.workers.get("w0")
    assert worker is not None
    assert rig.router.core.claim(worker, "episode", "ep1-a0", time.monotonic()) is None
    episode = {TOKEN_HEADER: token("ep1")}
    session = await seed(rig, episode)

    closed = await rig.request("POST", "/close_session", headers={**episode, **session.with_cookie})

    assert closed.status == 200
    assert (await session_view(rig, "resources", session.sid))["state"] == "episode_ended"
    assert (await session_view(rig, "mcp_token", session.sid))["state"] == "episode_ended"
    assert (await session_view(rig, "episode", "ep1-a0"))["state"] == "held"


# ============================================================================ bodies and paths


async def test_rollouts_named_in_bodies_and_paths_reach_their_worker(rig: Rig) -> None:
    workers = await start(rig, 3, kinds("rollout", "rollout_path"))
    started = []
    for _ in range(6):
        reply = await rig.request("POST", "/rollouts")
        assert reply.status == 200
        started.append((reply.json()["id"], reply.worker))
    assert [wid for _, wid in started] == ["w0", "w1", "w2"] * 2
    assert await claims_by_worker(rig) == {"w0": 4, "w1": 4, "w2": 4}

    json_type = {"Content-Type": "application/json"}
    for rid, wid in started:
        body = json.dumps({"rollout_id": rid}).encode()
        by_body = await rig.request("POST", "/rollouts/step", headers=json_type, data=body)
        assert by_body.status == 200 and by_body.json() == {
            "worker": wid,
            "rollout": rid,
            "steps": 1,
        }
        by_path = await rig.request("POST", f"/rollouts/{rid}/step")
        assert by_path.status == 200 and by_path.json()["steps"] == 2
    assert sum(sum(w.rollouts.values()) for w in workers.values()) == 12

    unknown = json.dumps({"rollout_id": "r-unknown"}).encode()
    (await rig.request("POST", "/rollouts/step", headers=json_type, data=unknown)).assert_answer(
        401, "unknown_episode", "r-unknown"
    )
    (await rig.request("POST", "/rollouts/r-unknown/step")).assert_answer(
        401, "unknown_episode", "r-unknown"
    )


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data[:5]
    yield data[5:]


@pytest.mark.parametrize("shape", ["not-json-type", "chunked", "over-max-bytes", "no-field"])
async def test_a_body_the_router_may_not_read_names_no_session(rig: Rig, shape: str) -> None:
    await start(rig, 2, kinds("rollout"))
    first = await rig.request("POST", "/rollouts")
    second = await rig.request("POST", "/rollouts")
    rid = second.json()["id"]
    assert (first.worker, second.worker) == ("w0", "w1")
    document: dict[str, object] = {"rollout_id": rid}
    headers = {"Content-Type": "application/json"}
    data: bytes | AsyncIterator[bytes]
    if shape == "not-json-type":
        headers["Content-Type"] = "text/plain"
    if shape == "over-max-bytes":
        document["pad"] = "p" * 1024
    if shape == "no-field":
        document = {"rollout": rid}
    data = json.dumps(document).encode()
    if shape == "chunked":
        data = _chunks(data)

    reply = await rig.request("POST", "/rollouts/step", headers=headers, data=data)

    # No session: balanced to w0 (equal claims, lowest id), which does not hold w1's rollout.
    assert reply.status == 409 and reply.json()["worker"] == "w0"


# ============================================================================ worker exits


async def test_a_killed_static_worker_makes_its_sessions_worker_exited(rig: Rig) -> None:
    workers = await start(rig, 3, kinds("resources"))
    seeded = [await seed(rig) for _ in range(6)]
    lost = [s for s in seeded if s.worker == "w1"]
    kept = [s for s in seeded if s.worker != "w1"]
    assert len(lost) == 2

    await workers["w1"].stop()
    took = await rig.wait_worker_state("w1", "exited")

    assert took < 2.0  # health.failures (2) refused probes, 50 ms apart
    for session in lost:
        reply = await rig.request("POST", "/tools/add", headers=session.with_cookie)
        reply.assert_answer(410, "worker_exited", session.sid)
    for session in kept:
        reply = await rig.request("POST", "/tools/add", headers=session.with_cookie)
        assert_tool_reply(reply, session, 1)
    assert {(await seed(rig)).worker for _ in range(4)} == {"w0", "w2"}
    assert (await claims_by_worker(rig))["w1"] == 0


# ============================================================================ replies unchanged


def _head_lines(raw: bytes) -> list[str]:
    """The reply head's lines without hop-by-hop ones (the router's own framing)."""
    lines = raw.decode("latin-1").split("\r\n")
    hop = ("connection:", "keep-alive:")
    return [line for line in lines if not line.lower().startswith(hop)]


async def _exchange(port: int, request: bytes) -> tuple[list[str], bytes]:
    http = await RawHttp.open(port)
    try:
        http.send(request)
        _, headers, raw = await http.read_head()
        body = await asyncio.wait_for(http.reader.readexactly(int(headers["content-length"])), 5.0)
        return _head_lines(raw), body
    finally:
        http.close()


@pytest.mark.parametrize(
    ("request_line", "learned"),
    [
        ("POST /seed_session", [("resources", "fixed-1"), ("mcp_token", "fixed-1")]),
        ("POST /mcp", [("mcp_session", "fixed-1")]),
    ],
    ids=["seed", "mcp-initialize"],
)
async def test_learning_leaves_the_reply_byte_for_byte_as_the_worker_sent_it(
    rig: Rig, request_line: str, learned: list[tuple[str, str]]
) -> None:
    workers = await start(rig, 1, NEMO)
    request = (
        f"{request_line} HTTP/1.1\r\nHost: public.example\r\nX-Test-Session-Id: fixed-1\r\n"
        "Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    ).encode()

    direct = await _exchange(workers["w0"].port, request)
    assert all(rig.router.core.claims.lookup(k, key) is None for k, key in learned)
    routed = await _exchange(rig.router.public_port, request)

    assert routed == direct
    for kind, key in learned:
        assert (await session_view(rig, kind, key))["worker"] == "w0"


@pytest.mark.parametrize(
    ("shape", "token_learned"),
    [("oversize", False), ("chunked-oversize", False), ("gzip", False), ("chunked", True)],
)
async def test_a_seed_reply_body_the_router_cannot_read_is_relayed_and_teaches_no_token(
    rig: Rig, shape: str, token_learned: bool
) -> None:
    """A JSON pointer is read only from a seed reply body that ends within 64 KiB and is
    plain JSON: a bigger body (whatever its framing) or an encoded one is relayed untouched
    and teaches nothing from the pointer. A small chunked body is read ahead and learned.
    Set-Cookie, in the head, is learned whatever the body."""
    workers = await start(rig, 1, NEMO)

    async with rig.http.post(
        rig.url("/seed_session"),
        headers={"X-Test-Reply": shape},
        data=b"{}",
        auto_decompress=False,
    ) as reply:
        assert reply.status == 200
        body = await reply.read()
        set_cookies = reply.headers.getall("Set-Cookie")
        encoding = reply.headers.get("Content-Encoding")
        chunked = reply.headers.get("Transfer-Encoding")

    [sent] = workers["w0"].seed_bodies
    assert hashlib.sha256(body).hexdigest() == hashlib.sha256(sent).hexdigest()
    assert (encoding, chunked) == (
        "gzip" if shape == "gzip" else None,
        "chunked" if shape.startswith("chunked") else None,
    )
    cookie = set_cookie_value(set_cookies, COOKIE)
    assert cookie is not None
    sid = read_session_cookie(cookie)
    assert sid is not None
    session = Seeded("w0", sid, cookie, mcp_token(sid))
    assert_tool_reply(
        await rig.request("POST", "/tools/add", headers=session.with_cookie), session, 1
    )
    by_token = await rig.request("POST", "/tools/add", headers=session.with_token)
    if token_learned:
        assert_tool_reply(by_token, session, 2)
    else:
        by_token.assert_answer(401, "unknown_episode", sid)


async def test_a_client_that_leaves_while_a_seed_reply_is_read_frees_the_worker(
    rig: Rig,
) -> None:
    # The router reads the seed reply's body for the token it teaches; its client leaves
    # meanwhile: the worker's connection is dropped at once, not read to its end.
    await start(rig, 1, NEMO)
    conn = await RawHttp.open(rig.router.public_port)
    conn.send(
        b"POST /seed_session HTTP/1.1\r\nHost: x\r\nX-Test-Reply: stalled\r\n"
        b"Content-Length: 2\r\n\r\n{}"
    )

    async def in_flight(count: int) -> bool:
        return (await rig.worker_views())["w0"]["in_flight"] == count

    await wait_until(lambda: in_flight(1), "the seed to be in flight")
    await asyncio.sleep(0.2)  # the head is in, the body half read
    conn.close()
    assert await wait_until(lambda: in_flight(0), "the slot to be free", 5.0) < 1.0


# --- cookies and MCP ids as the workers read them ---------------------------------------------


async def test_an_mcp_delete_with_its_session_id_repeated_alike_releases_it(rig: Rig) -> None:
    workers = await start(rig, 1, kinds("mcp_session"))
    reply = await rig.request("POST", "/mcp", data=b"{}")
    sid = reply.headers["Mcp-Session-Id"]

    # The same id twice is one id: it routed the DELETE, and ends with it.
    repeated = [("Mcp-Session-Id", sid), ("Mcp-Session-Id", sid)]
    deleted = await rig.request("DELETE", "/mcp", headers=repeated)

    assert deleted.status == 200 and sid not in workers["w0"].mcp_sessions
    assert (await session_view(rig, "mcp_session", sid))["state"] == "episode_ended"
    after = await rig.request("POST", "/mcp", headers={"Mcp-Session-Id": sid}, data=b"{}")
    after.assert_answer(404, "unknown_session", sid)


@pytest.mark.parametrize("value", ["a,b", "a b", 'a"b'])
async def test_a_session_cookie_off_the_rfc_grammar_still_decides(rig: Rig, value: str) -> None:
    # The worker reads it (Starlette's parser takes any value): it is the cookie source
    # present, and decides (401 here), never a weaker source behind it.
    await start(rig, 2, kinds("resources", "rollout"))
    await rig.request("POST", "/rollouts")
    rollout = (await rig.request("POST", "/rollouts")).json()["id"]
    headers = [("Content-Type", "application/json"), ("Cookie", f"{COOKIE}={value}")]
    body = json.dumps({"rollout_id": rollout}).encode()

    reply = await rig.request("POST", "/rollouts/step", headers=headers, data=body)

    assert reply.status == 401 and reply.json()["error"] == "invalid_token"


@pytest.mark.parametrize("other", ["x,y", "x y", 'x"y'])
async def test_a_session_cookie_repeated_with_an_off_grammar_value_is_ambiguous(
    rig: Rig, other: str
) -> None:
    await start(rig, 2, kinds("resources"))
    seeded = await seed(rig)
    headers = [("Cookie", f"{COOKIE}={seeded.cookie}; {COOKIE}={other}")]

    reply = await rig.request("POST", "/tools/add", headers=headers)

    assert reply.status == 400 and reply.json()["error"] == "ambiguous_session"


RAW_COOKIE = parse_config(
    "sessions: [{name: sess, cookie: {name: sess, format: raw}, seed: {method: POST, path: /seed}}]"
).sessions


async def test_a_raw_cookie_learned_quoted_is_read_back_as_the_worker_reads_it(
    rig: Rig, tmp_path: Path
) -> None:
    # Python's servers quote a value with a space or a comma (`sess="w1 1"`, a comma
    # as \054): the key learned from Set-Cookie is the key read from Cookie, and the
    # worker's own reading of it.
    statics = []
    for wid in ("w0", "w1"):
        minted = iter(range(1, 100))

        async def seeded(
            request: web.Request, wid: str = wid, minted: Any = minted
        ) -> web.Response:
            reply = web.json_response({"worker": wid})
            reply.set_cookie("sess", f"{wid} {next(minted)},x")
            return reply

        async def whoami(request: web.Request, wid: str = wid) -> web.Response:
            return web.json_response({"worker": wid, "cookie": request.cookies.get("sess")})

        app = web.Application()
        app.router.add_post("/seed", seeded)
        app.router.add_get("/whoami", whoami)
        app.router.add_get("/health", whoami)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        rig.stack.push_async_callback(runner.cleanup)
        statics.append(StaticWorkerConfig(wid, f"http://127.0.0.1:{runner.addresses[0][1]}"))
    config = router_config(
        tmp_path, workers=tuple(statics), health=FAST_PROBES, sessions=RAW_COOKIE
    )
    await rig.start_router(config)

    for _ in range(2):  # one session on each worker
        reply = await rig.request("POST", "/seed")
        pair = reply.headers.getall("Set-Cookie")[0].split(";")[0]
        assert pair.startswith('sess="')  # quoted by http.cookies
        key = f"{reply.worker} 1,x"
        assert (await session_view(rig, "sess", key))["worker"] == reply.worker
        back = await rig.request("GET", "/whoami", headers={"Cookie": pair})
        assert back.json() == {"worker": reply.worker, "cookie": key}
