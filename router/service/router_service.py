"""One router process: opens every listener and task in one place, closes them in reverse.

`RouterService(config).start()` brings up, in order: the core, the control
socket, static workers and their prober, spawned workers, the public and the
admin listeners, and the periodic tick. `stop()` undoes that in reverse, letting
in-flight requests finish first (SIGTERM semantics). `reload(new)` hands what a
new config changes to each running part (router.service.reload decides what may change).

It owns the parts' wiring: which part is built from what, the order of start and
stop, the tasks it runs, and what a worker's events do to the other parts. It
never computes a part's settings from the config (router.service.settings), sets
a listener's socket options (router.service.listeners), decides what a probe or a `workers:`
list means for a worker (router.service.static_workers) or handles signals (router.service.process).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import Coroutine
from functools import partial
from typing import Any

from aiohttp import web

from router.app import PublicHandler, access_log
from router.build import build_name
from router.config import Config, config_warnings, load_config
from router.control import ControlServer, ControlSession
from router.core import RouterCore, Worker, WorkerOrigin, WorkerState
from router.directory import (
    Directory,
    KeyLayout,
    LookupCache,
    ScriptRunner,
    TrackedLookups,
    open_redis,
)
from router.edge import EdgeServer
from router.fleet import FleetLink
from router.fleet.locality import host_identity
from router.metrics import EdgeCounts, RouterMetrics
from router.protocol import UpstreamAddress, parse_upstream
from router.relay import Forwarder, end_to_end_headers
from router.service.admin import admin_application
from router.service.health import HealthProber
from router.service.journal import JournalFile, SkippedLine, replay
from router.service.listeners import bound_port, serve_admin, serve_public
from router.service.logs import setup_logging
from router.service.reload import ReloadPlan, effective_config, plan_reload
from router.service.settings import (
    advertised_peer,
    control_policy,
    core_settings,
    directory_settings,
    directory_target,
    edge_limits,
    forward_buffering,
    forward_timeouts,
    session_kinds,
    spawn_spec,
    warn_of_a_short_lease,
)
from router.service.spawner import SpawnedWorker, Spawner
from router.service.static_workers import check_worker, sync_static_workers
from router.sessions import SessionReader

log = logging.getLogger("episode_router")

TICK_INTERVAL_S = 0.25  # lease, grace and recovery deadlines are checked this often
# How long a failed forward to a spawned worker waits to hear whether its process exited:
# a kill's exit is reaped in milliseconds; a live worker that failed costs its client this.
SPAWN_EXIT_WAIT_S = 0.1


class RouterService:
    """Everything one router process runs."""

    def __init__(self, config: Config, *, config_path: str | None = None) -> None:
        self.config = config
        self.config_path = config_path  # where a reload reads the new config
        self.boot = secrets.token_hex(8)
        self._clock = time.monotonic
        self.core = RouterCore(core_settings(config), self._clock(), on_retire=self._retired)
        self.forwarder = Forwarder(
            forward_timeouts(config),
            pool_size_per_upstream=config.limits.worker_connections,
            buffering=forward_buffering(config),
        )
        self.forwarder.max_body_bytes = config.limits.max_body_bytes
        self.forwarder.end_to_end = end_to_end_headers(config.session_headers)
        self.metrics = self._build_metrics()
        self.control = ControlServer(
            self.core,
            control_policy(config, self.boot),
            on_lease_lost=self._lease_lost,
            metrics=self.metrics,
        )
        self.handler = PublicHandler(
            self.core,
            SessionReader(session_kinds(config), config.path_prefixes),
            self.forwarder,
            check_worker=self.check_worker,
            max_body_bytes=config.limits.max_body_bytes,
            metrics=self.metrics,
            access_log=config.log.access,
        )
        self.prober = HealthProber(
            self.core,
            path=config.health.path,
            interval_s=config.health.interval_s,
            timeout_s=config.health.timeout_s,
            on_change=self._probed_change,
        )
        self.spawner: Spawner | None = None
        self.journal: JournalFile | None = None
        self.fleet: FleetLink | None = None  # with a `directory:` section (design §10)
        self.peer_handler: PublicHandler | None = None
        self._peer: asyncio.Server | None = None
        self._peer_edge: EdgeServer | None = None
        self.peer_port = 0
        self._public: asyncio.Server | None = None
        self._edge: EdgeServer | None = None
        self._admin: web.BaseRunner | None = None
        self._tasks: set[asyncio.Task[object]] = set()
        self._reload_lock = asyncio.Lock()
        self.public_port = 0
        self.admin_port = 0

    def _buffer_figures(self) -> tuple[int, int, int, int]:
        forwarder = self.forwarder
        budget = forwarder.budget
        cut = forwarder.paced_over_share_cut
        return budget.held, budget.refused, forwarder.paced_over_share, cut

    def _build_metrics(self) -> RouterMetrics:
        core = self.core

        def recovery_remaining() -> float | None:
            now = self._clock()
            return core.recovery_remaining(now) if core.recovering(now) else None

        return RouterMetrics(
            claims_by_worker_kind=core.claims.held_counts_by_kind,
            tombstones=lambda: core.claims.tombstone_count,
            workers=lambda: ((w.id, w.state.value, w.draining) for w in core.workers),
            in_flight=lambda: ((w.id, w.in_flight) for w in core.workers),
            control_connections=lambda: self.control.connection_count,
            recovery_remaining=recovery_remaining,
            journal_write_errors=lambda: self.journal.write_errors if self.journal else 0,
            buffering=self._buffer_figures,
            kinds=[kind.name for kind in self.config.sessions],
        )

    # -- start / stop --------------------------------------------------------

    async def start(self) -> None:
        """Bring everything up (see the module docstring).

        Raises OSError when a socket cannot be bound (another router holds the
        control socket, a port is taken) and ValueError for a spawn setup that
        cannot start. What started before the failure is stopped first: spawned
        workers, listeners, the journal, the control socket and its file.
        """
        try:
            await self._start()
        except BaseException:
            # Spawned workers run in sessions of their own: left alone they would be
            # re-parented to init and outlive us, holding their ports; the socket file
            # would stay behind too.
            try:
                await self.stop()
            except Exception:  # the start's own error is the one to report
                log.exception("stopping what a failed start had started failed")
            raise

    async def _start(self) -> None:
        config = self.config
        warn_of_a_short_lease(config.control.lease_timeout_s)
        self.control.bind(config.control.socket)  # first: it fails if another router runs
        if config.state.path is not None:
            self._open_journal(config.state.path)  # before any hello can arrive
        if config.directory is not None:
            await self._join_the_fleet()  # before any hello: claims go through it
        await self.control.serve()
        now = self._clock()
        for static in config.workers:
            self.core.register(static.id, static.url, WorkerOrigin.STATIC, now)
            self.core.expect(static.id)
        if config.workers:
            self.prober.start()
        if config.spawn is not None:
            await self._start_spawner()
        self._edge = EdgeServer(
            self.handler.handle, edge_limits(config), asyncio.get_running_loop()
        )
        self._edge.on_refused = self.handler.refused_at_the_edge
        self.metrics.watch_edge(partial(edge_counts, self._edge))
        self._public = await serve_public(
            self._edge,
            config.listen.host,
            config.listen.port,
            reuse_port=config.listen.reuse_port,
        )
        self.public_port = int(self._public.sockets[0].getsockname()[1])
        self._admin = await serve_admin(
            admin_application(self),
            config.admin.host,
            config.admin.port,
            access_log=access_log if config.log.access else None,
            shutdown_grace_s=config.timeouts.shutdown_grace_s,
        )
        self.admin_port = bound_port(self._admin)
        # The ports the kernel picked (a port 0) are the router's own too from now on.
        self.control.set_policy(control_policy(config, self.boot, self._bound_listeners()))
        self._spawn_task(self._tick_forever(), "tick")
        log.info(
            "router started",
            extra={
                "public_port": self.public_port,
                "admin_port": self.admin_port,
                "build": build_name(),  # the hot path compiled or pure Python
            },
        )
        for warning in config_warnings(config):
            log.warning("config: %s", warning)

    async def _join_the_fleet(self) -> None:
        """The peer listener bound, the directory client made, the registration begun
        (retried in the background while the directory is unreachable: design §10)."""
        config = self.config
        assert config.directory is not None and config.peer is not None
        peer_handler = PublicHandler(
            self.core,
            self.handler.sessions,
            self.forwarder,
            check_worker=self.check_worker,
            max_body_bytes=config.limits.max_body_bytes,
            metrics=self.metrics,
            access_log=config.log.access,
        )
        self._peer_edge = EdgeServer(
            peer_handler.handle, edge_limits(config), asyncio.get_running_loop()
        )
        self._peer = await serve_public(
            self._peer_edge, config.peer.host, config.peer.port, name="peer.listen"
        )
        self.peer_port = int(self._peer.sockets[0].getsockname()[1])
        settings = directory_settings(
            config, advertised_peer(config, self.peer_port, os.environ), host_identity()
        )
        target = directory_target(config)
        redis = open_redis(target, config.directory.password)
        tracking = None
        if isinstance(target, str) and config.directory.password is None:
            # Standalone Redis: absent, ended and dead answers cached while Redis can
            # invalidate them (design §10); under Sentinel lookups are not cached.
            layout = KeyLayout(settings.prefix)
            cache = LookupCache(
                settings.lease_ms,
                owner_prefix=layout.owner_prefix,
                workers_prefix=layout.workers_prefix if settings.host else None,
            )
            tracking = TrackedLookups(target, cache, ScriptRunner())
        directory = Directory(redis, settings, tracking=tracking)
        fleet = FleetLink(directory, self.core, clock=self._clock, close_redis=redis.aclose)
        fleet.tracking = tracking
        secret = config.peer.secret.encode()
        self.control.claim_gate = fleet
        for handler, peer_side in ((self.handler, False), (peer_handler, True)):
            handler.fleet = fleet
            handler.peer_secret = secret
            handler.peer_side = peer_side
        self.peer_handler = peer_handler
        self.fleet = fleet
        self.metrics.watch_fleet(fleet.figures)
        fleet.start()

    def _open_journal(self, path: str) -> None:
        """Replay the previous run's journal, then start a fresh one from the result."""
        journal = JournalFile(path, clock=time.time)
        journal.lock()  # before it is read: another router's journal is not this one's
        try:
            lines = journal.read()
            skipped = replay(
                self.core, lines, self._clock(), time.time(), url_refusal=self._journaled_url
            )
            _log_skipped(path, skipped)
            journal.compact(self.core, self._clock())
        except BaseException:
            journal.close()  # and its lock
            raise
        self.core.journal = journal
        self.journal = journal
        log.info(
            "journal replayed",
            extra={
                "path": path,
                "lines": len(lines),
                "workers": len(self.core.workers),
                "claims": self.core.claims.held_total,
                "tombstones": self.core.claims.tombstone_count,
            },
        )

    def _journaled_url(self, url: str) -> str | None:
        """Why a journaled worker must not be restored at `url`: the hello policy, a
        unix socket owned by any uid that may say hello."""
        address = parse_upstream(url)
        if isinstance(address, str):
            return address
        policy = self.control.policy
        owners = policy.allowed_uids | {policy.own_uid}
        return policy.worker_url_refusal(address, owners)

    def _maybe_compact_journal(self) -> None:
        journal = self.journal
        if journal is None:
            return
        live = (
            self.core.claims.held_total + self.core.claims.tombstone_count + len(self.core.workers)
        )
        now = self._clock()
        if journal.wants_compaction(live, now):
            journal.compact_during_run(self.core, now)  # a failure is logged; appends go on

    async def stop(self) -> None:
        """Stop accepting, let in-flight requests finish (up to the grace), then close."""
        self.handler.shutting_down = True
        if self.fleet is not None:
            # This incarnation's certificate first: its keys are 410 fleet-wide at once,
            # while its own requests in flight finish from the local table.
            await self.fleet.stop()
        if self._peer is not None:
            self._peer.close()
        if self._public is not None:
            self._public.close()  # no new connections
            assert self._edge is not None
            await self._edge.shutdown(self.config.timeouts.shutdown_grace_s)
        if self._peer_edge is not None:
            if self.peer_handler is not None:
                self.peer_handler.shutting_down = True
            await self._peer_edge.shutdown(self.config.timeouts.shutdown_grace_s)
        if self.spawner is not None:
            await self.spawner.stop()  # while the control socket is open: they say bye
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.prober.close()
        await self.control.close()
        await self.forwarder.close()
        if self.journal is not None:
            self.journal.close()
        if self._admin is not None:
            await self._admin.cleanup()
        log.info("router stopped")

    async def _start_spawner(self) -> None:
        spawn = self.config.spawn
        assert spawn is not None
        spec = spawn_spec(spawn)
        self.spawner = Spawner(
            spec,
            control_address=self.config.control.socket,
            on_exit=self._spawned_exited,
            on_start=self._spawned_started if spec.probed else lambda spawned: None,
            secret=self.config.control.secret,
            adopted_pid=self._lease_pid,
        )
        for spawned in self.spawner.workers:
            self.core.expect(spawned.worker_id)
        await self.spawner.start()

    def _spawn_task(self, coro: Coroutine[Any, Any, object], name: str) -> None:
        """A named task, referenced until it ends (never garbage-collected mid-run)."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- events --------------------------------------------------------------

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_INTERVAL_S)
            try:
                self._tick()
            except Exception:
                # One bad tick must not end them all: without this task no lease goes
                # silent, no grace ends and no tombstone expires.
                log.exception("periodic tick failed")

    def _tick(self) -> None:
        leased = [w for w in self.core.workers if w.lease is not None]
        result = self.core.tick(self._clock(), leased)
        for worker in result.lost:
            log.warning("worker lease silent", extra={"worker": worker.id})
            self.metrics.worker_transition("lost")
            self.control.close_lease(worker)
        if result.recovery_ended:
            log.info("recovery window ended")
        if self.fleet is not None:
            for kind, key in result.expired_learned:
                self.fleet.released(kind, key)  # ended fleet-wide, as a close would
        self._maybe_compact_journal()

    def _probed_change(self, worker: Worker) -> None:
        """A static worker's probes changed its state: counted as a control worker's
        transitions are (an exit is counted by _retired, which it goes through)."""
        if worker.state is not WorkerState.EXITED:
            self.metrics.worker_transition(worker.state.value)

    def _retired(self, worker: Worker) -> None:
        log.warning("worker exited", extra={"worker": worker.id})
        self.metrics.worker_transition("exited")
        self.control.close_lease(worker)
        self.forwarder.forget(worker.id)

    def _lease_lost(self, worker: Worker) -> None:
        """Its control connection closed: if its address refuses connections too,
        it is gone now; otherwise it is lost until the grace ends."""
        self.metrics.worker_transition("lost")
        # The generation is taken now, not when the probe task first runs: a new boot's
        # hello may land in between, and the probe is about the process that left.
        check = self.check_worker(worker, generation=worker.generation)
        self._spawn_task(check, f"check-{worker.id}")

    def _spawned_started(self, spawned: SpawnedWorker) -> None:
        """A spawned worker that never says hello started: listed from now on, probed,
        and given new sessions once its health probe answers (a restarted one is a new
        generation: its old sessions stay 410)."""
        self.core.register(
            spawned.worker_id, spawned.url, WorkerOrigin.SPAWNED, self._clock(), probed=True
        )
        self.prober.start()

    def _spawned_exited(self, spawned: SpawnedWorker, returncode: int | None) -> None:
        worker = self.core.workers.get(spawned.worker_id)
        log.warning(
            "spawned worker died", extra={"worker": spawned.worker_id, "returncode": returncode}
        )
        if worker is not None and worker.state is not WorkerState.EXITED:
            self.core.retire(worker, self._clock())

    def _lease_pid(self, worker_id: str) -> int | None:
        """The pid on the other end of a worker's control connection (Unix only)."""
        worker = self.core.workers.get(worker_id)
        session = worker.lease if worker is not None else None
        return session.peer.pid if isinstance(session, ControlSession) else None

    def worker_pid(self, worker_id: str) -> int | None:
        """The pid of a worker this router spawned and runs now, or of one it adopted
        from its last run (its control connection's peer), else None."""
        if self.spawner is None:
            return None
        pid = self.spawner.pid(worker_id)
        if pid is None and worker_id in self.control.policy.spawned_ids:
            pid = self._lease_pid(worker_id)  # adopted: no process object of ours
        return pid

    def _bound_listeners(self) -> list[UpstreamAddress]:
        """The addresses the listeners are bound at (a config's port 0 included)."""
        bound = [
            UpstreamAddress("", host, port)
            for host, port in (
                (self.config.listen.host, self.public_port),
                (self.config.admin.host, self.admin_port),
            )
            if port
        ]
        control = self.config.control.tcp_address
        if control is not None and self.control.tcp_port:
            bound.append(UpstreamAddress("", control[0], self.control.tcp_port))
        return bound

    # -- reload ----------------------------------------------------------------

    def reload(self, new: Config) -> ReloadPlan:
        """Apply what `new` changes that a running router can change (see
        router.service.reload); the claim table and in-flight requests are untouched.
        Raises ConfigError (the running restart-only sections and `new` do not go
        together) or ValueError, before changing anything, if `new` cannot be applied."""
        plan = plan_reload(self.config, new)
        target = effective_config(self.config, new, source=self.config_path or "<reload>")
        # May raise: nothing is applied yet.
        reader = SessionReader(session_kinds(target), target.path_prefixes)
        if self.spawner is not None:
            # Workers it starts from now on must say hello with the secret the control
            # policy below will check (may raise ValueError: still nothing applied).
            self.spawner.set_secret(target.control.secret)
        self.core.settings = core_settings(target)
        self.core.claims.tombstone_ttl_s = target.claims.tombstone_ttl_s
        self.core.claims.max_tombstones = target.claims.max_tombstones
        self.handler.sessions = reader
        self.metrics.add_kinds(kind.name for kind in target.sessions)
        self.handler.max_body_bytes = target.limits.max_body_bytes
        self.handler.access_log = target.log.access
        self.forwarder.max_body_bytes = target.limits.max_body_bytes
        self.forwarder.end_to_end = end_to_end_headers(target.session_headers)
        self.control.set_policy(control_policy(target, self.boot, self._bound_listeners()))
        self.forwarder.set_timeouts(forward_timeouts(target))
        self.forwarder.set_buffering(forward_buffering(target))
        self.forwarder.pool_size = target.limits.worker_connections  # pools opened from now on
        if self._edge is not None:
            self._edge.set_limits(edge_limits(target))
        self.prober.path = target.health.path
        self.prober.interval_s = target.health.interval_s
        self.prober.timeout_s = target.health.timeout_s
        sync_static_workers(self.core, self.prober, target.workers, self._clock())
        if target.log != self.config.log:
            setup_logging(target.log)
        self.config = target
        log.info(
            "config reloaded",
            extra={"applied": list(plan.applied), "needs_restart": list(plan.needs_restart)},
        )
        return plan

    async def reload_from_file(self) -> ReloadPlan:
        """Reload from the file the router was started with. Raises ConfigError
        (bad file, or not a regular file), ValueError (cannot apply) or LookupError
        (no file: a demo).

        The file (and the secret files it names) is read in a thread: a slow disk
        must not stall the event loop. One reload at a time, in the order asked."""
        path = self.config_path
        if path is None:
            raise LookupError("this router was not started from a config file")
        async with self._reload_lock:
            new = await asyncio.to_thread(load_config, path)
            return self.reload(new)

    async def check_worker(self, worker: Worker, generation: int | None = None) -> bool:
        """Probe `worker`'s address; retire it if nothing listens. True if it is gone.
        `generation`: the process generation the probe is about (default: the current)."""
        about = worker.generation if generation is None else generation
        gone = await check_worker(
            self.core,
            self.prober,
            worker,
            generation=about,
            connect_timeout_s=self.config.timeouts.connect_s,
            clock=self._clock,
        )
        if gone or worker.origin is not WorkerOrigin.SPAWNED or self.spawner is None:
            return gone
        # A process of ours: whether it runs is ours to know. Killed a moment ago, it may
        # still accept the probe's connect while it dies; its exit reaches the spawner
        # within milliseconds (and retires it, through _spawned_exited).
        if await self.spawner.exits_within(worker.id, SPAWN_EXIT_WAIT_S):
            if worker.state is not WorkerState.EXITED and worker.generation == about:
                self.core.retire(worker, self._clock())
            return True
        return False


# The skipped journal lines named one by one in the log; the rest are counted.
_SKIPPED_LINES_LOGGED = 20


def _log_skipped(path: str, skipped: list[SkippedLine]) -> None:
    for line in skipped[:_SKIPPED_LINES_LOGGED]:
        log.warning(
            "journal line skipped",
            extra={"path": path, "line": line.number, "reason": line.reason},
        )
    if len(skipped) > _SKIPPED_LINES_LOGGED:
        log.warning(
            "journal lines skipped",
            extra={"path": path, "bad_lines": len(skipped)},
        )


def edge_counts(edge: EdgeServer) -> EdgeCounts:
    """What the public server counted, for the metrics (read at scrape time)."""
    return EdgeCounts(
        open_connections=len(edge.connections),
        refused_at_limit=edge.refused_at_limit,
        idle_closed_for_room=edge.idle_closed_for_room,
        head_bytes_held=edge.head_bytes_held,
        heads_over_budget=edge.heads_over_budget,
    )
