"""Pure tests for design §4's seed, close and prefix rules, with the kinds NeMo Gym needs:
a session cookie, a body field the seed request names itself (`learn: request`), and a
token learned from the first of two places in the seed reply; routes behind a prefix the
workers strip. The reader, the learner and a real RouterCore, no event loop.
"""

from __future__ import annotations

import json

from multidict import CIMultiDict

from router.config import (
    BodyFieldConfig,
    CookieSourceConfig,
    LearnConfig,
    RouteConfig,
    SessionKindConfig,
    TokenFormatConfig,
)
from router.core import Answer, CoreSettings, Forward, RouterCore, Worker, WorkerOrigin
from router.sessions import SessionReader, SessionRef, kind_from_config
from router.sessions.learning import ReplyLearner, plan_learning

COOKIE = "SimpleWeatherResourcesServer___single_tool"
SEED = RouteConfig("POST", "/seed_session", (LearnConfig(cookie=COOKIE),))
CLOSE = RouteConfig("POST", "/close_session")
KINDS = (
    SessionKindConfig(
        "resources", cookie=CookieSourceConfig(COOKIE, "raw"), seed=SEED, close=CLOSE
    ),
    SessionKindConfig(
        "resources_session",
        body_field=BodyFieldConfig("/resources_session_id"),
        seed=RouteConfig("POST", "/seed_session", (LearnConfig(request=True),)),
        close=CLOSE,
    ),
    SessionKindConfig(
        "mcp_token",
        header="X-NeMo-Gym-Session-Token",
        token=TokenFormatConfig("raw"),
        seed=RouteConfig(
            "POST",
            "/seed_session",
            (
                LearnConfig(json_pointer="/resources_tools/headers/token"),
                LearnConfig(json_pointer="/mcp/headers/token"),
            ),
        ),
    ),
)
READER = SessionReader([kind_from_config(k) for k in KINDS], ["/ng-rollout/{rollout_id}"])
SETTINGS = CoreSettings(kinds={k.name: False for k in KINDS}, recovery_window_s=0.0)


def core_with_workers() -> tuple[RouterCore, Worker, Worker]:
    core = RouterCore(SETTINGS, 0.0)
    core.tick(0.0)
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.STATIC, 0.0)
    w1 = core.register("w1", "http://127.0.0.1:9002", WorkerOrigin.STATIC, 0.0)
    return core, w0, w1


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def reply(
    core: RouterCore,
    worker: Worker,
    path: str,
    *,
    request_body: bytes | None = None,
    found: SessionRef | None = None,
    status: int = 200,
    set_cookie: str | None = None,
    reply_body: bytes | None = None,
) -> None:
    """A request on `path` (its route path) whose reply `worker` answers, shown to the
    learner as the forwarder shows it."""
    method = "POST"
    plan = plan_learning(
        READER,
        method,
        path,
        found,
        READER.seeding(method, path),
        CIMultiDict(),
        1.0,
        request_body,
    )
    learner = ReplyLearner(plan, core, worker, clock=lambda: 1.0, wall_clock=lambda: 1.0)
    headers = CIMultiDict({"Set-Cookie": f"{COOKIE}={set_cookie}"} if set_cookie else {})
    wanted = learner.head(status, headers, headers.getall("Set-Cookie", []))
    if wanted and reply_body is not None:
        learner.body(reply_body)


def test_routes_match_behind_a_prefix_the_workers_strip() -> None:
    assert READER.route_path("/ng-rollout/r-1/seed_session") == "/seed_session"
    assert READER.route_path("/ng-rollout/r-1/") == "/"
    assert READER.route_path("/seed_session") == "/seed_session"
    assert READER.route_path("/ng-rollout/seed_session") == "/ng-rollout/seed_session"
    assert READER.seeding("POST", READER.route_path("/ng-rollout/r1/seed_session")) == {
        "resources",
        "mcp_token",
    }


def test_a_kind_whose_seed_names_its_session_reads_its_source_on_its_seed_route() -> None:
    # Its own source is not ignored there (the others' are); its body is wanted on its
    # seed and close routes, whatever decided.
    assert "resources_session" not in READER.seeding("POST", "/seed_session")
    assert READER.route_of("resources_session", "POST", "/seed_session") == "seed"
    assert READER.route_of("resources_session", "POST", "/close_session") == "close"
    assert READER.route_of("resources", "POST", "/seed_session") == "session"
    assert READER.route_of("resources", "POST", "/close_session") == "close"
    assert READER.wants_body("POST", "/seed_session")
    assert READER.wants_body("POST", "/close_session")
    assert not READER.wants_body("POST", "/get_weather")
    found = READER.read_body(body(resources_session_id="rs-1"), READER.seeding("POST", "/s"))
    assert found == SessionRef("resources_session", "rs-1")


