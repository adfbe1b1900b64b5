"""The router process around one `RouterService`: its signals and its garbage collector.

`run_until_signalled` raises the open-file limit to its hard limit, starts the
service, stops it on SIGTERM or SIGINT, and
reloads its config file on SIGHUP (a bad file is refused and logged; the running
config stays). Once the service is up, `tune_gc` sets the collector for a
long-running server.

It never builds, changes or reads a part of the service itself: starting,
stopping and reloading are the service's own methods.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from typing import TYPE_CHECKING

from router.config import ConfigError
from router.service.listeners import raise_open_file_limit

if TYPE_CHECKING:
    from router.service.router_service import RouterService

log = logging.getLogger("episode_router")

# The collector's first generation runs after this many more container objects are
# allocated than freed (CPython's default: 700). A forward leaves almost no cycles behind,
# so under load the default ran gen-0 passes that found nothing. At 50,000 a wave of
# clients leaving mid-forward held tens of MB in a cycle until a pass (that cycle is
# broken since); this one held a tenth of that with far fewer passes than the default,
# and stays as a margin for any cycle not yet found (measured: docs/performance.md,
# "The collector's threshold").
GC_GEN0_THRESHOLD = 5_000


def tune_gc() -> None:
    """Once the router is up: everything built at startup (modules, config, the journal's
    replay) moves out of the collector's view, and gen 0 is collected less often."""
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)


async def run_until_signalled(service: RouterService) -> None:
    """Start, wait for SIGTERM or SIGINT, stop."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reload_on_signal, service)
    raise_open_file_limit()  # before the connection limit is drawn from it
    await service.start()
    tune_gc()
    try:
        await stop.wait()
    finally:
        # A signal while stopping (a second SIGTERM from an orchestrator, Ctrl-C twice,
        # a SIGHUP) changes nothing: with the defaults put back first, one killed the
        # router mid-stop, its in-flight requests cut, its spawned workers orphaned and
        # its socket file left. The stop is bounded anyway (shutdown_grace_s, then
        # spawn.stop_timeout_s).
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.add_signal_handler(signum, _already_stopping, signum)
        try:
            await service.stop()
        finally:
            for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                with contextlib.suppress(Exception):
                    loop.remove_signal_handler(signum)
                # Stopped: what is left is the exit. A signal now (one sent while it
                # stopped, arriving late) must not turn a clean stop's 0 into -15.
                signal.signal(signum, signal.SIG_IGN)


def _already_stopping(signum: signal.Signals) -> None:
    log.warning("signal ignored: the router is already stopping", extra={"signal": signum.name})


# The reloads SIGHUP started, referenced until they end (a bare task may be collected).
_RELOADS: set[asyncio.Task[None]] = set()


def _reload_on_signal(service: RouterService) -> None:
    """SIGHUP: reload in a task of its own (the file is read off the event loop)."""
    task = asyncio.get_running_loop().create_task(_reload(service), name="reload-on-sighup")
    _RELOADS.add(task)
    task.add_done_callback(_RELOADS.discard)


async def _reload(service: RouterService) -> None:
    """A bad config is refused with its reason and the old one stays."""
    try:
        await service.reload_from_file()
    except (ConfigError, ValueError, LookupError) as exc:
        log.error("config reload refused; the running config stays", extra={"reason": str(exc)})
