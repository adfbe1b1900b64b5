"""The directory's records and the scripts' answers as typed values (design §10).

The Lua scripts beside this module answer flat arrays of strings and integers; the
decoders here turn them into frozen dataclasses and enums, and refuse anything else
with `DirectoryReplyError`. Times are the directory's own milliseconds (Redis `TIME`
inside the scripts), never a router's clock. Pure: no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from router.directory.errors import DirectoryReplyError

# What redis-py hands back for a script's array reply, with decode_responses on.
Reply = Sequence[object]


class OwnerState(enum.Enum):
    """An owner record's state."""

    HELD = "h"
    ENDED = "e"


@dataclass(frozen=True, slots=True)
class Owner:
    """Who claimed a key: a router incarnation, and whether the claim ended."""

    router_id: str
    epoch: int
    state: OwnerState


class LookupState(enum.Enum):
    """What the directory knows about a key."""

    HELD = "held"  # held by an incarnation whose lease is alive
    ENDED = "ended"  # released: the record stays for the tombstone TTL
    DEAD = "dead"  # held by an incarnation with a death certificate or a lapsed lease
    ABSENT = "absent"  # no record


# Items per key in the lookup script's answer.
LOOKUP_ITEMS = 6

_LOOKUP_CODES = {"h": LookupState.HELD, "e": LookupState.ENDED, "x": LookupState.DEAD}


@dataclass(frozen=True, slots=True)
class OwnerWorker:
    """The worker process that holds a key, as its router published it for routers on
    the same host (design §10, shape B): where it listens, and the boot it said hello
    with (sent in `X-Episode-Router-Boot`, so another process on that address refuses)."""

    url: str
    boot: str


@dataclass(frozen=True, slots=True)
class LookupResult:
    """One key's lookup: its state, its owner record (None when absent) and, for a key
    held by a live incarnation, that router's peer address and how long its lease ran
    from the moment the directory answered (ms; 0 within a grace that keeps a lapsed
    lease alive); and the owner's worker, when that router published it for this host."""

    state: LookupState
    owner: Owner | None = None
    peer: str | None = None
    lease_left_ms: int = 0
    worker: OwnerWorker | None = None


ABSENT = LookupResult(LookupState.ABSENT)


@dataclass(frozen=True, slots=True)
class FleetView:
    """The fleet record as one script call saw it, in the directory's milliseconds.

    `since` is when the directory first held this fleet (again, after a loss of data);
    `grace_until` is the end of a grace in which no lapsed lease counts as dead (after
    a spell in which no router could check in, or a loss of data)."""

    now_ms: int
    since_ms: int
    grace_until_ms: int

    def repopulating(self, lease_ms: int) -> bool:
        """Whether the fleet record is younger than one lease: the routers may not all
        have written their claims back yet, so an absent record proves nothing."""
        return self.now_ms < self.since_ms + lease_ms


@dataclass(frozen=True, slots=True)
class LookupBatch:
    """One lookup script call: the fleet as it saw it, and a result per key asked."""

    fleet: FleetView
    results: tuple[LookupResult, ...]


class Standing(enum.Enum):
    """A router incarnation's standing in the directory, as a write script found it."""

    OK = "ok"  # current epoch, lease alive (or lapsed within the fleet's grace)
    FENCED = "fenced"  # a newer epoch, a death certificate, or a lease lapsed
    LOST = "lost"  # no membership and no certificate: the directory lost its data


class ClaimVerdict(enum.Enum):
    """What became of one key of a claim batch (design §3's claim refusals)."""

    CLAIMED = "ok"
    CONFLICT = "conflict"  # another live incarnation holds it
    ENDED = "ended"  # its record ended: not claimable while the tombstone lives
    EXITED = "worker_exited"  # held by a dead incarnation: likewise


_CLAIM_CODES = {verdict.value: verdict for verdict in ClaimVerdict}


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    verdict: ClaimVerdict
    holder: str | None = None  # the live holder's router id, for CONFLICT


class ReleaseVerdict(enum.Enum):
    RELEASED = "ok"  # ended now, or already ended, or never recorded
    NOT_HOLDER = "not_holder"  # another incarnation holds it


_RELEASE_CODES = {verdict.value: verdict for verdict in ReleaseVerdict}


@dataclass(frozen=True, slots=True)
class Registration:
    """A register script's answer: the new incarnation and its lease."""

    epoch: int
    lease_deadline_ms: int
    fleet: FleetView


@dataclass(frozen=True, slots=True)
class Heartbeat:
    standing: Standing
    lease_deadline_ms: int  # the new deadline when OK, else 0
    now_ms: int


@dataclass(frozen=True, slots=True)
class Member:
    """A membership record: a router's current incarnation, lease and peer address."""

    router_id: str
    epoch: int
    lease_deadline_ms: int
    peer: str


@dataclass(frozen=True, slots=True)
class Membership:
    """The membership as one read saw it, with the directory's time of that read."""

    members: tuple[Member, ...]
    now_ms: int


@dataclass(frozen=True, slots=True)
class SweepReport:
    declared_dead: int  # incarnations whose lease lapsed, certified dead by this sweep
    expired: int  # owner records of dead incarnations given their tombstone TTL


def _integer(value: object) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str | bytes) and value.isdigit():
        return int(value)
    raise DirectoryReplyError(f"expected an integer from the directory, got {value!r}")


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    raise DirectoryReplyError(f"expected a string from the directory, got {value!r}")


def _array(reply: object, at_least: int) -> Reply:
    if not isinstance(reply, list) or len(reply) < at_least:
        raise DirectoryReplyError(f"expected an array of {at_least}+ from the directory: {reply!r}")
    return reply


