"""The router's own answers and how it contains faults, on real processes.

Against a router with two demo workers: forged, unknown, malformed, repeated and
ended tokens; a second worker claiming a held key over the control socket. Then,
each with processes of its own: a worker killed with SIGKILL, and a SIGTERM to
the router while a request is in flight.
"""

from __future__ import annotations

import asyncio
import base64
import json
import signal
import time

import aiohttp
import pytest

from bench.launch import free_port
from router.client import ControlClient, ControlError
from router.tokens import SigningKey, mint_token, new_nonce, parse_token

from .conftest import (
    Http,
    Launcher,
    Reply,
    Router,
    add,
    assert_router_answer,
    call_tool,
    get,
    served_problem,
    start_episode,
    until_gone,
)

pytestmark = pytest.mark.e2e

# The demo workers' HS256 key (EPISODE_TOKEN_SECRET), so a test can sign a token they accept.
SECRET = "e2e-demo-workers-signing-secret-0123456789"
WORKER_KEY = SigningKey.hs256(SECRET.encode())
OTHER_KEY = SigningKey.hs256(b"another-key-that-no-worker-uses-0123456789")
KILL_TO_410_S = 1.0


@pytest.fixture(scope="module")
def shared(module_launcher: Launcher) -> Router:
    """A router with two demo workers signing with WORKER_KEY, past its recovery window,
    shared by the tests that leave every process running."""
    router = module_launcher.router()
    module_launcher.workers(router, ["w1", "w2"], env={"EPISODE_TOKEN_SECRET": SECRET})
    router.wait_ready(recovered=True)
    return router


def reissue(
    token: str, key: SigningKey, *, nonce: str | None = None, att: int | None = None
) -> str:
    """`token` signed again with `key`, with the nonce or attempt changed if given."""
    claims = parse_token(token, now=time.time())
    return mint_token(
        ep=claims.ep,
        att=claims.att if att is None else att,
        nonce=claims.nonce if nonce is None else nonce,
        key=key,
        iat=claims.iat,
    )


def compact(header: object, payload: object, signature: bytes = b"\x01" * 32) -> str:
    """A compact JWS built by hand, for structures mint_token refuses to make."""

    def segment(data: bytes) -> str:
        return base64.urlsafe_b64encode(data).rstrip(b"=").decode()

    return ".".join(segment(json.dumps(part).encode()) for part in (header, payload)) + (
        "." + segment(signature)
    )


def assert_worker_refusal(reply: Reply, status: int, error: str, worker: str) -> None:
    """`reply` is the demo worker's own refusal (it names the worker), not the router's."""
    assert reply.status == status, str(reply)
    body = reply.json()
    assert (body.get("error"), body.get("worker")) == (error, worker), body
    assert "session" not in body, body  # the router's answers carry "session"


# --- tokens --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "new_nonce_too", "refusal"),
    [
        (OTHER_KEY, False, "bad_signature"),  # the same ep/att/nonce, signed with another key
        (WORKER_KEY, True, "bad_nonce"),  # a valid signature, a nonce the worker never issued
        (OTHER_KEY, True, "bad_signature"),
    ],
    ids=["other-key", "changed-nonce", "other-key-and-nonce"],
)
async def test_forged_token_is_forwarded_and_refused_by_its_owner(
    shared: Router, http: Http, key: SigningKey, new_nonce_too: bool, refusal: str
) -> None:
    episode = await start_episode(http, shared.base_url)
    await add(http, shared.base_url, episode, 5)
    forged = reissue(episode.token, key, nonce=new_nonce() if new_nonce_too else None)
    assert forged != episode.token

    for tool in ("add", "get"):
        reply = await http.post(f"{shared.base_url}/tools/{tool}", token=forged, body=None)
        assert_worker_refusal(reply, 403, refusal, episode.worker)

    await get(http, shared.base_url, episode)  # 5, and call number 2: the forgeries never ran


async def test_token_naming_no_episode_is_401_unknown_episode(shared: Router, http: Http) -> None:
    stranger = mint_token(ep="never-claimed", att=0, nonce=new_nonce(), key=WORKER_KEY, iat=0)
    reply = await http.post(f"{shared.base_url}/tools/get", token=stranger)
    assert_router_answer(reply, 401, "unknown_episode", "never-claimed-a0")

    episode = await start_episode(http, shared.base_url)
    next_attempt = reissue(episode.token, WORKER_KEY, att=1)  # attempt 1 was never claimed
    reply = await http.post(f"{shared.base_url}/tools/get", token=next_attempt)
    assert_router_answer(reply, 401, "unknown_episode", f"{episode.key.removesuffix('-a0')}-a1")
    await get(http, shared.base_url, episode)  # call number 1: the edited one never ran


PAYLOAD = {"ep": "ep7", "att": 0, "nonce": "n" * 22, "iat": 0}


@pytest.mark.parametrize(
    "token",
    [
        "not-a-token",
        "a.b",
        compact({"alg": "none"}, PAYLOAD),
        compact({"alg": "HS256"}, {**PAYLOAD, "att": "0"}),
        compact({"alg": "HS256"}, {**PAYLOAD, "ep": "bad key/with slash"}),
        mint_token(ep="ep7", att=0, nonce="n" * 22, key=WORKER_KEY, iat=0, exp=1),  # expired
    ],
    ids=["garbage", "two-segments", "alg-none", "att-string", "ep-chars", "expired"],
)
async def test_malformed_token_is_401_invalid_token(shared: Router, http: Http, token: str) -> None:
    reply = await http.post(f"{shared.base_url}/tools/get", token=token)
    assert_router_answer(reply, 401, "invalid_token", None)


