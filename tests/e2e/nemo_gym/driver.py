"""NeMo Gym's own clients against a router in front of NeMo Gym's own servers.

Run with NeMo Gym's interpreter (.venv-nemo-gym, see tests/e2e/test_nemo_gym.py), never
the router's: it imports nemo_gym and the MCP SDK as NeMo Gym installs them.

    python driver.py FLOW BASE_URL [COUNT]

prints one JSON object: what each call answered, so the test judges the flow. Every flow
speaks as NeMo Gym's agents and environment servers do: `nemo_gym.server_utils.request`
or `ServerClient` with the cookies of each reply passed on the next call (the client keeps
no cookie jar: `simple_agent` passes them by hand), and the MCP SDK's default HTTP client,
which does keep the cookies replies set. State is proven by the servers' own replies: a
counter that reads back what this session added, a seed the holder refuses.

Flows:
- counter: COUNT sessions on example_session_state_mgmt, each seeded with its own count
  and then 5 stateful calls (increment, increment, get, increment, get).
- mcp: COUNT sessions seeded over HTTP, then 5 calls over MCP with the session token the
  seed reply carried (increment x4, get), through the SDK's default client.
- observability: COUNT rollouts through `ServerClient` with `observability_enabled`: every
  path carries NeMo Gym's `/ng-rollout/<rollout_id>` prefix.
- env-seed: COUNT Environment-Server seeds on example_single_tool_call, then one MCP tool
  call each with the token under /resources_tools/headers.
- contract: COUNT trials of NeMo Gym's session contract on example_single_tool_call.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from typing import Any
from urllib.parse import urlparse

from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from nemo_gym.config_types import BaseServerConfig
from nemo_gym.rollout_correlation import rollout_context
from nemo_gym.server_utils import (
    GlobalAIOHTTPAsyncClientConfig,
    ServerClient,
    get_response_json,
    request,
    set_global_aiohttp_client,
)
from omegaconf import OmegaConf

TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
CONCURRENCY = 16  # sessions driven at once


def cookies_of(response: Any) -> dict[str, str]:
    """As simple_agent's `_cookies`: what the reply set, by name."""
    return {str(name): str(morsel.value) for name, morsel in response.cookies.items()}


async def call(method: str, url: str, jar: dict[str, str], body: Any = None) -> tuple[int, Any]:
    """One call as an agent makes it: the session's cookies sent, the reply's kept."""
    kwargs: dict[str, Any] = {"cookies": dict(jar)}
    if body is not None:
        kwargs["json"] = body
    response = await request(method, url, **kwargs)
    jar.update(cookies_of(response))
    try:
        payload = await get_response_json(response)
    except Exception:
        payload = (await response.read()).decode(errors="replace")
    return response.status, payload


async def bounded(count: int, one: Any) -> list[Any]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def run(i: int) -> Any:
        async with gate:
            try:
                return await one(i)
            except Exception as exc:
                return {"i": i, "error": repr(exc)[:300]}

    return await asyncio.gather(*(run(i) for i in range(count)))


async def counter(base: str, count: int) -> dict[str, Any]:
    async def one(i: int) -> dict[str, Any]:
        jar: dict[str, str] = {}
        start = 100 + i
        seed = await call("POST", f"{base}/seed_session", jar, {"initial_count": start})
        steps = [
            await call("POST", f"{base}/increment_counter", jar, {"count": 1}),
            await call("POST", f"{base}/increment_counter", jar, {"count": 2}),
            await call("POST", f"{base}/get_counter_value", jar),
            await call("POST", f"{base}/increment_counter", jar, {"count": 3}),
            await call("POST", f"{base}/get_counter_value", jar),
        ]
        expected = [None, None, start + 3, None, start + 6]
        right = sum(
            1
            for (status, payload), want in zip(steps, expected, strict=True)
            if status == 200 and (want is None or payload.get("count") == want)
        )
        # An increment is proven by the reads after it: all five right only if both are.
        if right == 5:
            return {"i": i, "right": 5}
        return {"i": i, "right": 0, "seed": seed, "steps": steps}

    results = await bounded(count, one)
    return {
        "sessions": count,
        "right": sum(r.get("right", 0) for r in results),
        "results": bad(results),
    }


