"""The claims directory (design §10): many routers sharing one claim view on Redis.

The data and its keys (`keys`, `records`, `settings`), what a lookup means for a
request (`meaning`), the circuit breaker, the batcher's pure half and the lookup cache
are pure; the client (`Directory`), its Redis connection, its scripts, the tracked
lookup connection, the heartbeat loop and `cancel_and_wait` do I/O. The fleet's link
(`router/fleet/`) is what the rest of the router uses of it.
"""

from __future__ import annotations

from router.directory.breaker import BreakerState, CircuitBreaker
from router.directory.cache import LookupCache
from router.directory.cancelling import cancel_and_wait
from router.directory.client import Directory, SessionKey
from router.directory.connect import SentinelTarget, open_redis, redis_url, sentinel_nodes
from router.directory.errors import (
    DirectoryError,
    DirectoryFenced,
    DirectoryReplyError,
    DirectoryTimeout,
    DirectoryUnavailable,
)
from router.directory.gate import ClaimGate
from router.directory.heartbeat import HeartbeatLoop
from router.directory.keys import KeyLayout
from router.directory.meaning import WITHOUT_AN_ANSWER, RequestMeaning, meaning_of
from router.directory.records import (
    ClaimOutcome,
    ClaimVerdict,
    FleetView,
    Heartbeat,
    KeyLookup,
    LookupBatch,
    LookupResult,
    LookupState,
    Member,
    Membership,
    Owner,
    OwnerState,
    OwnerWorker,
    Registration,
    ReleaseVerdict,
    Standing,
    SweepReport,
)
from router.directory.scripts import ScriptRunner
from router.directory.settings import DirectorySettings
from router.directory.tracking import TrackedLookups

__all__ = [
    "WITHOUT_AN_ANSWER",
    "BreakerState",
    "CircuitBreaker",
    "ClaimGate",
    "ClaimOutcome",
    "ClaimVerdict",
    "Directory",
    "DirectoryError",
    "DirectoryFenced",
    "DirectoryReplyError",
    "DirectorySettings",
    "DirectoryTimeout",
    "DirectoryUnavailable",
    "FleetView",
    "Heartbeat",
    "HeartbeatLoop",
    "KeyLayout",
    "KeyLookup",
    "LookupBatch",
    "LookupCache",
    "LookupResult",
    "LookupState",
    "Member",
    "Membership",
    "Owner",
    "OwnerState",
    "OwnerWorker",
    "Registration",
    "ReleaseVerdict",
    "RequestMeaning",
    "ScriptRunner",
    "SentinelTarget",
    "SessionKey",
    "Standing",
    "SweepReport",
    "TrackedLookups",
    "cancel_and_wait",
    "meaning_of",
    "open_redis",
    "redis_url",
    "sentinel_nodes",
]
