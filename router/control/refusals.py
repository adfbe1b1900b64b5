"""The control protocol's refusals (design §3): what a refused claim, release or
sync entry is answered, and how many refusals one sync reply lists.

This module owns the wording of a refusal (`claim_refused`, `not_holder`,
`refused_sync_entry`) and the budget of a sync reply (`SyncRefusals`: listed in
order while the reply stays one line under MAX_LINE_BYTES, then only counted). It
is pure: it never asks the core anything nor keeps state between messages; the
session in `router.control.session` decides what is refused.
"""

from __future__ import annotations

from router.core import ClaimRefusal
from router.protocol import (
    MAX_KEY_CHARS,
    MAX_LINE_BYTES,
    Reply,
    encode_line,
    encoded_size,
    error_reply,
)

__all__ = [
    "SYNC_MAX_PENDING",
    "SyncRefusals",
    "claim_refused",
    "not_holder",
    "refused_sync_entry",
]

# The most claims one sync may span, across its messages: the upper bound of
# control.max_claims_per_worker, which bounds a sync (the reply's envelope is sized for it).
SYNC_MAX_PENDING = 2_000_000

_REFUSAL_DETAIL = {
    "conflict": "Another worker holds this key (`holder`; it may be lost and in its grace period).",
    "ended": "This key ended; a new attempt needs a new key.",
    "worker_exited": "The worker that held this key exited; a new attempt needs a new key.",
}


def claim_refused(request_id: object, refusal: ClaimRefusal) -> Reply:
    """The reply to a claim the core refused."""
    extra = {"holder": refusal.holder} if refusal.holder is not None else {}
    return error_reply(request_id, refusal.error, _REFUSAL_DETAIL[refusal.error], **extra)


def not_holder(request_id: object) -> Reply:
    """The reply to a release of a key this worker does not hold."""
    return error_reply(request_id, "not_holder", "Another worker holds this key.")


def refused_sync_entry(entry: object, error: Reply | None) -> Reply:
    """The refusal of a malformed sync entry. Its kind and key are echoed only when
    they are strings a claim could carry, so that every refusal stays small."""
    kind: object = None
    key: object = None
    if isinstance(entry, dict):
        kind, key = entry.get("kind", "episode"), entry.get("key")
    code = error["error"] if error is not None else "bad_request"
    return {"kind": _echoable(kind), "key": _echoable(key), "error": code}


def _echoable(value: object) -> str | None:
    return value if isinstance(value, str) and len(value) <= MAX_KEY_CHARS else None


class SyncRefusals:
    """The refusals one sync reply lists: in order while the reply stays under
    MAX_LINE_BYTES, then only counted (`refused_omitted`)."""

    __slots__ = ("_room", "full", "listed", "omitted")

    def __init__(self, request_id: object) -> None:
        # The reply without its refusals, with the largest counts it can carry.
        envelope = {
            "id": request_id,
            "ok": True,
            "accepted": SYNC_MAX_PENDING,
            "refused": [],
            "more": True,
            "refused_omitted": 1 << 62,
        }
        self._room = MAX_LINE_BYTES - len(encode_line(envelope))
        self.listed: list[Reply] = []
        self.omitted = 0
        self.full = self._room <= 0

    def add(self, refusal: Reply) -> None:
        """List `refusal` if it fits (with its comma); otherwise count it, and every later one."""
        size = encoded_size(refusal) + 1
        if self.full or size > self._room:
            self.full = True
            self.omitted += 1
            return
        self.listed.append(refusal)
        self._room -= size

    def reply(self, request_id: object, accepted: int, *, more: bool) -> Reply:
        """The sync reply, with `refused_omitted` when some refusals are not listed."""
        reply: Reply = {"id": request_id, "ok": True, "accepted": accepted, "refused": self.listed}
        if more:
            reply["more"] = True
        if self.omitted:
            reply["refused_omitted"] = self.omitted
        return reply
