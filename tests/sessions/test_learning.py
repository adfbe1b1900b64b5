"""Pure tests for router.sessions.learning: what a request's reply may teach (`plan_learning`)
and what `ReplyLearner` makes of a reply, against a real RouterCore with a fake clock.

A reply is shown to the learner as the forwarder shows it: the head first (status, headers
as a case-insensitive multidict, every Set-Cookie line), then, only when `head` asked for a
body budget and the body fits in it, the whole body. After each step the test asserts the
whole claim table (every held claim and tombstone, via the playbook's snapshot) and the
conflict counter.

No event loop, no sockets: `now` comes from a `Clock` the test moves.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
from itsdangerous import TimestampSigner, URLSafeSerializer
from multidict import CIMultiDict

from router.config import (
    BodyFieldConfig,
    CookieSourceConfig,
    LearnConfig,
    McpSourceConfig,
    RouteConfig,
    SessionKindConfig,
    TokenFormatConfig,
)
from router.core.answers import Answer
from router.core.machine import CoreSettings, Forward, RouterCore
from router.core.workers import Worker, WorkerOrigin
from router.sessions.learning import MAX_LEARN_BODY_BYTES, LearningPlan, ReplyLearner, plan_learning
from router.sessions.reader import SessionReader, SessionRef, kind_from_config
from tests.playbook import C, Snapshot, apply_changes, claims_snapshot

WALL = 1_700_000_000.0  # the wall clock cookies' Expires are judged against
COOKIE = "ResourcesServer___resources"
SECRET = "resources-server-secret"
MCP_TOKEN_HEADER = "X-NeMo-Gym-Session-Token"
TOKEN_POINTER = "/mcp/headers/X-NeMo-Gym-Session-Token"
IDLE_TTL = 50.0

KINDS = (
    SessionKindConfig("episode", header="X-NeMo-Gym-Episode-Token"),
    SessionKindConfig(
        "resources",
        cookie=CookieSourceConfig(COOKIE),
        seed=RouteConfig("POST", "/seed_session", (LearnConfig(cookie=COOKIE),)),
        close=RouteConfig("POST", "/close_session"),
    ),
    SessionKindConfig(
        "mcp_token",
        header=MCP_TOKEN_HEADER,
        token=TokenFormatConfig("itsdangerous", "sid"),
        seed=RouteConfig("POST", "/seed_session", (LearnConfig(json_pointer=TOKEN_POINTER),)),
    ),
    SessionKindConfig("mcp_session", mcp=McpSourceConfig()),
    SessionKindConfig(
        "task",
        header="X-Task-Id",
        token=TokenFormatConfig("raw"),
        seed=RouteConfig("POST", "/tasks", (LearnConfig(header="X-New-Task"),)),
    ),
    SessionKindConfig(
        "rollout",
        body_field=BodyFieldConfig("/rollout_id"),
        seed=RouteConfig("POST", "/rollouts", (LearnConfig(json_pointer="/id"),)),
    ),
)
READER = SessionReader([kind_from_config(kind) for kind in KINDS])
SETTINGS = CoreSettings(
    kinds={kind.name: False for kind in KINDS},
    mcp_kinds=frozenset({"mcp_session"}),
    tombstone_ttl_s=1000.0,
    recovery_window_s=0.0,
    learned_idle_ttl_s=IDLE_TTL,
)
CONFLICTS = ("learn_conflicts",)


def starlette_cookie(session_id: object) -> str:
    """The value Starlette's SessionMiddleware sets for a session {"session_id": ...}."""
    payload = base64.b64encode(json.dumps({"session_id": session_id}).encode())
    return TimestampSigner(SECRET).sign(payload).decode()


def set_session(session_id: object) -> str:
    """SessionMiddleware's Set-Cookie line for a new session."""
    value = starlette_cookie(session_id)
    return f"{COOKIE}={value}; path=/; Max-Age=1209600; httponly; samesite=lax"


# SessionMiddleware's Set-Cookie line when a request clears the session.
CLEARED = f"{COOKIE}=null; path=/; expires=Thu, 01 Jan 1970 00:00:00 GMT; httponly; samesite=lax"


def mcp_token(sid: str) -> str:
    token = URLSafeSerializer("mcp-secret", salt="nemo-gym-mcp-session-token").dumps({"sid": sid})
    assert isinstance(token, str)
    return token


