"""The bundled control client against a real in-process router, on real sockets.

Where tests/worker/test_client.py checks the client against the contract (a scripted
router), these run it against our own RouterService: what it does when that
router refuses its hello after a reconnect, and when a retire races its claims.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from router.client import ControlClient, ControlError
from router.service.router_service import RouterService
from router.worker import client as client_module
from tests.router_fixtures import RawLease, Rig, open_rig, router_config, wait_until

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


async def _worker_url(rig: Rig) -> str:
    """A loopback port that accepts connections, as a live worker's would."""
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    rig.stack.callback(server.close)
    return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def _started(rig: Rig, address: str, secret: str | None = None) -> ControlClient:
    url = await _worker_url(rig)
    client = ControlClient(address, worker_id="w0", url=url, secret=secret, reconnect_max_s=0.2)
    await client.start()
    rig.stack.push_async_callback(client.stop)
    return client


def _watch_replies(service: RouterService) -> list[tuple[object, object]]:
    """(op, "ok" or the error code) of every request the router answers from now on."""
    answered: list[tuple[object, object]] = []
    observe = service.control.observe

    def spy(session: object, request: dict[str, object], reply: dict[str, object]) -> None:
        answered.append((request.get("op"), reply.get("error", "ok")))
        observe(session, request, reply)  # type: ignore[arg-type]

    service.control.observe = spy  # type: ignore[method-assign]
    return answered


def _hellos(answered: list[tuple[object, object]]) -> list[object]:
    return [result for op, result in answered if op == "hello"]


async def _until(check: Callable[[], bool], what: str) -> None:
    async def holds() -> bool:
        return check()

    await wait_until(holds, what)


def _drop_lease(service: RouterService) -> None:
    worker = service.core.workers.get("w0")
    assert worker is not None
    service.control.close_lease(worker)


async def test_a_hello_refused_for_good_after_a_reconnect_fails_pending_and_later_calls(
    rig: Rig,
) -> None:
    config = router_config(rig.tmp_path)
    control = dataclasses.replace(config.control, socket="tcp://127.0.0.1:0", secret="s1")
    service = await rig.start_router(dataclasses.replace(config, control=control))
    client = await _started(rig, f"tcp://127.0.0.1:{service.control.tcp_port}", secret="s1")
    await client.claim("ep1-a0")
    answered = _watch_replies(service)
    # The operator rotates the secret; this worker still has the old one.
    service.reload(dataclasses.replace(config, control=dataclasses.replace(control, secret="s2")))

    _drop_lease(service)
    claiming = asyncio.create_task(client.claim("ep2-a0"), name="claim")  # sent as it drops

    with pytest.raises(ControlError) as pending:
        await asyncio.wait_for(claiming, 5)
    assert pending.value.error == "forbidden"
    with pytest.raises(ControlError) as later:
        await asyncio.wait_for(client.claim("ep3-a0"), 1)
    assert later.value.error == "forbidden"
    assert not client.connected
    await asyncio.sleep(0.5)  # a client that kept redialling would say hello again here
    assert _hellos(answered) == ["forbidden"]


