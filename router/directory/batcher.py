"""The event-loop half of the batcher: callers of one loop turn share one script call.

`ask(key)` queues the key and schedules a flush with `call_soon`, which runs after
every callback already ready in this turn of the loop: concurrent callers that ask in
the same turn go out together (`router/directory/batching.py` keeps them, in slices).
`ask_each(keys)` does the same for many keys at once, with one future for them all
rather than one a key: the claims of one control read (hundreds, from a pipelining
worker) cost one future, not a task, a coroutine and a future each.

Deadlines: every caller of a batch asked within one loop turn, so one deadline serves
them all, counted from the first of them: the batch's call gets what is left of it,
and a caller is never kept past its own. One timer a batch, not one a caller (a timer
per caller was a quarter of the client's CPU per claim+release pair). A caller may
give up earlier on its own: that cancels only its own future.

A batcher may also be given `start(keys, seconds_left, answered)`: a send that needs
no coroutine, which writes its call and hands the answers (or the error) to
`answered` once, from whatever loop callback has them, and returns True; or returns
False when it cannot (the batch then goes the task's way). The tracked lookups use it:
a first ask's lookup waits on one round trip, and the batch's task, its coroutine
chain and its `asyncio.timeout`, with the reader task tracking.py had then, cost a
serial first ask three loop turns and 28 µs of CPU (docs/performance.md, "A first
ask, serially").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable, Sequence
from functools import partial
from typing import Generic, TypeVar, cast

from router.directory.batching import DEFAULT_BATCH_LIMIT, PendingBatch
from router.directory.errors import DirectoryReplyError, DirectoryUnavailable

K = TypeVar("K", bound=Hashable)
R = TypeVar("R")


class _Gathered(Generic[R]):
    """The answers of one `ask_each` call, filled in as the batches of its keys answer
    (its keys may span several script calls): its future is set once all are in."""

    __slots__ = ("answers", "left", "waiter")

    def __init__(self, count: int, waiter: asyncio.Future[list[R | Exception]]) -> None:
        self.answers: list[R | Exception | None] = [None] * count
        self.left = count
        self.waiter = waiter

    def give(self, index: int, answer: R | Exception) -> None:
        self.answers[index] = answer
        self.left -= 1
        if not self.left and not self.waiter.done():  # a caller that gave up cancelled it
            self.waiter.set_result(cast("list[R | Exception]", self.answers))


# Who waits for a key's answer: one `ask` caller's future, one key of an `ask_each`,
# or an `ask_then` caller's callback.
_Waiter = asyncio.Future[R] | tuple[_Gathered[R], int] | Callable[[R | Exception], None]

# A send that needs no task: (keys, seconds left, answered) -> whether it sent them.
Start = Callable[[list[K], float, Callable[[Sequence[R] | Exception], None]], bool]


class Batcher(Generic[K, R]):
    """Batches `ask(key)` and `ask_each(keys)` calls into `send(keys, seconds_left)`
    calls of at most `limit` keys; `send` must end within `seconds_left` (raising on
    its own)."""

    __slots__ = (
        "_deadline_s",
        "_first_at",
        "_limit",
        "_name",
        "_pending",
        "_send",
        "_start",
        "_tasks",
    )

    def __init__(
        self,
        name: str,
        send: Callable[[list[K], float], Awaitable[Sequence[R]]],
        deadline_s: float,
        limit: int = DEFAULT_BATCH_LIMIT,
        start: Start[K, R] | None = None,
    ) -> None:
        self._name = name
        self._send = send
        self._start = start
        self._deadline_s = deadline_s
        self._limit = limit
        self._pending: PendingBatch[K, _Waiter[R]] = PendingBatch()
        self._tasks: set[asyncio.Task[None]] = set()  # referenced until done
        self._first_at = 0.0  # loop time of the first ask since the last flush

    async def ask(self, key: K) -> R:
        """The answer for `key` from the next batch, within the deadline from the ask:
        or the error the batch's call raised (DirectoryTimeout past the deadline)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[R] = loop.create_future()
        self._wait(loop, key, waiter)
        return await waiter

    def ask_then(self, key: K, then: Callable[[R | Exception], None]) -> None:
        """`ask` without a coroutine: `then` gets the answer for `key`, or the error the
        batch's call raised, from a later loop callback (never from this call)."""
        self._wait(asyncio.get_running_loop(), key, then)

    def _wait(self, loop: asyncio.AbstractEventLoop, key: K, waiter: _Waiter[R]) -> None:
        """`waiter` waits for `key`; the first key since the last flush schedules one."""
        if self._pending.add(key, waiter):
            self._first_at = loop.time()
            loop.call_soon(self._flush)

    async def ask_each(self, keys: Sequence[K]) -> list[R | Exception]:
        """The answer for each of `keys`, in order, from the next batches (as `ask`
        would give them, with the other callers of this loop turn): each its result,
        or the error its batch's call raised. Never raises for a batch's failure."""
        if not keys:
            return []
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[list[R | Exception]] = loop.create_future()
        gathered = _Gathered(len(keys), waiter)
        pending = self._pending
        if not pending:
            self._first_at = loop.time()
            loop.call_soon(self._flush)
        add = pending.add
        for index, key in enumerate(keys):
            add(key, (gathered, index))
        return await waiter

    def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        deadline_at = self._first_at + self._deadline_s
        start = self._start
        for keys, waiters in self._pending.take(self._limit):
            if start is not None:
                answered = _Answered(keys, waiters)
                try:
                    if start(keys, max(deadline_at - loop.time(), 0.0), answered):
                        continue
                except Exception as error:  # its callers answered, not left waiting
                    answered(error)
                    continue
            answer = self._answer(keys, waiters, deadline_at)
            task = loop.create_task(answer, name=f"directory-{self._name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            # A task cancelled (at shutdown), even before it started, still answers.
            task.add_done_callback(partial(_fail_the_rest, waiters, self._name))

    async def _answer(
        self, keys: list[K], waiters: list[list[_Waiter[R]]], deadline_at: float
    ) -> None:
        try:
            left = max(deadline_at - asyncio.get_running_loop().time(), 0.0)
            results = await self._send(keys, left)
            if len(results) != len(keys):
                raise DirectoryReplyError(f"{len(keys)} keys asked, {len(results)} answers")
        except Exception as error:
            _fail(waiters, error)
            return
        _give(results, waiters)

    async def close(self) -> None:
        """Wait for the batches in flight (each is under its own deadline)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _give(results: Sequence[R], waiters: list[list[_Waiter[R]]]) -> None:
    for result, each in zip(results, waiters, strict=True):
        for waiter in each:
            if isinstance(waiter, tuple):
                gathered, index = waiter
                gathered.give(index, result)
            elif isinstance(waiter, asyncio.Future):
                if not waiter.done():  # a caller that gave up cancelled its own
                    waiter.set_result(result)
            else:
                waiter(result)


class _Answered(Generic[K, R]):
    """What a `start`ed batch hands its answers (or its error) to: its callers' waiters
    get them (the first call only; a later one is a bug of the sender's, ignored)."""

    __slots__ = ("_keys", "_waiters")

    def __init__(self, keys: list[K], waiters: list[list[_Waiter[R]]]) -> None:
        self._keys: list[K] | None = keys
        self._waiters = waiters

    def __call__(self, results: Sequence[R] | Exception) -> None:
        keys, self._keys = self._keys, None
        if keys is None:
            return
        if isinstance(results, Exception):
            _fail(self._waiters, results)
        elif len(results) != len(keys):
            error = DirectoryReplyError(f"{len(keys)} keys asked, {len(results)} answers")
            _fail(self._waiters, error)
        else:
            _give(results, self._waiters)


def _fail(waiters: list[list[_Waiter[R]]], error: Exception) -> None:
    for each in waiters:
        for waiter in each:
            if isinstance(waiter, tuple):
                gathered, index = waiter
                gathered.give(index, error)
            elif isinstance(waiter, asyncio.Future):
                if not waiter.done():
                    waiter.set_exception(error)
            else:
                waiter(error)


def _fail_the_rest(waiters: list[list[_Waiter[R]]], name: str, task: asyncio.Task[None]) -> None:
    # Only a cancelled task leaves waiters unanswered (`_answer` answers every one
    # otherwise): walking them all after every batch cost more than the batch's decoding.
    if task.cancelled():
        _fail(waiters, DirectoryUnavailable(f"the {name} batch was cancelled"))
