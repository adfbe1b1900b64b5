"""One router process (design §3, §6): the wiring of its parts, the admin
listener, health probes, the journal, reloads, spawned workers, signals and logs.
"""

from __future__ import annotations

from router.service.logs import setup_logging
from router.service.process import run_until_signalled
from router.service.router_service import RouterService

__all__ = [
    "RouterService",
    "run_until_signalled",
    "setup_logging",
]
