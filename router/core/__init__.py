"""The router's core (design §1, §3): the claim table, the worker registry and the
state machine that decides where a request goes. Pure: no I/O; `now` is passed in.
"""

from __future__ import annotations

from router.core.answers import (
    STATUS_BY_CODE,
    Answer,
    render,
)
from router.core.claims import (
    Claim,
    ClaimRefusal,
    ClaimState,
)
from router.core.machine import (
    CoreSettings,
    Forward,
    RouterCore,
)
from router.core.workers import (
    Worker,
    WorkerOrigin,
    WorkerState,
)

__all__ = [
    "STATUS_BY_CODE",
    "Answer",
    "Claim",
    "ClaimRefusal",
    "ClaimState",
    "CoreSettings",
    "Forward",
    "RouterCore",
    "Worker",
    "WorkerOrigin",
    "WorkerState",
    "render",
]