def seed_body(sid: str) -> bytes:
    """A NeMo Gym seed reply: the MCP headers the agent must send, in the JSON body."""
    return json.dumps({"ok": True, "mcp": {"headers": {MCP_TOKEN_HEADER: mcp_token(sid)}}}).encode()


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Router:
    """A core with two static workers, its clocks, and the state last asserted."""

    core: RouterCore
    w0: Worker
    w1: Worker
    clock: Clock = field(default_factory=Clock)
    wall: Clock = field(default_factory=lambda: Clock(WALL))
    state: Snapshot = field(default_factory=dict)

    def snapshot(self) -> Snapshot:
        snapshot = claims_snapshot(self.core.claims)
        if self.core.learn_conflicts:
            snapshot[CONFLICTS] = self.core.learn_conflicts
        return snapshot

    def changed(self, changes: dict[tuple[str, ...], object]) -> None:
        """The whole state is the last one with exactly `changes` applied (None removes)."""
        want = apply_changes(self.state, changes)
        assert self.snapshot() == want
        self.state = want

    def reply(
        self,
        plan: LearningPlan,
        worker: Worker,
        status: int = 200,
        headers: Iterable[tuple[str, str]] = (),
        body: bytes | None = None,
    ) -> int:
        """Shows `worker`'s reply to a learner for `plan`, as the forwarder does;
        returns the body budget its head asked for."""
        head = CIMultiDict(headers)
        learner = ReplyLearner(plan, self.core, worker, clock=self.clock, wall_clock=self.wall)
        wanted = learner.head(status, head, head.getall("Set-Cookie", []))
        if wanted > 0 and body is not None and len(body) <= wanted:
            learner.body(body)
        return wanted


@pytest.fixture
def router() -> Router:
    core = RouterCore(SETTINGS, 0.0)
    core.tick(0.0)  # no recovery window: unknown keys are answered at once
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.STATIC, 0.0)
    w1 = core.register("w1", "http://127.0.0.1:9002", WorkerOrigin.STATIC, 0.0)
    return Router(core, w0, w1)


def plan_for(
    method: str,
    path: str,
    found: SessionRef | None = None,
    headers: dict[str, str] | None = None,
) -> LearningPlan:
    """The plan for a request; one routed by an MCP session carries its header."""
    sent: CIMultiDict[str] = CIMultiDict(headers or {})
    if found is not None and found.kind == "mcp_session" and "Mcp-Session-Id" not in sent:
        sent["Mcp-Session-Id"] = found.key
    return plan_learning(
        READER, method, path, found, READER.seeding(method, path), sent, time.time()
    )


SEED = plan_for("POST", "/seed_session")
MCP_POST = plan_for("POST", "/mcp")


def answer_code(decision: Forward | Answer) -> tuple[int, str, str | None]:
    assert isinstance(decision, Answer), decision
    return decision.status, decision.code, decision.session


# ============================================================================ plan_learning


def test_a_seed_route_plans_learning_for_every_kind_seeded_there() -> None:
    by_name = READER.by_name
    assert LearningPlan(seed=(by_name["mcp_token"], by_name["resources"])) == SEED
    assert SEED
    assert plan_for("POST", "/rollouts") == LearningPlan(seed=(by_name["rollout"],))


def test_a_close_route_plans_releasing_the_session_it_names() -> None:
    found = SessionRef("resources", "s1")
    assert plan_for("POST", "/close_session", found) == LearningPlan(close=found)
    # No session, or one of a kind whose close route this is not: nothing to release.
    assert not plan_for("POST", "/close_session")
    assert not plan_for("POST", "/close_session", SessionRef("episode", "ep1-a0"))
    assert not plan_for("GET", "/close_session", found)


def test_a_close_route_routed_by_a_stronger_source_ends_the_session_its_own_source_names() -> None:
    # The episode token decided where the request went; the cookie beside it names the
    # session the close ends, as an MCP DELETE's own header does.
    with_cookie = {"Cookie": f"{COOKIE}={starlette_cookie('s1')}"}
    by_token = SessionRef("episode", "ep1-a0")
    assert plan_for("POST", "/close_session", by_token, with_cookie) == LearningPlan(
        close=SessionRef("resources", "s1")
    )
    assert not plan_for("POST", "/close_session", by_token, {"Cookie": f"{COOKIE}=not-signed"})


