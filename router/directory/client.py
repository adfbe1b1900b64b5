"""The directory client: one router incarnation's calls to the claims directory (design §10).

`Directory` runs the scripts of `scripts/` on a redis-py asyncio client: every call
under a deadline (`asyncio.timeout`) and behind a circuit breaker, lookups and
claims of one loop turn batched into one script call each. It holds the
incarnation's epoch once `register()` returned it. It decides nothing about
requests: `meaning_of` (pure) does, from what `lookup_one` returns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ReadOnlyError, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from router.directory.batcher import Batcher
from router.directory.breaker import CircuitBreaker
from router.directory.cache import LookupCache
from router.directory.errors import (
    DirectoryFenced,
    DirectoryReplyError,
    DirectoryTimeout,
    DirectoryUnavailable,
)
from router.directory.keys import KeyLayout
from router.directory.records import (
    ClaimOutcome,
    Heartbeat,
    KeyLookup,
    LookupBatch,
    Member,
    Membership,
    Registration,
    ReleaseVerdict,
    Standing,
    SweepReport,
    decode_claims,
    decode_heartbeat,
    decode_lookup,
    decode_member,
    decode_registration,
    decode_releases,
    decode_remaining,
    decode_standing,
    decode_sweep,
)
from router.directory.scripts import Script, ScriptRunner
from router.directory.settings import DirectorySettings
from router.directory.tracking import TrackedLookups

# A key as the router names it: (kind, key).
SessionKey = tuple[str, str]
# A key to claim, with a reference to the worker process that will hold it ("" for none:
# see `worker_reference`).
ClaimKey = tuple[str, str, str]


class Directory:
    """The claims directory as one router incarnation sees it.

    Every method raises `DirectoryTimeout` past its deadline, `DirectoryUnavailable`
    when Redis cannot be reached or the breaker is open, `DirectoryReplyError` for an
    answer the scripts never give; writes raise `DirectoryFenced` when the directory
    refuses this incarnation (nothing was written then).
    """

    def __init__(
        self,
        redis: Redis,
        settings: DirectorySettings,
        *,
        breaker: CircuitBreaker | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracking: TrackedLookups | None = None,
    ) -> None:
        self.settings = settings
        self.layout = KeyLayout(settings.prefix)
        self.epoch: int | None = None  # set by register()
        self._redis = redis
        self._scripts = ScriptRunner()
        self._breaker = breaker if breaker is not None else CircuitBreaker()
        self._clock = clock
        # With tracking, lookups go over its tracked connection while it is up, and
        # lookup_one answers from its cache (absent, ended and dead answers only).
        self._tracking = tracking
        self._lookups: Batcher[SessionKey, KeyLookup] = Batcher(
            "lookup",
            self._lookup_batch,
            settings.lookup_timeout_ms / 1000,
            settings.batch_limit,
            start=self._start_tracked_lookup,
        )
        self._claims: Batcher[ClaimKey, ClaimOutcome] = Batcher(
            "claim", self._claim_within, settings.claim_timeout_s, settings.batch_limit
        )
        self._releases: Batcher[SessionKey, ReleaseVerdict] = Batcher(
            "release", self._release_within, settings.claim_timeout_s, settings.batch_limit
        )

    @property
    def breaker(self) -> CircuitBreaker:
        return self._breaker

    async def load_scripts(self) -> None:
        """SCRIPT LOAD every script now (calls load a missing one themselves)."""
        await self._guarded(self._scripts.load_all(self._redis), self.settings.claim_timeout_s)

    async def register(self) -> Registration:
        """Start a new incarnation: the epoch is bumped, the lease starts, the
        previous incarnation of this router id is certified dead."""
        s = self.settings
        reply = await self._run(
            Script.REGISTER,
            (),
            (s.router_id, s.peer_address, s.lease_ms, s.quiet_ms, s.tombstone_ms),
            s.claim_timeout_s,
        )
        registration = decode_registration(reply)
        self.epoch = registration.epoch
        return registration

    async def heartbeat(self) -> Heartbeat:
        """Extend the lease; the answer says FENCED or LOST when it was not extended."""
        s = self.settings
        args = (s.router_id, self._epoch(), s.lease_ms, s.quiet_ms)
        return decode_heartbeat(await self._run(Script.HEARTBEAT, (), args, s.claim_timeout_s))

    async def claim(
        self, keys: Sequence[SessionKey], workers: Sequence[str] = ()
    ) -> tuple[ClaimOutcome, ...]:
        """Write owner records for `keys` (one script call), each for the worker process
        its item of `workers` names (none when empty); an outcome per key."""
        named = workers or [""] * len(keys)
        triples = [(kind, key, worker) for (kind, key), worker in zip(keys, named, strict=True)]
        return await self._claim_within(triples, self.settings.claim_timeout_s)

    async def release(self, keys: Sequence[SessionKey]) -> tuple[ReleaseVerdict, ...]:
        """Mark this incarnation's records of `keys` ended (one script call)."""
        return await self._release_within(keys, self.settings.claim_timeout_s)

    async def claim_one(self, kind: str, key: str, worker: str = "") -> ClaimOutcome:
        """Claim one key for the worker process `worker` names (`worker_reference`),
        batched with the other claims of this loop turn."""
        return await self._claims.ask((kind, key, worker))

    async def release_one(self, kind: str, key: str) -> ReleaseVerdict:
        """Release one key, batched with the other releases of this loop turn."""
        return await self._releases.ask((kind, key))

    async def claim_each(
        self, keys: Sequence[SessionKey], worker: str = ""
    ) -> list[ClaimOutcome | Exception]:
        """Claim `keys` for the worker process `worker` names, batched with the other
        claims of this loop turn (as many script calls as the batch limit cuts them
        into): each key's outcome, or the error that kept its script call from
        answering (a DirectoryError). Never raises for it."""
        return await self._claims.ask_each([(kind, key, worker) for kind, key in keys])

    async def publish_workers(self, changes: Sequence[tuple[str, str]]) -> None:
        """Publish where this incarnation's workers listen, for the routers on its host
        (`settings.host`): pairs of a worker reference and `encode_worker`'s text, or
        "" to withdraw one. Raises DirectoryFenced when this incarnation is not alive
        (nothing was written)."""
        s = self.settings
        args: list[str | int] = [s.router_id, self._epoch(), s.lease_ms, s.quiet_ms, s.host]
        for reference, value in changes:
            args += (reference, value)
        reply = await self._run(Script.WORKERS, (), args, s.claim_timeout_s)
        self._refuse_unless_ok(decode_standing(reply))

    async def release_each(self, keys: Sequence[SessionKey]) -> list[ReleaseVerdict | Exception]:
        """Release `keys` as `claim_each` claims them: each key's verdict, or its error."""
        return await self._releases.ask_each(keys)

    async def retire(self, reason: str = "retired") -> None:
        """Write this incarnation's death certificate (SIGTERM, or once fenced): its
        keys answer `dead` at once; then give its records their tombstone TTL, a chunk
        per call, until none is left."""
        s = self.settings
        epoch = self._epoch()
        args = (s.router_id, epoch, s.tombstone_ms, s.reap_chunk, reason)
        # Bounded: each call takes up to reap_chunk records, and the set only shrinks.
        while decode_remaining(await self._run(Script.RETIRE, (), args, s.claim_timeout_s)):
            pass
        self.epoch = None

    async def sweep(self) -> SweepReport:
        """Certify the incarnations whose lease lapsed and expire a chunk of dead
        records (the heartbeat loop calls this after each beat)."""
        s = self.settings
        args = (s.lease_ms, s.quiet_ms, s.tombstone_ms, s.reap_chunk)
        return decode_sweep(await self._run(Script.SWEEP, (), args, s.claim_timeout_s))

    async def lookup(self, keys: Sequence[SessionKey]) -> LookupBatch:
        """Owner records and their owners' liveness for `keys`, in one script call."""
        return await self._lookup_within(keys, self.settings.lookup_timeout_ms / 1000)

    async def lookup_one(self, kind: str, key: str) -> KeyLookup:
        """Look one key up, batched with the other lookups of this loop turn, under
        `lookup_timeout_ms` of its own; from the cache when it holds the key."""
        cached = self.cached(kind, key)
        if cached is not None:
            return cached
        return await self._lookups.ask((kind, key))

    def lookup_then(
        self, kind: str, key: str, then: Callable[[KeyLookup | Exception], None]
    ) -> None:
        """`lookup_one` without a coroutine, for a key `cached` had no answer for: `then`
        gets the answer, or the error, from a later loop callback."""
        self._lookups.ask_then((kind, key), then)

    def cached(self, kind: str, key: str) -> KeyLookup | None:
        """The lookup cache's answer for a key, if it holds one that is still good."""
        tracking = self._tracking
        if tracking is None:
            return None
        # The cache's clock is time.monotonic (tracking.py's too): the running loop's
        # time would cost a getpid() system call a request to find the loop.
        return tracking.cache.get(self.layout.owner(kind, key), time.monotonic())

    def forget(self, kind: str, key: str) -> None:
        """Drop the cached answer for a key (a hop to the owner it named failed)."""
        if self._tracking is not None:
            self._tracking.cache.forget(self.layout.owner(kind, key))

    async def members(self) -> tuple[Member, ...]:
        """The membership: every router's current incarnation, lease and peer."""
        return (await self.membership()).members

    async def membership(self) -> Membership:
        """The membership and the directory's time as it was read (one round trip), so
        the leases in it can be counted on a router's own clock."""
        pipeline = self._redis.pipeline(transaction=False)
        pipeline.hgetall(self.layout.members())
        pipeline.time()
        replies = await self._guarded(pipeline.execute(), self.settings.claim_timeout_s)
        if not isinstance(replies, list) or len(replies) != 2:
            raise DirectoryReplyError(f"the membership read answered {replies!r}")
        raw, clock = replies
        if not isinstance(raw, dict):
            raise DirectoryReplyError(f"membership is not a hash: {raw!r}")
        if not (isinstance(clock, tuple | list) and len(clock) == 2):
            raise DirectoryReplyError(f"TIME answered {clock!r}")
        members = (decode_member(str(r), str(v)) for r, v in raw.items())
        ordered = tuple(sorted(members, key=lambda member: member.router_id))
        return Membership(ordered, int(clock[0]) * 1000 + int(clock[1]) // 1000)

    async def close(self) -> None:
        """Let the batches in flight finish (each under its deadline)."""
        for batcher in (self._lookups, self._claims, self._releases):
            await batcher.close()

    async def _claim_within(
        self, keys: Sequence[ClaimKey], deadline_s: float
    ) -> tuple[ClaimOutcome, ...]:
        s = self.settings
        owner = self.layout.owner
        owners = [owner(kind, key) for kind, key, _worker in keys]
        args: list[str | int] = [
            self.layout.prefix,
            s.router_id,
            self._epoch(),
            s.lease_ms,
            s.quiet_ms,
        ]
        args += (worker for _kind, _key, worker in keys)
        if s.min_replicas:
            # Redis ends a blocked WAIT on its timer (10 times a second by default): ask
            # for 150 ms less than the deadline, so WAIT answers "too few" before it.
            wait_ms = max(round(deadline_s * 1000) - 150, 1)
            call = self._scripts.run_replicated(
                self._redis, Script.CLAIM, owners, args, s.min_replicas, wait_ms
            )
            reply = await self._guarded(call, deadline_s)
        else:
            reply = await self._run(Script.CLAIM, owners, args[1:], deadline_s)
        standing, outcomes = decode_claims(reply, len(keys))
        self._refuse_unless_ok(standing)
        return outcomes

    async def _release_within(
        self, keys: Sequence[SessionKey], deadline_s: float
    ) -> tuple[ReleaseVerdict, ...]:
        s = self.settings
        args = (s.router_id, self._epoch(), s.lease_ms, s.quiet_ms, s.tombstone_ms)
        reply = await self._run(Script.RELEASE, self._owners(keys), args, deadline_s)
        standing, verdicts = decode_releases(reply, len(keys))
        self._refuse_unless_ok(standing)
        return verdicts

    async def _lookup_within(self, keys: Sequence[SessionKey], deadline_s: float) -> LookupBatch:
        s = self.settings
        args = (s.lease_ms, s.quiet_ms, s.host)
        reply = await self._run(Script.LOOKUP, self._owners(keys), args, deadline_s)
        return decode_lookup(reply, len(keys))

    async def _lookup_batch(self, keys: list[SessionKey], deadline_s: float) -> list[KeyLookup]:
        """A batch's lookup on the pooled client: the tracked connection is not up."""
        batch = await self._lookup_within(keys, deadline_s)
        return [KeyLookup(result, batch.fleet) for result in batch.results]

    def _start_tracked_lookup(
        self,
        keys: list[SessionKey],
        deadline_s: float,
        answered: Callable[[Sequence[KeyLookup] | Exception], None],
    ) -> bool:
        """A batch's lookup on the tracked connection, its answers stored in the cache
        and handed to `answered` from the reply's own loop callback (no task: see
        batcher.py); False while that connection is not up."""
        tracking = self._tracking
        if tracking is None or not tracking.connected.is_set():
            return False
        if not self._breaker.allow(self._clock()):
            answered(DirectoryUnavailable("the directory's circuit breaker is open"))
            return True
        s = self.settings
        owners = self._owners(keys)
        call = _TrackedLookup(self._breaker, self._clock, tracking.cache, owners, answered)
        args = (self.layout.prefix, s.lease_ms, s.quiet_ms, s.host)
        try:
            tracking.lookup_then(owners, args, call.replied)
        except DirectoryUnavailable as error:
            call.replied(error)
            return True
        call.deadline = asyncio.get_running_loop().call_later(
            deadline_s, call.timed_out, deadline_s
        )
        return True

    def _owners(self, keys: Sequence[SessionKey]) -> list[str]:
        owner = self.layout.owner
        return [owner(kind, key) for kind, key in keys]

    def _epoch(self) -> int:
        if self.epoch is None:
            raise DirectoryFenced(Standing.LOST.value)  # not registered (or retired)
        return self.epoch

    def _refuse_unless_ok(self, standing: Standing) -> None:
        if standing is not Standing.OK:
            raise DirectoryFenced(standing.value)

    async def _run(
        self, script: Script, keys: Sequence[str], args: Sequence[str | int], deadline_s: float
    ) -> object:
        prefixed = (self.layout.prefix, *args)
        return await self._guarded(
            self._scripts.run(self._redis, script, keys, prefixed), deadline_s
        )

    async def _guarded(self, call: Coroutine[Any, Any, Any], deadline_s: float) -> object:
        """Await `call` under `deadline_s` and the breaker; map failures to our errors."""
        if not self._breaker.allow(self._clock()):
            call.close()
            raise DirectoryUnavailable("the directory's circuit breaker is open")
        try:
            async with asyncio.timeout(deadline_s):
                reply = await call
        except TimeoutError:
            self._breaker.failed(self._clock())
            raise DirectoryTimeout(f"the directory did not answer within {deadline_s}s") from None
        except (RedisConnectionError, RedisTimeoutError, OSError) as error:
            self._breaker.failed(self._clock())
            raise DirectoryUnavailable(f"the directory cannot be reached: {error}") from error
        except ReadOnlyError as error:  # a primary a failover turned into a replica
            self._breaker.failed(self._clock())
            raise DirectoryUnavailable(f"the directory is read-only here: {error}") from error
        except DirectoryUnavailable:  # too few replicas acknowledged a write
            self._breaker.failed(self._clock())
            raise
        except ResponseError as error:
            self._breaker.succeeded()  # it answered: an error of ours, not an outage
            raise DirectoryReplyError(f"the directory refused the call: {error}") from error
        except RedisError as error:
            self._breaker.failed(self._clock())
            raise DirectoryUnavailable(f"the directory failed: {error}") from error
        except asyncio.CancelledError:
            self._breaker.abandoned()
            raise
        self._breaker.succeeded()
        return reply


class _TrackedLookup:
    """One batch's lookup on the tracked connection: its reply or its deadline,
    whichever comes first, answers the batch (as `_guarded` would: the breaker told,
    the errors ours); a held answer is kept in the cache."""

    __slots__ = (
        "_answered",
        "_breaker",
        "_cache",
        "_clock",
        "_generation",
        "_owners",
        "_sent_at",
        "deadline",
    )

    def __init__(
        self,
        breaker: CircuitBreaker,
        clock: Callable[[], float],
        cache: LookupCache,
        owners: list[str],
        answered: Callable[[Sequence[KeyLookup] | Exception], None],
    ) -> None:
        self._breaker = breaker
        self._clock = clock
        self._cache = cache
        self._owners = owners
        self._answered: Callable[[Sequence[KeyLookup] | Exception], None] | None = answered
        self._generation = cache.generation  # what the cache knew when this went out
        self._sent_at = time.monotonic()  # the cache's clock
        self.deadline: asyncio.TimerHandle | None = None

    def replied(self, reply: object) -> None:
        answered, self._answered = self._answered, None
        if answered is None:  # past its deadline: answered already
            return
        if self.deadline is not None:
            self.deadline.cancel()
        if isinstance(reply, DirectoryUnavailable):  # the connection closed, or an error
            self._breaker.failed(self._clock())
            answered(reply)
            return
        self._breaker.succeeded()
        try:
            batch = decode_lookup(reply, len(self._owners))
        except DirectoryReplyError as error:
            answered(error)
            return
        lookups = [KeyLookup(result, batch.fleet) for result in batch.results]
        self._cache.store(self._owners, lookups, self._generation, self._sent_at)
        answered(lookups)

    def timed_out(self, deadline_s: float) -> None:
        answered, self._answered = self._answered, None
        if answered is not None:
            self._breaker.failed(self._clock())
            answered(DirectoryTimeout(f"the directory did not answer within {deadline_s}s"))
