"""A stalled upload is the client's timeout, whatever the worker's timeouts (design §1).

`limits.body_timeout_s` bounds the client's silence while its body arrives; the worker's
`timeouts.first_byte_s` runs only while the worker is the one to answer. When the two are
equal, both clocks run out together: the answer must still be the client's 408
`request_timeout`, and the worker must not be blamed.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from router.config import TimeoutsConfig
from tests.app.test_faults import limits, request_bytes
from tests.router_fixtures import TOKEN_HEADER, RawHttp, Rig, open_rig, router_config, token

pytestmark = pytest.mark.timeout(60)

# A small body, and one past any amount the router may hold before it takes a worker
# connection (it then streams to the worker as it arrives).
BODIES = {"small": (10, 3), "streamed": (8 * 1024 * 1024, 2 * 1024 * 1024)}


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


@pytest.mark.parametrize("size", list(BODIES))
@pytest.mark.parametrize("attempt", range(3))
async def test_a_stalled_upload_is_408_when_first_byte_s_equals_body_timeout_s(
    rig: Rig, tmp_path: Path, size: str, attempt: int
) -> None:
    announced, sent = BODIES[size]
    timeouts = TimeoutsConfig(connect_s=1.0, first_byte_s=1.0, stream_idle_s=5.0)
    router = await rig.start_router(
        router_config(tmp_path, timeouts=timeouts, limits=limits(body_timeout_s=1.0))
    )
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    headers = [(TOKEN_HEADER, token("ep")), ("Content-Length", str(announced))]
    conn = await RawHttp.open(router.public_port)
    try:
        conn.send(request_bytes("POST", "/upload", headers) + b"x" * sent)
        await conn.writer.drain()
        started = time.monotonic()
        status, headers_in, body = await conn.read_reply()
        took = time.monotonic() - started
    finally:
        conn.close()

    assert (status, headers_in.get("connection")) == (408, "close"), body
    assert json.loads(body)["error"] == "request_timeout"
    assert took < 5.0, took
    view = (await rig.worker_views())["w0"]
    assert view["state"] == "live", view  # the client's silence is no fault of the worker
