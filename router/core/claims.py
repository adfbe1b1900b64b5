"""The claim table: which worker holds which session key, and what became of ended ones.

This module owns the rules of design §3 "one attempt, one worker": a key is held
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


# Module globals for the states the hot paths test: reading `ClaimState.HELD` goes
# through the enum's class machinery, and costs several times what reading a global does.
_HELD = ClaimState.HELD
_ENDED = ClaimState.ENDED
_EXITED = ClaimState.EXITED


class _Traits:
    """What a claim shares with the others of its kind: the kind, whether it was
    learned, and its siblings (none, for almost every claim)."""

    __slots__ = ("kind", "learned", "siblings")

    def __init__(self, kind: str, learned: bool, siblings: tuple[Claim, ...] = ()) -> None:
        self.kind = kind
        self.learned = learned
        self.siblings = siblings


class Claim:
    """One key's record. Held claims and tombstones share this type."""

    # One of these exists per live session, possibly a million of them, so the
    # record is six slots (80 bytes with the GC header; eight slots were 96). The
    # fields routing reads on every request (state, worker, last_used) are slots;
    # the kind, the learned flag and the siblings, read only when a session ends
    # or is listed, sit in a _Traits shared by all the table's claims of one kind
    # (and copied for the rare claim given siblings).
    __slots__ = ("_traits", "key", "last_used", "since", "state", "worker")

    def __init__(self, traits: _Traits, key: str, worker: str, now: float) -> None:
        self._traits = traits
        self.key = key
        self.worker = worker
        self.state = _HELD
        self.since = now
        self.last_used = now  # the same float object as `since` until the claim is used

    @property
    def kind(self) -> str:
        return self._traits.kind

    @property
    def learned(self) -> bool:
        return self._traits.learned

    @property
    def siblings(self) -> tuple[Claim, ...]:
        """Claims learned from the same seed reply (one session under several kinds,
        e.g. a cookie and an MCP token): a close ends them together."""
        return self._traits.siblings

    @siblings.setter
    def siblings(self, siblings: tuple[Claim, ...]) -> None:
        traits = self._traits
        self._traits = _Traits(traits.kind, traits.learned, siblings)

    def __repr__(self) -> str:
        return f"Claim({self.kind}:{self.key} {self.state.value} by {self.worker})"


class _HeldIndex:
    """Claims in the order they were claimed, of which `count` are still held.

    Claims leave lazily: an ended claim stays in `claims` (its state says it
    ended; a claim is never held again) until the ended ones outnumber the held
    ones, when one pass drops them all, so each removal costs O(1) amortized
    and an ended claim outlives its tombstone only until that pass.

    A list costs 8 bytes per claim where a set of claims cost 34. The price is
    the pass, which holds the loop while it runs (how long, beside a full
    gc.collect(): docs/performance.md).
    """

    __slots__ = ("by_kind", "claims", "count")

    def __init__(self) -> None:
        self.claims: list[Claim] = []
        self.count = 0
        # Held claims per kind, kept as they change: the metrics read them at every
        # scrape, and counting a million claims there stalled the loop.
        self.by_kind: dict[str, int] = {}

    def add(self, claim: Claim) -> None:
        self.claims.append(claim)
        self.count += 1
        kind = claim._traits.kind
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    def dropped(self, kind: str) -> None:
        """One listed claim of `kind` is no longer held (its state says so)."""
        self.count -= 1
        self.by_kind[kind] -= 1
        if len(self.claims) > 2 * self.count + _COMPACT_SLACK:
            self.claims = self.held()

    def held(self) -> list[Claim]:
        return [c for c in self.claims if c.state is _HELD]