def _standing(value: object) -> Standing:
    try:
        return Standing(_text(value))
    except ValueError:
        raise DirectoryReplyError(f"unknown standing {value!r}") from None


def decode_fleet(reply: Reply, at: int = 0) -> FleetView:
    return FleetView(_integer(reply[at]), _integer(reply[at + 1]), _integer(reply[at + 2]))


def decode_lookup(reply: object, count: int) -> LookupBatch:
    """The lookup script's answer for `count` keys: `[now, since, grace]` then
    `code, router, epoch, peer, lease left, worker` per key (code `a` absent, `h`,
    `e`, `x`; the worker `"<url> <boot>"` or empty)."""
    items = _array(reply, 3 + LOOKUP_ITEMS * count)
    if len(items) != 3 + LOOKUP_ITEMS * count:
        raise DirectoryReplyError(f"a lookup of {count} keys answered {len(items)} items")
    results: list[LookupResult] = []
    for at in range(3, len(items), LOOKUP_ITEMS):
        code = items[at]
        if code == "a":
            results.append(ABSENT)
            continue
        state = _LOOKUP_CODES.get(_text(code))
        if state is None:
            raise DirectoryReplyError(f"unknown lookup code {code!r}")
        stored = OwnerState.ENDED if state is LookupState.ENDED else OwnerState.HELD
        owner = Owner(_text(items[at + 1]), _integer(items[at + 2]), stored)
        if state is LookupState.HELD:
            peer, left = _text(items[at + 3]), _integer(items[at + 4])
            worker = _text(items[at + 5])
            results.append(
                LookupResult(state, owner, peer, left, decode_worker(worker) if worker else None)
            )
        else:
            results.append(LookupResult(state, owner))
    return LookupBatch(decode_fleet(items), tuple(results))


def decode_worker(value: str) -> OwnerWorker:
    """A published worker: `"<url> <boot>"` (neither holds a space)."""
    url, _, boot = value.partition(" ")
    if not url or not boot or " " in boot:
        raise DirectoryReplyError(f"a malformed worker record: {value!r}")
    return OwnerWorker(url, boot)


def encode_worker(url: str, boot: str) -> str:
    """What the workers script stores for a worker (`decode_worker` reads it back)."""
    return f"{url} {boot}"


def decode_claims(reply: object, count: int) -> tuple[Standing, tuple[ClaimOutcome, ...]]:
    """The claim script's answer: the caller's standing, then `code, holder` per key
    (no per-key items unless the standing is OK: nothing was written)."""
    items = _array(reply, 1)
    standing = _standing(items[0])
    if standing is not Standing.OK:
        return standing, ()
    if len(items) != 1 + 2 * count:
        raise DirectoryReplyError(f"a claim of {count} keys answered {len(items)} items")
    outcomes: list[ClaimOutcome] = []
    for at in range(1, len(items), 2):
        verdict = _CLAIM_CODES.get(_text(items[at]))
        if verdict is None:
            raise DirectoryReplyError(f"unknown claim verdict {items[at]!r}")
        holder = _text(items[at + 1]) or None
        outcomes.append(ClaimOutcome(verdict, holder))
    return standing, tuple(outcomes)


def decode_releases(reply: object, count: int) -> tuple[Standing, tuple[ReleaseVerdict, ...]]:
    """The release script's answer: the caller's standing, then a verdict per key."""
    items = _array(reply, 1)
    standing = _standing(items[0])
    if standing is not Standing.OK:
        return standing, ()
    if len(items) != 1 + count:
        raise DirectoryReplyError(f"a release of {count} keys answered {len(items)} items")
    verdicts: list[ReleaseVerdict] = []
    for item in items[1:]:
        verdict = _RELEASE_CODES.get(_text(item))
        if verdict is None:
            raise DirectoryReplyError(f"unknown release verdict {item!r}")
        verdicts.append(verdict)
    return standing, tuple(verdicts)


def decode_standing(reply: object) -> Standing:
    """`[standing]`: the workers script's answer."""
    return _standing(_array(reply, 1)[0])


def decode_registration(reply: object) -> Registration:
    """`[epoch, lease deadline, now, since, grace]`."""
    items = _array(reply, 5)
    return Registration(_integer(items[0]), _integer(items[1]), decode_fleet(items, 2))


def decode_heartbeat(reply: object) -> Heartbeat:
    """`[standing, lease deadline, now]`."""
    items = _array(reply, 3)
    return Heartbeat(_standing(items[0]), _integer(items[1]), _integer(items[2]))


def decode_member(router_id: str, value: str) -> Member:
    """A `{p}:members` field: `"<epoch> <deadline ms> <peer address>"`."""
    epoch, deadline, peer = [*value.split(" ", 2), "", ""][:3]
    if not (epoch.isdigit() and deadline.isdigit()):
        raise DirectoryReplyError(f"a malformed membership record for {router_id!r}: {value!r}")
    return Member(router_id, int(epoch), int(deadline), peer)


def decode_sweep(reply: object) -> SweepReport:
    """`[declared dead, records expired]`."""
    items = _array(reply, 2)
    return SweepReport(_integer(items[0]), _integer(items[1]))


def decode_remaining(reply: object) -> int:
    """The retire script's answer: how many held records still wait for their TTL."""
    return _integer(reply)


@dataclass(frozen=True, slots=True)
class KeyLookup:
    """One key's lookup with the fleet as the same script call saw it."""

    result: LookupResult
    fleet: FleetView