async def test_worker_busy_after_a_reconnect_fails_calls_until_it_clears(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = await rig.start_router()
    client = await _started(rig, service.config.control.socket)
    await client.claim("ep1-a0")
    answered = _watch_replies(service)
    # Time for another process to say hello as w0 before this client redials.
    monkeypatch.setattr(client_module, "RECONNECT_START_S", 0.5)
    intruder = await RawLease.open(service.config.control.socket)
    worker = service.core.workers.get("w0")
    assert worker is not None

    _drop_lease(service)
    claiming = asyncio.create_task(client.claim("ep2-a0"), name="claim")  # sent as it drops
    await _until(lambda: worker.lease is None, "the lease to drop")
    # Another process says hello as w0 with its own boot: the router retires this one's claims.
    assert (await intruder.hello("w0", worker.url, "another-boot"))["ok"] is True

    with pytest.raises(ControlError) as pending:
        await asyncio.wait_for(claiming, 5)
    assert pending.value.error == "worker_busy"
    with pytest.raises(ControlError) as later:
        await asyncio.wait_for(client.claim("ep3-a0"), 1)
    assert later.value.error == "worker_busy"
    assert client.refusal is not None and client.refusal.error == "worker_busy"
    assert not client.connected

    # The other process goes: the refusal clears, and the client is back with the router's
    # view: its old claim was retired by the other boot's hello, so it is dropped.
    intruder.abort()
    await _until(lambda: client.connected, "the client to be back")
    assert client.refusal is None
    assert client.held == frozenset()
    await client.claim("ep4-a0")
    assert client.held == {("episode", "ep4-a0")}
    hellos = _hellos(answered)  # the other process's, this one's refused ones, its last
    assert hellos == ["ok", *["worker_busy"] * (len(hellos) - 2), "ok"] and len(hellos) > 2


async def test_a_drain_refused_with_the_hello_is_not_the_state_the_handshake_repeats(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = await rig.start_router()
    client = await _started(rig, service.config.control.socket)
    worker = service.core.workers.get("w0")
    assert worker is not None and not worker.draining
    monkeypatch.setattr(client_module, "RECONNECT_START_S", 0.5)
    intruder = await RawLease.open(service.config.control.socket)
    _drop_lease(service)
    await _until(lambda: worker.lease is None, "the lease to drop")
    # Another worker takes w0's url while w0 is lost: w0's next hellos are worker_busy.
    assert (await intruder.hello("w9", worker.url, "b9"))["ok"] is True
    await _until(lambda: client.refusal is not None, "the refusal")

    with pytest.raises(ControlError) as refused:
        await client.drain(True)  # never reaches the router: its caller is told so

    assert refused.value.error == "worker_busy"
    intruder.abort()
    await _until(lambda: client.connected, "the client to be back")
    await asyncio.sleep(0.2)  # the handshake's drain, had it sent one, is answered
    assert not worker.draining  # the refused drain is not applied behind its caller's back
    await client.drain(True)
    assert worker.draining


async def test_claims_racing_a_retire_are_resent_after_the_new_hello(rig: Rig) -> None:
    # The retire closes the lease's connection in the same step (it stops reading), so a
    # claim sent in that window is never answered `no_hello`: the client resends it after
    # its next hello. The retire lands after 0, 1, 2... turns of the loop: before, among
    # and after the claims' lines.
    service = await rig.start_router()
    client = await _started(rig, service.config.control.socket)
    answered = _watch_replies(service)
    for turns in range(8):
        worker = service.core.workers.get("w0")
        assert worker is not None
        claims = [client.claim(f"ep{turns}-{i}-a0") for i in range(50)]
        claiming = asyncio.gather(*claims, return_exceptions=True)
        for _ in range(turns):
            await asyncio.sleep(0)
        service.core.retire(worker, service._clock())
        results = await asyncio.wait_for(claiming, 10)
        assert [r for r in results if r is not None] == []
        await _until(lambda: client.connected, "the client to be back")
    assert [result for _, result in answered if result != "ok"] == []


async def test_a_claim_past_the_cap_is_refused_to_the_caller_and_not_held(rig: Rig) -> None:
    config = router_config(rig.tmp_path)
    control = dataclasses.replace(config.control, max_claims_per_worker=2)
    service = await rig.start_router(dataclasses.replace(config, control=control))
    client = await _started(rig, service.config.control.socket)
    await client.claim("ep1-a0")
    await client.claim("ep2-a0")
    with pytest.raises(ControlError) as refused:
        await client.claim("ep3-a0")
    assert refused.value.error == "too_many_claims" and refused.value.reply["limit"] == 2
    assert client.held == {("episode", "ep1-a0"), ("episode", "ep2-a0")}
    assert service.core.claims.held_count("w0") == 2


async def test_a_resync_over_a_lowered_cap_keeps_the_first_claims_and_drops_the_rest(
    rig: Rig,
) -> None:
    config = router_config(rig.tmp_path)
    service = await rig.start_router(config)
    client = await _started(rig, service.config.control.socket)
    for i in range(5):
        await client.claim(f"ep{i}-a0")
    lowered = dataclasses.replace(config.control, max_claims_per_worker=3)
    service.reload(dataclasses.replace(config, control=lowered))
    answered = _watch_replies(service)

    _drop_lease(service)  # the client reconnects and syncs its five claims
    await _until(lambda: bool(_hellos(answered)) and client.connected, "the client to be back")
    kept = {("episode", f"ep{i}-a0") for i in range(3)}
    await _until(lambda: client.held == kept, "the client to drop the claims past the cap")
    assert ("sync", "too_many_claims") in answered
    assert answered[-1] == ("sync", "ok")
    assert service.core.claims.held_count("w0") == 3
    assert {c.key for c in service.core.claims.held_by("w0")} == {k for _, k in kept}


async def test_a_client_refused_for_too_many_connections_redials_until_taken(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    config = router_config(rig.tmp_path)
    control = dataclasses.replace(config.control, max_connections=1)
    service = await rig.start_router(dataclasses.replace(config, control=control))
    squatter = await RawLease.open(service.config.control.socket)
    assert (await squatter.call("ping"))["error"] == "no_hello"  # it holds the one slot
    answered = _watch_replies(service)
    url = await _worker_url(rig)
    client = ControlClient(
        service.config.control.socket, worker_id="w0", url=url, reconnect_max_s=0.2
    )
    starting = asyncio.create_task(client.start(), name="start")
    rig.stack.push_async_callback(client.stop)
    await asyncio.sleep(0.5)  # refused, redialling with backoff
    assert not starting.done() and not client.connected
    assert _hellos(answered) == []  # none of its connections got as far as a hello
    said = [r.getMessage() for r in caplog.records if r.name == "router.client"]
    assert any(m.startswith("the router refused this control connection: ") for m in said)

    squatter.abort()
    await asyncio.wait_for(starting, 5)
    assert client.connected
    await client.claim("ep1-a0")
    assert client.held == {("episode", "ep1-a0")}
