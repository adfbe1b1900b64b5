"""Where this router's workers listen, published for the routers on its host (design §10,
shape B): they forward a key's request straight to the worker that holds it, with its
boot, instead of through this router's peer listener.

A worker is published while it is live (or unhealthy: its sessions go on) with the boot
of a hello: its process says so itself, and refuses a request with another boot (the
bundled middleware), so a process that took its address over never serves its
predecessor's episodes. Anything else (a worker lost, exited, forgotten, static, or
restored from the journal and not heard from yet) is withdrawn: its keys go through this
router, whose own table answers them. A worker's reference names its process (its id
and its generation here), so the keys a process held never point to its successor.

`PublishedWorkers` keeps what this incarnation has published and the changes that wait
to be written; the fleet link writes them once a loop turn, and everything again after
each registration (a new incarnation has an empty table). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from router.core import Worker, WorkerOrigin, WorkerState
from router.directory.records import encode_worker

# Worker states whose sessions are forwarded to it: LOST ones are too, within the
# reconnect grace, but through this router only, which answers 410 once the grace ends.
_PUBLISHED_STATES = (WorkerState.LIVE, WorkerState.UNHEALTHY)
_HELLO_ORIGINS = (WorkerOrigin.CONTROL, WorkerOrigin.SPAWNED)


def worker_reference(worker: Worker) -> str:
    """The reference an owner record keeps for the process `worker` is now ("" for a
    worker that never said hello: nothing of it is published)."""
    if worker.boot is None or worker.origin not in _HELLO_ORIGINS:
        return ""
    return f"{worker.generation}/{worker.id}"


def published_value(worker: Worker) -> str:
    """What the directory holds for `worker` now: its address and boot, or "" (withdrawn)."""
    boot = worker.boot
    if (
        boot is None
        or worker.origin not in _HELLO_ORIGINS
        or worker.state not in _PUBLISHED_STATES
        or " " in worker.url
    ):
        return ""
    return encode_worker(worker.url, boot)


class PublishedWorkers:
    """This incarnation's published workers, and the changes not written yet."""

    __slots__ = ("_pending", "_published", "_reference")

    def __init__(self) -> None:
        self._published: dict[str, str] = {}  # reference -> value, as last written
        self._pending: dict[str, str] = {}  # reference -> value ("": withdraw)
        self._reference: dict[str, str] = {}  # worker id -> its current reference

    def __len__(self) -> int:
        return len(self._published)

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def changed(self, worker: Worker) -> bool:
        """`worker` changed (a hello, a loss, an exit, a probe): whether a write waits now."""
        reference = worker_reference(worker)
        before = self._reference.get(worker.id)
        if before is not None and before != reference:
            self._want(before, "")  # its previous process: withdrawn
        if reference:
            self._reference[worker.id] = reference
            self._want(reference, published_value(worker))
        else:
            self._reference.pop(worker.id, None)
        return bool(self._pending)

    def _want(self, reference: str, value: str) -> None:
        if self._published.get(reference, "") == value:
            self._pending.pop(reference, None)
        else:
            self._pending[reference] = value

    def restart(self, workers: Iterable[Worker]) -> None:
        """A new incarnation: its table starts empty, so every worker is written anew."""
        self._published.clear()
        self._pending.clear()
        self._reference.clear()
        for worker in workers:
            self.changed(worker)

    def take(self) -> list[tuple[str, str]]:
        """The changes to write now, counted as written (`failed` puts them back)."""
        changes = list(self._pending.items())
        self._pending.clear()
        for reference, value in changes:
            if value:
                self._published[reference] = value
            else:
                self._published.pop(reference, None)
        return changes

    def failed(self, changes: Iterable[tuple[str, str]]) -> None:
        """A write of `changes` did not go through: each waits again, unless a later
        change of its reference waits already."""
        for reference, value in changes:
            if reference not in self._pending:
                # As if not written: undo its bookkeeping, then want it again.
                self._published.pop(reference, None)
                self._pending[reference] = value