def test_the_mcp_path_plans_learning_and_a_delete_there_plans_the_release() -> None:
    mcp = READER.by_name["mcp_session"]
    assert LearningPlan(mcp=mcp) == MCP_POST
    assert MCP_POST
    assert plan_for("GET", "/mcp", SessionRef("mcp_session", "m1")) == LearningPlan(mcp=mcp)
    found = SessionRef("mcp_session", "m1")
    assert plan_for("DELETE", "/mcp", found) == LearningPlan(mcp=mcp, mcp_release="m1")
    assert plan_for("DELETE", "/mcp") == LearningPlan(mcp=mcp)


@pytest.mark.parametrize(
    ("method", "path", "found"),
    [
        ("POST", "/tools/add", SessionRef("resources", "s1")),
        ("POST", "/tools/add", None),
        ("GET", "/seed_session", None),
        ("POST", "/seed_session/", None),
        ("POST", "/mcp/", None),
        ("POST", "/mcpx", SessionRef("mcp_session", "m1")),
        ("POST", "/tasks/t1", SessionRef("task", "t1")),
    ],
)
def test_other_routes_plan_nothing(method: str, path: str, found: SessionRef | None) -> None:
    plan = plan_for(method, path, found)
    assert plan == LearningPlan()
    assert not plan


def test_a_reader_with_no_seed_close_or_mcp_kind_plans_nothing_anywhere() -> None:
    reader = SessionReader([kind_from_config(KINDS[0])])
    assert not reader.learns
    assert not plan_learning(
        reader, "POST", "/seed_session", None, frozenset(), CIMultiDict(), time.time()
    )


# ============================================================================ seeds


def test_a_seed_reply_teaches_its_session_cookie(router: Router) -> None:
    router.clock.now = 3.0
    wanted = router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("s1"))])

    # The token kind seeded on the same route asks for the body; the cookie needed none.
    assert wanted == MAX_LEARN_BODY_BYTES
    router.changed({C("s1", "resources"): "held w0 learned"})
    assert router.core.learned == 1
    claim = router.core.claims.lookup("resources", "s1")
    assert claim is not None and (claim.since, claim.last_used) == (3.0, 3.0)
    decision = router.core.route("resources", "s1", 4.0)
    assert decision == Forward(router.w0, "s1", None)


def test_the_last_set_cookie_for_the_name_wins_and_other_cookies_are_ignored(
    router: Router,
) -> None:
    headers = [
        ("Set-Cookie", "theme=dark; path=/"),
        ("Set-Cookie", set_session("old")),
        ("set-cookie", set_session("s2")),
        ("Set-Cookie", f"{COOKIE}x=junk"),
    ]
    router.reply(SEED, router.w1, 201, headers)
    router.changed({C("s2", "resources"): "held w1 learned"})


def test_starlettes_deletion_cookie_is_not_learned(router: Router) -> None:
    router.reply(SEED, router.w0, 200, [("Set-Cookie", CLEARED)])
    router.changed({})
    assert router.core.learned == 0
    # A session cookie deleted by a later line of the same reply is not learned either.
    router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("s1")), ("Set-Cookie", CLEARED)])
    router.changed({})


def test_a_cookie_expiring_is_judged_on_the_wall_clock(router: Router) -> None:
    value = starlette_cookie("s1")
    future = f"{COOKIE}={value}; expires=Wed, 15 Nov 2023 00:00:00 GMT"  # after WALL
    past = f"{COOKIE}={starlette_cookie('s2')}; expires=Tue, 14 Nov 2023 00:00:00 GMT"
    router.reply(SEED, router.w0, 200, [("Set-Cookie", future)])
    router.reply(SEED, router.w0, 200, [("Set-Cookie", past)])
    router.changed({C("s1", "resources"): "held w0 learned"})


def test_a_seed_reply_teaches_a_raw_header(router: Router) -> None:
    plan = plan_for("POST", "/tasks")
    assert router.reply(plan, router.w1, 200, [("x-new-task", "task-7")]) == 0
    router.changed({C("task-7", "task"): "held w1 learned"})


