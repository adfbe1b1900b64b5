"""A client that leaves mid-forward leaves nothing alive behind it without the collector.

The relay's failure for it ("client_left") becomes a value in the handler; the exception's
traceback (and its cause's) holds the forward's frames, so each must be cleared where the
failure stops being raised, or every request of a client that left stays alive, with its
head's bytes, until the collector runs. A real router in this process, on loopback.
"""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from router.edge import PublicRequest
from tests.app.test_faults import in_flight_is_zero, request_bytes
from tests.router_fixtures import TOKEN_HEADER, RawHttp, Rig, open_rig, token, wait_until

pytestmark = pytest.mark.timeout(30)

CLIENTS = 5


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


def live_requests() -> int:
    """PublicRequest objects alive (tracked by the collector, not collected)."""
    return sum(1 for obj in gc.get_objects() if type(obj) is PublicRequest)


async def test_requests_of_clients_that_left_mid_forward_are_freed_with_the_collector_off(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    ask = request_bytes("POST", "/slow", [(TOKEN_HEADER, token("ep"))], b"{}")
    gc.collect()
    gc.disable()
    try:
        before = live_requests()
        clients = []
        for _ in range(CLIENTS):
            conn = await RawHttp.open(router.public_port)
            conn.send(ask)
            clients.append(conn)

        async def parked() -> bool:
            return worker.parked == CLIENTS

        await wait_until(parked, "the requests to reach the worker")
        for conn in clients:
            conn.close()

        async def free() -> bool:
            return await in_flight_is_zero(rig, "w0")

        await wait_until(free, "the in-flight slots to be free")
        del clients, conn
        left = live_requests() - before
    finally:
        gc.enable()

    assert left == 0, f"{left} requests of clients that left are alive in reference cycles"
