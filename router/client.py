"""The worker side of the control socket, under the name workers import:
`from router.client import ControlClient` (design §3). The code is in `router.worker`,
whose public names this module re-exports, all of them and only them.
"""

from __future__ import annotations

from router.worker import *  # noqa: F403 - the same names as router.worker's face
from router.worker import __all__ as __all__
