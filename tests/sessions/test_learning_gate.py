"""Pure tests for learned claims written through the claims directory (design §10): the
learner with a fake `ClaimGate` at the boundary, a real RouterCore, no event loop (the
gate answers at once, so the write the forwarder would await is run by hand).
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from typing import Any

from multidict import CIMultiDict

from router.core import Worker
from router.directory import ClaimOutcome, ClaimVerdict, DirectoryError, DirectoryTimeout
from router.sessions.learning import ReplyLearner, plan_learning
from tests.sessions.test_seed_rules import COOKIE, READER, core_with_workers


class AnsweringGate:
    """A BatchClaimGate that answers every claim at once with `outcome`, or with the
    outcome `by_key` names for a key."""

    def __init__(
        self,
        outcome: ClaimOutcome | DirectoryError,
        by_key: dict[str, ClaimOutcome | DirectoryError] | None = None,
    ) -> None:
        self.outcome = outcome
        self.by_key = by_key or {}
        self.asked: list[tuple[str, str]] = []
        self.calls: list[list[tuple[str, str]]] = []  # the keys of each claim_each call
        self.released_keys: list[tuple[str, str]] = []

    async def claim(self, kind: str, key: str, worker: Worker | None = None) -> ClaimOutcome:
        raise AssertionError("the learner claims a reply's keys in one claim_each call")

    async def claim_each(
        self, keys: Sequence[tuple[str, str]], worker: Worker | None = None
    ) -> list[ClaimOutcome | DirectoryError]:
        self.calls.append(list(keys))
        self.asked.extend(keys)
        return [self.by_key.get(key, self.outcome) for _kind, key in keys]

    def released(self, kind: str, key: str) -> None:
        self.released_keys.append((kind, key))


def run(write: Coroutine[Any, Any, bool]) -> bool:
    """Runs a write whose gate never suspends, with no event loop."""
    try:
        write.send(None)
    except StopIteration as done:
        result: bool = done.value
        return result
    raise AssertionError("the write suspended")


def seed_reply(
    gate: AnsweringGate, path: str = "/seed_session", body: bytes | None = None
) -> tuple[Any, ReplyLearner]:
    """A seed reply that sets the cookie `s1`, and whose body, when given, is read."""
    core, w0, _w1 = core_with_workers()
    plan = plan_learning(
        READER, "POST", path, None, READER.seeding("POST", path), CIMultiDict(), 1.0
    )
    learner = ReplyLearner(plan, core, w0, clock=lambda: 1.0, wall_clock=lambda: 1.0, gate=gate)
    wants_body = learner.head(200, CIMultiDict(), [f"{COOKIE}=s1; Path=/"])
    if body is not None:
        assert wants_body
        learner.body(body)
    return core, learner


TWO_KEYS_BODY = b'{"resources_tools": {"headers": {"token": "t1"}}}'


def test_the_keys_of_one_reply_are_claimed_in_one_call() -> None:
    gate = AnsweringGate(ClaimOutcome(ClaimVerdict.CLAIMED))
    core, learner = seed_reply(gate, body=TWO_KEYS_BODY)
    assert learner.directory_write is not None

    assert run(learner.directory_write) is True

    # The cookie's key and the body's, in one directory call, not a round trip each.
    assert gate.calls == [[("resources", "s1"), ("mcp_token", "t1")]]
    for kind, key in (("resources", "s1"), ("mcp_token", "t1")):
        claim = core.claims.lookup(kind, key)
        assert claim is not None and claim.worker == "w0" and claim.learned


def test_one_key_refused_the_other_is_learned() -> None:
    conflict = ClaimOutcome(ClaimVerdict.CONFLICT, holder="r2")
    gate = AnsweringGate(ClaimOutcome(ClaimVerdict.CLAIMED), by_key={"s1": conflict})
    core, learner = seed_reply(gate, body=TWO_KEYS_BODY)
    assert learner.directory_write is not None

    assert run(learner.directory_write) is True  # relayed: the directory answered

    assert core.claims.lookup("resources", "s1") is None
    assert core.learn_conflicts == 1
    assert core.claims.lookup("mcp_token", "t1") is not None


def test_one_key_unwritten_keeps_the_reply_back_and_the_written_one_is_held() -> None:
    gate = AnsweringGate(
        ClaimOutcome(ClaimVerdict.CLAIMED), by_key={"t1": DirectoryTimeout("late")}
    )
    core, learner = seed_reply(gate, body=TWO_KEYS_BODY)
    assert learner.directory_write is not None

    assert run(learner.directory_write) is False  # the reply is not relayed

    # The directory holds s1 for this router: so does its table (a lookup elsewhere
    # forwards here, and finds it).
    assert core.claims.lookup("resources", "s1") is not None
    assert core.claims.lookup("mcp_token", "t1") is None


def test_a_learned_key_is_held_only_once_the_directory_took_it() -> None:
    gate = AnsweringGate(ClaimOutcome(ClaimVerdict.CLAIMED))
    core, learner = seed_reply(gate)
    assert core.claims.lookup("resources", "s1") is None  # not before the directory
    assert learner.directory_write is not None

    assert run(learner.directory_write) is True

    assert gate.asked == [("resources", "s1")]
    claim = core.claims.lookup("resources", "s1")
    assert claim is not None and claim.worker == "w0" and claim.learned


def test_a_key_another_router_holds_is_not_learned_and_counted() -> None:
    gate = AnsweringGate(ClaimOutcome(ClaimVerdict.CONFLICT, holder="r2"))
    core, learner = seed_reply(gate)
    assert learner.directory_write is not None

    assert run(learner.directory_write) is True  # relayed, not learned

    assert core.claims.lookup("resources", "s1") is None
    assert core.learn_conflicts == 1


def test_a_directory_that_does_not_answer_keeps_the_reply_from_the_client() -> None:
    gate = AnsweringGate(DirectoryTimeout("late"))
    core, learner = seed_reply(gate)
    assert learner.directory_write is not None

    assert run(learner.directory_write) is False

    assert core.claims.lookup("resources", "s1") is None


def test_without_a_gate_nothing_waits() -> None:
    core, w0, _w1 = core_with_workers()
    path = "/seed_session"
    plan = plan_learning(
        READER, "POST", path, None, READER.seeding("POST", path), CIMultiDict(), 1.0
    )
    learner = ReplyLearner(plan, core, w0, clock=lambda: 1.0, wall_clock=lambda: 1.0)
    learner.head(200, CIMultiDict(), [f"{COOKIE}=s1; Path=/"])
    assert learner.directory_write is None
    assert core.claims.lookup("resources", "s1") is not None
