"""The claim table: which worker holds which session key, and what became of ended ones.

This module owns the rules of DESIGN §3 "one attempt, one worker": a key is held
by at most one worker, and a key that ended or whose worker exited is remembered
as a tombstone so that a stale token never resurrects it while the router
remembers it.

It is pure and synchronous: no asyncio, no sockets, no clock reads. Every
method that depends on time takes `now` (seconds, monotonic or wall; the caller
picks one and sticks to it).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


class ClaimState(enum.Enum):
    """What a key in the table stands for."""

    HELD = "held"
    ENDED = "episode_ended"  # released by its worker, or dropped by a sync
    EXITED = "worker_exited"  # its worker went away while holding it


class Claim:
    """One key's record. Held claims and tombstones share this type."""

    # One of these exists per live session, possibly a million of them:
    # __slots__ keeps each at ~100 bytes instead of ~400 with a __dict__.
    __slots__ = ("key", "kind", "last_used", "learned", "siblings", "since", "state", "worker")

    def __init__(
        self, kind: str, key: str, worker: str, now: float, *, learned: bool = False
    ) -> None:
        self.kind = kind
        self.key = key
        self.worker = worker
        self.state = ClaimState.HELD
        self.since = now
        self.last_used = now
        self.learned = learned
        # Claims learned from the same seed reply (one session under several kinds,
        # e.g. a cookie and an MCP token): a close ends them together.
        self.siblings: tuple[Claim, ...] = ()

    def __repr__(self) -> str:
        return f"Claim({self.kind}:{self.key} {self.state.value} by {self.worker})"


@dataclass(frozen=True, slots=True)
class ClaimRefusal:
    """Why a claim was refused; `error` is the control protocol's error code."""

    error: str  # "conflict" | "ended" | "worker_exited"
    holder: str | None = None


@dataclass(frozen=True, slots=True)
class SyncResult:
    accepted: int
    refused: tuple[tuple[str, str, ClaimRefusal], ...]  # (kind, key, why)
    ended: int  # keys the worker held before and no longer lists


