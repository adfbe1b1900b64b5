"""The lookup cache: answers a key's lookup again without Redis, while Redis can say when
it changed (design §10: "a cached negative answer is only kept while the directory can
invalidate it").

Absent (no record, in a settled fleet), ended and dead answers are kept until Redis says
the owner record changed. A held answer is kept too, but only while its owner's lease
surely runs (the lease left that the lookup read, counted from when the lookup went
out): its owner's liveness lives in other keys (membership, certificates), which can
change without the record changing. Kept that long, a held answer is never what makes
a request wrong: a release, a takeover or a dead owner's tombstone TTL changes the
record (and Redis says so); an owner that died meanwhile answers nothing (503
`owner_unreachable`, as it would with a fresh lookup while its lease runs); one paused
past its lease refuses to serve (503) on its own clock, so no 200 ever follows a 410
given elsewhere; and a hop that fails drops the entry (`forget`).

Redis client tracking tells of every change to a key the lookup connection read
(`router/directory/tracking.py`); the cache is on only while that channel is live, and
emptied whenever it or the lookup connection was lost.

A link to Redis that is cut without a close (no FIN, no RST) would leave the cache on
while changes made elsewhere never arrive: the channel is pinged every 100 ms, and
the cache answers only while something came on it within `max_silence_s` (a pong
comes after every invalidation Redis sent before it, on the same connection), so a
silent channel turns the cache off within that.

The race of client-side caching: an invalidation may arrive on its channel before the
reply of a lookup that was already in flight when the key changed. So each store
names the cache's generation when its lookup went out, and a batch whose lookup saw
an invalidation (or a loss) during its flight stores nothing. Only an owner record's
invalidation counts (given `owner_prefix`): the lookup script reads the membership and
the fleet record too, which every router's heartbeat rewrites every few seconds, and
no kept answer depends on those after its lookup (a held one is kept within the lease
that lookup read). An incarnation's worker table counts too (given `workers_prefix`):
a held answer that names the worker to forward to straight (shape B) depends on it,
and is dropped when that table changes (a worker lost, exited, replaced). Pure: no I/O.
"""

from __future__ import annotations

from router.directory.records import KeyLookup, LookupState

_NEVER = float("inf")

# 300 ms: three pings missed. A cut link stops cached answers that soon; a busy loop
# that reads a pong late only sends a few lookups to Redis meanwhile.
DEFAULT_MAX_SILENCE_S = 0.3
# How much sooner than the lease the lookup read a held answer is given up: as much as a
# router gives up serving its own keys before its lease (router/fleet/link.py), which
# covers the two clocks' drift over a lease.
HELD_MARGIN_S = 0.2
# 100,000 keys: a burst of unknown keys (a scan with made-up tokens) cannot grow the
# cache without bound; past it, new answers are not kept.
DEFAULT_MAX_ENTRIES = 100_000

_KEPT_UNTIL_CHANGED = (LookupState.ABSENT, LookupState.ENDED, LookupState.DEAD)


