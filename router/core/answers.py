"""The router's own answers (design §1): the one place that maps a code to a status.

Every answer the router writes itself is JSON
`{"error": <code>, "detail": <one sentence>, "session": <key or null>}`.
Pure: builds status, headers and body bytes; the HTTP layer only sends them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Final

STATUS_BY_CODE: Final[dict[str, int]] = {
    "bad_request": 400,
    "ambiguous_session": 400,
    "invalid_token": 401,
    "unknown_episode": 401,
    "bad_signature": 403,
    "peer_refused": 403,
    "unknown_session": 404,
    "payload_too_large": 413,
    "uri_too_long": 414,
    "worker_exited": 410,
    "episode_ended": 410,
    "request_timeout": 408,
    "not_owner": 421,
    "headers_too_large": 431,
    "upstream_error": 502,
    "no_worker": 503,
    "recovering": 503,
    "shutting_down": 503,
    "worker_busy": 503,
    "owner_unreachable": 503,
    "upstream_timeout": 504,
}

# 401s name their own scheme: never "Bearer", so OAuth-aware clients (MCP SDKs)
# do not start a discovery flow when they see one.
AUTH_SCHEME = "EpisodeToken"


@dataclass(frozen=True, slots=True)
class Answer:
    """A reply the router gives itself instead of forwarding."""

    code: str
    detail: str
    session: str | None = None
    retry_after_s: float | None = None
    # The session kind whose source the answer is about (a refused token, say): for
    # the metrics and the log, never rendered.
    kind: str | None = None

    @property
    def status(self) -> int:
        return STATUS_BY_CODE[self.code]


def render(answer: Answer) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and body for `answer`."""
    body = json.dumps(
        {"error": answer.code, "detail": answer.detail, "session": answer.session},
        separators=(",", ":"),
    ).encode()
    headers = [("Content-Type", "application/json")]
    status = answer.status
    if status == 401:
        headers.append(("WWW-Authenticate", f'{AUTH_SCHEME} error="{answer.code}"'))
    if answer.retry_after_s is not None:
        headers.append(("Retry-After", str(max(1, math.ceil(answer.retry_after_s)))))
    return status, headers, body
