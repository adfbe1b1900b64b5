"""Control claims acknowledged through the claims directory (design §10, "Writes and
fencing") on a real Unix socket under tmp_path.

Two gates: `HeldGate`, a fake at the boundary whose answers each test releases by hand
(ordering, the claim cap, a release behind its claim, a closed connection, a retired
lease), and `DirectoryGate`, a real `Directory` on a real redis-server
(tests/directory/conftest.py), for what the directory answers.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from redis.asyncio import Redis

from router.control.server import ControlServer
from router.control.session import ControlPolicy
from router.core import Worker
from router.core.machine import CoreSettings, RouterCore
from router.directory import (
    ClaimOutcome,
    ClaimVerdict,
    Directory,
    DirectoryError,
    DirectoryTimeout,
)
from router.fleet.link import FleetLink
from tests.directory.conftest import RedisServer, directory_for, redis_client, redis_server
from tests.router_fixtures import RawLease, wait_until

__all__ = ["redis_client", "redis_server"]  # the fixtures, used here by name

pytestmark = pytest.mark.timeout(60)

URL = "http://127.0.0.1:9001"
CLAIMED = ClaimOutcome(ClaimVerdict.CLAIMED)


class HeldGate:
    """A BatchClaimGate whose claims wait until the test answers them."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []
        self.calls: list[list[tuple[str, str]]] = []  # the keys of each call, in order
        self.waiting: dict[tuple[str, str], asyncio.Future[ClaimOutcome]] = {}
        self.released_keys: list[tuple[str, str]] = []
        self.prefix: str | None = None  # what the hello reply offers

    async def claim(self, kind: str, key: str, worker: Worker | None = None) -> ClaimOutcome:
        self.calls.append([(kind, key)])
        return await self._held(kind, key)

    async def claim_each(
        self, keys: Sequence[tuple[str, str]], worker: Worker | None = None
    ) -> list[ClaimOutcome | DirectoryError]:
        self.calls.append(list(keys))
        held = [self._held(kind, key) for kind, key in keys]
        return list(await asyncio.gather(*held, return_exceptions=True))  # type: ignore[arg-type]

    def _held(self, kind: str, key: str) -> asyncio.Future[ClaimOutcome]:
        self.asked.append((kind, key))
        answer = asyncio.get_running_loop().create_future()
        self.waiting[kind, key] = answer
        return answer

    def released(self, kind: str, key: str) -> None:
        self.released_keys.append((kind, key))

    def key_prefix(self) -> str | None:
        return self.prefix

    def answer(self, key: str, outcome: ClaimOutcome | Exception = CLAIMED) -> None:
        waiter = self.waiting.pop(("episode", key))
        if isinstance(outcome, Exception):
            waiter.set_exception(outcome)
        else:
            waiter.set_result(outcome)


class DirectoryGate:
    """The BatchClaimGate on a real Directory (as the fleet link is)."""

    def __init__(self, directory: Directory) -> None:
        self.directory = directory
        self._releases: set[asyncio.Task[object]] = set()

    async def claim(self, kind: str, key: str, worker: Worker | None = None) -> ClaimOutcome:
        return await self.directory.claim_one(kind, key)

    async def claim_each(
        self, keys: Sequence[tuple[str, str]], worker: Worker | None = None
    ) -> list[ClaimOutcome | DirectoryError]:
        answers = await self.directory.claim_each(keys)
        assert all(isinstance(a, (ClaimOutcome, DirectoryError)) for a in answers)
        return answers  # type: ignore[return-value]

    def released(self, kind: str, key: str) -> None:
        task = asyncio.get_running_loop().create_task(self.directory.release_one(kind, key))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def key_prefix(self) -> str | None:
        return None

    async def settled(self) -> None:
        await asyncio.gather(*self._releases, return_exceptions=True)


def _policy(**overrides: object) -> ControlPolicy:
    return ControlPolicy(
        own_uid=os.getuid(),
        allowed_uids=frozenset(),
        allowed_upstreams=frozenset(),
        secret=None,
        router_boot="router-boot-1",
        **overrides,  # type: ignore[arg-type]
    )


@asynccontextmanager
async def served(
    tmp_path: Path, gate: object, name: str = "control", **policy: object
) -> AsyncIterator[tuple[RouterCore, str]]:
    core = RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic())
    server = ControlServer(
        core,
        _policy(**policy),
        on_lease_lost=lambda worker: None,
        claim_gate=gate,  # type: ignore[arg-type]
    )
    address = f"unix:{tmp_path}/{name}.sock"
    await server.start(address)
    try:
        yield core, address
    finally:
        await server.close()


async def _leased(address: str, worker: str = "w0") -> RawLease:
    lease = await RawLease.open(address)
    assert (await lease.hello(worker, URL if worker == "w0" else URL + "1", "boot-1"))["ok"]
    return lease