# Ended claims a _HeldIndex tolerates beyond as many as it holds, so that a small
# worker's list is not rebuilt on every release.
_COMPACT_SLACK = 16


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

    Memory per claim (`bench.micro`; figures in docs/performance.md): the key, the
    six-slot record, its `now` float, the dict entry and the per-worker list entry,
    less than the layout before this one (eight-slot records, a set of claims per
    worker). A tombstone reads the claim's `since` rather than holding a (time,
    claim) tuple in the tombstone queue.
    """

    def __init__(self, *, tombstone_ttl_s: float, max_tombstones: int) -> None:
        self.tombstone_ttl_s = tombstone_ttl_s
        self.max_tombstones = max_tombstones
        self._by_kind: dict[str, dict[str, Claim]] = {}
        # The two _Traits each kind's claims share, indexed by `learned`.
        self._traits: dict[str, tuple[_Traits, _Traits]] = {}
        self._held_by_worker: dict[str, _HeldIndex] = {}
        # Held claims learned from replies, kept apart so that expiring idle ones
        # walks only them, not every held claim.
        self._learned = _HeldIndex()
        # Tombstones in the order they were made (each one's `since`). Each record
        # is made once and never revived, so the left end is always the oldest
        # live tombstone unless it was already evicted: popleft is enough to
        # expire and evict.
        self._tombstones: deque[Claim] = deque()

    # -- reading -----------------------------------------------------------

    def lookup(self, kind: str, key: str) -> Claim | None:
        """The record for `key` of `kind` (held or tombstone), or None if unknown."""
        keys = self._by_kind.get(kind)
        return keys.get(key) if keys is not None else None

    def held_by(self, worker: str) -> frozenset[Claim]:
        held = self._held_by_worker.get(worker)
        return frozenset(held.held()) if held is not None else frozenset()

    def held_count(self, worker: str) -> int:
        held = self._held_by_worker.get(worker)
        return held.count if held is not None else 0

    @property
    def held_total(self) -> int:
        return sum(held.count for held in self._held_by_worker.values())

    @property
    def tombstone_count(self) -> int:
        return len(self._tombstones)

    def held_counts_by_kind(self) -> dict[tuple[str, str], int]:
        """(worker, kind) → number of held claims; for metrics."""
        return {
            (worker, kind): count
            for worker, held in self._held_by_worker.items()
            for kind, count in held.by_kind.items()
            if count
        }

    def tombstones(self) -> Iterator[Claim]:
        yield from self._tombstones

    def held(self) -> Iterator[Claim]:
        for held in self._held_by_worker.values():
            yield from held.held()

    # -- changing ----------------------------------------------------------

    def claim(
        self, kind: str, key: str, worker: str, now: float, *, learned: bool = False
    ) -> ClaimRefusal | None:
        """Record that `worker` holds `key`. Returns None when it does (again),
        or the refusal: another worker holds it, or it ended or exited."""
        keys = self._by_kind.get(kind)
        if keys is None:
            keys = self._add_kind(kind)
        existing = keys.get(key)
        if existing is None:
            claim = Claim(self._traits[kind][learned], key, worker, now)
            keys[key] = claim
            held = self._held_by_worker.get(worker)
            if held is None:
                held = self._held_by_worker[worker] = _HeldIndex()
            held.add(claim)
            if learned:
                self._learned.add(claim)
            return None
        if existing.state is _HELD:
            if existing.worker == worker:
                existing.last_used = now
                return None
            return ClaimRefusal("conflict", existing.worker)
        if existing.state is _ENDED:
            return ClaimRefusal("ended")
        return ClaimRefusal("worker_exited")

    def release(self, kind: str, key: str, worker: str, now: float) -> bool:
        """End `key`. False only when another worker holds it (not_holder).

        Releasing a key that already ended, exited, or was never seen is
        accepted (ops are idempotent); an unseen key gets an `ended` tombstone
        so that a late request for it is told the episode ended.
        """
        keys = self._by_kind.get(kind)
        if keys is None:
            keys = self._add_kind(kind)
        existing = keys.get(key)
        if existing is None:
            claim = Claim(self._traits[kind][False], key, worker, now)
            keys[key] = claim
            self._bury(claim, _ENDED, now)
            return True
        if existing.state is not _HELD:
            return True
        if existing.worker != worker:
            return False
        self._end(existing, _ENDED, now)
        return True

    def worker_exited(self, worker: str, now: float) -> int:
        """Turn every claim `worker` holds into a `worker_exited` tombstone.
        Returns how many there were."""
        index = self._held_by_worker.pop(worker, None)
        if index is None:
            return 0
        held = index.held()
        for claim in held:
            self._bury(claim, _EXITED, now)
            traits = claim._traits
            if traits.learned:
                self._learned.dropped(traits.kind)
        return len(held)

    def exit_held(self, kind: str, key: str, now: float) -> bool:
        """Turn one held claim into a `worker_exited` tombstone while its worker runs on
        (the fleet declared this router's incarnation dead: design §10). False when the
        key is not held."""
        claim = self.lookup(kind, key)
        if claim is None or claim.state is not _HELD:
            return False
        self._end(claim, _EXITED, now)
        return True

    def sync(self, worker: str, claims: Iterable[tuple[str, str]], now: float) -> SyncResult:
        """Replace what `worker` holds with `claims` (a complete set).

        Keys it held and no longer lists end; listed keys are claimed under the
        usual rules, so a key another worker holds stays with that worker.
        """
        listed = set(claims)
        index = self._held_by_worker.get(worker)
        before = index.held() if index is not None else []
        dropped = [c for c in before if (c._traits.kind, c.key) not in listed]
        for claim in dropped:
            self._end(claim, _ENDED, now)
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
        while self._tombstones and self._tombstones[0].since <= cutoff:
            self._forget(self._tombstones.popleft())
            gone += 1
        return gone

    def expire_idle_learned(self, now: float, idle_ttl_s: float) -> list[Claim]:
        """End learned claims unused for `idle_ttl_s` (their workers never release);
        returns them."""
        cutoff = now - idle_ttl_s
        idle = [c for c in self._learned.claims if c.state is _HELD and c.last_used <= cutoff]
        for claim in idle:
            self._end(claim, _ENDED, now)
        return idle

    def renew_learned(self, now: float) -> None:
        """Every held learned claim counts as used at `now` (after a journal's replay:
        uses are not journaled, so a claim's last use before the restart is unknown)."""
        for claim in self._learned.claims:
            if claim.state is _HELD:
                claim.last_used = now

    def restore_tombstone(
        self, kind: str, key: str, worker: str, state: ClaimState, made_at: float
    ) -> None:
        """Put back a tombstone from a journal (it must be in time order with the
        others restored). A key already present is left as it is."""
        keys = self._by_kind.get(kind)
        if keys is None:
            keys = self._add_kind(kind)
        if key in keys or state is _HELD:
            return
        claim = Claim(self._traits[kind][False], key, worker, made_at)
        keys[key] = claim
        self._bury(claim, state, made_at)

    # -- internals ---------------------------------------------------------

    def _add_kind(self, kind: str) -> dict[str, Claim]:
        self._traits[kind] = (_Traits(kind, learned=False), _Traits(kind, learned=True))
        keys: dict[str, Claim] = {}
        self._by_kind[kind] = keys
        return keys

    def forget_held(self, kind: str, key: str, worker: str) -> bool:
        """Drop `worker`'s held claim of `key` as if it had never been made: no
        tombstone (the claims directory refused it, design §10: another router holds
        it, or it ended there, and a local tombstone would answer for it wrongly).
        False, changing nothing, when `worker` does not hold it."""
        claim = self.lookup(kind, key)
        if claim is None or claim.state is not _HELD or claim.worker != worker:
            return False
        del self._by_kind[kind][key]
        claim.state = _ENDED  # out of the held indexes, which keep it until their next pass
        self._unhold(claim)
        return True

    def _end(self, claim: Claim, state: ClaimState, now: float) -> None:
        """Bury a held claim and take it out of the held indexes."""
        self._bury(claim, state, now)
        self._unhold(claim)

    def _unhold(self, claim: Claim) -> None:
        """Take a claim no longer held (its state says so) out of the held indexes."""
        kind = claim._traits.kind
        if claim._traits.learned:
            self._learned.dropped(kind)
        held = self._held_by_worker[claim.worker]
        if held.count == 1:
            del self._held_by_worker[claim.worker]
        else:
            held.dropped(kind)

    def _bury(self, claim: Claim, state: ClaimState, now: float) -> None:
        claim.state = state
        claim.since = now
        self._tombstones.append(claim)
        while len(self._tombstones) > self.max_tombstones:
            self._forget(self._tombstones.popleft())

    def _forget(self, claim: Claim) -> None:
        keys = self._by_kind.get(claim._traits.kind)
        if keys is not None and keys.get(claim.key) is claim:
            del keys[claim.key]
