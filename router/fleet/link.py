"""One router's place in the fleet (design §10): registered in the directory, its lease
kept alive, its claims written there, the keys it does not hold looked up there.

`FleetLink` is what the rest of the router sees of the directory: the control socket
and the learner write claims through it (it is their `ClaimGate`), the public handler
asks it what a key its table does not know means (`lookup`), and the service starts it
and stops it (SIGTERM writes this incarnation's death certificate at once). It answers
the heartbeat's FENCED (every claim held here turns 410 `worker_exited`, the router
registers again) and LOST (it registers again and writes its table back), and writes
the table back after a start (a journal's claims) and after an outage in which a sync
could not be written. It never decides what a request gets: `meaning_of` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final, cast

from router.core import ClaimState, RouterCore, Worker
from router.directory import (
    WITHOUT_AN_ANSWER,
    ClaimOutcome,
    ClaimVerdict,
    Directory,
    DirectoryError,
    DirectorySettings,
    DirectoryUnavailable,
    HeartbeatLoop,
    KeyLookup,
    LookupResult,
    LookupState,
    Member,
    Owner,
    OwnerState,
    RequestMeaning,
    Standing,
    TrackedLookups,
    cancel_and_wait,
    meaning_of,
)
from router.fleet.prefixes import PrefixRoutes
from router.fleet.worker_table import PublishedWorkers, worker_reference
from router.metrics import FleetFigures
from router.protocol.key_prefix import key_prefix

log = logging.getLogger("episode_router.fleet")

# A directory unreachable at start, or after a lost registration, is tried this often:
# local hits go on meanwhile, misses get 503 `recovering`, claims `directory_unavailable`.
REGISTER_RETRY_S: Final = 1.0
# How much sooner than its lease, on its own clock, a router stops serving its keys:
# two clocks counting a 10 s lease drift apart by microseconds; a scheduling delay
# between the renewal and the reading of the clock is covered too.
LEASE_MARGIN_S: Final = 0.2
# Keys per claim or release call when the whole table is written back.
WRITE_BACK_CHUNK: Final = 256


@dataclass(slots=True)
class FleetCounts:
    """What the link counted, for the metrics (read at scrape time)."""

    lookups: dict[str, int] = field(default_factory=dict)  # by RequestMeaning value
    directory_errors: dict[str, int] = field(default_factory=dict)  # by call
    fenced: int = 0
    lost: int = 0
    registrations: int = 0
    written_back: int = 0
    declared_exited: int = 0
    peer_forwards: dict[str, int] = field(default_factory=dict)  # by outcome
    peer_refused: dict[str, int] = field(default_factory=dict)  # by reason
    lookup_seconds_count: int = 0
    lookup_seconds_sum: float = 0.0
    prefix_routes: int = 0  # keys routed from the prefix that names their router

    def peer_forward(self, outcome: str) -> None:
        self.peer_forwards[outcome] = self.peer_forwards.get(outcome, 0) + 1

    def refused_hop(self, reason: str) -> None:
        self.peer_refused[reason] = self.peer_refused.get(reason, 0) + 1


# Not frozen, and its own __init__: one is made per request a cached answer routes,
# and the compiled build compiles this one, where a dataclass's generated __init__ runs
# interpreted (a third of `FleetLink.cached`, perf on bench.fleet's load).
@dataclass(slots=True, init=False)
class Lookup:
    """What a key the local table does not know means, and where its owner listens."""

    meaning: RequestMeaning
    result: LookupResult | None
    cached: bool  # from the lookup cache, not asked of the directory just now

    def __init__(
        self, meaning: RequestMeaning, result: LookupResult | None = None, cached: bool = False
    ) -> None:
        self.meaning = meaning
        self.result = result
        self.cached = cached

    @property
    def receiver(self) -> str:
        """The owner's incarnation, as the peer header names it."""
        owner = self.result.owner if self.result is not None else None
        return f"{owner.router_id}:{owner.epoch}" if owner is not None else ""


