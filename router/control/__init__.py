"""The control socket (design §3): a connection's session rules (pure) and the
listening server and connections (asyncio).
"""

from __future__ import annotations

from router.control.server import ControlServer
from router.control.session import (
    ControlPolicy,
    ControlSession,
    valid_worker_id,
)

__all__ = [
    "ControlPolicy",
    "ControlServer",
    "ControlSession",
    "valid_worker_id",
]
