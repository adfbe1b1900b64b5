"""NeMo Gym itself, unmodified, behind the router: every flow its agents and MCP clients use.

`nemo-gym` 0.7.0 from PyPI runs in an environment of its own (.venv-nemo-gym, Python
3.13: `bash scripts/test` builds it). Two routers each spawn four workers of a resources
server shipped in the package, exactly as docs/guides/nemo-gym.md configures them (the
test reads the guide's config and changes only paths and ports):
`example_session_state_mgmt` (a counter per session cookie, which silently reads 0 for
a session it does not hold) and `example_single_tool_call` (the Environment-Server
protocol). The load is NeMo Gym's own client code and the MCP SDK's default client, run
by tests/e2e/nemo_gym/driver.py with NeMo Gym's interpreter; what proves that a call
reached the worker holding its session is the servers' own replies.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from bench.launch import free_port, free_port_range

from .conftest import LOOPBACK, Launcher, Router

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "nemo-gym.md"
NEMO_ENV = ROOT / ".venv-nemo-gym"
DRIVER = Path(__file__).with_name("nemo_gym") / "driver.py"
WORKERS = 4
START_TIMEOUT_S = 180.0  # four NeMo Gym servers importing pandas and scipy on two cores
FLOW_TIMEOUT_S = 600.0
KILL_TO_410_S = 1.0
# The guide's server and what the session-state one changes (its guide paragraph).
SINGLE_TOOL = {"server": "example_single_tool_call", "name": "single_tool"}
SESSION_STATE = {
    "example_single_tool_call": "example_session_state_mgmt",
    "single_tool": "session_state",
    "SimpleWeatherResourcesServer": "StatefulCounterResourcesServer",
}

pytestmark = pytest.mark.e2e


def nemo_python() -> Path:
    python = NEMO_ENV / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"NeMo Gym's environment is missing ({NEMO_ENV}): `bash scripts/test` builds it "
            "(nemo-gym 0.7.0 on Python 3.13; see docs/guides/nemo-gym.md, 'Installing "
            "NeMo Gym')",
            pytrace=False,
        )
    return python


def guide_config(renames: dict[str, str]) -> dict[str, Any]:
    """The guide's config, with NeMo Gym where this checkout installs it."""
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", GUIDE.read_text(), re.S) if "spawn:" in b]
    assert len(blocks) == 1, "the guide holds one router config"
    text = blocks[0].replace("/opt/nemo-gym", str(NEMO_ENV))
    for old, new in renames.items():
        text = text.replace(old, new)
    config: dict[str, Any] = yaml.safe_load(text)
    return config