async def test_token_header_repeated_with_different_values_is_400(
    shared: Router, http: Http
) -> None:
    first = await start_episode(http, shared.base_url)
    second = await start_episode(http, shared.base_url)
    tokens = (first.token, second.token)

    reply = await http.request("POST", f"{shared.base_url}/tools/add", tokens=tokens)
    assert_router_answer(reply, 400, "ambiguous_session", None)

    await get(http, shared.base_url, first)  # call number 1 on each: neither one ran
    await get(http, shared.base_url, second)


async def test_ended_episode_is_410_episode_ended(shared: Router, http: Http) -> None:
    episode = await start_episode(http, shared.base_url)
    await add(http, shared.base_url, episode, 2)

    reply = await http.post(f"{shared.base_url}/episodes/end", token=episode.token)
    assert (reply.status, reply.json()) == (
        200,
        {
            "worker": episode.worker,
            "episode": episode.key,
            "result": {"ended": True, "counter": 2},
            "calls": 1,
        },
    )

    for path in ("/tools/get", "/episodes/end"):
        reply = await http.post(shared.base_url + path, token=episode.token)
        assert_router_answer(reply, 410, "episode_ended", episode.key)
    view = shared.admin(f"/admin/sessions/episode/{episode.key}")
    assert view is not None and view[0] == 200
    assert (view[1]["worker"], view[1]["state"]) == (episode.worker, "episode_ended")


# --- the control socket --------------------------------------------------------------------------


async def test_second_worker_claiming_a_held_key_is_refused(shared: Router, http: Http) -> None:
    held = await start_episode(http, shared.base_url)
    ended = await start_episode(http, shared.base_url)
    reply = await http.post(f"{shared.base_url}/episodes/end", token=ended.token)
    assert reply.status == 200, str(reply)
    nobody_listens = f"http://127.0.0.1:{free_port()}"
    intruder = ControlClient(f"unix:{shared.socket_path}", worker_id="intruder", url=nobody_listens)
    await intruder.start()
    try:
        with pytest.raises(ControlError) as conflict:
            await intruder.claim(held.key)
        with pytest.raises(ControlError) as tombstone:
            await intruder.claim(ended.key)
        assert intruder.held == frozenset()
    finally:
        await intruder.stop()

    assert (conflict.value.error, conflict.value.reply.get("holder")) == ("conflict", held.worker)
    assert tombstone.value.error == "ended"
    view = shared.admin(f"/admin/sessions/episode/{held.key}")
    assert view is not None and (view[1]["worker"], view[1]["state"]) == (held.worker, "held")
    await get(http, shared.base_url, held)  # still served by its own worker


# --- processes that die --------------------------------------------------------------------------


async def test_killed_worker_episodes_get_410_while_others_carry_on(
    launcher: Launcher, http: Http
) -> None:
    router = launcher.router()
    workers = {w.worker_id: w for w in launcher.workers(router, ["w1", "w2", "w3"])}
    router.wait_ready(recovered=True)
    episodes = [await start_episode(http, router.base_url) for _ in range(9)]
    for value, episode in enumerate(episodes, start=1):
        await add(http, router.base_url, episode, value)
    victim = episodes[0].worker
    doomed = [e for e in episodes if e.worker == victim]
    survivors = [e for e in episodes if e.worker != victim]
    assert survivors, f"every episode went to {victim}"

    workers[victim].process.kill9()
    killed_at = time.monotonic()
    for episode in doomed:
        waited = time.monotonic() - killed_at
        reply = await until_gone(http, router.base_url, episode, KILL_TO_410_S - waited)
        assert_router_answer(reply, 410, "worker_exited", episode.key)
    for episode in survivors:  # right after: the other workers' episodes carry on
        await add(http, router.base_url, episode, 100)
        await get(http, router.base_url, episode)

    views = router.workers()
    assert (views[victim]["state"], views[victim]["claims"]) == ("exited", 0)
    for worker_id in set(workers) - {victim}:
        mine = sum(1 for e in survivors if e.worker == worker_id)
        assert (views[worker_id]["state"], views[worker_id]["claims"]) == ("live", mine)
    fresh = [await start_episode(http, router.base_url) for _ in range(4)]
    assert victim not in {e.worker for e in fresh}
    for episode in doomed:  # and they stay gone
        reply = await call_tool(http, router.base_url, episode, "get", None)
        assert_router_answer(reply, 410, "worker_exited", episode.key)


async def test_sigterm_lets_the_request_in_flight_finish(launcher: Launcher, http: Http) -> None:
    router = launcher.router()
    launcher.workers(router, ["w1"])
    episode = await start_episode(http, router.base_url)
    slow = asyncio.create_task(call_tool(http, router.base_url, episode, "sleep", {"seconds": 1}))
    deadline = time.monotonic() + 5
    while (await asyncio.to_thread(router.workers))["w1"]["in_flight"] != 1:
        assert time.monotonic() < deadline and not slow.done(), "the slow call never started"
        await asyncio.sleep(0.02)

    router.process.signal(signal.SIGTERM)
    await asyncio.sleep(0.1)
    router.process.signal(signal.SIGTERM)  # a second one changes nothing
    await asyncio.sleep(0.1)
    try:
        late = await call_tool(http, router.base_url, episode, "get", None)
    except aiohttp.ClientConnectionError:
        pass  # the listener is closed: a refused connect is a fine answer too
    else:
        assert_router_answer(late, 503, "shutting_down", None)

    problem = served_problem(await slow, episode, 1.0)
    assert problem is None, problem
    assert await asyncio.to_thread(router.process.wait, 10.0) == 0, router.process.tail()
    assert not router.socket_path.exists()
