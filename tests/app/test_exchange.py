"""Which answer a failed forward gets (design §3), pure: no request, no event loop."""

from __future__ import annotations

import pytest

from router.app.exchange import body_timeout_answer, failure_answer
from router.core.answers import Answer
from router.core.machine import Forward
from router.core.workers import Worker, WorkerOrigin, WorkerState
from router.relay.contract import FailureKind, UpstreamFailure


def _decision(session: str | None = "ep-1", state: WorkerState = WorkerState.LIVE) -> Forward:
    worker = Worker("w0", "http://127.0.0.1:9000", WorkerOrigin.CONTROL, now=0.0)
    worker.state = state
    return Forward(worker, session, None)


@pytest.mark.parametrize(
    ("kind", "gone", "state", "code"),
    [
        ("refused", False, WorkerState.LIVE, "worker_exited"),
        ("error", True, WorkerState.LIVE, "worker_exited"),
        ("error", False, WorkerState.EXITED, "worker_exited"),
        ("error", False, WorkerState.LOST, "worker_exited"),
        ("error", False, WorkerState.LIVE, "upstream_error"),
        ("timeout", True, WorkerState.LIVE, "upstream_timeout"),
        ("timeout", False, WorkerState.EXITED, "upstream_timeout"),
    ],
)
def test_a_failed_forward_gets_the_answer_of_design_3(
    kind: FailureKind, gone: bool, state: WorkerState, code: str
) -> None:
    answer = failure_answer(UpstreamFailure(kind, "it broke"), gone, _decision(state=state))
    assert answer.code == code and answer.session == "ep-1"


def test_the_worker_exited_answer_says_what_the_worker_was_for() -> None:
    refused = UpstreamFailure("refused", "connect refused")
    episode = failure_answer(refused, False, _decision("ep-1"))
    chosen = failure_answer(refused, False, _decision(None))
    assert "ran this episode" in episode.detail and episode.session == "ep-1"
    assert "was chosen for this request" in chosen.detail and chosen.session is None


def test_an_upstream_error_carries_the_failures_detail() -> None:
    answer = failure_answer(UpstreamFailure("error", "reset by peer"), False, _decision())
    assert answer == Answer("upstream_error", "The worker failed: reset by peer", "ep-1")


def test_a_body_that_stopped_arriving_is_the_clients_timeout() -> None:
    answer = body_timeout_answer("no byte for 5s")
    assert answer.code == "request_timeout" and "no byte for 5s" in answer.detail