def test_a_named_seed_is_balanced_learned_from_the_request_and_found_again() -> None:
    core, _, w1 = core_with_workers()
    first = core.route_new("resources_session", "rs-1", 1.0)
    assert isinstance(first, Forward)
    seed = body(resources_session_id="rs-1")
    reply(
        core,
        first.worker,
        "/seed_session",
        request_body=seed,
        found=SessionRef("resources_session", "rs-1"),
        set_cookie="sid-1",
        reply_body=body(resources_tools={"headers": {"token": "sid-1"}}),
    )
    for kind, key in (
        ("resources_session", "rs-1"),
        ("resources", "sid-1"),
        ("mcp_token", "sid-1"),
    ):
        claim = core.claims.lookup(kind, key)
        assert claim is not None and claim.worker == first.worker.id, (kind, claim)
    # A repeated seed (a retry whose reply was lost) goes to the holder.
    for _ in range(3):
        again = core.route_new("resources_session", "rs-1", 2.0)
        assert isinstance(again, Forward) and again.worker is first.worker
    # A failed seed teaches nothing.
    reply(
        core,
        w1,
        "/seed_session",
        request_body=body(resources_session_id="rs-2"),
        found=SessionRef("resources_session", "rs-2"),
        status=500,
    )
    assert core.claims.lookup("resources_session", "rs-2") is None


def test_the_first_place_of_the_reply_that_holds_the_token_is_learned() -> None:
    core, w0, _ = core_with_workers()
    reply(
        core,
        w0,
        "/seed_session",
        set_cookie="sid-legacy",
        reply_body=body(mcp={"headers": {"token": "tok-legacy"}}),
    )
    claim = core.claims.lookup("mcp_token", "tok-legacy")
    assert claim is not None and claim.worker == "w0"
    reply(
        core,
        w0,
        "/seed_session",
        set_cookie="sid-both",
        reply_body=body(
            resources_tools={"headers": {"token": "first"}}, mcp={"headers": {"token": "second"}}
        ),
    )
    assert core.claims.lookup("mcp_token", "first") is not None
    assert core.claims.lookup("mcp_token", "second") is None
    assert core.learn_misses == {}


def test_a_seed_reply_naming_no_session_is_counted_under_its_kind() -> None:
    core, w0, _ = core_with_workers()
    reply(core, w0, "/seed_session", reply_body=body(other={}))  # no cookie, no token
    assert core.learn_misses == {"resources": 1, "mcp_token": 1}


def test_a_close_reaches_a_worker_whatever_the_router_remembers() -> None:
    core, w0, w1 = core_with_workers()
    assert core.learn(w1, "resources_session", "rs-1", 1.0) is None
    held = core.route_close("resources_session", "rs-1", 1.0)
    assert isinstance(held, Forward) and held.worker is w1
    reply(
        core,
        w1,
        "/close_session",
        request_body=body(resources_session_id="rs-1"),
        found=SessionRef("resources_session", "rs-1"),
    )
    assert isinstance(core.route("resources_session", "rs-1", 2.0), Answer)  # 410 now
    # Closed: a repeated close still reaches the worker that held it.
    again = core.route_close("resources_session", "rs-1", 2.0)
    assert isinstance(again, Forward) and again.worker is w1
    # Never seeded: a close is balanced, and its 2xx makes the router remember the end.
    unknown = core.route_close("resources_session", "never", 2.0)
    assert isinstance(unknown, Forward)
    reply(
        core,
        unknown.worker,
        "/close_session",
        request_body=body(resources_session_id="never"),
        found=SessionRef("resources_session", "never"),
    )
    refused = core.route_new("resources_session", "never", 3.0)
    assert isinstance(refused, Answer) and refused.code == "episode_ended"
    # The holder gone: the closed session's close goes to a worker that runs.
    core.retire(w1, 4.0)
    moved = core.route_close("resources_session", "rs-1", 4.0)
    assert isinstance(moved, Forward) and moved.worker is w0


def test_a_seed_after_its_close_is_refused_and_an_exited_holder_is_410() -> None:
    core, w0, _ = core_with_workers()
    assert core.learn(w0, "resources_session", "rs-1", 1.0) is None
    assert core.release(w0, "resources_session", "rs-1", 1.0)
    ended = core.route_new("resources_session", "rs-1", 2.0)
    assert isinstance(ended, Answer) and (ended.status, ended.code) == (410, "episode_ended")
    assert core.learn(w0, "resources_session", "rs-2", 1.0) is None
    core.retire(w0, 3.0)
    for decision in (
        core.route_new("resources_session", "rs-2", 3.0),
        core.route_close("resources_session", "rs-2", 3.0),
    ):
        assert isinstance(decision, Answer) and decision.code == "worker_exited"
