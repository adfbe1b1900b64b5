"""Session kinds (design §4): which session a request names, the value formats
and where they sit, and the claims learned from replies. Pure: no sockets, no event loop.
"""

from __future__ import annotations

from router.sessions.learning import (
    LearningPlan,
    ReplyLearner,
    plan_learning,
)
from router.sessions.reader import (
    SessionKind,
    SessionReader,
    SessionRef,
    kind_from_config,
)

__all__ = [
    "LearningPlan",
    "ReplyLearner",
    "SessionKind",
    "SessionReader",
    "SessionRef",
    "kind_from_config",
    "plan_learning",
]
