"""The router's state machine: claims, worker leases, recovery, and routing decisions.

Everything that decides where a request goes, or what becomes of a worker,
lives here; the control server, the health prober, the spawner and the public
handler only feed it events and act on what it returns.

Pure and synchronous: no asyncio, no sockets, no clock reads (`now` is passed
in, from one monotonic clock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final, Protocol

from router.core.answers import Answer
from router.core.claims import Claim, ClaimRefusal, ClaimState, ClaimTable, SyncResult
from router.core.workers import Worker, WorkerOrigin, WorkerRegistry, WorkerState


@dataclass(frozen=True, slots=True)
class CoreSettings:
    """The settings the state machine needs (a subset of the config)."""

    kinds: dict[str, bool]  # session kind name → True when unknown keys are forwarded
    mcp_kinds: frozenset[str] = frozenset()  # unknown or ended keys of these get 404
    lease_timeout_s: float = 15.0
    reconnect_grace_s: float = 5.0
    tombstone_ttl_s: float = 3600.0
    max_tombstones: int = 1_000_000
    recovery_window_s: float = 30.0
    learned_idle_ttl_s: float = 3600.0
    health_failures: int = 2


class JournalSink(Protocol):
    """Told of every control-plane change, to persist it (see router.service.journal)."""

    def worker(self, worker: Worker) -> None: ...
    def drain(self, worker: Worker) -> None: ...
    def claim(self, kind: str, key: str, worker: str) -> None: ...
    def learn(self, kind: str, key: str, worker: str) -> None: ...
    def release(self, kind: str, key: str, worker: str) -> None: ...
    def forget(self, kind: str, key: str, worker: str) -> None: ...  # held, now never was
    def sync(self, worker: str, claims: Iterable[tuple[str, str]]) -> None: ...
    def link(self, claims: list[tuple[str, str]]) -> None: ...  # learned from one reply
    def exited(self, worker: str) -> None: ...
    def hold(self) -> None: ...  # keep what follows until flush (one write for many changes)
    def flush(self) -> None: ...  # write what was held; changes are written at once again


class _NoJournal:
    def worker(self, worker: Worker) -> None:
        pass

    def drain(self, worker: Worker) -> None:
        pass

    def claim(self, kind: str, key: str, worker: str) -> None:
        pass

    def learn(self, kind: str, key: str, worker: str) -> None:
        pass

    def release(self, kind: str, key: str, worker: str) -> None:
        pass

    def forget(self, kind: str, key: str, worker: str) -> None:
        pass

    def sync(self, worker: str, claims: Iterable[tuple[str, str]]) -> None:
        pass

    def link(self, claims: list[tuple[str, str]]) -> None:
        pass

    def exited(self, worker: str) -> None:
        pass

    def hold(self) -> None:
        pass

    def flush(self) -> None:
        pass


# Not frozen: one is made per routed request, and a frozen init costs more than a plain
# one. Its own __init__: the compiled build (setup.py) compiles it, where the
# dataclass's is generated at run time and interpreted.
@dataclass(slots=True, init=False)
class Forward:
    """Send the request to `worker`; `boot` goes in X-Episode-Router-Boot."""

    worker: Worker
    session: str | None
    boot: str | None

    def __init__(self, worker: Worker, session: str | None, boot: str | None) -> None:
        self.worker = worker
        self.session = session
        self.boot = boot


Decision = Forward | Answer


@dataclass(slots=True)
class TickResult:
    """What a periodic tick changed, for the I/O layer to act on and log."""

    lost: list[Worker] = field(default_factory=list)  # leases that went silent
    exited: list[Worker] = field(default_factory=list)
    recovery_ended: bool = False
    # Learned claims that ended unused (kind, key): a fleet's directory is told too.
    expired_learned: list[tuple[str, str]] = field(default_factory=list)


# Exited workers the registry keeps (for the admin API and the per-worker metrics), the
# longest gone forgotten past this many: worker ids come and go (a pool that restarts
# with fresh ids, or a peer inventing them), and each one kept costs memory and metric
# series. A forgotten worker's sessions stay 410 worker_exited (route needs no worker
# for that); configured (static) workers are always kept, probed to come back.
MAX_EXITED_WORKERS: Final = 1024
# Balancing weighs the sessions each worker's clients used in the current activity
# window and the one before (Worker.recent_sessions): a session counts once a window
# however many calls it makes. A minute outlasts an agent's pause between tool calls
# (a model's turn), and a session nobody used for two windows no longer weighs.
ACTIVE_WINDOW_S: Final = 60.0


class RouterCore:
    """Claims, workers and the recovery window of one router process."""

    def __init__(
        self,
        settings: CoreSettings,
        now: float,
        *,
        on_retire: Callable[[Worker], None] = lambda worker: None,
    ) -> None:
        self.settings = settings
        # Told of every worker that exits, so the I/O layer can close its
        # lease connection and drop its connection pool.
        self.on_retire = on_retire
        # Told of every change to a worker's process, address or state (a hello, a loss,
        # an exit, a probe's verdict), so the fleet can publish where the workers listen
        # (design §10, shape B).
        self.on_worker_change: Callable[[Worker], None] = _ignore_worker
        self.journal: JournalSink = _NoJournal()
        self.claims = ClaimTable(
            tombstone_ttl_s=settings.tombstone_ttl_s, max_tombstones=settings.max_tombstones
        )
        self.workers = WorkerRegistry()
        self._recovery_ends_at: float | None = now + settings.recovery_window_s
        self._expected: set[str] = set()  # workers to hear from before recovery ends early
        self._recovered: set[str] = set()
        self._exited: dict[str, None] = {}  # exited non-static worker ids, oldest first
        # When the current activity window began: a claim last used before it is
        # counted in its worker's recent sessions when used again.
        self._window_start = now
        self.conflicts = 0
        self.learned = 0
        self.learn_conflicts = 0
        # Seed replies that named no session, by kind (a config that cannot learn).
        self.learn_misses: dict[str, int] = {}

    # -- recovery ----------------------------------------------------------

    def expect(self, worker_id: str) -> None:
        """Recovery waits for this worker (spawned, static or journaled)."""
        self._expected.add(worker_id)

    def mark_recovered(self, worker_id: str, now: float) -> None:
        """This worker synced (or, for a static one, was probed)."""
        self._recovered.add(worker_id)
        self._maybe_end_recovery(now)

    def recovering(self, now: float) -> bool:
        """Whether unknown keys get 503 recovering now. Only `tick` ends the
        window (and retires journaled workers that did not come back)."""
        return self._recovery_ends_at is not None and now < self._recovery_ends_at

    def recovery_remaining(self, now: float) -> float:
        return 0.0 if self._recovery_ends_at is None else max(0.0, self._recovery_ends_at - now)

    def _maybe_end_recovery(self, now: float) -> None:
        # With nobody to expect, the router cannot know when every worker is
        # back, so it waits the whole window rather than answer a wrong 401.
        if (
            self._recovery_ends_at is not None
            and self._expected
            and self._expected.issubset(self._recovered)
        ):
            self._end_recovery(now)

    def _end_recovery(self, now: float) -> list[Worker]:
        self._recovery_ends_at = None
        gone = [
            w
            for w in self.workers
            if w.origin is WorkerOrigin.JOURNAL and w.state is not WorkerState.EXITED
        ]
        for worker in gone:
            self.retire(worker, now)
        return gone

    # -- routing -----------------------------------------------------------

    def route(self, kind: str | None, key: str | None, now: float) -> Decision:
        """Where a request naming session `key` of `kind` goes (None: no session)."""
        if kind is None or key is None:
            return self.balance(None)
        claim = self.claims.lookup(kind, key)
        if claim is None:
            return self._route_unknown(kind, key, now)
        if claim.state is ClaimState.HELD:
            worker = self.workers.get(claim.worker)
            if worker is not None and worker.forwardable:
                if claim.last_used < self._window_start:
                    worker.recent += 1  # first use in this activity window
                claim.last_used = now
                return Forward(worker, key, worker.boot)
            return _worker_exited(key)
        if claim.state is ClaimState.ENDED:
            if kind in self.settings.mcp_kinds:
                return _unknown_mcp_session(key)
            return Answer("episode_ended", "This episode has ended.", key)
        return _worker_exited(key)

    def route_new(self, kind: str, key: str, now: float) -> Decision:
        """A seed that names its own session (its kind learns from the request): to the
        worker that holds it, so a repeated seed finds its session; balanced when no
        worker does; the usual answers for one that ended or whose worker exited."""
        if self.claims.lookup(kind, key) is None and not self.recovering(now):
            return self.balance(key)
        return self.route(kind, key, now)

    def route_close(self, kind: str, key: str, now: float) -> Decision:
        """A close route's request, naming `key`: its holder, as any request; and, where
        another request would be refused, the worker whose own contract answers a
        repeated or unknown close: the one that held an ended session if it still runs,
        else any. A session whose worker exited is still 410."""
        claim = self.claims.lookup(kind, key)
        if claim is None:
            return self.route(kind, key, now) if self.recovering(now) else self.balance(key)
        if claim.state is ClaimState.ENDED:
            former = self.workers.get(claim.worker)
            if former is not None and former.forwardable:
                return Forward(former, key, former.boot)
            return self.balance(key)
        return self.route(kind, key, now)

    def _route_unknown(self, kind: str, key: str, now: float) -> Decision:
        if self.recovering(now):
            return Answer(
                "recovering",
                "The router restarted and is still hearing back from its workers; retry shortly.",
                key,
                retry_after_s=self.recovery_remaining(now),
            )
        if self.settings.kinds.get(kind, False):
            return self.balance(key)
        if kind in self.settings.mcp_kinds:
            return _unknown_mcp_session(key)
        return Answer("unknown_episode", "No worker holds this episode.", key)

    def balance(self, session: str | None, exclude: frozenset[str] = frozenset()) -> Decision:
        """A live, non-draining worker for a request that names no known session."""
        worker = self.workers.pick(self.claims.held_count, exclude)
        if worker is None:
            return Answer("no_worker", "No worker is available.", session, retry_after_s=1.0)
        return Forward(worker, session, worker.boot)

    # -- worker lifecycle --------------------------------------------------

    def register(
        self,
        worker_id: str,
        url: str,
        origin: WorkerOrigin,
        now: float,
        boot: str | None = None,
        *,
        probed: bool = False,
    ) -> Worker:
        """Add a worker, or bring back one the registry knew (new generation).
        `probed`: a spawned worker that never says hello, health-probed instead: it
        takes no new session until its first probe answers (a static one is probed
        whatever this says)."""
        worker = self.workers.get(worker_id)
        if worker is None:
            worker = Worker(worker_id, url, origin, now, boot)
            self.workers.add(worker)
            self._journal_worker(worker)
            self._await_probe(worker, probed)
            self.on_worker_change(worker)
            return worker
        if worker.boot != boot or worker.state is WorkerState.EXITED:
            if worker.state is not WorkerState.EXITED:
                self.retire(worker, now)
            worker.generation += 1
            if worker.drained_by_worker:
                worker.draining = worker.drained_by_worker = False
        worker.url, worker.boot, worker.origin = url, boot, origin
        self._exited.pop(worker_id, None)
        worker.state = WorkerState.LIVE
        worker.lost_since = None
        worker.last_heard = now
        self._journal_worker(worker)
        self._await_probe(worker, probed)
        self.on_worker_change(worker)
        return worker

    @staticmethod
    def _await_probe(worker: Worker, probed: bool) -> None:
        worker.probed = probed or worker.origin is WorkerOrigin.STATIC
        if probed:
            worker.state = WorkerState.UNHEALTHY  # until its first probe answers

    def _journal_worker(self, worker: Worker) -> None:
        if worker.origin is not WorkerOrigin.STATIC:
            self.journal.worker(worker)

    def set_draining(self, worker: Worker, on: bool, *, by_worker: bool = False) -> None:
        """No new sessions for `worker` while on; its episodes go on. `by_worker`:
        the worker asked (over the control socket), not an operator."""
        worker.draining = on
        worker.drained_by_worker = on and by_worker
        self.journal.drain(worker)

    def retire(self, worker: Worker, now: float) -> int:
        """The worker is gone: its sessions become `worker_exited`."""
        worker.state = WorkerState.EXITED
        worker.lost_since = None
        count = self.claims.worker_exited(worker.id, now)
        self.journal.exited(worker.id)
        self.on_retire(worker)  # closes its lease's connection, found by `worker.lease`
        worker.lease = None  # void: the connection's close must not touch a next generation
        self._forget_long_exited(worker)
        self.on_worker_change(worker)
        return count

    def _forget_long_exited(self, worker: Worker) -> None:
        """Notes `worker` as the latest to exit, and forgets the longest exited past
        MAX_EXITED_WORKERS (see there)."""
        if worker.origin is WorkerOrigin.STATIC:
            return
        exited = self._exited
        exited.pop(worker.id, None)
        exited[worker.id] = None
        while len(exited) > MAX_EXITED_WORKERS:
            oldest = next(iter(exited))
            del exited[oldest]
            kept = self.workers.get(oldest)
            if kept is not None and kept.state is WorkerState.EXITED:
                self.workers.remove(oldest)

    def remove(self, worker: Worker, now: float) -> None:
        """Forget a worker the config no longer lists: its sessions become `worker_exited`
        (it is retired first if it was not yet), no probe brings it back, and recovery
        stops waiting for it. Registering the id again starts afresh."""
        if worker.state is not WorkerState.EXITED:
            self.retire(worker, now)
        if self.workers.get(worker.id) is worker:
            self.workers.remove(worker.id)
        self._exited.pop(worker.id, None)
        self._expected.discard(worker.id)
        self._maybe_end_recovery(now)

    def lose(self, worker: Worker, now: float) -> None:
        """Its lease ended without a goodbye: keep forwarding for the grace period."""
        if worker.state in (WorkerState.LIVE, WorkerState.UNHEALTHY):
            worker.state = WorkerState.LOST
            worker.lost_since = now
            self.on_worker_change(worker)

    def probe_result(self, worker: Worker, outcome: str, failures: int, now: float) -> bool:
        """A probed worker's health probe: 'ok', 'refused' or 'timeout'.
        `failures` counts consecutive refusals. Returns True if the state changed."""
        before = worker.state
        if outcome == "ok":
            if worker.state is WorkerState.EXITED:
                # Back on the same port: a new generation. Its old sessions stay 410.
                worker.generation += 1
            worker.state = WorkerState.LIVE
            self.mark_recovered(worker.id, now)
        elif outcome == "refused" and worker.origin is WorkerOrigin.SPAWNED:
            # Its process is the spawner's to judge (an exit retires it): nothing listens
            # yet, or any more, so no new sessions meanwhile.
            if worker.state is WorkerState.LIVE:
                worker.state = WorkerState.UNHEALTHY
        elif outcome == "refused" and failures >= self.settings.health_failures:
            if worker.state is not WorkerState.EXITED:
                self.retire(worker, now)
            self.mark_recovered(worker.id, now)
        elif outcome == "timeout" and worker.state is WorkerState.LIVE:
            worker.state = WorkerState.UNHEALTHY
        if worker.state is before:
            return False
        self.on_worker_change(worker)
        return True

    def tick(self, now: float, silent_leases: Iterable[Worker] = ()) -> TickResult:
        """Expire leases, graces, tombstones, idle learned claims and recovery."""
        result = TickResult()
        lease_cutoff = now - self.settings.lease_timeout_s
        for worker in silent_leases:
            if worker.state is WorkerState.LIVE and worker.last_heard <= lease_cutoff:
                self.lose(worker, now)
                result.lost.append(worker)
        grace_cutoff = now - self.settings.reconnect_grace_s
        for worker in self.workers:
            if (
                worker.state is WorkerState.LOST
                and worker.origin is not WorkerOrigin.JOURNAL
                and worker.lost_since is not None
                and worker.lost_since <= grace_cutoff
            ):
                self.retire(worker, now)
                result.exited.append(worker)
        self._roll_activity_window(now)
        self.claims.expire(now)
        for claim in self.claims.expire_idle_learned(now, self.settings.learned_idle_ttl_s):
            # Journaled as a release: replayed, it must not come back held.
            self.journal.release(claim.kind, claim.key, claim.worker)
            result.expired_learned.append((claim.kind, claim.key))
        if self._recovery_ends_at is not None and now >= self._recovery_ends_at:
            result.exited.extend(self._end_recovery(now))
            result.recovery_ended = True
        return result

    def _roll_activity_window(self, now: float) -> None:
        passed = int((now - self._window_start) // ACTIVE_WINDOW_S)
        if passed < 1:
            return
        self._window_start += passed * ACTIVE_WINDOW_S
        for worker in self.workers:
            worker.roll_window(passed)

    # -- claims on behalf of a worker ----------------------------------------

    def claim(self, worker: Worker, kind: str, key: str, now: float) -> ClaimRefusal | None:
        fresh = self._fresh(kind, key)
        refusal = self.claims.claim(kind, key, worker.id, now)
        if refusal is None:
            worker.recent += fresh
            self.journal.claim(kind, key, worker.id)
        elif refusal.error == "conflict":
            self.conflicts += 1
        return refusal

    def learn(self, worker: Worker, kind: str, key: str, now: float) -> ClaimRefusal | None:
        """A claim learned from `worker`'s reply (a seed route, an MCP session).
        A key another worker holds is not learned (counted in `learn_conflicts`)."""
        fresh = self._fresh(kind, key)
        refusal = self.claims.claim(kind, key, worker.id, now, learned=True)
        if refusal is None:
            worker.recent += fresh
            self.learned += 1
            self.journal.learn(kind, key, worker.id)
        else:
            self.learn_conflicts += 1
        return refusal

    def _fresh(self, kind: str, key: str) -> int:
        """1 when a claim of `key` would be its first use in this activity window."""
        claim = self.claims.lookup(kind, key)
        return 1 if claim is None or claim.last_used < self._window_start else 0

    def learn_missed(self, kind: str) -> None:
        """A seed reply of `kind` named no session: nothing was learned from it."""
        self.learn_misses[kind] = self.learn_misses.get(kind, 0) + 1

    def link_learned(self, pairs: Iterable[tuple[str, str]]) -> None:
        """The claims `pairs` (kind, key) were learned from one reply: one session."""
        claims = [c for c in (self.claims.lookup(k, key) for k, key in pairs) if c is not None]
        for claim in claims:
            claim.siblings = tuple(other for other in claims if other is not claim)
        if len(claims) > 1:
            self.journal.link([(claim.kind, claim.key) for claim in claims])

    def release_learned(self, worker: Worker, kind: str, key: str, now: float) -> bool:
        """A close route's (or MCP DELETE's) 2xx reply ends the session, under every
        kind the seed reply taught it."""
        claim = self.claims.lookup(kind, key)
        siblings = claim.siblings if claim is not None else ()
        released = self.release(worker, kind, key, now)
        for sibling in siblings:
            if sibling.state is ClaimState.HELD and sibling.worker == worker.id:
                self.release(worker, sibling.kind, sibling.key, now)
        return released

    def release(self, worker: Worker, kind: str, key: str, now: float) -> bool:
        released = self.claims.release(kind, key, worker.id, now)
        if released:
            self.journal.release(kind, key, worker.id)
        return released

    def forget(self, worker: Worker, kind: str, key: str) -> bool:
        """Drop `worker`'s held claim of `key` with no tombstone: the claims directory
        refused it (design §10). False when `worker` does not hold it."""
        forgotten = self.claims.forget_held(kind, key, worker.id)
        if forgotten:
            self.journal.forget(kind, key, worker.id)
        return forgotten

    def sync(self, worker: Worker, claims: Iterable[tuple[str, str]], now: float) -> SyncResult:
        listed = set(claims)
        result = self.claims.sync(worker.id, listed, now)
        self.journal.sync(worker.id, listed)
        self.mark_recovered(worker.id, now)
        return result

    def declare_exited(self, keys: Iterable[tuple[str, str]], now: float) -> int:
        """The fleet holds these held keys dead (this router was fenced, or its records
        belong to an incarnation it replaced): 410 `worker_exited` here too, so no key
        answered 410 anywhere is served again (design §10). Their workers run on; each is
        journaled as a release, so a restart does not bring them back."""
        count = 0
        for kind, key in list(keys):
            claim = self.claims.lookup(kind, key)
            if claim is not None and self.claims.exit_held(kind, key, now):
                self.journal.release(kind, key, claim.worker)
                count += 1
        return count

    def session_info(self, kind: str, key: str) -> Claim | None:
        return self.claims.lookup(kind, key)


def _ignore_worker(worker: Worker) -> None:
    pass


def _worker_exited(key: str) -> Answer:
    return Answer("worker_exited", "The worker that ran this episode is no longer running.", key)


def _unknown_mcp_session(key: str) -> Answer:
    # The MCP specification's answer to an unknown session: the client starts a new one.
    return Answer("unknown_session", "No MCP session with this id; start a new one.", key)