UNANSWERED: Final = Lookup(WITHOUT_AN_ANSWER)


class FleetLink:
    """The directory as one router process uses it (see the module docstring)."""

    def __init__(
        self,
        directory: Directory,
        core: RouterCore,
        *,
        clock: Callable[[], float] = time.monotonic,
        close_redis: Callable[[], object] | None = None,
    ) -> None:
        self.directory = directory
        self.settings: DirectorySettings = directory.settings
        self.core = core
        self._clock = clock
        self._close_redis = close_redis
        self.heartbeat = HeartbeatLoop(directory, self._standing_lost, on_renewed=self._renewed)
        # Until when, on this router's own clock, its lease surely runs: the last renewal
        # was sent no earlier than that, less a margin for the clocks' drift. Past it the
        # fleet may have declared it dead and answered 410 for its keys, so it serves
        # none of them (design §10, "Writes and fencing").
        self._serving_until = float("-inf")
        self.counts = FleetCounts()
        self._tasks: set[asyncio.Task[None]] = set()
        # The keys released in this loop turn, written together once it ends.
        self._releasing: list[tuple[str, str]] = []
        self._registering: asyncio.Task[None] | None = None
        self._watching: asyncio.Task[None] | None = None
        self._stopping = False
        self.members: tuple[Member, ...] = ()
        # With `key_prefixes`: the other routers' live incarnations, from the membership.
        self._prefixes = PrefixRoutes(self.router_id) if self.settings.key_prefixes else None
        # The tracked lookup connection and its cache (standalone Redis), if any.
        self.tracking: TrackedLookups | None = None
        # With a host to share (shape B): where this router's workers listen, published
        # for the routers on it, which forward to them straight.
        self._workers: PublishedWorkers | None = None
        if self.settings.host:
            self._workers = PublishedWorkers()
            core.on_worker_change = self.worker_changed
        self._publishing = False
        # Read on every cached answer: the settings' properties run interpreted.
        self._router_id = self.settings.router_id
        self._lease_ms = self.settings.lease_ms
        self._incarnation = ("", -1)  # the peer header's name for the epoch last asked

    # -- start and stop -------------------------------------------------------------

    @property
    def router_id(self) -> str:
        return self.settings.router_id

    @property
    def incarnation(self) -> str:
        """This router's current incarnation as the peer header names it ("" before
        the first registration); formatted once an epoch (every hop asks)."""
        epoch = self.directory.epoch
        if epoch is None:
            return ""
        name, named = self._incarnation
        if named != epoch:
            name = f"{self._router_id}:{epoch}"
            self._incarnation = (name, epoch)
        return name

    def key_prefix(self) -> str | None:
        """The prefix the hello reply offers workers (`directory.key_prefix`): this
        incarnation's, once registered; None when off or not registered."""
        epoch = self.directory.epoch
        if self._prefixes is None or epoch is None:
            return None
        return key_prefix(self.router_id, epoch)

    @property
    def registered(self) -> bool:
        return self.directory.epoch is not None

    def serving(self, now: float) -> bool:
        """Whether this router may serve the keys of its own table at `now` (monotonic):
        registered, and its lease renewed within the last lease, on its own clock."""
        return now < self._serving_until

    def _renewed(self, sent_at: float) -> None:
        lease = self.settings.lease_ttl_s
        self._serving_until = sent_at + lease - min(LEASE_MARGIN_S, lease * 0.1)
        if self._workers is not None and self._workers.pending:
            self._publish_soon()  # a write that failed before: again with each heartbeat

    def start(self) -> None:
        """Register (retried in the background while the directory cannot be reached),
        then write the local table back and keep the lease alive."""
        self._registering = asyncio.get_running_loop().create_task(
            self._register_until_done(), name="directory-register"
        )
        if self.tracking is not None:
            self.tracking.start()

    async def stop(self) -> None:
        """SIGTERM: this incarnation's certificate at once (its keys 410 fleet-wide, not
        after a lease), the heartbeat stopped, the connections closed."""
        self._stopping = True
        if self._registering is not None:
            await cancel_and_wait(self._registering)
        await self.heartbeat.stop()
        if self._watching is not None:
            await cancel_and_wait(self._watching)
        if self.registered:
            try:
                await self.directory.retire("sigterm")
            except DirectoryError as error:
                log.warning("could not retire from the directory (its lease lapses): %s", error)
        if self.tracking is not None:
            await self.tracking.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.directory.close()
        if self._close_redis is not None:
            closed = self._close_redis()
            if asyncio.iscoroutine(closed):
                await closed

    async def wait_registered(self, timeout_s: float) -> bool:
        """Whether the first registration is done within `timeout_s` (for tests)."""
        task = self._registering
        if task is None:
            return self.registered
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(task)
        except TimeoutError:
            return False
        return self.registered

    async def _register_until_done(self) -> None:
        while not self._stopping:
            try:
                await self.directory.load_scripts()
                sent_at = asyncio.get_running_loop().time()
                registration = await self.directory.register()
            except DirectoryError as error:
                self._count_error("register")
                log.warning("directory registration failed (retrying): %s", error)
                await asyncio.sleep(REGISTER_RETRY_S)
                continue
            self.counts.registrations += 1
            if self._workers is not None:
                self._workers.restart(self.core.workers)  # a new incarnation's table
            self._renewed(sent_at)
            log.info(
                "registered in the directory",
                extra={"router_id": self.router_id, "epoch": registration.epoch},
            )
            await self.write_back()
            if self._stopping:
                return  # stopped as it wrote back: no heartbeat after stop()
            self.heartbeat.start()
            if self._watching is None:
                self._watching = asyncio.get_running_loop().create_task(
                    self._watch_members(), name="directory-members"
                )
            return

    async def _watch_members(self) -> None:
        """The membership read once a heartbeat interval, for the members gauge."""
        while True:
            # A failure is counted by the heartbeat's and the requests' own calls.
            with contextlib.suppress(DirectoryError):
                await self.refresh_members()
            await asyncio.sleep(self.settings.heartbeat_interval_s)

    async def _standing_lost(self, standing: Standing) -> None:
        """The heartbeat found this incarnation FENCED or LOST (design §10)."""
        self._serving_until = float("-inf")
        if standing is Standing.FENCED:
            self.counts.fenced += 1
            # Paused or cut off past its lease: the fleet answered its keys 410 already.
            exited = self.core.declare_exited(
                [(c.kind, c.key) for c in self.core.claims.held()], self._clock()
            )
            self.counts.declared_exited += exited
            log.warning("fenced by the directory: its claims are 410 now", extra={"claims": exited})
            try:
                await self.directory.retire("fenced")
            except DirectoryError as error:
                log.warning("could not write the fenced certificate: %s", error)
        else:
            self.counts.lost += 1
            log.warning("the directory lost this router's registration: writing the table back")
        self.directory.epoch = None
        self._registering = asyncio.get_running_loop().create_task(
            self._register_until_done(), name="directory-register"
        )

    # -- the table written back ---------------------------------------------------------

    async def write_back(self) -> None:
        """Write the local table into the directory: held keys claimed (a key the fleet
        holds dead or ended, or another router holds, turns 410 here), ended ones
        released. After a start (a journal's claims), a LOST, and an outage."""
        claims = self.core.claims.held()
        held = [(c.kind, c.key) for c in claims]
        workers = [self._reference_of(c.worker) for c in claims]
        ended = [
            (c.kind, c.key) for c in self.core.claims.tombstones() if c.state is ClaimState.ENDED
        ]
        refused: list[tuple[str, str]] = []
        try:
            for start in range(0, len(held), WRITE_BACK_CHUNK):
                chunk = held[start : start + WRITE_BACK_CHUNK]
                outcomes = await self.directory.claim(
                    chunk, workers[start : start + WRITE_BACK_CHUNK]
                )
                refused.extend(
                    pair
                    for pair, outcome in zip(chunk, outcomes, strict=True)
                    if outcome.verdict is not ClaimVerdict.CLAIMED
                )
            for start in range(0, len(ended), WRITE_BACK_CHUNK):
                await self.directory.release(ended[start : start + WRITE_BACK_CHUNK])
        except DirectoryError as error:
            self._count_error("write_back")
            log.warning("writing the table back failed (next registration retries): %s", error)
            return
        if refused:
            self.counts.declared_exited += self.core.declare_exited(refused, self._clock())
            log.warning(
                "claims the directory holds dead or elsewhere are 410 here",
                extra={"claims": len(refused)},
            )
        self.counts.written_back += len(held) + len(ended)

    # -- the claim gate -------------------------------------------------------------------

    async def claim(self, kind: str, key: str, worker: Worker | None = None) -> ClaimOutcome:
        """ClaimGate: write this router's owner record of `key`, held by `worker`."""
        refused = self._named_elsewhere(key)
        if refused is not None:
            return refused
        try:
            return await self.directory.claim_one(kind, key, self._reference(worker))
        except DirectoryError:
            self._count_error("claim")
            raise

    async def claim_each(
        self, keys: Sequence[tuple[str, str]], worker: Worker | None = None
    ) -> list[ClaimOutcome | DirectoryError]:
        """BatchClaimGate: write this router's owner records of `keys` (one control
        read's claims, or one reply's), held by `worker`: each key's outcome, or the
        error that kept it unwritten."""
        if self._prefixes is not None:
            return await self._claim_unless_named_elsewhere(keys, worker)
        return await self._claim_each(keys, worker)

    async def _claim_each(
        self, keys: Sequence[tuple[str, str]], worker: Worker | None
    ) -> list[ClaimOutcome | DirectoryError]:
        answers = await self.directory.claim_each(keys, self._reference(worker))
        for index, answer in enumerate(answers):
            if isinstance(answer, ClaimOutcome):
                continue
            self._count_error("claim")  # one a key, as `claim` counts them
            if not isinstance(answer, DirectoryError):  # a batch that broke its contract
                log.error("a directory claim failed", exc_info=answer)
                answers[index] = DirectoryUnavailable(f"the claim failed: {answer!r}")
        return cast("list[ClaimOutcome | DirectoryError]", answers)

    async def _claim_unless_named_elsewhere(
        self, keys: Sequence[tuple[str, str]], worker: Worker | None
    ) -> list[ClaimOutcome | DirectoryError]:
        """`claim_each` where keys may carry another router's prefix: those are refused
        here, the rest claimed in the directory."""
        outcomes: list[ClaimOutcome | DirectoryError | None] = [
            self._named_elsewhere(key) for _kind, key in keys
        ]
        asked = [index for index, outcome in enumerate(outcomes) if outcome is None]
        if asked:
            answers = await self._claim_each([keys[index] for index in asked], worker)
            for index, answer in zip(asked, answers, strict=True):
                outcomes[index] = answer
        return cast("list[ClaimOutcome | DirectoryError]", outcomes)

    def _named_elsewhere(self, key: str) -> ClaimOutcome | None:
        """`conflict` for a key whose prefix names another member of the fleet: the fleet
        routes it there, so this router must not hold it (design §10)."""
        if self._prefixes is None:
            return None
        other = self._prefixes.other_router(key)
        return ClaimOutcome(ClaimVerdict.CONFLICT, holder=other) if other is not None else None

    def _reference(self, worker: Worker | None) -> str:
        """The owner record's worker reference for a claim `worker` makes ("" when no
        worker table is published: the record names no worker then)."""
        if self._workers is None or worker is None:
            return ""
        return worker_reference(worker)

    def _reference_of(self, worker_id: str) -> str:
        return self._reference(self.core.workers.get(worker_id))

    # -- the worker table (shape B) ---------------------------------------------------------

    def worker_changed(self, worker: Worker) -> None:
        """RouterCore's `on_worker_change`: publish or withdraw `worker`, written with
        the other changes of this loop turn (after a registration, the whole table)."""
        published = self._workers
        if published is not None and published.changed(worker) and self.registered:
            self._publish_soon()

    def _publish_soon(self) -> None:
        if not self._publishing:
            self._publishing = True
            asyncio.get_running_loop().call_soon(self._publish_gathered)

    def _publish_gathered(self) -> None:
        self._publishing = False
        published = self._workers
        if published is None or not published.pending or not self.registered:
            return
        changes = published.take()
        task = asyncio.get_running_loop().create_task(
            self._publish(changes), name="directory-workers"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, changes: list[tuple[str, str]]) -> None:
        assert self._workers is not None
        try:
            await self.directory.publish_workers(changes)
        except DirectoryError as error:
            # Written again with the next heartbeat the directory renews; meanwhile a
            # withdrawn worker's keys may still be forwarded to straight (its boot
            # refuses another process), and a new one's go through this router.
            self._workers.failed(changes)
            self._count_error("workers")
            log.debug("publishing the worker table failed: %s", error)

    def released(self, kind: str, key: str) -> None:
        """ClaimGate: mark `key`'s record ended, in the background: the releases of one
        loop turn go out together (a task a release was a fifth of the control socket's
        CPU per claim+release pair through the directory)."""
        if not self.registered:
            return  # written back with the table once registered again
        releasing = self._releasing
        if not releasing:
            asyncio.get_running_loop().call_soon(self._release_gathered)
        releasing.append((kind, key))

    def _release_gathered(self) -> None:
        keys, self._releasing = self._releasing, []
        loop = asyncio.get_running_loop()
        task = loop.create_task(self._release(keys), name="directory-release")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _release(self, keys: list[tuple[str, str]]) -> None:
        answers = await self.directory.release_each(keys)
        for answer in answers:
            if isinstance(answer, Exception):
                # The local table stays the authority: a record still held answers from it.
                self._count_error("release")
                log.debug("directory release failed: %s", answer)

    # -- the request path ------------------------------------------------------------------

    def cached(self, kind: str, key: str) -> Lookup | None:
        """What a key the local table does not know means, from the lookup cache alone:
        None when it holds no answer (then `lookup` or `lookup_then` asks the
        directory)."""
        epoch = self.directory.epoch
        if epoch is None:
            return None
        found = self.directory.cached(kind, key)
        if found is None:
            return self._by_prefix(key) if self._prefixes is not None else None
        meaning = self._meaning(found, epoch)
        self._count_lookup(meaning)
        return Lookup(meaning, found.result, cached=True)

    def _by_prefix(self, key: str) -> Lookup | None:
        """The owner a key's prefix names, if the membership holds it live: a hop to it
        with no lookup (handled as a cached answer: a failed hop asks the directory)."""
        assert self._prefixes is not None
        member = self._prefixes.owner(key, self._clock())
        if member is None:
            return None
        self.counts.prefix_routes += 1
        owner = Owner(member.router_id, member.epoch, OwnerState.HELD)
        return Lookup(RequestMeaning.PEER, LookupResult(LookupState.HELD, owner, member.peer), True)

    def forget(self, kind: str, key: str) -> None:
        """A hop to the owner a lookup named failed: that answer is not given again."""
        self.directory.forget(kind, key)
        if self._prefixes is not None:
            self._prefixes.drop(key)

    async def lookup(self, kind: str, key: str) -> Lookup:
        """What a key the local table does not know means (never raises), for a key
        `cached` had no answer for: asked of the directory, batched with the loop
        turn's other lookups (`directory_lookup_seconds` times those waits; a lookup
        cancelled with its request is not timed)."""
        epoch = self.directory.epoch
        if epoch is None:
            self._count_lookup(WITHOUT_AN_ANSWER)
            return UNANSWERED
        started = self._clock()
        try:
            found = await self.directory.lookup_one(kind, key)
        except Exception as error:  # a DirectoryError, or logged as unexpected
            return self.answered(error, epoch, started)
        return self.answered(found, epoch, started)

    def lookup_then(self, kind: str, key: str, then: Callable[[Lookup], None]) -> bool:
        """`lookup` without a coroutine, for a key `cached` had no answer for: `then`
        gets what the key means, from a later loop callback. False, and nothing asked,
        when this router is not registered: then `lookup`, which answers at once."""
        epoch = self.directory.epoch
        if epoch is None:
            return False
        answer = LookupAnswer(self, epoch, self._clock(), then)
        self.directory.lookup_then(kind, key, answer)
        return True

    def answered(self, found: KeyLookup | Exception, epoch: int, started: float) -> Lookup:
        """What a lookup asked at `started` (by the incarnation `epoch`) answered means,
        counted; a failed one is WITHOUT_AN_ANSWER."""
        counts = self.counts
        counts.lookup_seconds_count += 1
        counts.lookup_seconds_sum += self._clock() - started
        if isinstance(found, Exception):
            if not isinstance(found, DirectoryError):
                log.error("a directory lookup failed unexpectedly: %r", found)
            self._count_error("lookup")
            self._count_lookup(WITHOUT_AN_ANSWER)
            return UNANSWERED
        meaning = self._meaning(found, epoch)
        self._count_lookup(meaning)
        return Lookup(meaning, found.result)

    async def refresh_members(self) -> Sequence[Member]:
        """The membership, for /admin/routers and status (raises DirectoryError), and
        the prefix routes."""
        sent_at = self._clock()
        membership = await self.directory.membership()
        self.members = membership.members
        if self._prefixes is not None:
            self._prefixes.update(membership.members, membership.now_ms, sent_at)
        return self.members

    def figures(self) -> FleetFigures:
        """What the link counted, for the metrics."""
        counts = self.counts
        now_ms = time.time() * 1000  # leases are the directory's clock: near enough to show
        live = sum(1 for member in self.members if member.lease_deadline_ms > now_ms)
        return FleetFigures(
            lookups=counts.lookups,
            directory_errors=counts.directory_errors,
            peer_forwards=counts.peer_forwards,
            peer_refused=counts.peer_refused,
            registered=self.registered,
            fenced=counts.fenced,
            lost=counts.lost,
            members=live,
            lookup_seconds_count=counts.lookup_seconds_count,
            lookup_seconds_sum=counts.lookup_seconds_sum,
            prefix_routes=counts.prefix_routes,
        )

    def _meaning(self, found: KeyLookup, epoch: int) -> RequestMeaning:
        return meaning_of(found.result, found.fleet, self._router_id, epoch, self._lease_ms)

    def _count_lookup(self, meaning: RequestMeaning) -> None:
        counts = self.counts.lookups
        # `_value_`, not `value`: an enum's `value` is a property that runs interpreted,
        # a request's cost in the compiled build.
        label: str = meaning._value_
        counts[label] = counts.get(label, 0) + 1

    def _count_error(self, call: str) -> None:
        errors = self.counts.directory_errors
        errors[call] = errors.get(call, 0) + 1


class LookupAnswer:
    """A `lookup_then` caller's callback, given the directory's answer (or its error)
    for one key: what it means goes to `then`."""

    __slots__ = ("_epoch", "_link", "_started", "_then")

    def __init__(
        self, link: FleetLink, epoch: int, started: float, then: Callable[[Lookup], None]
    ) -> None:
        self._link = link
        self._epoch = epoch
        self._started = started
        self._then = then

    def __call__(self, found: KeyLookup | Exception) -> None:
        self._then(self._link.answered(found, self._epoch, self._started))