def test_a_json_pointer_asks_for_the_body_and_learns_from_it(router: Router) -> None:
    plan = plan_for("POST", "/rollouts")
    learner = ReplyLearner(plan, router.core, router.w0, clock=router.clock, wall_clock=router.wall)
    assert learner.head(200, CIMultiDict(), []) == MAX_LEARN_BODY_BYTES
    router.changed({})  # nothing learned before the body
    learner.body(b'{"id": "r-1", "other": [1, 2]}')
    router.changed({C("r-1", "rollout"): "held w0 learned"})


def test_an_integer_at_the_json_pointer_is_learned_in_decimal(router: Router) -> None:
    router.reply(plan_for("POST", "/rollouts"), router.w0, 200, body=b'{"id": 12}')
    router.changed({C("12", "rollout"): "held w0 learned"})


def test_a_boolean_at_the_json_pointer_is_not_learned(router: Router) -> None:
    router.reply(plan_for("POST", "/rollouts"), router.w0, 200, body=b'{"id": true}')
    router.changed({})


def test_one_seed_reply_teaches_both_the_cookie_and_the_token(router: Router) -> None:
    wanted = router.reply(
        SEED, router.w1, 200, [("Set-Cookie", set_session("s1"))], body=seed_body("s1")
    )
    assert wanted == MAX_LEARN_BODY_BYTES
    router.changed(
        {C("s1", "resources"): "held w1 learned", C("s1", "mcp_token"): "held w1 learned"}
    )
    assert router.core.claims.held_count("w1") == 2  # balancing counts both


def test_a_body_the_forwarder_does_not_read_teaches_nothing_from_the_pointer(
    router: Router,
) -> None:
    # Over the budget (or never ending within it): the forwarder never calls body().
    big = seed_body("s1")[:-1] + b', "pad": "' + b"p" * MAX_LEARN_BODY_BYTES + b'"}'
    assert len(big) > MAX_LEARN_BODY_BYTES
    router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("s1"))], body=big)
    router.changed({C("s1", "resources"): "held w0 learned"})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"<html>seeded</html>", "seed reply is not JSON: nothing learned"),
        (b"\x1f\x8b\x08\x00", "seed reply is not JSON: nothing learned"),
        (b'{"mcp": {}}', "seed reply named no session"),
        (
            b'{"mcp": {"headers": {"X-NeMo-Gym-Session-Token": null}}}',
            "seed reply named no session",
        ),
        (b'{"mcp": {"headers": {"X-NeMo-Gym-Session-Token": ""}}}', "seed reply named no session"),
    ],
    ids=["html", "gzip", "missing", "null", "empty"],
)
def test_a_body_without_the_pointer_teaches_nothing_and_says_so(
    router: Router, caplog: pytest.LogCaptureFixture, body: bytes, message: str
) -> None:
    with caplog.at_level(logging.INFO, logger="episode_router.learn"):
        router.reply(plan_for("POST", "/rollouts"), router.w0, 200, body=body)
    router.changed({})
    # A warning, once for the reply (with its kinds when it is no JSON at all), and
    # the kind's miss counted: a config that cannot work is loud.
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == message and set(messages[1:]) <= {"seed reply named no session"}
    assert all(r.levelno == logging.WARNING for r in caplog.records)
    assert getattr(caplog.records[0], "worker", None) == "w0"
    assert router.core.learn_misses == {"rollout": 1}


@pytest.mark.parametrize(
    ("headers", "body", "kind"),
    [
        ([("Set-Cookie", f"{COOKIE}=not-a-starlette-cookie")], None, "resources"),
        ([("Set-Cookie", f"{COOKIE}={starlette_cookie(None)}")], None, "resources"),
        ([], b'{"mcp": {"headers": {"X-NeMo-Gym-Session-Token": "garbage"}}}', "mcp_token"),
    ],
    ids=["cookie-malformed", "cookie-null-session-id", "token-malformed"],
)
def test_an_unreadable_session_in_a_seed_reply_is_logged_not_raised(
    router: Router,
    caplog: pytest.LogCaptureFixture,
    headers: list[tuple[str, str]],
    body: bytes | None,
    kind: str,
) -> None:
    with caplog.at_level(logging.WARNING, logger="episode_router.learn"):
        router.reply(SEED, router.w0, 200, headers, body)
    router.changed({})
    assert router.core.learned == 0
    # The kind that found nothing where it looks says so too (a warning of its own).
    [record] = [r for r in caplog.records if r.getMessage() != "seed reply named no session"]
    assert record.getMessage() == "seed reply's session is unreadable"
    assert (getattr(record, "kind", None), getattr(record, "error", None)) == (
        kind,
        "invalid_token",
    )