def _lines(*lines: bytes) -> bytes:
    return b"\n".join(lines) + b"\n"


async def _asked(gate: HeldGate, count: int) -> None:
    async def check() -> bool:
        return len(gate.waiting) == count

    await wait_until(check, f"{count} claims asked of the gate")


# --- a fake gate: ordering, the cap, releases behind claims ---------------------------------


async def test_the_hello_reply_offers_the_gates_key_prefix_when_it_has_one(
    tmp_path: Path,
) -> None:
    gate = HeldGate()
    async with served(tmp_path, gate) as (_core, address):
        lease = await RawLease.open(address)
        reply = await lease.hello("w0", URL, "boot-1")
        assert reply["ok"] and "key_prefix" not in reply  # none offered: none said
        gate.prefix = "r1:7:"
        reply = await lease.hello("w0", URL, "boot-1")  # a hello again, on the same lease
        assert reply["ok"] and reply["key_prefix"] == "r1:7:"
        lease.abort()


async def test_replies_keep_request_order_while_a_claim_waits(tmp_path: Path) -> None:
    gate = HeldGate()
    async with served(tmp_path, gate) as (core, address):
        lease = await _leased(address)
        core.claims.claim("episode", "known", "w0", 0.0)  # held: answered at once
        lease.writer.write(
            _lines(
                b'{"op":"claim","id":1,"key":"new1"}',
                b'{"op":"claim","id":2,"key":"known"}',
                b'{"op":"ping","id":3}',
                b'{"op": "claim", "id": 4, "key": "new2"}',  # the general path
            )
        )
        await _asked(gate, 2)
        assert gate.asked == [("episode", "new1"), ("episode", "new2")]  # one loop turn
        assert core.claims.lookup("episode", "new1") is None  # not before the directory
        gate.answer("new2")  # the later one first: still written after the earlier
        gate.answer("new1", ClaimOutcome(ClaimVerdict.CONFLICT, holder="r2"))

        replies = [await lease.read_reply() for _ in range(4)]

        assert [(r["id"], r["ok"], r.get("error"), r.get("holder")) for r in replies] == [
            (1, False, "conflict", "r2"),
            (2, True, None, None),
            (3, True, None, None),
            (4, True, None, None),
        ]
        assert "another router" in replies[0]["detail"].lower()
        assert {c.key for c in core.claims.held()} == {"known", "new2"}
        lease.abort()


async def test_the_claims_of_one_read_go_to_the_gate_in_one_call(tmp_path: Path) -> None:
    gate = HeldGate()
    async with served(tmp_path, gate) as (core, address):
        lease = await _leased(address)
        lease.writer.write(
            _lines(
                b'{"op":"claim","id":1,"key":"k1"}',
                b'{"op":"release","id":2,"key":"k1"}',  # behind its claim: asks nothing
                b'{"op":"claim","key":"k2","kind":"episode","id":3}',
                b'{"op": "claim", "id": 4, "key": "k3"}',  # the general path
                b'{"op":"ping","id":5}',
                b'{"op":"claim","id":6,"key":"k4"}',
            )
        )
        keys = ["k1", "k2", "k3", "k4"]
        await _asked(gate, len(keys))
        assert gate.calls == [[("episode", key) for key in keys]]
        for key in keys:
            gate.answer(key)

        replies = [await lease.read_reply() for _ in range(6)]

        assert [(r["id"], r["ok"]) for r in replies] == [(i, True) for i in range(1, 7)]
        assert {c.key for c in core.claims.held()} == {"k2", "k3", "k4"}
        lease.abort()


async def test_waiting_replies_keep_their_ids_as_sent(tmp_path: Path) -> None:
    gate = HeldGate()
    async with served(tmp_path, gate) as (_core, address):
        lease = await _leased(address)
        lease.writer.write(
            _lines(
                b'{"op":"claim","id":"a b","key":"k1"}',
                b'{"op":"release","id":-7,"key":"k1"}',
                b'{"op":"claim","id":"c","key":"k2"}',
                b'{"op":"claim","id":0,"key":"k3"}',
            )
        )
        await _asked(gate, 3)
        gate.answer("k1")
        gate.answer("k2", ClaimOutcome(ClaimVerdict.CONFLICT, holder="r2"))
        gate.answer("k3", DirectoryTimeout("late"))

        replies = [await lease.read_reply() for _ in range(4)]

        assert [(r["id"], r["ok"], r.get("error")) for r in replies] == [
            ("a b", True, None),
            (-7, True, None),
            ("c", False, "conflict"),
            (0, False, "directory_unavailable"),
        ]
        lease.abort()