def start_router(launcher: Launcher, name: str, renames: dict[str, str]) -> Router:
    folder = launcher.root / name
    folder.mkdir()
    config = guide_config(renames)
    config["listen"] = {"host": LOOPBACK, "port": free_port()}
    config["admin"] = {"host": LOOPBACK, "port": free_port()}
    config["control"] = {"socket": f"unix:{folder / 'control.sock'}"}
    config["spawn"]["base_port"] = free_port_range(WORKERS)
    config["spawn"]["count"] = WORKERS
    config["claims"] = {"recovery_window_s": 1}
    config["log"] = {"format": "json"}
    config_path = folder / "checked.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    check = subprocess.run(
        [sys.executable, "-m", "router.cli", "check-config", str(config_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0 and "warning" not in check.stdout, check.stdout + check.stderr
    router = launcher.router_from(name, folder, config)
    router.wait_live([f"w{i}" for i in range(WORKERS)], timeout=START_TIMEOUT_S)
    return router


@pytest.fixture(scope="module")
def routers(module_launcher: Launcher) -> Iterator[dict[str, Router]]:
    nemo_python()
    yield {
        "session_state": start_router(module_launcher, "session-state", SESSION_STATE),
        "single_tool": start_router(module_launcher, "single-tool", {}),
    }


def drive(flow: str, router: Router, count: int) -> dict[str, Any]:
    """One flow of NeMo Gym's clients (driver.py, NeMo Gym's interpreter) at the router."""
    result = subprocess.run(
        [str(nemo_python()), str(DRIVER), flow, router.base_url, str(count)],
        capture_output=True,
        text=True,
        timeout=FLOW_TIMEOUT_S,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    outcome: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return outcome


def session_view(router: Router, kind: str, key: str) -> dict[str, Any]:
    found = router.admin(f"/admin/sessions/{kind}/{key}")
    assert found is not None and found[0] == 200, found
    view: dict[str, Any] = found[1]
    return view


def token_sid(token: str) -> str:
    """The session id in NeMo Gym's MCP token (an itsdangerous URLSafeSerializer payload)."""
    payload = token.split(".")[0]
    decoded: dict[str, Any] = json.loads(
        base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
    )
    return str(decoded["sid"])


def cookie_sid(cookie: str) -> str:
    """The session id in a Starlette session cookie (base64 JSON, then the signature)."""
    decoded: dict[str, Any] = json.loads(base64.b64decode(cookie.split(".")[0]))
    return str(decoded["session_id"])


def test_nemo_gyms_client_keeps_every_session_on_its_worker(routers: dict[str, Router]) -> None:
    outcome = drive("counter", routers["session_state"], 100)
    print(f"NeMo Gym client: {outcome['right']}/500 stateful calls on their worker")
    assert outcome["right"] == 500, outcome["results"]
    assert_spread(routers["session_state"])


def test_the_mcp_sdks_default_client_keeps_every_session_on_its_worker(
    routers: dict[str, Router],
) -> None:
    """The SDK's client keeps the cookie every NeMo Gym reply sets, and sends it beside
    the session token: the token decides (design §4)."""
    outcome = drive("mcp", routers["session_state"], 100)
    print(f"MCP SDK default client: {outcome['right']}/500 stateful calls on their worker")
    assert outcome["right"] == 500, outcome["results"]


def test_rollout_prefixes_of_observability_route_like_any_path(
    routers: dict[str, Router],
) -> None:
    outcome = drive("observability", routers["session_state"], 10)
    print(f"observability_enabled: {outcome['right']}/10 rollouts")
    assert outcome["right"] == 10, outcome["results"]


def test_environment_server_seeds_teach_the_mcp_token(routers: dict[str, Router]) -> None:
    router = routers["single_tool"]
    outcome = drive("env-seed", router, 20)
    assert outcome["ok"] == 20, [r for r in outcome["results"] if not r.get("ok")][:3]
    for result in outcome["results"]:
        cookie = next(iter(result["cookies"].values()))
        seeded = session_view(router, "resources_session", result["session"])
        by_cookie = session_view(router, "resources", cookie_sid(cookie))
        assert seeded["worker"] == by_cookie["worker"], (seeded, by_cookie)
    # The token the seed reply carried is learned, for the worker its cookie's session
    # is on: its sid (the cookie's session id) routes to that worker.
    token_learned = 0
    for result in outcome["results"]:
        cookie = next(iter(result["cookies"].values()))
        by_token = session_view(router, "mcp_token", token_sid(result["token"]))
        by_cookie = session_view(router, "resources", cookie_sid(cookie))
        token_learned += (by_token["state"], by_token["worker"]) == ("held", by_cookie["worker"])
    print(
        f"Environment-Server seeds: MCP token learned {token_learned}/20, served {outcome['ok']}/20"
    )
    assert token_learned == 20


def test_nemo_gyms_session_contract_holds_through_the_router(
    routers: dict[str, Router],
) -> None:
    outcome = drive("contract", routers["single_tool"], 12)
    expected = {
        "seed": 200,
        "seed_again": 200,
        "same_id": 1,
        "seed_other_episode": 500,  # the holder refuses it: the retry reached the holder
        "close": 200,
        "close_again": 200,
        "close_never_seeded": 200,
        "lost_seed": 200,
        "lost_close_other_episode": 500,  # the holder refuses it: the close reached it
        "lost_close": 200,
    }
    refused = ("seed_after_close", "seed_never_seeded_after_close", "lost_seed_after_close")
    right = 0
    for trial in outcome["results"]:
        steps = trial["steps"]
        ok = all(steps.get(k) == v for k, v in expected.items())
        ok = ok and all(steps.get(k, 0) >= 400 for k in refused)
        right += ok
        assert ok, trial
    print(f"NeMo Gym's session contract: {right}/12 trials")


async def test_a_killed_workers_sessions_are_410_within_a_second_and_close_then_call_is_410(
    routers: dict[str, Router],
) -> None:
    router = routers["session_state"]
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        sessions = [await seed_counter(http, router, 10 + i) for i in range(8)]
        workers = {s["worker"] for s in sessions}
        assert len(workers) > 1, sessions
        victim = sessions[0]["worker"]
        pid = router.workers()[victim]["pid"]
        assert isinstance(pid, int)
        os.kill(pid, signal.SIGKILL)  # a process the router started for this test
        killed_at = time.monotonic()
        doomed = [s for s in sessions if s["worker"] == victim]
        kept = [s for s in sessions if s["worker"] != victim]
        first = doomed[0]
        status = 0
        while time.monotonic() - killed_at < KILL_TO_410_S * 5:
            status, body = await counter_call(http, router, first["cookies"])
            if status != 200:
                break
        elapsed = time.monotonic() - killed_at
        assert (status, body.get("error")) == (410, "worker_exited"), (status, body)
        print(f"kill -9 of a NeMo Gym worker: its session 410 worker_exited in {elapsed:.3f} s")
        assert elapsed < KILL_TO_410_S
        for session in doomed:
            status, body = await counter_call(http, router, session["cookies"])
            assert (status, body.get("error")) == (410, "worker_exited")
        for session in kept:
            status, body = await counter_call(http, router, session["cookies"])
            assert (status, body) == (200, {"count": session["count"]})
        # The spawner starts it again: a new generation that never serves the old sessions.
        router.wait_live([victim], timeout=START_TIMEOUT_S)
        status, body = await counter_call(http, router, first["cookies"])
        assert (status, body.get("error")) == (410, "worker_exited")

    single_tool = routers["single_tool"]
    async with aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar()) as http:
        seed_body = {
            "resources_session_id": "resources-session-close-then-call",
            "episode_id": {"rollout_id": "closethencall"},
            "task_id": {"taskset": "router-e2e", "task_id": "t1"},
            "task_data": {},
        }
        async with http.post(f"{single_tool.base_url}/seed_session", json=seed_body) as reply:
            assert reply.status == 200
            cookies = {name: morsel.value for name, morsel in reply.cookies.items()}
        close = {k: seed_body[k] for k in ("resources_session_id", "episode_id")}
        url = f"{single_tool.base_url}/close_session"
        async with http.post(url, json=close, cookies=cookies) as reply:
            assert reply.status == 200
        url = f"{single_tool.base_url}/get_weather"
        async with http.post(url, json={"city": "Oslo"}, cookies=cookies) as reply:
            assert reply.status == 410 and (await reply.json())["error"] == "episode_ended"


async def seed_counter(http: aiohttp.ClientSession, router: Router, count: int) -> dict[str, Any]:
    url = f"{router.base_url}/seed_session"
    async with http.post(url, json={"initial_count": count}) as reply:
        assert reply.status == 200, await reply.text()
        cookies = {name: morsel.value for name, morsel in reply.cookies.items()}
    [cookie] = cookies.values()
    view = session_view(router, "resources", cookie_sid(cookie))
    return {"cookies": cookies, "worker": view["worker"], "count": count}


async def counter_call(
    http: aiohttp.ClientSession, router: Router, cookies: dict[str, str]
) -> tuple[int, dict[str, Any]]:
    url = f"{router.base_url}/get_counter_value"
    async with http.post(url, cookies=cookies) as reply:
        return reply.status, await reply.json()


def assert_spread(router: Router) -> None:
    """The sessions went to every worker (each held some), as balancing spreads them."""
    views = router.workers()
    held = {wid: view["claims"] for wid, view in views.items()}
    assert all(count > 0 for count in held.values()), held
