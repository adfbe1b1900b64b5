"""The public handler: a request's session and decision, then a forward or the
router's own answer (design §1).
"""

from __future__ import annotations

from router.app.exchange import MAX_LOGGED_PATH
from router.app.handler import (
    PublicHandler,
    access_log,
)

__all__ = [
    "MAX_LOGGED_PATH",
    "PublicHandler",
    "access_log",
]