async def test_directory_verdicts_and_errors_map_to_control_errors(tmp_path: Path) -> None:
    gate = HeldGate()
    async with served(tmp_path, gate) as (core, address):
        lease = await _leased(address)
        lease.writer.write(
            _lines(*(b'{"op":"claim","id":%d,"key":"k%d"}' % (i, i) for i in range(3)))
        )
        await _asked(gate, 3)
        gate.answer("k0", ClaimOutcome(ClaimVerdict.ENDED))
        gate.answer("k1", ClaimOutcome(ClaimVerdict.EXITED))
        gate.answer("k2", DirectoryTimeout("late"))

        replies = [await lease.read_reply() for _ in range(3)]

        assert [r["error"] for r in replies] == ["ended", "worker_exited", "directory_unavailable"]
        assert "directory.claim_timeout_s" in replies[2]["detail"]
        assert list(core.claims.held()) == []
        lease.abort()


async def test_the_cap_counts_claims_that_wait(tmp_path: Path) -> None:
    gate = HeldGate()
    async with served(tmp_path, gate, max_claims_per_worker=2) as (_core, address):
        lease = await _leased(address)
        lease.writer.write(
            _lines(*(b'{"op":"claim","id":%d,"key":"k%d"}' % (i, i) for i in range(3)))
        )
        await _asked(gate, 2)
        gate.answer("k0")
        gate.answer("k1")

        replies = [await lease.read_reply() for _ in range(3)]

        assert [r.get("error") for r in replies] == [None, None, "too_many_claims"]
        assert replies[2]["limit"] == 2
        assert gate.asked == [("episode", "k0"), ("episode", "k1")]
        lease.abort()


async def test_a_release_behind_its_waiting_claim_is_applied_after_it(tmp_path: Path) -> None:
    gate = HeldGate()
    async with served(tmp_path, gate) as (core, address):
        lease = await _leased(address)
        lease.writer.write(
            _lines(
                b'{"op":"claim","id":1,"key":"k"}',
                b'{"op":"release","id":2,"key":"k"}',
                b'{"op":"claim","id":3,"key":"k"}',
            )
        )
        await _asked(gate, 1)
        assert gate.asked == [("episode", "k")]  # the claim again waits behind, unasked
        gate.answer("k")

        replies = [await lease.read_reply() for _ in range(3)]

        assert [(r["id"], r.get("error")) for r in replies] == [(1, None), (2, None), (3, "ended")]
        claim = core.claims.lookup("episode", "k")
        assert claim is not None and claim.state.value == "episode_ended"
        assert gate.released_keys == [("episode", "k")]
        lease.abort()


async def test_a_closed_connection_still_applies_its_waiting_claims(tmp_path: Path) -> None:
    gate = HeldGate()
    async with served(tmp_path, gate) as (core, address):
        lease = await _leased(address)
        lease.writer.write(_lines(b'{"op":"claim","id":1,"key":"k"}'))
        await _asked(gate, 1)
        lease.abort()

        async def lost() -> bool:
            worker = core.workers.get("w0")
            return worker is not None and worker.state.value == "lost"

        await wait_until(lost, "the lease lost")
        gate.answer("k")

        async def held() -> bool:
            claim = core.claims.lookup("episode", "k")
            return claim is not None and claim.worker == "w0"

        await wait_until(held, "the claim applied")


async def test_a_claim_whose_lease_was_retired_meanwhile_is_not_applied(tmp_path: Path) -> None:
    gate = HeldGate()
    async with served(tmp_path, gate) as (core, address):
        lease = await _leased(address)
        lease.writer.write(_lines(b'{"op":"claim","id":1,"key":"k"}', b'{"op":"bye","id":2}'))
        await _asked(gate, 1)
        gate.answer("k")

        replies = [await lease.read_reply() for _ in range(2)]

        assert [(r["id"], r["ok"], r.get("error")) for r in replies] == [
            (1, False, "no_hello"),
            (2, True, None),
        ]
        assert core.claims.lookup("episode", "k") is None
        assert gate.released_keys == [("episode", "k")]  # its record is not left held
        lease.abort()


async def test_a_sync_drops_the_keys_the_directory_refuses(tmp_path: Path) -> None:
    gate = HeldGate()
    async with served(tmp_path, gate) as (core, address):
        lease = await _leased(address)
        lease.send_line(
            {
                "op": "sync",
                "id": 9,
                "claims": [{"key": "a"}, {"key": "b"}],
                "more": False,
            }
        )
        await _asked(gate, 2)
        gate.answer("a")
        gate.answer("b", ClaimOutcome(ClaimVerdict.CONFLICT, holder="r2"))

        reply = await lease.read_reply()

        assert reply["accepted"] == 1
        assert reply["refused"] == [{"kind": "episode", "key": "b", "error": "conflict"}]
        assert {c.key for c in core.claims.held()} == {"a"}
        assert core.claims.lookup("episode", "b") is None  # no tombstone either
        lease.abort()


