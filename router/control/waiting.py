"""Control replies that wait for the claims directory (design §10, "Writes and fencing").

With a `ClaimGate`, a claim of a key the local table does not hold yet is acknowledged
only once the directory holds its owner record. This module owns what such a reply
waits for and how the directory's answer is worded: `WaitingReply` (a place in a
connection's ordered outbox, holding the keys it asks the gate for and, once the gate
answered, the outcome), and the refusals the directory's verdicts map to. Pure: it
never calls the gate, nor the core; `ControlSession` decides what waits and applies
the outcome, `ControlConnection` asks the gate and writes the replies in order.
"""

from __future__ import annotations

import json

from router.control.refusals import SyncRefusals
from router.core import Worker, WorkerState
from router.directory.errors import DirectoryError
from router.directory.records import ClaimOutcome, ClaimVerdict
from router.protocol import Reply, encode_line, error_reply

__all__ = [
    "MAX_WAITING_REPLIES",
    "GateAnswer",
    "WaitingReply",
    "directory_refusal",
    "directory_unavailable",
    "lease_ended",
]

# Replies one connection may have waiting (for the directory, or behind one that does)
# before it is read no further: a pipelining worker's claims of one read go to the gate
# together (the directory batches them), and this bounds what a worker that never
# stops sending makes the router hold while the directory is slow, as WRITE_BUFFER_HIGH
# does for reply bytes.
MAX_WAITING_REPLIES = 4096

# What the gate answered for a reply's keys: an outcome per key, in order, or the error
# that kept them from being written.
GateAnswer = tuple[ClaimOutcome, ...] | DirectoryError


class WaitingReply:
    """A reply not decided yet, in its connection's outbox.

    `op` is "claim", "release" or "sync". `asks` are the keys the connection claims
    through the gate for it (none for a reply that only waits behind another of the
    same key: a release, or a claim again, of a key whose claim waits). `answer` is
    set once the gate answered. The session applies it (`ControlSession.settle`) when
    every reply before it is out: the local table changes in request order per key.

    A line of the fast path keeps its id as the line's own bytes (`raw_id`, its JSON
    text): its ok reply is written from them, and the id is decoded only for a refusal.
    """

    __slots__ = (
        "_request_id",
        "accepted",
        "answer",
        "asks",
        "generation",
        "key",
        "kind",
        "leader",
        "op",
        "raw_id",
        "refusals",
        "worker",
    )

    def __init__(
        self,
        op: str,
        request_id: object,
        worker: Worker,
        asks: tuple[tuple[str, str], ...],
        *,
        kind: str = "",
        key: str = "",
        leader: WaitingReply | None = None,
        raw_id: bytes = b"",
    ) -> None:
        self.op = op
        self._request_id = request_id
        self.raw_id = raw_id  # the id's JSON text when it came from the fast path, or b""
        self.worker = worker
        # A lease retired meanwhile (bye, exit) or taken by a new process bumps this:
        # the waiting claim is then not applied.
        self.generation = worker.generation
        self.asks = asks
        self.kind = kind
        self.key = key
        self.leader = leader  # the waiting claim of the same key this one follows
        self.answer: GateAnswer | None = None
        # A sync's reply so far: its refusals and how many the local table accepted.
        self.refusals: SyncRefusals | None = None
        self.accepted = 0

    @property
    def request_id(self) -> object:
        """The request's id (decoded from `raw_id` when the line gave its bytes)."""
        raw = self.raw_id
        return json.loads(raw) if raw else self._request_id

    def ok_line(self) -> bytes:
        """The reply line `{"id": ..., "ok": true}` to this request."""
        raw = self.raw_id
        if raw:
            return b'{"id":' + raw + b',"ok":true}\n'
        return encode_line({"id": self._request_id, "ok": True})

    @property
    def ready(self) -> bool:
        """True once nothing but the replies before it keeps it from being applied."""
        return not self.asks or self.answer is not None

    def lease_current(self) -> bool:
        """True while the worker it speaks for still holds the lease it was asked under
        (a closed connection leaves it lost, not retired: its claims still apply)."""
        worker = self.worker
        return worker.generation == self.generation and worker.state is not WorkerState.EXITED


_DIRECTORY_DETAIL = {
    ClaimVerdict.CONFLICT: "Another router holds this key (`holder` is its router id).",
    ClaimVerdict.ENDED: "This key ended; a new attempt needs a new key.",
    ClaimVerdict.EXITED: "The worker that held this key exited; a new attempt needs a new key.",
}


def directory_refusal(request_id: object, outcome: ClaimOutcome) -> Reply:
    """The reply to a claim the directory refused (any verdict but CLAIMED)."""
    verdict = outcome.verdict
    extra = {"holder": outcome.holder} if verdict is ClaimVerdict.CONFLICT else {}
    return error_reply(request_id, verdict.value, _DIRECTORY_DETAIL[verdict], **extra)


def directory_unavailable(request_id: object) -> Reply:
    """The reply to a claim (or sync) the directory did not take in time."""
    return error_reply(
        request_id,
        "directory_unavailable",
        "The claims directory did not take the claim within directory.claim_timeout_s;"
        " the worker may retry.",
    )


def lease_ended(request_id: object) -> Reply:
    """The reply to a claim whose lease ended (bye, exit) while it waited: not held."""
    return error_reply(
        request_id,
        "no_hello",
        "The lease ended while this claim waited for the claims directory; it is not held.",
    )
