"""Binding a router's two TCP listeners: the public port and the admin port.

`serve_public` binds the public port to an `EdgeServer`; `serve_admin` binds an
aiohttp application to the admin port; `bound_port` reads back the port the
admin listener got (the config may ask for port 0). A bind failure is an
OSError that names the config section whose address it was. `connection_limit`
says how many public connections the open-file limit leaves room for, and
`raise_open_file_limit` lifts the soft limit to the hard one at start.

It owns the binding options (backlog, address reuse, the admin runner's
shutdown, the descriptors the listeners may take) and nothing else: it never
handles a request, never builds the edge server or the admin application it is
given, and never closes what it bound (the caller's `stop` does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
from collections.abc import Iterator
from typing import Final

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

from router.app import MAX_LOGGED_PATH
from router.edge import EdgeServer

PUBLIC_BACKLOG = 1024  # pending connections on the public port (asyncio's default: 100)

# Descriptors kept out of the public connections' share: the listeners, the control
# socket and its workers' connections, the admin listener's clients, spawned workers'
# pipes, the journal and the logs.
RESERVED_FILES: Final = 256
MIN_CONNECTIONS: Final = 16  # however low the open-file limit, the public port serves a few


def connection_limit(open_files: int) -> int:
    """The public connections the open-file limit `open_files` leaves room for: half of
    what the reserve leaves, since a public connection may hold a worker connection
    while its request is forwarded."""
    return max(MIN_CONNECTIONS, (open_files - RESERVED_FILES) // 2)


def open_file_limit() -> int:
    """The process's soft open-file limit (a very large one for "unlimited")."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def raise_open_file_limit() -> int:
    """Lifts the soft open-file limit to the hard one, as nginx's worker_rlimit_nofile
    does (the usual soft 1,024 is far below what a busy port needs); returns the soft
    limit in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return open_file_limit()


async def serve_public(
    edge: EdgeServer, host: str, port: int, *, name: str = "listen", reuse_port: bool = False
) -> asyncio.Server:
    """The public listener (or the peer listener, `name`): every connection to `edge`;
    with `reuse_port`, shared with the other processes that bind it so (SO_REUSEPORT)."""
    with _naming_the_listener(name, host, port):
        loop = asyncio.get_running_loop()
        return await loop.create_server(
            edge,
            host,
            port,
            reuse_address=True,
            reuse_port=reuse_port or None,
            backlog=PUBLIC_BACKLOG,
        )


async def serve_admin(
    app: web.Application,
    host: str,
    port: int,
    *,
    access_log: logging.Logger | None,
    shutdown_grace_s: float,
) -> web.BaseRunner:
    """The admin listener, serving `app`; `access_log` None logs no requests."""
    with _naming_the_listener("admin", host, port):
        runner = web.AppRunner(
            app,
            access_log=access_log,
            access_log_class=AdminAccessLogger,
            shutdown_timeout=shutdown_grace_s,
            handle_signals=False,
        )
        return await _start_site(runner, host, port)


def bound_port(runner: web.BaseRunner) -> int:
    address = runner.addresses[0]
    return int(address[1])


async def _start_site(runner: web.BaseRunner, host: str, port: int) -> web.BaseRunner:
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()  # not ours to keep: stop() only knows a started runner
        raise
    return runner


@contextlib.contextmanager
def _naming_the_listener(section: str, host: str, port: int) -> Iterator[None]:
    """A bind failure says which config section's address it was: asyncio's message
    names the address only, and the operator has two listeners to look at."""
    try:
        yield
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        named = OSError(f"{section} {host}:{port}: {reason}")  # str(): the message alone
        named.errno = exc.errno
        raise named from exc


class AdminAccessLogger(AbstractAccessLogger):
    """An admin request's access line in the public one's shape (fields, not aiohttp's
    Apache-style text), so the log stays one JSON object per line."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        self.logger.info(
            "admin request",
            extra={
                "method": request.method,
                "path": request.path[:MAX_LOGGED_PATH],
                "status": response.status,
                "duration_ms": round(time * 1000, 3),
                "client": request.remote,
            },
        )
