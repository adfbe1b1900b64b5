"""The heartbeat loop: a router's lease kept alive, and the fleet swept, in one named task.

Every third of a lease it runs the heartbeat script, then a sweep. When the directory
answers FENCED or LOST, it calls `on_fenced` with that standing: the router retires
its claims (410) and registers again (design §10, "Writes and fencing"). A directory
that does not answer is logged, once per outage, and tried again at the next beat.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from router.directory.cancelling import cancel_and_wait
from router.directory.client import Directory
from router.directory.errors import DirectoryError
from router.directory.records import Standing

log = logging.getLogger("episode_router.directory")


class HeartbeatLoop:
    """Keeps one `Directory`'s lease alive until `stop()`."""

    def __init__(
        self,
        directory: Directory,
        on_fenced: Callable[[Standing], Awaitable[None]],
        interval_s: float | None = None,
        on_renewed: Callable[[float], None] = lambda sent_at: None,
    ) -> None:
        self._directory = directory
        self._on_fenced = on_fenced
        # Told, after each beat the directory answered OK, the loop time the beat was
        # sent at: the lease runs one lease_ttl_s from no earlier than that.
        self._on_renewed = on_renewed
        self._interval_s = (
            interval_s if interval_s is not None else directory.settings.heartbeat_interval_s
        )
        if self._interval_s * 1000 >= directory.settings.quiet_ms:
            # A fleet whose beats come further apart than that is always "quiet": its
            # grace would never end, and no lapsed lease would ever count as dead.
            raise ValueError("the heartbeat interval must be shorter than half a lease")
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self.beats = 0  # heartbeats the directory answered OK

    def start(self) -> None:
        if self._task is None:
            name = f"directory-heartbeat-{self._directory.settings.router_id}"
            self._task = asyncio.get_running_loop().create_task(self._run(), name=name)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            await cancel_and_wait(task)

    async def _run(self) -> None:
        while True:
            if not await self.beat_once():
                return
            await asyncio.sleep(self._interval_s)

    async def beat_once(self) -> bool:
        """One heartbeat and sweep; FENCED or LOST goes to the callback, after which the
        loop ends (the router registers again and starts a new one): False then."""
        try:
            sent_at = asyncio.get_running_loop().time()
            beat = await self._directory.heartbeat()
            if beat.standing is Standing.OK:
                self.beats += 1
                self._on_renewed(sent_at)
                await self._directory.sweep()
        except DirectoryError as error:
            if not self._failing:
                log.warning("directory heartbeat failed (retrying every beat): %s", error)
            self._failing = True
            return True
        if self._failing:
            log.info("directory heartbeat answered again")
        self._failing = False
        if beat.standing is Standing.OK:
            return True
        log.warning("this router is %s in the directory", beat.standing.value)
        self._task = None  # this task ends with the callback: start() makes a new one
        await self._on_fenced(beat.standing)
        return False
