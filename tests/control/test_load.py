"""The control socket under abuse, while the public port keeps serving (design §3).

A whole `RouterService` runs in this process: its control socket under tmp_path, its
public and admin listeners on loopback, one well-behaved worker. Against it: thousands of
control connections that never say hello (idle, or sending garbage and ops before hello),
and a worker that says hello, claims and breaks off its connection a thousand times. All
the while a client keeps calling the public port, and the process's resident memory is
sampled from /proc/self/statm (`PeakRss`). Counts and times are bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router_fixtures import (
    WAIT_S,
    MiB,
    PeakRss,
    RawLease,
    Rig,
    episode_key,
    open_rig,
    token,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)

CONNECTIONS = 2000  # control connections that never say hello
BATCH = 50  # opened at once
HELLO_DEADLINE_S = 3.0  # shortened from 10 s; longer than opening them all takes on a busy machine
CYCLES = 1000  # hello, claim, break off
TRAFFIC_MAX_S = 40.0  # the public caller stops after this whatever happens
# Resident growth of the whole process, router and test clients together (measured: about
# 16 MiB for the 2,000 connections, nothing for the churn).
CONNECTIONS_RSS_BOUND = 48 * MiB
CHURN_RSS_BOUND = 16 * MiB
GARBAGE = (
    b"this is not json\n",
    b"\xff\xfe\x00\n",
    b'{"op":"claim","id":7,"key":"ep-a0"}\n',  # an op before hello
    b'{"op":"teleport","id":"x"}\n',
    b"[1,2,3]\n",
)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


@dataclass(slots=True)
class PublicTraffic:
    """What a client calling the public port saw while the control socket was abused."""

    outcomes: Counter[str] = field(default_factory=Counter)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self, rig: Rig, worker_id: str) -> None:
        """Calls on the episode `live` (held by `worker_id`), one after another, until
        `stop` (or TRAFFIC_MAX_S). An episode, not sessionless calls: those would be
        balanced onto the churned worker too."""
        ends_at = time.monotonic() + TRAFFIC_MAX_S
        while not self.stop.is_set() and time.monotonic() < ends_at:
            reply = await rig.request("GET", "/during", episode=token("live"))
            served = reply.status == 200 and reply.worker == worker_id
            self.outcomes["200" if served else f"{reply.status} {reply.body[:80]!r}"] += 1
            await asyncio.sleep(0.005)  # pacing: leave the loop to the abuse


@contextlib.asynccontextmanager
async def public_traffic(rig: Rig, worker_id: str) -> AsyncIterator[PublicTraffic]:
    """Keeps calling the public port while the body of the `async with` runs."""
    await rig.workers[worker_id].claim(episode_key("live", 0))
    traffic = PublicTraffic()
    caller = asyncio.create_task(traffic.run(rig, worker_id), name="public-traffic")
    try:
        yield traffic
    finally:
        traffic.stop.set()
        await caller


async def metric(rig: Rig, name: str, **labels: str) -> float | None:
    """The first sample of `name` whose labels include `labels`, or None."""
    text = (await rig.admin("GET", "/metrics")).body.decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


# --- thousands of connections that never say hello --------------------------------------------


async def _open_many(address: str, count: int) -> list[RawLease]:
    """`count` connections to the control socket, BATCH at a time."""
    opened: list[RawLease] = []
    for start in range(0, count, BATCH):
        batch = range(start, min(start + BATCH, count))
        opened += await asyncio.gather(*(RawLease.open(address) for _ in batch))
    return opened


async def _read_line(lease: RawLease, timeout_s: float = WAIT_S) -> dict[str, object]:
    line = await asyncio.wait_for(lease.reader.readline(), timeout_s)
    assert line.endswith(b"\n"), line
    reply = json.loads(line)
    assert isinstance(reply, dict)
    return reply


async def _goodbye(lease: RawLease) -> tuple[dict[str, object], bytes]:
    """The last line the router sends a connection that never said hello, and what follows
    it (b"" once the router closed the connection)."""
    last = await _read_line(lease, HELLO_DEADLINE_S + WAIT_S)
    return last, await asyncio.wait_for(lease.reader.read(), WAIT_S)


async def test_thousands_of_control_connections_without_hello_are_closed_while_public_serves(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    router.control.hello_deadline_s = HELLO_DEADLINE_S  # for the connections opened from now
    # All of them wait at once here (the cap on those is tests/control/test_bounds.py's).
    policy = router.control.policy
    router.control.set_policy(replace(policy, max_connections_before_hello=CONNECTIONS))
    await rig.add_worker("w0")

    with PeakRss() as rss:
        async with public_traffic(rig, "w0") as traffic:
            leases = await _open_many(router.config.control.socket, CONNECTIONS)
            noisy = leases[::2]  # half send garbage; the other half stay silent
            for index, lease in enumerate(noisy):
                lease.writer.write(GARBAGE[index % len(GARBAGE)])
            replies = [await _read_line(lease) for lease in noisy]
            # Every one is still open: garbage and ops before hello keep the connection.
            assert await metric(rig, "episode_router_control_connections") == CONNECTIONS + 1
            goodbyes = await asyncio.gather(*(_goodbye(lease) for lease in leases))
            for lease in leases:
                lease.abort()

    errors = Counter(str(reply["error"]) for reply in replies)
    assert all(reply["ok"] is False for reply in replies)
    assert errors == {
        "bad_request": 3 * len(noisy) // len(GARBAGE),
        "no_hello": len(noisy) // len(GARBAGE),
        "unknown_op": len(noisy) // len(GARBAGE),
    }
    deadline_goodbye = ({"id": None, "ok": False, "error": "no_hello"}, b"")
    assert all(
        ({k: v for k, v in last.items() if k != "detail"}, rest) == deadline_goodbye
        for last, rest in goodbyes
    ), goodbyes[:3]

    async def only_the_worker_is_left() -> bool:
        return await metric(rig, "episode_router_control_connections") == 1

    await wait_until(only_the_worker_is_left, "the closed connections to be forgotten")
    assert set(traffic.outcomes) == {"200"}, traffic.outcomes
    assert traffic.outcomes["200"] >= 20, traffic.outcomes
    assert (await rig.worker_views())["w0"]["state"] == "live"
    assert rss.growth < CONNECTIONS_RSS_BOUND, rss.growth


# --- a worker that says hello, claims and breaks off, a thousand times ------------------------


async def _hello_until_accepted(lease: RawLease, url: str) -> int:
    """Says hello as `churn` with a new boot; returns how many `worker_busy` refusals came
    first (a previous connection the router has not yet seen close), retried as a
    restarting worker would, for at most WAIT_S."""
    boot = secrets.token_hex(8)
    deadline = time.monotonic() + WAIT_S
    busy = 0
    while True:
        reply = await lease.hello("churn", url, boot)
        if reply["ok"] is True:
            return busy
        assert reply["error"] == "worker_busy", reply
        assert time.monotonic() < deadline, "the router never saw the last connection close"
        busy += 1
        await asyncio.sleep(0.001)


@contextlib.contextmanager
def refusing_address() -> Iterator[str]:
    """A loopback address that refuses connections for as long as the block runs: a socket
    bound to it but not listening holds the port, so no other process can start listening
    there (as it could on a port merely found free) and turn the refusals into connects."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{held.getsockname()[1]}"