# --- a real Directory on a real redis-server ---------------------------------------------


async def test_claims_through_a_real_directory(
    tmp_path: Path, redis_client: Redis, redis_server: RedisServer
) -> None:
    one = DirectoryGate(await directory_for(redis_client, "r1"))
    two = DirectoryGate(await directory_for(redis_client, "r2"))
    async with (
        served(tmp_path, one, "one") as (_core1, address1),
        served(tmp_path, two, "two") as (_core2, address2),
    ):
        first = await _leased(address1)
        second = await _leased(address2)
        assert (await first.call("claim", key="ep1"))["ok"] is True
        refused = await second.call("claim", key="ep1")
        assert (refused["error"], refused["holder"]) == ("conflict", "r1")
        assert (await first.call("release", key="ep1"))["ok"] is True
        await one.settled()
        assert (await second.call("claim", key="ep1"))["error"] == "ended"
        first.abort()
        second.abort()


async def test_a_paused_redis_gives_directory_unavailable_in_time_and_the_rest_answers(
    tmp_path: Path, redis_client: Redis, redis_server: RedisServer
) -> None:
    gate = DirectoryGate(await directory_for(redis_client, "r1", claim_timeout_s=0.5))
    async with served(tmp_path, gate) as (core, address):
        lease = await _leased(address)
        core.claims.claim("episode", "known", "w0", 0.0)
        redis_server.pause()
        started = time.monotonic()
        lease.writer.write(
            _lines(
                b'{"op":"claim","id":1,"key":"new"}',
                b'{"op":"ping","id":2}',
                b'{"op":"claim","id":3,"key":"known"}',
            )
        )
        replies = [await lease.read_reply() for _ in range(3)]
        waited = time.monotonic() - started
        redis_server.resume()

        assert [(r["id"], r.get("error")) for r in replies] == [
            (1, "directory_unavailable"),
            (2, None),
            (3, None),
        ]
        assert waited < 0.5 + 1.0  # the claim timeout, and a margin for a loaded machine
        lease.abort()


async def test_pairs_through_the_fleet_link_make_one_directory_call_a_read(
    tmp_path: Path, redis_client: Redis, redis_server: RedisServer
) -> None:
    directory = await directory_for(redis_client, "r1")
    link = FleetLink(directory, RouterCore(CoreSettings(kinds={"episode": False}), 0.0))
    pairs = 300
    async with served(tmp_path, link) as (core, address):
        lease = await _leased(address)
        calls = redis_server.script_calls()  # counted by Redis: the link is not started,
        lease.writer.write(  # so no heartbeat or sweep runs meanwhile
            b"".join(
                b'{"op":"claim","id":%d,"key":"p%d"}\n{"op":"release","id":%d,"key":"p%d"}\n'
                % (2 * i, i, 2 * i + 1, i)
                for i in range(pairs)
            )
        )
        replies = [await lease.read_reply() for _ in range(2 * pairs)]
        await asyncio.sleep(0)  # the releases of the last turn go out
        await asyncio.gather(*link._tasks)

        assert all(r["ok"] for r in replies)
        assert core.claims.held_total == 0
        # One script call a read for the claims, one a loop turn for the releases: a
        # few, not 300 (nor 600).
        assert redis_server.script_calls() - calls <= 20
        states = redis_client.pipeline(transaction=False)
        for i in range(pairs):
            states.hget(directory.layout.owner("episode", f"p{i}"), "s")
        assert await states.execute() == ["e"] * pairs  # every key claimed, then ended
        lease.abort()


PAIRS = 20_000


async def test_claim_and_release_pairs_through_a_real_directory(
    tmp_path: Path, redis_client: Redis, redis_server: RedisServer
) -> None:
    gate = DirectoryGate(await directory_for(redis_client, "r1"))
    async with served(tmp_path, gate) as (core, address):
        lease = await _leased(address)
        data = b"".join(
            b'{"op":"claim","id":%d,"key":"ep%d"}\n{"op":"release","id":%d,"key":"ep%d"}\n'
            % (2 * i, i, 2 * i + 1, i)
            for i in range(PAIRS)
        )
        started = time.perf_counter()
        lease.writer.write(data)
        replies = [await lease.read_reply() for _ in range(2 * PAIRS)]
        elapsed = time.perf_counter() - started
        await gate.settled()

        assert [r["id"] for r in replies] == list(range(2 * PAIRS))
        assert all(r["ok"] for r in replies)
        assert core.claims.held_total == 0
        print(f"\n{PAIRS} claim+release pairs through the directory: {PAIRS / elapsed:,.0f}/s")
        lease.abort()
