"""The worker registry: who the workers are, their lease states, and balancing.

A worker is known by its id. Its lease (design §3) moves through:

    live ──connection closed / silent──▶ lost ──grace over / connect refused──▶ exited
      ▲                                   │
      └──────── same-boot hello ──────────┘

Static workers (configured, no control connection) are live until their
health probes fail; a timeout only makes them unhealthy. Draining is a flag
beside the state: a draining worker gets no new sessions.

Pure and synchronous: no asyncio, no sockets, no clock reads.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator


class WorkerState(enum.Enum):
    LIVE = "live"
    # A probed worker whose probes time out, or a spawned one whose probe has not
    # answered yet: no new sessions, its sessions go on.
    UNHEALTHY = "unhealthy"
    LOST = "lost"  # lease gone, within the reconnect grace: still forwarded to
    EXITED = "exited"


class WorkerOrigin(enum.Enum):
    CONTROL = "control"  # said hello on the control socket
    STATIC = "static"  # configured under `workers:`
    SPAWNED = "spawned"  # started by the router; speaks on the control socket
    JOURNAL = "journal"  # recorded by a previous run, not heard from yet


class Worker:
    """One worker process as the router sees it."""

    __slots__ = (
        "boot",
        "drained_by_worker",
        "draining",
        "generation",
        "id",
        "in_flight",
        "last_heard",
        "lease",
        "lost_since",
        "origin",
        "probed",
        "recent",
        "recent_before",
        "state",
        "url",
    )

    def __init__(
        self, worker_id: str, url: str, origin: WorkerOrigin, now: float, boot: str | None = None
    ) -> None:
        self.id = worker_id
        self.url = url
        self.origin = origin
        self.boot = boot
        self.state = WorkerState.LIVE
        self.draining = False
        # Set when the worker itself asked to drain: its process's wish, which a
        # new process (a new boot) does not inherit. An operator's drain stays.
        self.drained_by_worker = False
        self.generation = 0
        self.in_flight = 0
        self.last_heard = now
        self.lost_since: float | None = None
        # The control connection that holds this worker's lease (opaque here).
        self.lease: object | None = None
        # Health-probed (a static worker, or a spawned one that never says hello): its
        # probes, not a lease, say whether it takes new sessions.
        self.probed = origin is WorkerOrigin.STATIC
        # Sessions used in the current activity window, and in the one before
        # (RouterCore counts them; ACTIVE_WINDOW_S): what balancing weighs.
        self.recent = 0
        self.recent_before = 0

    @property
    def recent_sessions(self) -> int:
        """How many of its sessions were used lately: in this activity window or the last."""
        return self.recent + self.recent_before

    def roll_window(self, windows_passed: int) -> None:
        """A new activity window began (`windows_passed` of them since the last roll)."""
        self.recent_before = self.recent if windows_passed == 1 else 0
        self.recent = 0

    @property
    def accepts_new_sessions(self) -> bool:
        return self.state is WorkerState.LIVE and not self.draining

    @property
    def forwardable(self) -> bool:
        """Requests for sessions it holds may still be sent to it."""
        return self.state is not WorkerState.EXITED

    def __repr__(self) -> str:
        return f"Worker({self.id} {self.state.value} {self.url})"


class WorkerRegistry:
    """Workers by id, with the balancing rule for sessionless requests."""

    def __init__(self) -> None:
        self._workers: dict[str, Worker] = {}

    def get(self, worker_id: str) -> Worker | None:
        return self._workers.get(worker_id)

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self._workers.values()))

    def __len__(self) -> int:
        return len(self._workers)

    def add(self, worker: Worker) -> None:
        self._workers[worker.id] = worker

    def remove(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def by_url(self, url: str) -> Worker | None:
        for worker in self._workers.values():
            if worker.url == url and worker.state is not WorkerState.EXITED:
                return worker
        return None

    def any_live(self) -> bool:
        return any(w.state is WorkerState.LIVE for w in self._workers.values())

    def pick(
        self, held_count: Callable[[str], int], exclude: frozenset[str] = frozenset()
    ) -> Worker | None:
        """The live, non-draining worker with the fewest sessions used lately, then the
        fewest requests in flight, then the fewest claims, then the lowest id (so ties
        are deterministic). Claims nobody uses any more (a server that never closes its
        sessions) weigh only in the last place: they are no load."""
        best: Worker | None = None
        best_rank: tuple[int, int, int, str] | None = None
        for worker in self._workers.values():
            if not worker.accepts_new_sessions or worker.id in exclude:
                continue
            rank = (worker.recent_sessions, worker.in_flight, held_count(worker.id), worker.id)
            if best_rank is None or rank < best_rank:
                best, best_rank = worker, rank
        return best
