"""Pure tests for learned claims written through the claims directory (design §10): the
learner with a fake `ClaimGate` at the boundary, a real RouterCore, no event loop (the
gate answers at once, so the write the forwarder would await is run by hand).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from multidict import CIMultiDict

from router.directory import ClaimOutcome, ClaimVerdict, DirectoryError, DirectoryTimeout
from router.sessions.learning import ReplyLearner, plan_learning
from tests.sessions.test_seed_rules import COOKIE, READER, core_with_workers


class AnsweringGate:
    """A ClaimGate that answers every claim at once with `outcome`."""

    def __init__(self, outcome: ClaimOutcome | DirectoryError) -> None:
        self.outcome = outcome
        self.asked: list[tuple[str, str]] = []
        self.released_keys: list[tuple[str, str]] = []

    async def claim(self, kind: str, key: str) -> ClaimOutcome:
        self.asked.append((kind, key))
        if isinstance(self.outcome, DirectoryError):
            raise self.outcome
        return self.outcome

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


def seed_reply(gate: AnsweringGate, path: str = "/seed_session") -> tuple[Any, ReplyLearner]:
    core, w0, _w1 = core_with_workers()
    plan = plan_learning(
        READER, "POST", path, None, READER.seeding("POST", path), CIMultiDict(), 1.0
    )
    learner = ReplyLearner(plan, core, w0, clock=lambda: 1.0, wall_clock=lambda: 1.0, gate=gate)
    learner.head(200, CIMultiDict(), [f"{COOKIE}=s1; Path=/"])
    return core, learner


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
