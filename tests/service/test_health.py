"""Probing workers (router.service.health): the bare connect probe, and the HTTP health checks of
static workers (`workers:`) through a real RouterService, on loopback and Unix sockets.

Static workers never speak on the control socket, so their claims are put in the
router's table directly, as a learned claim would be.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from bench.launch import free_port
from router.config import HealthConfig, StaticWorkerConfig
from router.service.health import probe_connect
from tests.metrics.test_registry import scrape, series
from tests.router_fixtures import (
    BOOT_HEADER,
    EchoWorker,
    Rig,
    open_rig,
    router_config,
    token,
    wait_until,
)

pytestmark = pytest.mark.timeout(30)

FAST_PROBES = HealthConfig(path="/health", interval_s=0.05, timeout_s=0.3, failures=2)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


# --- probe_connect --------------------------------------------------------------------------


async def test_probe_connect_to_a_listening_port_is_ok() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        assert await probe_connect(f"http://127.0.0.1:{port}", 1.0) == "ok"


async def test_probe_connect_to_a_closed_port_is_refused() -> None:
    assert await probe_connect(f"http://127.0.0.1:{free_port()}", 1.0) == "refused"


async def test_probe_connect_to_a_listening_unix_socket_is_ok(tmp_path: Path) -> None:
    path = tmp_path / "w.sock"
    server = await asyncio.start_unix_server(lambda r, w: w.close(), str(path))
    async with server:
        assert await probe_connect(f"unix:{path}", 1.0) == "ok"


async def test_probe_connect_to_a_missing_unix_socket_is_refused(tmp_path: Path) -> None:
    assert await probe_connect(f"unix:{tmp_path}/gone.sock", 1.0) == "refused"


# --- static workers -------------------------------------------------------------------------


async def _static_router(
    rig: Rig, tmp_path: Path, url: str, *, recovery_window_s: float = 0.0
) -> None:
    config = router_config(
        tmp_path,
        recovery_window_s=recovery_window_s,
        workers=(StaticWorkerConfig("s0", url),),
        health=FAST_PROBES,
    )
    await rig.start_router(config)


async def _static_worker(rig: Rig) -> EchoWorker:
    """An echo worker that never says hello: only its HTTP side runs."""
    worker = EchoWorker("s0", "unix:/nonexistent")
    await worker.serve()
    rig.stack.push_async_callback(worker.close_http)
    return worker


def _claim_for_static(rig: Rig, key: str) -> None:
    assert rig.router.core.claims.claim("episode", key, "s0", time.monotonic()) is None


async def test_a_static_worker_is_probed_and_forwarded_to_without_a_boot(
    rig: Rig, tmp_path: Path
) -> None:
    worker = await _static_worker(rig)
    await _static_router(rig, tmp_path, worker.url)
    _claim_for_static(rig, "ep-a0")

    reply = await rig.request(
        "POST",
        "/tools/add",
        episode=token("ep"),
        data=b"{}",
        headers={BOOT_HEADER: "forged-by-the-client"},
    )

    assert reply.status == 200 and reply.worker == "s0"
    assert reply.seen_headers(BOOT_HEADER) == []  # a static worker has no boot
    view = (await rig.worker_views())["s0"]
    assert (view["state"], view["origin"], view["claims"]) == ("live", "static", 1)
    assert "/health" in worker.paths_seen()


async def test_a_static_worker_that_stops_listening_exits_after_its_failed_probes(
    rig: Rig, tmp_path: Path
) -> None:
    worker = await _static_worker(rig)
    await _static_router(rig, tmp_path, worker.url)
    _claim_for_static(rig, "ep-a0")
    assert (await rig.request("GET", "/", episode=token("ep"))).worker == "s0"

    await worker.close_http()
    took = await rig.wait_worker_state("s0", "exited")

    assert took < 2.0
    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )
    (await rig.request("POST", "/seed")).assert_answer(503, "no_worker", None)
    assert (await rig.worker_views())["s0"]["claims"] == 0


async def test_a_static_worker_that_comes_back_is_a_new_generation_and_old_sessions_stay_410(
    rig: Rig, tmp_path: Path
) -> None:
    worker = await _static_worker(rig)
    await _static_router(rig, tmp_path, worker.url)
    _claim_for_static(rig, "ep-a0")
    await worker.close_http()
    await rig.wait_worker_state("s0", "exited")

    await worker.serve()  # the same port again
    await rig.wait_worker_state("s0", "live")

    assert (await rig.worker_views())["s0"]["generation"] == 1
    (await rig.request("GET", "/", episode=token("ep"))).assert_answer(
        410, "worker_exited", "ep-a0"
    )
    assert (await rig.request("POST", "/seed")).worker == "s0"


async def test_a_static_worker_whose_probes_time_out_is_unhealthy(rig: Rig, tmp_path: Path) -> None:
    held: list[asyncio.StreamWriter] = []

    async def accept_and_say_nothing(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        await _static_router(rig, tmp_path, f"http://127.0.0.1:{port}")
        await rig.wait_worker_state("s0", "unhealthy")
        (await rig.request("POST", "/seed")).assert_answer(503, "no_worker", None)
        assert (await rig.admin("GET", "/readyz")).status == 503
    finally:
        for writer in held:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_a_static_worker_answering_5xx_is_unhealthy_until_it_recovers(
    rig: Rig, tmp_path: Path
) -> None:
    status = {"code": 503}

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"worker": "s0"}, status=status["code"])

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", health)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    rig.stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]

    await _static_router(rig, tmp_path, f"http://127.0.0.1:{port}")
    await rig.wait_worker_state("s0", "unhealthy")
    status["code"] = 200
    await rig.wait_worker_state("s0", "live")
    assert (await rig.request("POST", "/seed")).worker == "s0"
    # Counted as a control worker's transitions are.
    transitions = series(scrape(rig.router.metrics), "episode_router_worker_transitions_total")
    assert transitions == {"state=unhealthy": 1.0, "state=live": 1.0}


async def test_probing_every_static_worker_ends_recovery_early(rig: Rig, tmp_path: Path) -> None:
    worker = await _static_worker(rig)
    await _static_router(rig, tmp_path, worker.url, recovery_window_s=30.0)

    async def recovered() -> bool:
        return (await rig.admin("GET", "/readyz")).json()["recovering"] is False

    assert await wait_until(recovered, "recovery to end once s0 was probed") < 2.0
    (await rig.request("GET", "/", episode=token("unknown"))).assert_answer(
        401, "unknown_episode", "unknown-a0"
    )
