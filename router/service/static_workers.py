"""What a router decides about its workers from news outside the control protocol.

`check_worker`: a worker looks gone (its control connection closed, or a forward
to it failed); a bare connect to its address says whether it is, and a
worker nothing listens for any more is retired (a static one through its health
prober, which counts the failure). `sync_static_workers`: a reload brought a new
`workers:` list; the registry's static workers are made to match it.

Both change the core's registry only through `RouterCore` (register, retire,
remove) and the prober. They never count metrics, close a lease or log: the
core's retire callback and the service's event handlers do that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from router.config import StaticWorkerConfig
from router.core import RouterCore, Worker, WorkerOrigin, WorkerState
from router.service.health import HealthProber, probe_connect


async def check_worker(
    core: RouterCore,
    prober: HealthProber,
    worker: Worker,
    *,
    generation: int | None,
    connect_timeout_s: float,
    clock: Callable[[], float],
) -> bool:
    """Probe `worker`'s address; retire it if nothing listens. True if it is gone.
    `generation`: the process generation the probe is about (None: the current)."""
    if generation is None:
        generation = worker.generation
    if worker.generation != generation:
        return False  # a newer process registered since: not this probe's business
    if _exited(worker):
        return True
    outcome = await probe_connect(worker.url, connect_timeout_s)
    if worker.generation != generation or _exited(worker):
        return _exited(worker)  # changed while we probed: the newer news wins
    if outcome != "refused":
        return False
    if worker.origin is WorkerOrigin.STATIC:
        prober.report(worker, outcome, clock())
        return _exited(worker)
    core.retire(worker, clock())
    return True


def sync_static_workers(
    core: RouterCore, prober: HealthProber, workers: Iterable[StaticWorkerConfig], now: float
) -> None:
    """The registry's static workers become `workers`: a removed one leaves the
    registry, a moved one is retired (its sessions end) and registered at its new
    URL, a new or exited one is registered, and so is one whose id a worker that
    said hello has (that worker is retired: its sessions end, its lease closes);
    the prober runs if any is left."""
    wanted = {static.id: static.url for static in workers}
    for worker in core.workers:
        if worker.origin is not WorkerOrigin.STATIC:
            continue
        if worker.id not in wanted:
            # Removed, exited or not: out of the registry, so no probe revives it.
            core.remove(worker, now)
        elif wanted[worker.id] != worker.url and worker.state is not WorkerState.EXITED:
            core.retire(worker, now)  # moved: its sessions end
    for worker_id, url in wanted.items():
        known = core.workers.get(worker_id)
        if (
            known is None
            or known.state is WorkerState.EXITED
            or known.url != url
            or known.origin is not WorkerOrigin.STATIC
        ):
            core.register(worker_id, url, WorkerOrigin.STATIC, now)
    if wanted:
        prober.start()


def _exited(worker: Worker) -> bool:
    return worker.state is WorkerState.EXITED
