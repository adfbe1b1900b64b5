"""The boot header (design §3): how the router names the worker process it meant.

The router forwards a registered worker's requests with `X-Episode-Router-Boot: <the boot
that worker said hello with>`, and the worker answers 410 itself when that is not its own
(`router.worker.boot`). This module owns the header's name and what a boot may be, for
the router's control session (which refuses a hello with any other boot), its relay and
the worker's check alike.

It is pure: no I/O. A boot value is never logged or shown.
"""

from __future__ import annotations

import re

__all__ = ["BOOT_HEADER", "valid_boot"]

BOOT_HEADER = "X-Episode-Router-Boot"

# What a boot may be (design §3: 1-128 characters): visible ASCII, no spaces. It
# travels in BOOT_HEADER, and every HTTP stack must hand the worker the bytes the
# router sent: one decodes a header as latin-1, another strips trailing spaces, and
# a worker would then refuse its own episodes.
_BOOT_VALUE = re.compile(r"[!-~]{1,128}")


def valid_boot(boot: str) -> bool:
    """True when `boot` survives the trip in BOOT_HEADER unchanged (see _BOOT_VALUE)."""
    return _BOOT_VALUE.fullmatch(boot) is not None
