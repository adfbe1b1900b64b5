"""Stopping a directory task whose first cancel is lost (as redis-py can lose one)."""

from __future__ import annotations

import asyncio
import contextlib

from router.directory import cancel_and_wait


async def test_a_task_that_swallows_its_first_cancel_is_cancelled_again_until_it_ends() -> None:
    swallowed = 0

    async def beating() -> None:
        nonlocal swallowed
        for _ in range(1000):  # bounded: 10 s at most
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1  # a library losing the first cancel

    task = asyncio.get_running_loop().create_task(beating(), name="swallows-one")
    await asyncio.sleep(0.02)
    assert await cancel_and_wait(task, every_s=0.02, tries=50)
    assert task.cancelled() and swallowed == 1


async def test_a_task_that_never_ends_is_given_up_after_its_tries() -> None:
    stop = asyncio.Event()

    async def stubborn() -> None:
        for _ in range(1000):  # bounded: 10 s at most
            if stop.is_set():
                return
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)

    task = asyncio.get_running_loop().create_task(stubborn(), name="stubborn")
    await asyncio.sleep(0.02)  # running: a task cancelled before its start just ends
    assert not await cancel_and_wait(task, every_s=0.01, tries=3)
    assert not task.done()
    stop.set()
    await asyncio.wait({task}, timeout=5)
    assert task.done()


async def test_a_task_already_done_is_left_alone() -> None:
    async def quick() -> None:
        return None

    task = asyncio.get_running_loop().create_task(quick(), name="quick")
    await task
    assert await cancel_and_wait(task)