class LookupCache:
    """Lookup answers by owner key, kept while the directory can invalidate them."""

    __slots__ = (
        "_entries",
        "_heard_at",
        "_held_margin_s",
        "_max_entries",
        "_max_silence_s",
        "_on",
        "_owner_prefix",
        "_workers_prefix",
        "generation",
        "lease_ms",
    )

    def __init__(
        self,
        lease_ms: int,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_silence_s: float = DEFAULT_MAX_SILENCE_S,
        owner_prefix: str = "",
        workers_prefix: str | None = None,
    ) -> None:
        # owner key -> (the answer, until when it may be given: loop time)
        self._entries: dict[str, tuple[KeyLookup, float]] = {}
        self._max_entries = max_entries
        self._max_silence_s = max_silence_s
        self._heard_at = float("-inf")  # when the channel last delivered anything
        self._on = False
        self.generation = 0  # bumped by every owner key's invalidation, loss and switch
        # The owner records' keys start with it (`KeyLayout.owner_prefix`); "": every
        # invalidated key counts as one.
        self._owner_prefix = owner_prefix
        # The worker tables' keys start with it (`KeyLayout.workers_prefix`); None: no
        # answer names a worker.
        self._workers_prefix = workers_prefix
        self.lease_ms = lease_ms
        self._held_margin_s = min(HELD_MARGIN_S, lease_ms / 10_000)

    @property
    def on(self) -> bool:
        return self._on

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, owner_key: str) -> bool:
        return owner_key in self._entries

    def heard(self, now: float) -> None:
        """The invalidation channel delivered something (a message, a pong) at `now`."""
        self._heard_at = now

    def get(self, owner_key: str, now: float) -> KeyLookup | None:
        """The kept answer for `owner_key`; None when there is none, or when the channel
        has been silent past `max_silence_s` (its invalidations may be held up)."""
        if not self._on or now - self._heard_at > self._max_silence_s:
            return None
        entry = self._entries.get(owner_key)
        if entry is None:
            return None
        if now >= entry[1]:  # a held answer past its owner's lease: asked again
            del self._entries[owner_key]
            return None
        return entry[0]

    def store(
        self, owner_keys: list[str], lookups: list[KeyLookup], generation: int, sent_at: float
    ) -> int:
        """Keep the answers worth keeping of one lookup that went out at `generation`,
        at loop time `sent_at`; nothing if anything was invalidated meanwhile. Returns
        how many were kept."""
        if not self._on or generation != self.generation:
            return 0
        kept = 0
        entries = self._entries
        for owner_key, lookup in zip(owner_keys, lookups, strict=True):
            if len(entries) >= self._max_entries:
                break
            result = lookup.result
            state = result.state
            if state is LookupState.HELD:
                # The lease ran that long from when the directory answered, which was
                # no sooner than `sent_at`.
                until = sent_at + result.lease_left_ms / 1000 - self._held_margin_s
                if until <= sent_at:
                    continue  # within a grace, or about to lapse: asked every time
            elif state not in _KEPT_UNTIL_CHANGED:
                continue
            elif state is LookupState.ABSENT and lookup.fleet.repopulating(self.lease_ms):
                continue  # an absent record proves nothing yet: 503, asked again
            else:
                until = _NEVER
            entries[owner_key] = (lookup, until)
            kept += 1
        return kept

    def forget(self, owner_key: str) -> None:
        """Drop the answer for `owner_key` (a hop to the owner it names failed)."""
        self._entries.pop(owner_key, None)

    def invalidate(self, owner_keys: list[str] | None) -> None:
        """Redis says these keys changed; None: every key (FLUSHALL, FLUSHDB)."""
        if owner_keys is None:
            self.generation += 1
            self._entries.clear()
            return
        prefix = self._owner_prefix
        entries = self._entries
        for owner_key in owner_keys:
            if owner_key.startswith(prefix):
                self.generation += 1
                entries.pop(owner_key, None)
            elif self._workers_prefix is not None and owner_key.startswith(self._workers_prefix):
                self.generation += 1
                self._drop_workers_of(owner_key[len(self._workers_prefix) :])

    def _drop_workers_of(self, incarnation: str) -> None:
        """Drop the answers that name a worker of `incarnation` (`"<router>:<epoch>"`),
        whose worker table changed: rare (a hello, a loss, an exit), so a scan."""
        entries = self._entries
        stale = [
            owner_key
            for owner_key, (lookup, _until) in entries.items()
            if lookup.result.worker is not None
            and (owner := lookup.result.owner) is not None
            and f"{owner.router_id}:{owner.epoch}" == incarnation
        ]
        for owner_key in stale:
            del entries[owner_key]

    def switch_on(self) -> None:
        """The invalidation channel and the tracked lookup connection are both live."""
        self.generation += 1
        self._entries.clear()
        self._on = True

    def switch_off(self) -> None:
        """Either was lost: nothing kept can be invalidated any more."""
        self.generation += 1
        self._entries.clear()
        self._on = False
