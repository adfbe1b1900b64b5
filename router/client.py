"""The worker side of the control socket, under the name workers import:
`from router.client import ControlClient` (design §3). The code is in `router.worker`.
"""

from __future__ import annotations

from router.worker import (
    BOOT_HEADER,
    FINAL_HELLO_REFUSALS,
    ASGIBootMiddleware,
    ControlAddress,
    ControlClient,
    ControlError,
    aiohttp_boot_middleware,
    boot_mismatch_answer,
    encode_line,
    parse_control_address,
    sync_messages,
)

__all__ = [
    "BOOT_HEADER",
    "FINAL_HELLO_REFUSALS",
    "ASGIBootMiddleware",
    "ControlAddress",
    "ControlClient",
    "ControlError",
    "aiohttp_boot_middleware",
    "boot_mismatch_answer",
    "encode_line",
    "parse_control_address",
    "sync_messages",
]
