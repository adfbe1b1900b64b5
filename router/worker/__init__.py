"""The worker side of the control socket (design §3): the client a Python worker
uses, and the boot check middlewares. `router.client` re-exports it.
"""

from __future__ import annotations

from router.worker.client import (
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