async def _churn_state(rig: Rig) -> str:
    return str((await rig.worker_views())["churn"]["state"])


async def test_a_worker_that_claims_and_breaks_off_in_a_loop_leaves_one_record_and_410s(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    await rig.add_worker("w0")
    url = rig.stack.enter_context(refusing_address())  # a dead process's address

    with PeakRss() as rss:
        async with public_traffic(rig, "w0") as traffic:
            for cycle in range(CYCLES):
                lease = await RawLease.open(router.config.control.socket)
                assert await _hello_until_accepted(lease, url) == 0
                claimed = await lease.call("claim", key=f"c{cycle}-a0")
                assert claimed["ok"] is True, claimed
                lease.abort()
                # Its address refuses connections: the router retires it at once. Waiting
                # for that keeps this loop clear of the race the next test is about.
                for _ in range(500):
                    if await _churn_state(rig) == "exited":
                        break
                    await asyncio.sleep(0.002)
                assert await _churn_state(rig) == "exited", cycle

    workers = (await rig.admin("GET", "/admin/workers")).json()["workers"]
    assert sorted(view["id"] for view in workers) == ["churn", "w0"]  # one record per id
    churn = next(view for view in workers if view["id"] == "churn")
    assert (churn["claims"], churn["in_flight"], churn["generation"]) == (0, 0, CYCLES - 1)
    for start in range(0, CYCLES, 50):
        batch = range(start, start + 50)
        replies = await asyncio.gather(
            *(rig.request("GET", "/", episode=token(f"c{i}")) for i in batch)
        )
        for i, reply in zip(batch, replies, strict=True):
            reply.assert_answer(410, "worker_exited", f"c{i}-a0")
    assert await metric(rig, "episode_router_claims", worker="churn", kind="episode") in (None, 0)
    assert set(traffic.outcomes) == {"200"}, traffic.outcomes
    assert traffic.outcomes["200"] >= 20, traffic.outcomes
    assert rss.growth < CHURN_RSS_BOUND, rss.growth


async def test_a_new_boot_that_says_hello_right_after_the_old_lease_broke_stays_live(
    rig: Rig,
) -> None:
    router = await rig.start_router()
    url = rig.stack.enter_context(refusing_address())  # the old process's address: it is gone
    lease = await RawLease.open(router.config.control.socket)
    await _hello_until_accepted(lease, url)
    outcomes = []
    for turns in range(8):  # how far behind the old lease's end the new hello comes
        new = await RawLease.open(router.config.control.socket)  # the new process connects
        lease.abort()  # the old process dies
        for _ in range(turns):
            await asyncio.sleep(0)  # one turn of the event loop each
        await _hello_until_accepted(new, url)
        lease = new
        try:
            assert (await lease.call("claim", key=f"n{turns}-a0"))["ok"] is True
            for _ in range(3):  # round trips: time for the old lease's probe to finish
                assert (await lease.call("ping"))["ok"] is True
            outcomes.append(await _churn_state(rig))
        except ConnectionError:
            outcomes.append("connection closed by the router")
            lease = await RawLease.open(router.config.control.socket)
            await _hello_until_accepted(lease, url)
    lease.abort()
    assert outcomes == ["live"] * 8


async def test_a_burst_of_500_simultaneous_control_connects_is_accepted(rig: Rig) -> None:
    router = await rig.start_router()
    leases = await asyncio.gather(
        *(RawLease.open(router.config.control.socket) for _ in range(500))
    )
    try:
        for lease in leases:
            lease.send_line({"op": "ping", "id": 1})
        replies = await asyncio.gather(
            *(_read_line(lease) for lease in leases), return_exceptions=True
        )
    finally:
        for lease in leases:
            lease.abort()
    # A connect the listen backlog had no room for fails once used (EAGAIN, then EINVAL).
    answered = Counter(
        reply["error"] if isinstance(reply, dict) else type(reply).__name__ for reply in replies
    )
    assert answered == {"no_hello": 500}
