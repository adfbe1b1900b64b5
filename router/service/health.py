"""Probing workers: a bare connect to tell 'gone' from 'busy', and HTTP health
checks for the workers with no control connection to lose: static ones, and spawned
ones that never say hello.

I/O only: outcomes go to `RouterCore.probe_result`, which decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

from router.core import RouterCore, Worker, WorkerOrigin, WorkerState

log = logging.getLogger("episode_router.health")

_GONE_ERRNOS = (errno.ECONNREFUSED, errno.ENOENT)


async def probe_connect(url: str, timeout_s: float) -> str:
    """Open and close a connection to `url`: 'ok', 'refused' or 'timeout'.

    'refused' means nothing listens there any more (ECONNREFUSED, or a Unix
    socket file that is gone): the process that held the address exited.
    """
    try:
        async with asyncio.timeout(timeout_s):
            if url.startswith("unix:"):
                _, writer = await asyncio.open_unix_connection(url[len("unix:") :])
            else:
                parts = urlsplit(url)
                _, writer = await asyncio.open_connection(parts.hostname, parts.port)
    except TimeoutError:
        return "timeout"
    except OSError as exc:
        return "refused" if exc.errno in _GONE_ERRNOS else "timeout"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return "ok"


class HealthProber:
    """Probes every static worker on an interval and reports to the core."""

    def __init__(
        self,
        core: RouterCore,
        *,
        path: str,
        interval_s: float,
        timeout_s: float,
        on_change: Callable[[Worker], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core = core
        self.path = path
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._on_change = on_change
        self._clock = clock
        self._failures: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        """Start probing (again a no-op once started)."""
        if self._task is not None:
            return
        self._session = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar())
        self._task = asyncio.create_task(self._run(), name="health-prober")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    async def probe_all(self) -> None:
        # Static workers always (one that exited may come back); a spawned one while its
        # process runs (the spawner registers it again when it restarts).
        statics = [
            w
            for w in self.core.workers
            if w.origin is WorkerOrigin.STATIC or (w.probed and w.state is not WorkerState.EXITED)
        ]
        outcomes = await asyncio.gather(*(self.probe(w) for w in statics))
        now = self._clock()
        for worker, outcome in zip(statics, outcomes, strict=True):
            self.report(worker, outcome, now)

    def report(self, worker: Worker, outcome: str, now: float) -> None:
        if self.core.workers.get(worker.id) is not worker:
            # Removed (by a reload) while the probe was out: its answer brings nothing back.
            self._failures.pop(worker.id, None)
            return
        failures = self._failures.get(worker.id, 0) + 1 if outcome == "refused" else 0
        self._failures[worker.id] = failures
        if self.core.probe_result(worker, outcome, failures, now):
            log.info(
                "static worker state changed",
                extra={"worker": worker.id, "state": worker.state.value, "probe": outcome},
            )
            self._on_change(worker)

    async def probe(self, worker: Worker) -> str:
        """'ok' for any reply under 500, 'timeout' for no reply in time or a 5xx,
        'refused' when nothing listens."""
        assert self._session is not None
        connector_url, path = _probe_target(worker.url, self.path)
        try:
            if connector_url is None:
                url = worker.url.rstrip("/") + path
                timeout = aiohttp.ClientTimeout(total=self.timeout_s)
                async with self._session.get(url, timeout=timeout) as reply:
                    return "ok" if reply.status < 500 else "timeout"
            async with (
                aiohttp.ClientSession(
                    connector=aiohttp.UnixConnector(path=connector_url),
                    timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                ) as unix_session,
                unix_session.get("http://localhost" + path) as reply,
            ):
                return "ok" if reply.status < 500 else "timeout"
        except aiohttp.ClientConnectorError as exc:
            return "refused" if exc.os_error.errno in _GONE_ERRNOS else "timeout"
        except (TimeoutError, aiohttp.ClientError):
            return "timeout"

    async def _run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)


def _probe_target(url: str, path: str) -> tuple[str | None, str]:
    if url.startswith("unix:"):
        return url[len("unix:") :], path
    return None, path
