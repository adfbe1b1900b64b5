"""The admin listener (design §6) of a real RouterService: health, readiness, the workers and
sessions views, drain, and the bearer token off loopback.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from router.config import AdminConfig, check_config
from router.service.admin import cross_origin, host_allowed
from tests.router_fixtures import RawHttp, Reply, Rig, open_rig, router_config, token, wait_until

pytestmark = pytest.mark.timeout(30)

WORKER_FIELDS = {
    "id",
    "url",
    "state",
    "origin",
    "draining",
    "generation",
    "claims",
    "in_flight",
    "pid",
}
ADMIN_TOKEN = "t0ken-" * 4


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


def _no_boot(rig: Rig, reply: Reply) -> None:
    """No boot id, the router's or a worker's, appears in an admin reply."""
    boots = [rig.router.boot] + [worker.boot for worker in rig.workers.values()]
    for boot in boots:
        assert boot.encode() not in reply.body
        assert all(boot not in value for value in reply.headers.values())


# --- health and readiness -------------------------------------------------------------------


async def test_healthz_is_200_while_the_process_is_up(rig: Rig) -> None:
    await rig.start_router()
    reply = await rig.admin("GET", "/healthz")
    assert (reply.status, reply.json()) == (200, {"ok": True})
    assert reply.headers["Content-Type"].startswith("application/json")


async def test_readyz_is_200_while_recovering_even_with_no_worker(rig: Rig) -> None:
    await rig.start_router(recovery_window_s=30.0)
    reply = await rig.admin("GET", "/readyz")
    assert (reply.status, reply.json()) == (
        200,
        {"ready": True, "recovering": True, "live_workers": 0, "accepting_workers": 0},
    )


async def test_readyz_is_503_with_no_live_worker_once_recovery_is_over(rig: Rig) -> None:
    await rig.start_router(reconnect_grace_s=30.0)
    reply = await rig.admin("GET", "/readyz")
    assert (reply.status, reply.json()) == (
        503,
        {"ready": False, "recovering": False, "live_workers": 0, "accepting_workers": 0},
    )

    worker = await rig.add_worker("w0", lease="raw")
    reply = await rig.admin("GET", "/readyz")
    assert (reply.status, reply.json()) == (
        200,
        {"ready": True, "recovering": False, "live_workers": 1, "accepting_workers": 1},
    )

    assert worker.lease is not None
    worker.lease.abort()  # lost: still forwarded to, but not live
    await rig.wait_worker_state("w0", "lost")
    assert (await rig.admin("GET", "/readyz")).status == 503


# --- the workers view ----------------------------------------------------------------------


async def test_the_workers_view_shows_every_field_and_never_a_boot(rig: Rig) -> None:
    await rig.start_router()
    w0 = await rig.add_worker("w0")
    w1 = await rig.add_worker("w1", lease="raw")
    await w0.claim("a-a0")
    await w0.claim("b-a0")
    slow = asyncio.create_task(rig.request("POST", "/slow", episode=token("a"), data=b"x"))

    async def parked() -> bool:
        return w0.parked == 1

    await wait_until(parked, "the slow request to reach w0")
    reply = await rig.admin("GET", "/admin/workers")

    assert reply.status == 200
    views = reply.json()["workers"]
    assert [view["id"] for view in views] == ["w0", "w1"]
    assert all(set(view) == WORKER_FIELDS for view in views)
    assert views[0] == {
        "id": "w0",
        "url": w0.url,
        "state": "live",
        "origin": "control",
        "draining": False,
        "generation": 0,
        "claims": 2,
        "in_flight": 1,
        "pid": None,  # known only for workers the router spawned
    }
    assert views[1] == {
        "id": "w1",
        "url": w1.url,
        "state": "live",
        "origin": "control",
        "draining": False,
        "generation": 0,
        "claims": 0,
        "in_flight": 0,
        "pid": None,
    }
    _no_boot(rig, reply)

    w0.release.set()
    assert (await slow).status == 200
    assert (await rig.worker_views())["w0"]["in_flight"] == 0


# --- the sessions view ---------------------------------------------------------------------


async def test_the_sessions_view_follows_a_claim_from_held_to_ended(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")

    reply = await rig.admin("GET", "/admin/sessions/episode/ep-a0")
    assert reply.status == 200
    view = reply.json()
    assert 0 <= view.pop("age_s") < 5
    assert view == {
        "kind": "episode",
        "key": "ep-a0",
        "worker": "w0",
        "state": "held",
        "learned": False,
    }
    _no_boot(rig, reply)

    await worker.release_key("ep-a0")
    reply = await rig.admin("GET", "/admin/sessions/episode/ep-a0")
    assert (reply.status, reply.json()["state"]) == (200, "episode_ended")


async def test_the_sessions_view_shows_an_exited_workers_claim(rig: Rig) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    assert worker.client is not None
    await worker.client.stop()  # bye

    reply = await rig.admin("GET", "/admin/sessions/episode/ep-a0")
    assert (reply.status, reply.json()["state"], reply.json()["worker"]) == (
        200,
        "worker_exited",
        "w0",
    )


@pytest.mark.parametrize("path", ["/admin/sessions/episode/nobody", "/admin/sessions/mcp/ep-a0"])
async def test_an_unknown_session_is_404(rig: Rig, path: str) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    reply = await rig.admin("GET", path)
    assert reply.status == 404
    assert reply.json()["error"] == "unknown_session"


# --- drain ---------------------------------------------------------------------------------


async def test_drain_and_undrain_change_where_new_sessions_go(rig: Rig) -> None:
    await rig.start_router()
    w0 = await rig.add_worker("w0")
    await rig.add_worker("w1")
    await w0.claim("ep-a0")  # w1 has fewer claims: new sessions go there
    assert (await rig.request("POST", "/seed")).worker == "w1"

    reply = await rig.admin("POST", "/admin/workers/w1/drain")

    assert reply.status == 200
    assert reply.json()["ok"] is True and reply.json()["worker"]["draining"] is True
    _no_boot(rig, reply)
    assert (await rig.worker_views())["w1"]["draining"] is True
    assert (await rig.request("POST", "/seed")).worker == "w0"

    reply = await rig.admin("DELETE", "/admin/workers/w1/drain")

    assert reply.status == 200 and reply.json()["worker"]["draining"] is False
    assert (await rig.request("POST", "/seed")).worker == "w1"


async def test_draining_an_unknown_worker_is_404(rig: Rig) -> None:
    await rig.start_router()
    for method in ("POST", "DELETE"):
        reply = await rig.admin(method, "/admin/workers/nobody/drain")
        assert (reply.status, reply.json()["error"]) == (404, "unknown_worker")


# --- off loopback --------------------------------------------------------------------------


async def _admin_off_loopback(rig: Rig) -> None:
    """The admin listener stays on loopback; only the host the middleware reads changes
    (no traffic ever goes to the documentation address 192.0.2.1)."""
    service = rig.router
    # The tests reach it at 127.0.0.1, a Host the operator allows.
    admin = AdminConfig("192.0.2.1", service.admin_port, ADMIN_TOKEN, ("127.0.0.1",))
    service.config = dataclasses.replace(service.config, admin=admin)


async def test_off_loopback_the_admin_api_needs_the_bearer_token(rig: Rig) -> None:
    await rig.start_router()
    await rig.add_worker("w0")
    await _admin_off_loopback(rig)

    for headers in (
        None,
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {ADMIN_TOKEN}"},
        {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
        {"Authorization": "Bearer"},
    ):
        reply = await rig.admin("GET", "/admin/workers", headers)
        assert reply.status == 401, headers
        assert reply.json()["error"] == "unauthorized"
        assert b"w0" not in reply.body

    drain = await rig.admin("POST", "/admin/workers/w0/drain")
    assert drain.status == 401
    assert (
        await rig.admin("GET", "/admin/workers", {"Authorization": f"Bearer {ADMIN_TOKEN}"})
    ).json()["workers"][0]["draining"] is False

    good = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    assert (await rig.admin("POST", "/admin/workers/w0/drain", good)).status == 200
    assert (await rig.admin("GET", "/admin/sessions/episode/x", good)).status == 404


@pytest.mark.parametrize("value", [b"Bearer \xff", b"Bearer " + ADMIN_TOKEN.encode() + b"\xe9"])
async def test_off_loopback_a_token_that_is_not_utf8_is_unauthorized(
    rig: Rig, value: bytes
) -> None:
    """Bytes that are not UTF-8 in Authorization are a wrong token: 401, never a 500."""
    await rig.start_router()
    await _admin_off_loopback(rig)
    http = await RawHttp.open(rig.router.admin_port)
    try:
        http.send(
            b"GET /admin/workers HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: "
            + value
            + b"\r\n\r\n"
        )
        status, _, body = await http.read_reply()
    finally:
        http.writer.close()
    assert (status, json.loads(body)["error"]) == (401, "unauthorized")


@pytest.mark.parametrize("host", ["LOCALHOST", "LocalHost", "localhost"])
async def test_localhost_in_any_case_is_loopback_and_needs_no_token(
    rig: Rig, tmp_path: Path, host: str
) -> None:
    """The config check lets `localhost` in any case through without a token (host names
    are case-insensitive), so the admin API must not then ask for one."""
    config = router_config(tmp_path, admin=AdminConfig(host=host, port=0))
    check_config(config)  # what `run` accepted
    await rig.start_router(config)
    assert (await rig.admin("GET", "/admin/workers")).status == 200
    assert (await rig.admin("POST", "/admin/workers/nobody/drain")).status == 404


async def test_off_loopback_health_and_readiness_stay_open(rig: Rig) -> None:
    await rig.start_router()
    await rig.add_worker("w0")
    await _admin_off_loopback(rig)
    assert (await rig.admin("GET", "/healthz")).status == 200
    assert (await rig.admin("GET", "/readyz")).status == 200


async def test_metrics_are_served_in_the_prometheus_text_format(rig: Rig) -> None:
    await rig.start_router()
    await rig.add_worker("w0")
    reply = await rig.admin("GET", "/metrics")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith("text/plain")
    assert b"# TYPE " in reply.body
    _no_boot(rig, reply)


# --- a browser on the host is not a way in -----------------------------------------------


@pytest.mark.parametrize(
    ("host", "bind", "allowed"),
    [
        ("127.0.0.1:9901", "127.0.0.1", True),
        ("127.0.0.1", "127.0.0.1", True),  # the port is not compared (a port mapping)
        ("localhost:9901", "127.0.0.1", True),
        ("LOCALHOST:9901", "::1", True),
        ("[::1]:9901", "::1", True),
        ("[::1]:9901", "localhost", True),
        ("127.0.0.2:9901", "127.0.0.1", True),  # an address is never a rebinding name
        ("10.1.2.3:9901", "0.0.0.0", True),
        ("localhost:9901", "0.0.0.0", True),
        ("router.internal:9901", "0.0.0.0", False),
        ("evil.example:9901", "127.0.0.1", False),  # DNS rebinding: the attacker's name
        ("10.1.2.3:9901", "127.0.0.1", False),
        ("localhost:9901", "10.0.0.5", False),
        ("admin.example:9901", "127.0.0.1", False),
        ("", "127.0.0.1", False),
        ("a b:1", "127.0.0.1", False),
    ],
)
def test_which_host_an_admin_request_may_name(host: str, bind: str, allowed: bool) -> None:
    assert host_allowed(host, bind, frozenset()) is allowed


def test_a_configured_name_is_allowed_and_no_host_is_not_a_browser() -> None:
    assert host_allowed("Admin.Example:9901", "127.0.0.1", frozenset({"admin.example"}))
    assert host_allowed(None, "127.0.0.1", frozenset())


@pytest.mark.parametrize(
    ("method", "headers", "refused"),
    [
        ("POST", {}, False),  # curl, the CLI: no Origin, no Sec-Fetch-Site
        ("POST", {"origin": "http://127.0.0.1:9901"}, False),
        ("POST", {"origin": "HTTP://127.0.0.1:9901", "sec-fetch-site": "same-origin"}, False),
        ("POST", {"sec-fetch-site": "none"}, False),  # typed in the address bar
        ("POST", {"origin": "http://evil.example"}, True),
        ("POST", {"origin": "http://localhost:3000"}, True),  # another port is another origin
        ("DELETE", {"origin": "null"}, True),  # a sandboxed page
        ("PUT", {"origin": "https://127.0.0.1:9901"}, True),
        ("POST", {"sec-fetch-site": "cross-site"}, True),
        ("POST", {"sec-fetch-site": "same-site"}, True),
        ("GET", {"origin": "http://evil.example", "sec-fetch-site": "cross-site"}, False),
    ],
)
def test_which_state_changing_requests_are_cross_origin(
    method: str, headers: dict[str, str], refused: bool
) -> None:
    assert cross_origin(method, "127.0.0.1:9901", headers) is refused


async def test_a_rebinding_page_cannot_read_the_admin_api(rig: Rig) -> None:
    await rig.start_router()
    await rig.add_worker("w0")
    port = rig.router.admin_port
    for path in ("/admin/workers", "/metrics", "/healthz"):
        reply = await rig.admin("GET", path, {"Host": f"evil.example:{port}"})
        assert reply.status == 421, path
        assert reply.json()["error"] == "misdirected_host"
        assert b"w0" not in reply.body
    assert (await rig.admin("GET", "/admin/workers", {"Host": f"localhost:{port}"})).status == 200


async def test_a_page_of_another_origin_cannot_drain_or_reload(rig: Rig) -> None:
    await rig.start_router()
    await rig.add_worker("w0")
    page = {"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site"}
    for method, path in [
        ("POST", "/admin/workers/w0/drain"),
        ("DELETE", "/admin/workers/w0/drain"),
        ("POST", "/admin/reload"),
    ]:
        reply = await rig.admin(method, path, page)
        assert reply.status == 403, (method, path)
        assert reply.json()["error"] == "cross_origin"
    assert (await rig.worker_views())["w0"]["draining"] is False
    # The same request without a browser's headers (curl, the CLI) is taken.
    assert (await rig.admin("POST", "/admin/workers/w0/drain")).status == 200
    assert (await rig.worker_views())["w0"]["draining"] is True


async def test_off_loopback_health_and_metrics_take_any_host_and_the_rest_does_not(
    rig: Rig,
) -> None:
    """A scraper that names the router's service (compose's `router:9901`) still gets
    /metrics; the API itself wants a Host of the listener's own, token or not."""
    await rig.start_router()
    await _admin_off_loopback(rig)
    port = rig.router.admin_port
    named = {"Host": f"router:{port}", "Authorization": f"Bearer {ADMIN_TOKEN}"}
    for path in ("/metrics", "/healthz", "/readyz"):
        reply = await rig.admin("GET", path, named)
        assert reply.status != 421 and b"misdirected_host" not in reply.body, path
    assert (await rig.admin("GET", "/metrics", named)).status == 200
    reply = await rig.admin("GET", "/admin/workers", named)
    assert (reply.status, reply.json()["error"]) == (421, "misdirected_host")
