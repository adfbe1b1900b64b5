"""Which host (and network) this router runs on, as routers sharing it can tell (design
§10, shape B): routers with the same forward straight to each other's workers.

Linux names a boot of the machine (`/proc/sys/kernel/random/boot_id`) and each network
and mount namespace (an inode under `/proc/self/ns/`): two routers that read the same
three reach the same loopback addresses and Unix sockets, so a worker URL one of them
published means the same process to the other. Pods, containers and network
namespaces of their own differ in one of them. Elsewhere (no /proc) there is no name:
"" (no direct forwarding).
"""

from __future__ import annotations

import os

_BOOT_ID = "/proc/sys/kernel/random/boot_id"
_NAMESPACES = ("/proc/self/ns/net", "/proc/self/ns/mnt")


def host_identity() -> str:
    """This process's host, network and mount namespace as one token (no spaces), or ""
    when the system does not name them."""
    try:
        with open(_BOOT_ID, encoding="ascii") as boot:
            boot_id = boot.read().strip()
        spaces = [os.stat(path) for path in _NAMESPACES]
    except (OSError, UnicodeDecodeError):
        return ""
    if not boot_id or any(c.isspace() for c in boot_id):
        return ""
    return "/".join([boot_id, *(f"{space.st_dev}.{space.st_ino}" for space in spaces)])