@pytest.mark.parametrize("status", [200, 201, 204, 299])
def test_any_2xx_seed_reply_teaches(router: Router, status: int) -> None:
    router.reply(SEED, router.w0, status, [("Set-Cookie", set_session("s1"))])
    router.changed({C("s1", "resources"): "held w0 learned"})


@pytest.mark.parametrize("status", [100, 199, 300, 302, 400, 404, 500, 503])
def test_a_reply_that_is_not_2xx_teaches_nothing(router: Router, status: int) -> None:
    wanted = router.reply(
        SEED, router.w0, status, [("Set-Cookie", set_session("s1"))], body=seed_body("s1")
    )
    assert wanted == 0
    router.changed({})
    assert router.reply(MCP_POST, router.w0, status, [("Mcp-Session-Id", "m1")]) == 0
    router.changed({})


def test_a_key_another_worker_holds_is_not_learned(router: Router) -> None:
    router.reply(SEED, router.w1, 200, [("Set-Cookie", set_session("s1"))])
    router.changed({C("s1", "resources"): "held w1 learned"})

    router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("s1"))])

    router.changed({CONFLICTS: 1})  # the holder is unchanged
    assert router.core.learned == 1
    assert router.core.route("resources", "s1", 1.0) == Forward(router.w1, "s1", None)
    # A key claimed over the control socket is not taken by a reply either.
    assert router.core.claim(router.w1, "resources", "s9", 1.0) is None
    router.changed({C("s9", "resources"): "held w1"})
    router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("s9"))])
    router.changed({CONFLICTS: 2})


def test_a_key_that_ended_is_not_learned_again(router: Router) -> None:
    router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("s1"))])
    router.reply(plan_for("POST", "/close_session", SessionRef("resources", "s1")), router.w0)
    router.changed({C("s1", "resources"): "ended w0 learned"})

    router.reply(SEED, router.w1, 200, [("Set-Cookie", set_session("s1"))])

    router.changed({CONFLICTS: 1})
    assert answer_code(router.core.route("resources", "s1", 1.0)) == (410, "episode_ended", "s1")


# ============================================================================ close


def test_a_close_reply_releases_the_session(router: Router) -> None:
    router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("s1"))])
    router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("s2"))])
    close = plan_for("POST", "/close_session", SessionRef("resources", "s1"))
    router.changed(
        {C("s1", "resources"): "held w0 learned", C("s2", "resources"): "held w0 learned"}
    )

    assert router.reply(close, router.w0, 500, [("Set-Cookie", CLEARED)]) == 0
    router.changed({})  # a failed close ends nothing

    router.clock.now = 7.0
    assert router.reply(close, router.w0, 200, [("Set-Cookie", CLEARED)]) == 0
    router.changed({C("s1", "resources"): "ended w0 learned"})
    assert answer_code(router.core.route("resources", "s1", 8.0)) == (410, "episode_ended", "s1")
    assert router.core.route("resources", "s2", 8.0) == Forward(router.w0, "s2", None)


def test_a_close_ends_the_session_under_every_kind_its_seed_reply_taught(router: Router) -> None:
    for sid in ("s1", "s2"):
        router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session(sid))], seed_body(sid))
    router.changed(
        {
            C("s1", "resources"): "held w0 learned",
            C("s1", "mcp_token"): "held w0 learned",
            C("s2", "resources"): "held w0 learned",
            C("s2", "mcp_token"): "held w0 learned",
        }
    )

    close = plan_for("POST", "/close_session", SessionRef("resources", "s1"))
    router.reply(close, router.w0, 200, [("Set-Cookie", CLEARED)])

    router.changed(
        {C("s1", "resources"): "ended w0 learned", C("s1", "mcp_token"): "ended w0 learned"}
    )
    assert answer_code(router.core.route("mcp_token", "s1", 1.0)) == (410, "episode_ended", "s1")
    assert router.core.route("mcp_token", "s2", 1.0) == Forward(router.w0, "s2", None)


