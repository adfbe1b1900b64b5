"""`RequestBody.gather`: a body waited for whole, nothing taken, its connection read on."""

from __future__ import annotations

import asyncio
import contextlib
import gc

import pytest

from router.edge import BodyBroken
from router.edge.request import BODY_HIGH_WATER, RequestBody

pytestmark = pytest.mark.timeout(10)


class Source:
    """The connection as the body sees it: how often it was told to stop and go."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def body_backlogged(self) -> None:
        self.events.append("stop")

    def body_drained(self) -> None:
        self.events.append("go")


async def test_gather_returns_true_once_the_whole_body_is_here_and_takes_nothing() -> None:
    source = Source()
    body = RequestBody(source, asyncio.get_running_loop())
    gathering = asyncio.ensure_future(body.gather(1 << 20))
    await asyncio.sleep(0)
    big = b"x" * (BODY_HIGH_WATER + 1)
    body.feed(big)
    await asyncio.sleep(0)
    assert not gathering.done()
    body.feed(b"yz")
    body.feed_eof()
    assert await gathering is True
    assert source.events == []  # past the usual mark, but read on while gathering
    assert body.take() == big + b"yz"


async def test_gather_returns_false_once_more_than_its_limit_is_held() -> None:
    source = Source()
    body = RequestBody(source, asyncio.get_running_loop())
    gathering = asyncio.ensure_future(body.gather(4))
    await asyncio.sleep(0)
    body.feed(b"abcd")
    await asyncio.sleep(0)
    assert not gathering.done()  # exactly the limit: it may still end here
    body.feed(b"e")
    assert await gathering is False
    assert body.take() == b"abcde"


async def test_gather_lets_a_throttled_body_read_on_and_restores_the_mark_after() -> None:
    source = Source()
    body = RequestBody(source, asyncio.get_running_loop())
    body.feed(b"x" * (BODY_HIGH_WATER + 1))
    assert source.events == ["stop"]
    limit = 2 * BODY_HIGH_WATER
    gathering = asyncio.ensure_future(body.gather(limit))
    await asyncio.sleep(0)
    assert source.events == ["stop", "go"]
    body.feed(b"y" * (BODY_HIGH_WATER - 2))  # over the usual mark, under the gathering's
    await asyncio.sleep(0)
    assert source.events == ["stop", "go"]
    body.feed(b"zzz")  # past the gathering's limit: it ends, and the connection stops
    assert await asyncio.wait_for(gathering, 1) is False
    assert source.events == ["stop", "go", "stop"]
    body.take()
    body.feed(b"w" * (BODY_HIGH_WATER + 1))  # the usual mark again
    assert source.events == ["stop", "go", "stop", "go", "stop"]


async def test_gather_raises_when_the_body_breaks() -> None:
    body = RequestBody(Source(), asyncio.get_running_loop())
    gathering = asyncio.ensure_future(body.gather(100))
    body.feed(b"ab")
    body.fail("no bytes for 1 s", malformed=False, timed_out=True)
    with pytest.raises(BodyBroken) as info:
        await gathering
    assert info.value.timed_out


def live_bodies() -> int:
    """How many RequestBody objects are alive (tracked by the collector, not collected)."""
    return sum(1 for obj in gc.get_objects() if type(obj) is RequestBody)


async def gather_until_broken(body: RequestBody) -> None:
    """What the forwarder does: waits for the body, and makes a value of its failure."""
    with contextlib.suppress(BodyBroken):
        await body.gather(1 << 20)


async def test_a_body_that_breaks_inside_gather_is_freed_with_the_collector_off() -> None:
    # The failure raised must not be the one the body keeps: that one's traceback would
    # hold the gather frame, which holds the body (a cycle only the collector frees).
    loop = asyncio.get_running_loop()
    gc.collect()
    gc.disable()
    try:
        before = live_bodies()
        for _ in range(5):
            body = RequestBody(Source(), loop)
            gathering = asyncio.ensure_future(gather_until_broken(body))
            await asyncio.sleep(0)
            body.feed(b"a" * 500_000)
            body.fail("the client went away mid-body", malformed=False)
            await gathering
            del body, gathering
        assert live_bodies() == before
    finally:
        gc.enable()


async def test_a_detached_body_drops_its_bytes_and_its_failure() -> None:
    source = Source()
    body = RequestBody(source, asyncio.get_running_loop())
    body.feed(b"a" * 1000)
    body.fail("the client went away mid-body", malformed=False)
    body.detach(Source())
    assert body.broken is None
    assert body.take() == b""
