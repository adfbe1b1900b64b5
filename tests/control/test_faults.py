"""The control plane against peers that push its limits, through a real RouterService and
the bundled `ControlClient` on a real Unix socket (design §3).

Each test names the bound it checks: a reply line never over 1 MiB, and a client
that still converges when the router cannot list every refusal in one line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from router.client import ControlClient
from router.protocol.control import MAX_LINE_BYTES
from tests.router_fixtures import RawLease, Rig, open_rig, wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


async def test_a_client_whose_refusals_do_not_fit_one_reply_line_still_learns_them_all(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    service = await rig.start_router()
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    rig.stack.callback(server.close)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = ControlClient(service.config.control.socket, worker_id="w0", url=url, boot="b0")
    client.reconnect_max_s = 0.2
    await client.start()
    rig.stack.push_async_callback(client.stop)
    # 2,500 refusals of ~530 bytes each: about 1.3 MiB, more than one reply line holds.
    keys = [f"ep{i:04d}-{'k' * 500}-a0" for i in range(2500)]
    await asyncio.gather(*(client.claim(key) for key in keys))
    assert len(client.held) == 2500
    hellos: list[str] = []
    observe = service.control.observe

    def count_hellos(session: object, request: dict[str, object], reply: object) -> None:
        if request.get("op") == "hello":
            hellos.append(str(reply))
        observe(session, request, reply)  # type: ignore[arg-type]

    service.control.observe = count_hellos  # type: ignore[method-assign]
    worker = service.core.workers.get("w0")
    assert worker is not None
    caplog.set_level(logging.WARNING, logger="router.client")

    service.core.retire(worker, service._clock())  # what the grace ending does

    # It reconnects once with the same boot, re-syncs, and drops every refused claim:
    # none is left believed held, and it does not go round reconnecting.
    async def converged() -> bool:
        return client.connected and not client.held

    await wait_until(converged, "the client to drop every refused claim")
    await asyncio.sleep(0.3)  # a looping client would say hello again in this time
    assert len(hellos) == 1
    assert client.connected and client.held == frozenset()
    assert not [r for r in caplog.records if "read failed" in r.getMessage()]
    assert service.core.claims.held_count("w0") == 0


async def test_no_sync_reply_line_is_over_the_limit(rig: Rig) -> None:
    service = await rig.start_router()
    lease_a = await _lease(rig, "w0")
    lease_b = await _lease(rig, "w1")
    keys = [{"kind": "episode", "key": f"ep{i:05d}-{'k' * 60}"} for i in range(12_000)]
    for start in range(0, len(keys), 6000):
        part = keys[start : start + 6000]
        reply = await lease_b.call("sync", claims=part, more=start + 6000 < len(keys))
        assert reply["ok"] is True

    lease_a.send_line({"op": "sync", "id": 99, "claims": keys[:6000], "more": True})
    lease_a.send_line({"op": "sync", "id": 100, "claims": keys[6000:], "more": False})
    more = await lease_a.reader.readline()
    last = await lease_a.reader.readline()

    assert len(more) < 200  # nothing malformed: nothing refused until the last message
    assert len(last) <= MAX_LINE_BYTES
    assert b'"refused_omitted":' in last
    assert service.core.claims.held_count("w0") == 0


async def _lease(rig: Rig, worker_id: str) -> RawLease:
    lease = await RawLease.open(rig.control_address)
    port = 9100 + int(worker_id[1:])
    reply = await lease.hello(worker_id, f"http://127.0.0.1:{port}", "boot")
    assert reply["ok"] is True
    return lease
