"""Keys that name their router (design §10): where a prefixed key's owner listens, from
the membership alone.

`PrefixRoutes` is built from each membership read (every heartbeat interval): the live
incarnations of the other routers, each until its lease as the directory gave it in
that read, counted on this router's clock from before the read was sent (so never past
the lease). A key whose prefix (`router.protocol.key_prefix`) names one of them is
forwarded to its peer listener with no lookup; one naming anything else (an earlier
epoch, this router, a router that is not a member, a lease run out) is looked up as any
key is. A hop that fails drops its incarnation until the next read.

Pure: no I/O; times are passed in.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.directory.records import Member
from router.protocol.key_prefix import split_key_prefix


class PrefixRoutes:
    """The other routers' live incarnations, by (router id, epoch), from the membership."""

    __slots__ = ("_live", "_members", "_self_id")

    def __init__(self, self_id: str) -> None:
        self._self_id = self_id
        # (router id, epoch) -> (the member, until when on this router's clock).
        self._live: dict[tuple[str, int], tuple[Member, float]] = {}
        self._members: frozenset[str] = frozenset()  # every other member's id

    def update(self, members: Iterable[Member], now_ms: int, sent_at: float) -> None:
        """A membership read: `now_ms` the directory's time in it, `sent_at` this router's
        clock when the read was sent."""
        live: dict[tuple[str, int], tuple[Member, float]] = {}
        others: set[str] = set()
        for member in members:
            if member.router_id == self._self_id:
                continue
            others.add(member.router_id)
            left_ms = member.lease_deadline_ms - now_ms
            if left_ms > 0 and member.peer:
                live[member.router_id, member.epoch] = (member, sent_at + left_ms / 1000)
        self._live = live
        self._members = frozenset(others)

    def owner(self, key: str, now: float) -> Member | None:
        """The live member a key's prefix names at `now`, if any."""
        if not self._live:
            return None
        named = split_key_prefix(key)
        if named is None:
            return None
        found = self._live.get(named)
        if found is None or now >= found[1]:
            return None
        return found[0]

    def drop(self, key: str) -> None:
        """A hop to the incarnation `key` names failed: not used again until the next
        membership read (which shows whether it is still that router's)."""
        named = split_key_prefix(key)
        if named is not None:
            self._live.pop(named, None)

    def other_router(self, key: str) -> str | None:
        """The id of another member `key`'s prefix names, whatever its epoch: this router
        must not claim such a key (the fleet routes it to that router)."""
        named = split_key_prefix(key)
        if named is None or named[0] not in self._members:
            return None
        return named[0]
