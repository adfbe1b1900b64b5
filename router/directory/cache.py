"""The lookup cache: answers a key's lookup again without Redis, while Redis can say when
it changed (design §10: "a cached negative answer is only kept while the directory can
invalidate it").

Only answers that Redis invalidates by the owner record's own key are kept: absent
(no record, in a settled fleet), ended and dead. A held answer is never kept: its
owner's liveness lives in other keys (membership, certificates) and changes without
the record changing. Redis client tracking tells of every change to a key the lookup
connection read (`router/directory/tracking.py`); the cache is on only while that
channel is live, and emptied whenever it or the lookup connection was lost.

A link to Redis that is cut without a close (no FIN, no RST) would leave the cache on
while changes made elsewhere never arrive: the channel is pinged every 100 ms, and
the cache answers only while something came on it within `max_silence_s` (a pong
comes after every invalidation Redis sent before it, on the same connection), so a
silent channel turns the cache off within that.

The race of client-side caching: an invalidation may arrive on its channel before the
reply of a lookup that was already in flight when the key changed. So each store
names the cache's generation when its lookup went out, and a batch whose lookup saw
an invalidation (or a loss) during its flight stores nothing. Pure: no I/O.
"""

from __future__ import annotations

from router.directory.records import KeyLookup, LookupState

# 300 ms: three pings missed. A cut link stops cached answers that soon; a busy loop
# that reads a pong late only sends a few lookups to Redis meanwhile.
DEFAULT_MAX_SILENCE_S = 0.3
# 100,000 keys: a burst of unknown keys (a scan with made-up tokens) cannot grow the
# cache without bound; past it, new answers are not kept.
DEFAULT_MAX_ENTRIES = 100_000

_KEPT = (LookupState.ABSENT, LookupState.ENDED, LookupState.DEAD)


class LookupCache:
    """Lookup answers by owner key, kept while the directory can invalidate them."""

    __slots__ = (
        "_entries",
        "_heard_at",
        "_max_entries",
        "_max_silence_s",
        "_on",
        "generation",
        "lease_ms",
    )

    def __init__(
        self,
        lease_ms: int,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_silence_s: float = DEFAULT_MAX_SILENCE_S,
    ) -> None:
        self._entries: dict[str, KeyLookup] = {}
        self._max_entries = max_entries
        self._max_silence_s = max_silence_s
        self._heard_at = float("-inf")  # when the channel last delivered anything
        self._on = False
        self.generation = 0  # bumped by every invalidation, loss and switch
        self.lease_ms = lease_ms

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
        return self._entries.get(owner_key)

    def store(self, owner_keys: list[str], lookups: list[KeyLookup], generation: int) -> int:
        """Keep the answers worth keeping of one lookup that went out at `generation`;
        nothing if anything was invalidated meanwhile. Returns how many were kept."""
        if not self._on or generation != self.generation:
            return 0
        kept = 0
        entries = self._entries
        for owner_key, lookup in zip(owner_keys, lookups, strict=True):
            state = lookup.result.state
            if state not in _KEPT or len(entries) >= self._max_entries:
                continue
            if state is LookupState.ABSENT and lookup.fleet.repopulating(self.lease_ms):
                continue  # an absent record proves nothing yet: 503, asked again
            entries[owner_key] = lookup
            kept += 1
        return kept

    def invalidate(self, owner_keys: list[str] | None) -> None:
        """Redis says these keys changed; None: every key (FLUSHALL, FLUSHDB)."""
        self.generation += 1
        if owner_keys is None:
            self._entries.clear()
            return
        for owner_key in owner_keys:
            self._entries.pop(owner_key, None)

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
