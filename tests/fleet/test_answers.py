"""Pure tests for what a lookup decides for a request (design §10 step 2): no event loop."""

from __future__ import annotations

import pytest

from router.directory import RequestMeaning
from router.fleet import answer_for, not_owner, owner_unreachable, peer_refused


@pytest.mark.parametrize(
    ("meaning", "mcp", "code", "status"),
    [
        (RequestMeaning.WORKER_EXITED, False, "worker_exited", 410),
        (RequestMeaning.WORKER_EXITED, True, "worker_exited", 410),
        (RequestMeaning.EPISODE_ENDED, False, "episode_ended", 410),
        (RequestMeaning.EPISODE_ENDED, True, "unknown_session", 404),
        (RequestMeaning.RECOVERING, False, "recovering", 503),
    ],
)
def test_the_directorys_answers(meaning: RequestMeaning, mcp: bool, code: str, status: int) -> None:
    answer = answer_for(meaning, "ep7-a0", mcp)
    assert answer is not None
    assert (answer.code, answer.status, answer.session) == (code, status, "ep7-a0")
    if status == 503:
        assert answer.retry_after_s == 1.0


@pytest.mark.parametrize(
    "meaning", [RequestMeaning.LOCAL, RequestMeaning.UNKNOWN, RequestMeaning.PEER]
)
def test_the_local_table_answers_its_own_and_nobodys_keys(meaning: RequestMeaning) -> None:
    assert answer_for(meaning, "ep7-a0", False) is None


def test_the_hops_answers() -> None:
    assert (owner_unreachable("k").status, owner_unreachable("k").retry_after_s) == (503, 1.0)
    assert not_owner("k").status == 421
    refused = peer_refused("a malformed header", None)
    assert refused.status == 403 and "a malformed header" in refused.detail
