"""Spawn mode: the worker processes the router starts, restarts and stops itself.

This module owns the `spawn:` configuration at run time (design §3 "Restart",
§5): it turns the operator's command template into one argument vector per
worker, starts each worker in a session and process group of its own (so a
signal aimed at the router's group misses it, and it can outlive a router
crash), restarts a worker that exits, with a growing delay while it keeps
failing fast, and stops every worker's whole process group at shutdown.

It must never run the template through a shell, signal anything but the
process groups it started, pipe a child's output (nothing would read it, and a
full pipe would hang the child), or let a worker's failure escape into the
router: every exit, and every start that fails, is reported through `on_exit`
and retried.

Rendering the command, the children's environment and the backoff are pure
functions in `router.service.spawn_plan` (its public names are re-exported here);
`Spawner` is the asyncio glue around them, with one named supervisor task per
worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping

from router.service.spawn_plan import (
    ENV_PREFIX,
    FIRST_BACKOFF_S,
    MAX_BACKOFF_S,
    PLACEHOLDERS,
    STABLE_RUN_S,
    SpawnedWorker,
    SpawnSpec,
    check_env,
    child_env,
    next_restart,
    plan_workers,
    render_command,
    render_cwd,
    render_env,
    restart_delay,
)

__all__ = [
    "ADOPT_POLL_S",
    "ADOPT_PROBE_TIMEOUT_S",
    "ENV_PREFIX",
    "FIRST_BACKOFF_S",
    "GROUP_POLL_S",
    "KILL_WAIT_S",
    "MAX_BACKOFF_S",
    "PLACEHOLDERS",
    "STABLE_RUN_S",
    "SpawnSpec",
    "SpawnedWorker",
    "Spawner",
    "next_restart",
    "plan_workers",
    "render_command",
    "render_cwd",
    "render_env",
    "restart_delay",
]

logger = logging.getLogger("episode_router.spawn")  # under the router's own logging

GROUP_POLL_S = 0.05  # how often stop() checks that a group's last member is gone
KILL_WAIT_S = 5.0  # after SIGKILL only uninterruptible sleep can delay an exit; don't hang on it
ADOPT_POLL_S = 1.0  # an adopted worker's port is re-checked this often, to respawn once it is free
ADOPT_PROBE_TIMEOUT_S = 1.0  # loopback answers at once; no answer in this time counts as free


class Spawner:
    """Starts, restarts and stops the worker processes of one SpawnSpec.

    `on_exit(worker, returncode)` is called from the event loop each time a
    worker's process exits while the spawner is not stopping, before it is
    restarted; `returncode` is negative for a signal and None when the process
    could not be started at all. Raises ValueError for a template or
    environment that cannot start a process.
    """

    def __init__(
        self,
        spec: SpawnSpec,
        *,
        control_address: str,
        on_exit: Callable[[SpawnedWorker, int | None], None],
        on_start: Callable[[SpawnedWorker], None] = lambda worker: None,
        extra_env: Mapping[str, str] | None = None,
        secret: str | None = None,
        adopted_pid: Callable[[str], int | None] = lambda worker_id: None,
    ) -> None:
        check_env(extra_env or {}, control_address, secret)
        self.spec = spec
        self.workers = plan_workers(spec)
        self._on_exit = on_exit
        self._on_start = on_start
        # The pid of a worker adopted from a previous run (we have no Process for it),
        # from its control connection; the last one seen, for when that is down.
        self._adopted_pid = adopted_pid
        self._adopted_seen: dict[str, int] = {}
        self._argv = {w.worker_id: render_command(spec, w) for w in self.workers}
        self._cwd = {w.worker_id: render_cwd(spec, w) for w in self.workers}
        self._env = {w.worker_id: render_env(spec, w) for w in self.workers}
        self._control_address = control_address
        self._extra_env = dict(extra_env or {})
        self._inherited = dict(os.environ)  # the router's environment when it started
        self._secret = secret
        self._procs: dict[str, asyncio.subprocess.Process] = {}
        self._supervisors: dict[str, asyncio.Task[None]] = {}
        self._stopping = asyncio.Event()

    async def start(self) -> None:
        """Start every worker's process; return once each has been started once.

        A process that could not be started is reported and retried in the
        background. Raises RuntimeError when called twice or after stop().
        """
        if self._supervisors or self._stopping.is_set():
            raise RuntimeError("a Spawner starts once, and not after stop()")
        loop = asyncio.get_running_loop()
        first_starts = []
        for worker in self.workers:
            first_start: asyncio.Future[None] = loop.create_future()
            task = asyncio.create_task(
                self._supervise(worker, first_start), name=f"spawn-supervise-{worker.worker_id}"
            )
            task.add_done_callback(_log_supervisor_end)
            self._supervisors[worker.worker_id] = task
            first_starts.append(first_start)
        await asyncio.gather(*first_starts)

    def set_secret(self, secret: str | None) -> None:
        """Give every worker started from now on `secret` (a reload rotated it); running
        ones keep the one they started with. Raises ValueError for a secret that no
        environment can hold, changing nothing."""
        check_env({}, self._control_address, secret)
        self._secret = secret

    def pid(self, worker_id: str) -> int | None:
        """Return the pid of the worker's running process, or None (not running, or unknown)."""
        proc = self._procs.get(worker_id)
        return proc.pid if proc is not None and proc.returncode is None else None

    async def exits_within(self, worker_id: str, timeout_s: float) -> bool:
        """True when the worker's process has exited, or exits within `timeout_s`: the
        spawner, its parent, is the authority on whether it runs (a process killed a
        moment ago may still accept a connection while it dies)."""
        proc = self._procs.get(worker_id)
        if proc is None or proc.returncode is not None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), timeout_s)
        except TimeoutError:
            return False
        return True

    async def stop(self) -> None:
        """Stop every worker: SIGTERM to its process group, SIGKILL after stop_timeout_s.

        Returns once every group is gone. No worker restarts once this began.
        Calling it again, or before start(), is harmless.
        """
        self._stopping.set()
        await asyncio.gather(*self._supervisors.values(), return_exceptions=True)

    async def _supervise(self, worker: SpawnedWorker, first_start: asyncio.Future[None]) -> None:
        try:
            proc, started_at = await self._launch(worker, first_start)
        finally:
            if not first_start.done():  # start() may have been cancelled meanwhile
                first_start.set_result(None)
        failures = 0
        while True:
            returncode = None if proc is None else await self._wait_exit_or_stop(worker, proc)
            if self._stopping.is_set():
                if proc is not None:
                    await self._terminate(worker, proc)
                return
            ran_s = None if proc is None else time.monotonic() - started_at
            if proc is not None:
                # Whatever the leader left behind in its group (a wrapper's server) would hold
                # the port and serve a dead worker's episodes: it goes with its leader.
                _signal_group(proc.pid, signal.SIGKILL)
            self._report_exit(worker, returncode)
            delay, failures = next_restart(failures, ran_s)
            if await self._stop_requested_within(delay):
                return
            proc, started_at = await self._launch(worker)

    async def _launch(
        self, worker: SpawnedWorker, first_start: asyncio.Future[None] | None = None
    ) -> tuple[asyncio.subprocess.Process | None, float]:
        await self._adopt_while_listening(worker, first_start)
        if self._stopping.is_set():
            return None, time.monotonic()  # stopped while adopting: start nothing
        argv = self._argv[worker.worker_id]
        # Built at each launch, not once: a restart after a reload gets the current secret.
        extra = {**self._extra_env, **self._env[worker.worker_id]}
        env = child_env(
            worker, self._control_address, self._secret, extra, inherited=self._inherited
        )
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self._cwd[worker.worker_id],
                start_new_session=True,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            logger.error("spawn: worker %s: cannot start %s: %s", worker.worker_id, argv[0], exc)
            return None, time.monotonic()
        self._procs[worker.worker_id] = proc
        logger.info("spawn: worker %s started, pid %d", worker.worker_id, proc.pid)
        self._on_start(worker)
        return proc, time.monotonic()

    async def _adopt_while_listening(
        self, worker: SpawnedWorker, first_start: asyncio.Future[None] | None
    ) -> None:
        """While something listens on the worker's port, start nothing.

        After a router restart, the workers of the previous run are still there
        (each in its own session) and reconnect over the control socket: they
        are adopted, not respawned, and count as started. Once the port refuses
        connections, the process that held it is gone and a new one starts. A
        stop while adopting stops the adopted process (its pid comes from its
        control connection) like one of our own.
        """
        said = False
        while not self._stopping.is_set() and await _port_listening(self.spec.host, worker.port):
            pid = self._adopted_pid(worker.worker_id)
            if pid is not None:
                self._adopted_seen[worker.worker_id] = pid  # kept: its lease may be down at stop
            if not said:
                # A warning: on a first start this is a process the router did not start
                # (a stale worker, or anything else), and it takes the worker's place.
                logger.warning(
                    "spawn: worker %s: port %d in use, adopting the process there",
                    worker.worker_id,
                    worker.port,
                )
                said = True
                if first_start is not None and not first_start.done():
                    first_start.set_result(None)
            if await self._stop_requested_within(ADOPT_POLL_S):
                await self._stop_adopted(worker)
                return

    async def _stop_adopted(self, worker: SpawnedWorker) -> None:
        pid = self._adopted_pid(worker.worker_id) or self._adopted_seen.get(worker.worker_id)
        if pid is None:
            logger.warning("spawn: worker %s: adopted, pid unknown: left running", worker.worker_id)
            return
        pgid = _adopted_group(worker, pid)
        if pgid is None:
            return
        gone_by = functools.partial(_members_gone_by, pgid)
        await self._term_then_kill(f"{worker.worker_id} (adopted)", pgid, gone_by)

    async def _term_then_kill(
        self, name: str, pgid: int, gone_by: Callable[[float], Awaitable[bool]]
    ) -> None:
        """SIGTERM to process group `pgid`, then SIGKILL if `gone_by(deadline)` says it
        outlived stop_timeout_s.

        After SIGKILL it waits again, for at most KILL_WAIT_S: a killed process is not
        gone at once (it exits on its way out of the kernel), and each member of the
        group dies on its own, so the group is gone only once `gone_by` says so.
        """
        _signal_group(pgid, signal.SIGTERM)
        if await gone_by(time.monotonic() + self.spec.stop_timeout_s):
            return
        logger.warning(
            "spawn: worker %s still running %.1f s after SIGTERM; sending SIGKILL",
            name,
            self.spec.stop_timeout_s,
        )
        _signal_group(pgid, signal.SIGKILL)
        if not await gone_by(time.monotonic() + KILL_WAIT_S):
            logger.error("spawn: worker %s: process group %d survived SIGKILL", name, pgid)

    async def _wait_exit_or_stop(
        self, worker: SpawnedWorker, proc: asyncio.subprocess.Process
    ) -> int | None:
        exited = asyncio.create_task(proc.wait(), name=f"spawn-wait-{worker.worker_id}")
        stopping = asyncio.create_task(self._stopping.wait(), name=f"spawn-stop-{worker.worker_id}")
        try:
            await asyncio.wait((exited, stopping), return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
            stopping.cancel()
        return proc.returncode

    async def _stop_requested_within(self, delay: float) -> bool:
        if delay <= 0:
            return self._stopping.is_set()
        try:
            await asyncio.wait_for(self._stopping.wait(), delay)
        except TimeoutError:
            return False
        return True

    def _report_exit(self, worker: SpawnedWorker, returncode: int | None) -> None:
        if returncode is not None:  # a start that failed was logged with its reason already
            logger.warning("spawn: worker %s exited with %s", worker.worker_id, returncode)
        try:
            self._on_exit(worker, returncode)
        except Exception:
            logger.exception("spawn: on_exit failed for worker %s", worker.worker_id)

    async def _terminate(self, worker: SpawnedWorker, proc: asyncio.subprocess.Process) -> None:
        gone_by = functools.partial(_group_gone_by, proc)
        await self._term_then_kill(worker.worker_id, proc.pid, gone_by)


async def _group_gone_by(proc: asyncio.subprocess.Process, deadline: float) -> bool:
    """Wait until the process and every member of its group exited; False at the deadline."""
    try:
        await asyncio.wait_for(proc.wait(), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        return False
    # Bounded by the deadline: a wrapper's child may still be shutting down after its leader.
    return await _members_gone_by(proc.pid, deadline)


async def _members_gone_by(pgid: int, deadline: float) -> bool:
    """Poll until no member of group `pgid` runs; False at the deadline. Polling: the
    kernel tells nobody but a parent when a process ends."""
    while _group_running(pgid):
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(GROUP_POLL_S)
    return True


async def _port_listening(host: str, port: int) -> bool:
    """True if a connect to host:port succeeds (refused, or no answer in time: False)."""
    try:
        async with asyncio.timeout(ADOPT_PROBE_TIMEOUT_S):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


def _adopted_group(worker: SpawnedWorker, pid: int) -> int | None:
    """The process group to stop for an adopted worker whose control connection comes from
    `pid`, or None (logged) when there is none to signal.

    The pid on the connection is the server, which a wrapper (`sh -c ...`) may have
    started as a child: the group its previous router started is the server's group,
    not a group numbered `pid`.
    """
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        logger.info("spawn: worker %s (adopted, pid %d) already exited", worker.worker_id, pid)
        return None
    except OSError as exc:
        logger.error("spawn: worker %s: cannot find pid %d's group: %s", worker.worker_id, pid, exc)
        return None
    if pgid == os.getpgrp():
        # Never ours to stop: every worker a router spawns leads a session of its own, so
        # this one was started some other way, and the group holds this router too.
        logger.error(
            "spawn: worker %s (adopted, pid %d) is in the router's own process group: left running",
            worker.worker_id,
            pid,
        )
        return None
    return pgid


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass  # the whole group already exited
    except PermissionError:
        logger.error("spawn: not allowed to signal process group %d", pgid)


def _group_running(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _group_has_live_member(pgid)


def _group_has_live_member(pgid: int) -> bool:
    """Tell whether a group has a member that is not a zombie.

    kill() succeeds on zombies too, and orphaned members stay zombies for good
    when nothing reaps them (a container whose init does not reap). On Linux,
    /proc tells them apart; elsewhere the group counts as running. This reads
    /proc synchronously: it runs only during stop(), while a group lingers.
    """
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as stat_file:
                stat = stat_file.read()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def _log_supervisor_end(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("spawn: %s failed", task.get_name(), exc_info=task.exception())