async def mcp_session(base: str, token: str, calls: list[tuple[str, dict[str, Any]]]) -> list[Any]:
    """Tool calls over MCP through the SDK's default HTTP client (it keeps cookies)."""
    http = create_mcp_http_client(headers={TOKEN_HEADER: token})
    results: list[Any] = []
    async with (
        http,
        streamable_http_client(f"{base}/mcp", http_client=http) as (read, write, _),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        for name, arguments in calls:
            result = await session.call_tool(name, arguments)
            results.append(
                {"error": result.isError, "value": result.structuredContent, "name": name}
            )
    return results


async def mcp(base: str, count: int) -> dict[str, Any]:
    async def one(i: int) -> dict[str, Any]:
        jar: dict[str, str] = {}
        start = 200 + i
        status, seed = await call("POST", f"{base}/seed_session", jar, {"initial_count": start})
        token = ((seed or {}).get("mcp") or {}).get("headers", {}).get(TOKEN_HEADER)
        if status != 200 or not token:
            return {"i": i, "right": 0, "seed": [status, seed]}
        calls = [("increment_counter", {"count": 1})] * 4 + [("get_counter_value", {})]
        results = await mcp_session(base, token, calls)
        right = sum(1 for r in results[:4] if not r["error"])
        last = results[4]
        read_back = not last["error"] and (last["value"] or {}).get("count") == start + 4
        if right == 4 and read_back:
            return {"i": i, "right": 5}
        return {"i": i, "right": 0, "results": results}

    results = await bounded(count, one)
    return {
        "sessions": count,
        "right": sum(r.get("right", 0) for r in results),
        "results": bad(results),
    }


def server_client(base: str, name: str, server: str, *, observability: bool) -> ServerClient:
    """A ServerClient as an agent holds one: the resources server at the router's address."""
    url = urlparse(base)
    entry = {"entrypoint": "app.py", "host": url.hostname, "port": url.port}
    config = {
        "head_server": {"host": "127.0.0.1", "port": 11000},
        name: {"resources_servers": {server: entry}},
    }
    if observability:
        config["observability_enabled"] = True
    head = BaseServerConfig(host="127.0.0.1", port=11000)
    return ServerClient(head_server_config=head, global_config_dict=OmegaConf.create(config))


async def observability(base: str, count: int) -> dict[str, Any]:
    client = server_client(base, "session_state", "example_session_state_mgmt", observability=True)

    async def post(jar: dict[str, str], path: str, body: Any = None) -> tuple[int, Any]:
        kwargs: dict[str, Any] = {"cookies": dict(jar)}
        if body is not None:
            kwargs["json"] = body
        response = await client.post(server_name="session_state", url_path=path, **kwargs)
        jar.update(cookies_of(response))
        return response.status, await get_response_json(response)

    async def one(i: int) -> dict[str, Any]:
        jar: dict[str, str] = {}
        with rollout_context(f"rollout-{i}-{uuid.uuid4().hex[:8]}"):
            seed = await post(jar, "/seed_session", {"initial_count": 300 + i})
            inc = await post(jar, "/increment_counter", {"count": 5})
            got = await post(jar, "/get_counter_value")
        if seed[0] == inc[0] == got[0] == 200 and got[1].get("count") == 305 + i:
            return {"i": i, "right": 1}
        return {"i": i, "right": 0, "seed": seed, "inc": inc, "got": got}

    results = await bounded(count, one)
    return {
        "rollouts": count,
        "right": sum(r.get("right", 0) for r in results),
        "results": bad(results),
    }


def env_seed_body(session: str, rollout: str) -> dict[str, Any]:
    return {
        "resources_session_id": session,
        "episode_id": {"rollout_id": rollout},
        "task_id": {"taskset": "router-e2e", "task_id": "t1"},
        "task_data": {},
    }


def env_close_body(session: str, rollout: str) -> dict[str, Any]:
    return {"resources_session_id": session, "episode_id": {"rollout_id": rollout}}


async def env_seed(base: str, count: int) -> dict[str, Any]:
    async def one(i: int) -> dict[str, Any]:
        jar: dict[str, str] = {}
        session, rollout = f"resources-session-{uuid.uuid4().hex}", f"rollout{i}"
        status, seed = await call(
            "POST", f"{base}/seed_session", jar, env_seed_body(session, rollout)
        )
        token = ((seed or {}).get("resources_tools") or {}).get("headers", {}).get(TOKEN_HEADER)
        if status != 200 or not token:
            return {"i": i, "ok": False, "seed": [status, seed]}
        results = await mcp_session(base, token, [("get_weather", {"city": f"City{i}"})])
        ok = not results[0]["error"] and (results[0]["value"] or {}).get("city") == f"City{i}"
        return {"i": i, "ok": ok, "session": session, "cookies": jar, "token": token}

    results = await bounded(count, one)
    return {"sessions": count, "ok": sum(1 for r in results if r.get("ok")), "results": results}


async def contract(base: str, count: int) -> dict[str, Any]:
    """NeMo Gym's session contract (nemo_gym/testing/session_conformance.py and the
    docstrings of base_resources_server.py), over HTTP through the router, with what proves
    a call reached the session's holder: the holder refuses a seed of the id for another
    episode, and a close for another episode; a worker that never saw the id takes both."""

    async def one(i: int) -> dict[str, Any]:
        session, rollout = f"resources-session-{uuid.uuid4().hex}", f"contract{i}"
        never = f"{session}-never-seeded"
        lost = f"{session}-lost"
        steps: dict[str, int] = {}

        async def step(name: str, path: str, body: Any, jar: dict[str, str] | None = None) -> Any:
            status, payload = await call("POST", f"{base}{path}", {} if jar is None else jar, body)
            steps[name] = status
            return payload

        # A seed, and the same seed again with no cookie (a retry): one session.
        first = await step("seed", "/seed_session", env_seed_body(session, rollout))
        again = await step("seed_again", "/seed_session", env_seed_body(session, rollout))
        steps["same_id"] = int(
            first.get("resources_session_id") == again.get("resources_session_id") == session
        )
        # Reaches the holder: it refuses the id for another episode (a stranger would seed it).
        await step("seed_other_episode", "/seed_session", env_seed_body(session, rollout + "x"))
        # A close, and again: both succeed (the worker's own contract answers).
        await step("close", "/close_session", env_close_body(session, rollout))
        await step("close_again", "/close_session", env_close_body(session, rollout))
        # A close of an id never seeded succeeds; a seed after a close is refused.
        await step("close_never_seeded", "/close_session", env_close_body(never, rollout))
        await step("seed_after_close", "/seed_session", env_seed_body(session, rollout))
        await step("seed_never_seeded_after_close", "/seed_session", env_seed_body(never, rollout))
        # A seed whose reply was lost (no cookie kept), then its close by the body's id:
        # it reaches the holder, which refuses a close for another episode and takes its own.
        await step("lost_seed", "/seed_session", env_seed_body(lost, rollout))
        await step(
            "lost_close_other_episode", "/close_session", env_close_body(lost, rollout + "x")
        )
        await step("lost_close", "/close_session", env_close_body(lost, rollout))
        await step("lost_seed_after_close", "/seed_session", env_seed_body(lost, rollout))
        return {"i": i, "steps": steps}

    return {"trials": count, "results": await bounded(count, one)}


def bad(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results worth showing when a flow fails: the first few that went wrong."""
    return [r for r in results if r.get("right", 0) == 0][:5]


FLOWS = {
    "counter": counter,
    "mcp": mcp,
    "observability": observability,
    "env-seed": env_seed,
    "contract": contract,
}


async def main(flow: str, base: str, count: int) -> None:
    set_global_aiohttp_client(GlobalAIOHTTPAsyncClientConfig())
    print(json.dumps(await FLOWS[flow](base.rstrip("/"), count)))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1))