def test_claims_taught_by_different_replies_are_closed_apart(router: Router) -> None:
    # The same key under two kinds, but from two replies: two sessions as far as we know.
    router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("s1"))], b"not json")
    router.reply(SEED, router.w0, 200, body=seed_body("s1"))
    router.changed(
        {C("s1", "resources"): "held w0 learned", C("s1", "mcp_token"): "held w0 learned"}
    )

    router.reply(plan_for("POST", "/close_session", SessionRef("resources", "s1")), router.w0)

    router.changed({C("s1", "resources"): "ended w0 learned"})


# ============================================================================ MCP


def test_an_mcp_reply_teaches_its_session_and_a_delete_ends_it(router: Router) -> None:
    assert router.reply(MCP_POST, router.w1, 200, [("mcp-session-id", "m1")]) == 0
    router.changed({C("m1", "mcp_session"): "held w1 learned"})
    assert router.core.route("mcp_session", "m1", 1.0) == Forward(router.w1, "m1", None)

    delete = plan_for("DELETE", "/mcp", SessionRef("mcp_session", "m1"))
    router.reply(delete, router.w1, 405)
    router.changed({})  # the server refused to end it

    router.reply(delete, router.w1, 200, [("Mcp-Session-Id", "m1")])
    router.changed({C("m1", "mcp_session"): "ended w1 learned"})  # ended, not learned again
    assert answer_code(router.core.route("mcp_session", "m1", 2.0)) == (
        404,
        "unknown_session",
        "m1",
    )


def test_an_unknown_mcp_session_is_404(router: Router) -> None:
    assert answer_code(router.core.route("mcp_session", "never", 1.0)) == (
        404,
        "unknown_session",
        "never",
    )
    assert answer_code(router.core.route("resources", "never", 1.0)) == (
        401,
        "unknown_episode",
        "never",
    )


def test_an_mcp_reply_without_a_session_id_teaches_nothing(router: Router) -> None:
    router.reply(MCP_POST, router.w0, 200, [("Content-Type", "text/event-stream")])
    router.changed({})


def test_an_mcp_reply_echoing_its_session_keeps_and_refreshes_it(router: Router) -> None:
    router.reply(MCP_POST, router.w0, 200, [("Mcp-Session-Id", "m1")])
    router.clock.now = 30.0
    again = plan_for("POST", "/mcp", SessionRef("mcp_session", "m1"))
    router.reply(again, router.w0, 200, [("Mcp-Session-Id", "m1")])
    router.changed({C("m1", "mcp_session"): "held w0 learned"})
    claim = router.core.claims.lookup("mcp_session", "m1")
    assert claim is not None and (claim.since, claim.last_used) == (0.0, 30.0)


def test_an_unreadable_mcp_session_id_is_logged_not_raised(
    router: Router, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="episode_router.learn"):
        router.reply(MCP_POST, router.w0, 200, [("Mcp-Session-Id", "not visible ascii")])
    router.changed({})
    [record] = caplog.records
    assert (getattr(record, "kind", None), getattr(record, "error", None)) == (
        "mcp_session",
        "invalid_token",
    )


# ============================================================================ idle expiry


def test_learned_claims_expire_after_the_idle_ttl_unless_used(router: Router) -> None:
    router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("used"))])
    router.reply(SEED, router.w0, 200, [("Set-Cookie", set_session("idle"))])
    assert router.core.claim(router.w1, "resources", "claimed", 0.0) is None
    router.changed(
        {
            C("used", "resources"): "held w0 learned",
            C("idle", "resources"): "held w0 learned",
            C("claimed", "resources"): "held w1",
        }
    )

    assert router.core.route("resources", "used", 40.0) == Forward(router.w0, "used", None)
    claim = router.core.claims.lookup("resources", "used")
    assert claim is not None and claim.last_used == 40.0

    router.core.tick(IDLE_TTL - 0.001)
    router.changed({})
    router.core.tick(IDLE_TTL)
    router.changed({C("idle", "resources"): "ended w0 learned"})
    assert answer_code(router.core.route("resources", "idle", 51.0)) == (
        410,
        "episode_ended",
        "idle",
    )

    router.core.tick(40.0 + IDLE_TTL - 0.001)
    router.changed({})
    router.core.tick(40.0 + IDLE_TTL)
    router.changed({C("used", "resources"): "ended w0 learned"})

    router.core.tick(10_000.0 - 1)  # claims from the control socket are released, never idle
    router.changed({C("idle", "resources"): None, C("used", "resources"): None})
