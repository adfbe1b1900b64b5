"""The pure half of the batcher: what was asked in one loop turn, cut into script calls.

Concurrent `lookup_one` (or `claim_one`, `release_one`) calls of one loop turn go out
as one script call. This module keeps the asked keys in order, each key once with
every caller waiting for it, and cuts them into batches of at most `limit` keys, so a
burst never becomes one script that blocks Redis for long. The event-loop glue lives
in `router/directory/batcher.py`. Pure: no asyncio.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
W = TypeVar("W")

# 256 keys a call: a lookup of that many is about one round trip plus well under a
# millisecond of script time, so one call never holds Redis up for long.
DEFAULT_BATCH_LIMIT = 256


class PendingBatch(Generic[K, W]):
    """Keys asked since the last flush, each with the callers (`W`) waiting for it."""

    __slots__ = ("_waiting",)

    def __init__(self) -> None:
        self._waiting: dict[K, list[W]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, key: K, waiter: W) -> bool:
        """Queue `waiter` for `key`; True when it is the first key since the last flush
        (the caller schedules the flush then)."""
        first = not self._waiting
        waiters = self._waiting.get(key)
        if waiters is None:
            self._waiting[key] = [waiter]
        else:
            waiters.append(waiter)
        return first

    def take(self, limit: int = DEFAULT_BATCH_LIMIT) -> Iterator[tuple[list[K], list[list[W]]]]:
        """Empty the batch: its keys in the order first asked, in slices of at most
        `limit`, each key's waiters beside it."""
        if limit < 1:
            raise ValueError("a batch limit is at least 1")
        waiting, self._waiting = self._waiting, {}
        keys = list(waiting)
        for start in range(0, len(keys), limit):
            chunk = keys[start : start + limit]
            yield chunk, [waiting[key] for key in chunk]
