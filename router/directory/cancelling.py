"""Stopping a task that runs directory calls: cancelled, and cancelled again while it runs on.

A cancellation that reaches a task inside a redis-py call can be lost there: the call
returns its reply (or raises its own error) with the cancel request still pending on
the task, and the task goes on to its next beat or retry. Seen in the fleet's tests: a
router's heartbeat task kept beating, `cancelling()` at 1, while its `stop()` waited
on it forever. So the task is cancelled again every `every_s` until it ends, a bounded
number of times.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("episode_router.directory")

CANCEL_EVERY_S = 0.1
# 100 tries, 10 s: far longer than any directory call's deadline (claim_timeout_s).
CANCEL_TRIES = 100


async def cancel_and_wait(
    task: asyncio.Task[None], every_s: float = CANCEL_EVERY_S, tries: int = CANCEL_TRIES
) -> bool:
    """Cancel `task` until it is done; whether it ended within `tries` cancels (it is
    left running, and logged, if not)."""
    cancels = 0
    while not task.done() and cancels < tries:
        task.cancel()
        cancels += 1
        await asyncio.wait({task}, timeout=every_s)
    if not task.done():
        log.warning("a directory task did not stop", extra={"task": task.get_name()})
        return False
    if cancels > 1:
        log.info(
            "a cancel was lost in a directory call: delivered again",
            extra={"task": task.get_name(), "cancels": cancels},
        )
    if not task.cancelled() and task.exception() is not None:
        log.warning("a directory task failed as it stopped: %s", task.exception())
    return True
