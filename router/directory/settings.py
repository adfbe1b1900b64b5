"""The directory client's settings (design §10's `directory:` keys), pure.

The service builds them from the config's `directory:` section and the peer address
the router advertises (router.service.settings). Every default carries its reason.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.directory.batching import DEFAULT_BATCH_LIMIT
from router.directory.keys import DEFAULT_PREFIX, check_name

# The defaults, named: the config's `directory:` section takes them from here.
DEFAULT_LEASE_TTL_S = 10.0
DEFAULT_LOOKUP_TIMEOUT_MS = 50
DEFAULT_CLAIM_TIMEOUT_S = 2.0
DEFAULT_TOMBSTONE_TTL_S = 3600.0


@dataclass(frozen=True, slots=True)
class DirectorySettings:
    """How one router incarnation uses the directory."""

    router_id: str
    peer_address: str = ""  # where peers reach this router's peer listener; none yet
    prefix: str = DEFAULT_PREFIX
    # 10 s: a dead pod's episodes turn 410 at most one lease after its last heartbeat,
    # while a GC pause or a slow Redis of a few seconds fences nobody.
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    # 50 ms: a miss waits at most this for its owner before 503 `recovering`; a local
    # Redis answers in well under a millisecond.
    lookup_timeout_ms: int = DEFAULT_LOOKUP_TIMEOUT_MS
    # 2 s: a worker waits this long for its claim before `directory_unavailable`; writes
    # (register, heartbeat, retire, sweep) use the same deadline.
    claim_timeout_s: float = DEFAULT_CLAIM_TIMEOUT_S
    # One hour, as claims.tombstone_ttl_s: records of ended keys and death certificates
    # stay that long, so 410 stays exact fleet-wide as long as one router remembers it.
    tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S
    # Up to this many keys per script call (see batching.py).
    batch_limit: int = DEFAULT_BATCH_LIMIT
    # Replicas that must hold a claim before it is acknowledged (WAIT): 0 for a
    # standalone Redis, which has none to wait for; 1 under Sentinel, so a failover never
    # loses a claim a worker was told about (the wiring sets it from the config's shape).
    min_replicas: int = 0
    # 1,000 records a call: a dead router's records get their TTL a chunk at a time, each
    # chunk about a millisecond of Redis time.
    reap_chunk: int = 1000
    # Off by default: with it, the hello reply offers this incarnation's key prefix, and
    # keys that start with a live peer's are routed from the membership (design §10).
    key_prefixes: bool = False
    # The host (and network) this router runs on, as `router.fleet.locality` names it;
    # "" for none. Routers with the same forward straight to each other's workers
    # (design §10, shape B): their worker table is published, and lookups hand them a
    # key's worker.
    host: str = ""

    def __post_init__(self) -> None:
        check_name("router_id", self.router_id)
        if " " in self.peer_address or " " in self.host:
            raise ValueError(f"a peer address has no spaces: {self.peer_address!r}")
        if self.lease_ttl_s <= 0 or self.lookup_timeout_ms <= 0 or self.claim_timeout_s <= 0:
            raise ValueError("the lease, lookup timeout and claim timeout are positive")
        if self.min_replicas < 0:
            raise ValueError("min_replicas is 0 or more")
        if self.tombstone_ttl_s <= 0 or self.batch_limit < 1 or self.reap_chunk < 1:
            raise ValueError("the tombstone TTL, batch limit and reap chunk are positive")

    @property
    def lease_ms(self) -> int:
        return round(self.lease_ttl_s * 1000)

    @property
    def quiet_ms(self) -> int:
        """No heartbeat from any router for half a lease means the directory (or every
        router's link to it) was out: the fleet's grace starts. The heartbeat comes
        every third of a lease, so one late beat does not start it."""
        return self.lease_ms // 2

    @property
    def heartbeat_interval_s(self) -> float:
        """A third of the lease: two beats may be lost before the lease lapses."""
        return self.lease_ttl_s / 3

    @property
    def tombstone_ms(self) -> int:
        return round(self.tombstone_ttl_s * 1000)
