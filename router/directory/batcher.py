"""The event-loop half of the batcher: callers of one loop turn share one script call.

`ask(key)` queues the key and schedules a flush with `call_soon`, which runs after
every callback already ready in this turn of the loop: concurrent callers that ask in
the same turn go out together (`router/directory/batching.py` keeps them, in slices).
Each caller has its own future and its own deadline: one that gives up cancels only
its own future, and the batch goes on for the others.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

from router.directory.batching import DEFAULT_BATCH_LIMIT, PendingBatch
from router.directory.errors import DirectoryReplyError, DirectoryTimeout

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


class Batcher(Generic[K, R]):
    """Batches `ask(key)` calls into `send(keys)` calls of at most `limit` keys."""

    __slots__ = ("_deadline_s", "_limit", "_name", "_pending", "_send", "_tasks")

    def __init__(
        self,
        name: str,
        send: Callable[[list[K]], Awaitable[Sequence[R]]],
        deadline_s: float,
        limit: int = DEFAULT_BATCH_LIMIT,
    ) -> None:
        self._name = name
        self._send = send
        self._deadline_s = deadline_s
        self._limit = limit
        self._pending: PendingBatch[K, asyncio.Future[R]] = PendingBatch()
        self._tasks: set[asyncio.Task[None]] = set()  # referenced until done

    async def ask(self, key: K) -> R:
        """The answer for `key` from the next batch; DirectoryTimeout past the deadline,
        or the error the batch's call raised."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[R] = loop.create_future()
        if self._pending.add(key, waiter):
            loop.call_soon(self._flush)
        try:
            async with asyncio.timeout(self._deadline_s):
                return await waiter
        except TimeoutError:
            raise DirectoryTimeout(f"no {self._name} answer within {self._deadline_s}s") from None

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        for keys, waiters in self._pending.take(self._limit):
            task = loop.create_task(self._answer(keys, waiters), name=f"directory-{self._name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _answer(self, keys: list[K], waiters: list[list[asyncio.Future[R]]]) -> None:
        try:
            results = await self._send(keys)
            if len(results) != len(keys):
                raise DirectoryReplyError(f"{len(keys)} keys asked, {len(results)} answers")
        except Exception as error:
            for each in waiters:
                for waiter in each:
                    if not waiter.done():
                        waiter.set_exception(error)
            return
        for result, each in zip(results, waiters, strict=True):
            for waiter in each:
                if not waiter.done():  # a caller past its deadline cancelled its own
                    waiter.set_result(result)

    async def close(self) -> None:
        """Wait for the batches in flight (each is under its own deadline)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