class ClaimTable:
    """Held claims and tombstones, with a per-worker index.

    Lookups are one dict probe per kind. Tombstones expire `tombstone_ttl_s`
    after they were made, and the oldest go first once there are more than
    `max_tombstones` of them.
    """

    def __init__(self, *, tombstone_ttl_s: float, max_tombstones: int) -> None:
        self.tombstone_ttl_s = tombstone_ttl_s
        self.max_tombstones = max_tombstones
        self._by_kind: dict[str, dict[str, Claim]] = {}
        self._held_by_worker: dict[str, set[Claim]] = {}
        # Held claims learned from replies, kept apart so that expiring idle ones
        # walks only them, not every held claim.
        self._learned: set[Claim] = set()
        # Tombstones in the order they were made. Each record is made once and
        # never revived, so the left end is always the oldest live tombstone
        # unless it was already evicted: popleft is enough to expire and evict.
        self._tombstones: deque[tuple[float, Claim]] = deque()

    # -- reading -----------------------------------------------------------

    def lookup(self, kind: str, key: str) -> Claim | None:
        """The record for `key` of `kind` (held or tombstone), or None if unknown."""
        keys = self._by_kind.get(kind)
        return keys.get(key) if keys is not None else None

    def held_by(self, worker: str) -> frozenset[Claim]:
        return frozenset(self._held_by_worker.get(worker, ()))

    def held_count(self, worker: str) -> int:
        held = self._held_by_worker.get(worker)
        return len(held) if held is not None else 0

    @property
    def held_total(self) -> int:
        return sum(len(held) for held in self._held_by_worker.values())

    @property
    def tombstone_count(self) -> int:
        return len(self._tombstones)

    def held_counts_by_kind(self) -> dict[tuple[str, str], int]:
        """(worker, kind) → number of held claims; for metrics."""
        counts: dict[tuple[str, str], int] = {}
        for worker, held in self._held_by_worker.items():
            for claim in held:
                label = (worker, claim.kind)
                counts[label] = counts.get(label, 0) + 1
        return counts

    def tombstones(self) -> Iterator[Claim]:
        for _, claim in self._tombstones:
            yield claim

    def held(self) -> Iterator[Claim]:
        for held in self._held_by_worker.values():
            yield from held

    # -- changing ----------------------------------------------------------

    def claim(
        self, kind: str, key: str, worker: str, now: float, *, learned: bool = False
    ) -> ClaimRefusal | None:
        """Record that `worker` holds `key`. Returns None when it does (again),
        or the refusal: another worker holds it, or it ended or exited."""
        keys = self._by_kind.setdefault(kind, {})
        existing = keys.get(key)
        if existing is None:
            claim = Claim(kind, key, worker, now, learned=learned)
            keys[key] = claim
            self._held_by_worker.setdefault(worker, set()).add(claim)
            if learned:
                self._learned.add(claim)
            return None
        if existing.state is ClaimState.HELD:
            if existing.worker == worker:
                existing.last_used = now
                return None
            return ClaimRefusal("conflict", existing.worker)
        if existing.state is ClaimState.ENDED:
            return ClaimRefusal("ended")
        return ClaimRefusal("worker_exited")

    def release(self, kind: str, key: str, worker: str, now: float) -> bool:
        """End `key`. False only when another worker holds it (not_holder).

        Releasing a key that already ended, exited, or was never seen is
        accepted (ops are idempotent); an unseen key gets an `ended` tombstone
        so that a late request for it is told the episode ended.
        """
        keys = self._by_kind.setdefault(kind, {})
        existing = keys.get(key)
        if existing is None:
            claim = Claim(kind, key, worker, now)
            keys[key] = claim
            self._bury(claim, ClaimState.ENDED, now)
            return True
        if existing.state is not ClaimState.HELD:
            return True
        if existing.worker != worker:
            return False
        self._unindex(existing)
        self._bury(existing, ClaimState.ENDED, now)
        return True

    def worker_exited(self, worker: str, now: float) -> int:
        """Turn every claim `worker` holds into a `worker_exited` tombstone.
        Returns how many there were."""
        held = self._held_by_worker.pop(worker, None)
        if not held:
            return 0
        for claim in held:
            self._learned.discard(claim)
            self._bury(claim, ClaimState.EXITED, now)
        return len(held)

    def sync(self, worker: str, claims: Iterable[tuple[str, str]], now: float) -> SyncResult:
        """Replace what `worker` holds with `claims` (a complete set).

        Keys it held and no longer lists end; listed keys are claimed under the
        usual rules, so a key another worker holds stays with that worker.
        """
        listed = set(claims)
        before = self._held_by_worker.get(worker, set())
        dropped = [c for c in before if (c.kind, c.key) not in listed]
        for claim in dropped:
            self._unindex(claim)
            self._bury(claim, ClaimState.ENDED, now)
        accepted = 0
        refused: list[tuple[str, str, ClaimRefusal]] = []
        for kind, key in sorted(listed):
            refusal = self.claim(kind, key, worker, now)
            if refusal is None:
                accepted += 1
            else:
                refused.append((kind, key, refusal))
        return SyncResult(accepted, tuple(refused), len(dropped))

    def touch(self, claim: Claim, now: float) -> None:
        claim.last_used = now

    def expire(self, now: float) -> int:
        """Forget tombstones older than the TTL. Returns how many went."""
        cutoff = now - self.tombstone_ttl_s
        gone = 0
        while self._tombstones and self._tombstones[0][0] <= cutoff:
            self._forget(self._tombstones.popleft()[1])
            gone += 1
        return gone

    def expire_idle_learned(self, now: float, idle_ttl_s: float) -> int:
        """End learned claims unused for `idle_ttl_s` (their workers never release)."""
        cutoff = now - idle_ttl_s
        idle = [c for c in self._learned if c.last_used <= cutoff]
        for claim in idle:
            self._unindex(claim)
            self._bury(claim, ClaimState.ENDED, now)
        return len(idle)

    def restore_tombstone(
        self, kind: str, key: str, worker: str, state: ClaimState, made_at: float
    ) -> None:
        """Put back a tombstone from a journal (it must be in time order with the
        others restored). A key already present is left as it is."""
        keys = self._by_kind.setdefault(kind, {})
        if key in keys or state is ClaimState.HELD:
            return
        claim = Claim(kind, key, worker, made_at)
        keys[key] = claim
        self._bury(claim, state, made_at)

    # -- internals ---------------------------------------------------------

    def _unindex(self, claim: Claim) -> None:
        self._learned.discard(claim)
        held = self._held_by_worker.get(claim.worker)
        if held is None:
            return
        held.discard(claim)
        if not held:
            del self._held_by_worker[claim.worker]

    def _bury(self, claim: Claim, state: ClaimState, now: float) -> None:
        claim.state = state
        claim.since = now
        self._tombstones.append((now, claim))
        while len(self._tombstones) > self.max_tombstones:
            self._forget(self._tombstones.popleft()[1])

    def _forget(self, claim: Claim) -> None:
        keys = self._by_kind.get(claim.kind)
        if keys is not None and keys.get(claim.key) is claim:
            del keys[claim.key]
