"""Pure tests for router.core.answers: the status of every code and the rendered reply."""

from __future__ import annotations

import json

import pytest

from router.core.answers import AUTH_SCHEME, STATUS_BY_CODE, Answer, render

# design §1 and §10, plus the hygiene answers of §8, the shutdown answer and the silent body's.
CONTRACT = {
    "worker_exited": 410,
    "episode_ended": 410,
    "unknown_episode": 401,
    "invalid_token": 401,
    "bad_signature": 403,
    "no_worker": 503,
    "recovering": 503,
    "unknown_session": 404,
    "ambiguous_session": 400,
    "upstream_error": 502,
    "upstream_timeout": 504,
    "bad_request": 400,
    "payload_too_large": 413,
    "uri_too_long": 414,
    "headers_too_large": 431,
    "shutting_down": 503,
    "worker_busy": 503,
    "request_timeout": 408,
    # design §10: several routers sharing a directory.
    "owner_unreachable": 503,
    "not_owner": 421,
    "peer_refused": 403,
}


def test_the_status_table_is_the_contracts() -> None:
    assert STATUS_BY_CODE == CONTRACT


@pytest.mark.parametrize(("code", "status"), sorted(CONTRACT.items()))
def test_every_answer_renders_the_documented_json(code: str, status: int) -> None:
    answer = Answer(code, "A sentence.", "ep7-a0")
    rendered_status, headers, body = render(answer)
    assert rendered_status == answer.status == status
    assert json.loads(body) == {"error": code, "detail": "A sentence.", "session": "ep7-a0"}
    expected = [("Content-Type", "application/json")]
    if status == 401:
        expected.append(("WWW-Authenticate", f'EpisodeToken error="{code}"'))
    assert headers == expected


def test_401s_never_name_the_bearer_scheme() -> None:
    assert AUTH_SCHEME == "EpisodeToken"
    _, headers, _ = render(Answer("invalid_token", "Bad token."))
    assert all("bearer" not in value.lower() for _, value in headers)


def test_a_missing_session_is_json_null() -> None:
    _, _, body = render(Answer("no_worker", "No worker is available."))
    assert body == b'{"error":"no_worker","detail":"No worker is available.","session":null}'


def test_details_and_sessions_are_escaped_as_json() -> None:
    answer = Answer("unknown_episode", 'Say "hi"\n\u2028.', 'k"\\\x00é')
    _, _, body = render(answer)
    assert body.isascii() and b"\n" not in body
    assert json.loads(body) == {
        "error": answer.code,
        "detail": answer.detail,
        "session": answer.session,
    }


@pytest.mark.parametrize(
    ("seconds", "header"),
    [(0.0, "1"), (0.2, "1"), (1.0, "1"), (1.01, "2"), (18.0, "18"), (29.5, "30")],
)
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one(
    seconds: float, header: str
) -> None:
    status, headers, _ = render(Answer("recovering", "Retry shortly.", "k", retry_after_s=seconds))
    assert status == 503
    assert headers == [("Content-Type", "application/json"), ("Retry-After", header)]


def test_retry_after_is_absent_unless_asked_for() -> None:
    _, headers, _ = render(Answer("no_worker", "None."))
    assert [name for name, _ in headers] == ["Content-Type"]
    _, headers, _ = render(Answer("unknown_episode", "Unknown.", retry_after_s=3.0))
    assert headers[-1] == ("Retry-After", "3")


def test_answers_are_values() -> None:
    assert Answer("no_worker", "x", None, 1.0) == Answer("no_worker", "x", retry_after_s=1.0)
    with pytest.raises(AttributeError):
        Answer("no_worker", "x").code = "recovering"  # type: ignore[misc]
