"""The top-level sections other than `sessions`, and the whole `Config` built from them.

This module owns the parsing of listen, admin, control, workers, health,
spawn, claims, state, limits, timeouts and log, and the checks that span a
section or the file (an admin listener off loopback needs a token, a tcp://
control socket needs a secret, no two listeners share an address).

It must never read the file or the environment itself: values come through
`_Section`, secrets through `router.config.secrets`.
"""

from __future__ import annotations

import re
import string
from typing import Final

from router.config.addresses import (
    _TCP,
    _UNIX,
    _check_addresses,
    _control_socket_problem,
    _is_loopback,
    _upstream_problem,
)
from router.config.errors import _join, _quote
from router.config.model import (
    AdminConfig,
    ClaimsConfig,
    Config,
    ControlConfig,
    HealthConfig,
    LimitsConfig,
    ListenConfig,
    LogConfig,
    SpawnConfig,
    StateConfig,
    StaticWorkerConfig,
    TimeoutsConfig,
)
from router.config.reader import _Context, _integer, _Section, _text
from router.config.secrets import _inline, _secret_text
from router.config.sessions import _sessions

_TOP_KEYS: Final = (
    *("listen", "admin", "control", "workers", "health", "spawn", "sessions"),
    *("claims", "state", "limits", "timeouts", "log"),
)
_WORKER_ID: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PLACEHOLDERS: Final = ("port", "worker_id", "host")
_CONTROL_KEYS: Final = (
    *("socket", "allowed_uids", "allowed_upstreams", "secret_env", "secret_file"),
    *("lease_timeout_s", "reconnect_grace_s"),
)
_CLAIMS_KEYS: Final = (
    "tombstone_ttl_s",
    "max_tombstones",
    "recovery_window_s",
    "learned_idle_ttl_s",
)
_LIMITS_KEYS: Final = (
    *("max_header_bytes", "max_headers", "max_body_bytes"),
    *("header_timeout_s", "idle_timeout_s", "max_line_bytes", "body_timeout_s"),
)
_TIMEOUTS_KEYS: Final = ("connect_s", "first_byte_s", "stream_idle_s", "shutdown_grace_s")


def _config(root: _Section) -> Config:
    config = Config(
        listen=_listen(root.child("listen", ("host", "port"))),
        admin=_admin(
            root.child("admin", ("host", "port", "token_env", "token_file"), _inline("token"))
        ),
        control=_control(root.child("control", _CONTROL_KEYS, _inline("secret"))),
        workers=_workers(root),
        health=_health(root.child("health", ("path", "interval_s", "timeout_s", "failures"))),
        spawn=_spawn(root),
        sessions=_sessions(root),
        claims=_claims(root.child("claims", _CLAIMS_KEYS)),
        state=StateConfig(path=root.child("state", ("path",)).optional_text("path")),
        limits=_limits(root.child("limits", _LIMITS_KEYS)),
        timeouts=_timeouts(root.child("timeouts", _TIMEOUTS_KEYS)),
        log=_log(root.child("log", ("format", "access", "level"))),
    )
    _check_addresses(root.ctx, config)
    return config


def _listen(sec: _Section) -> ListenConfig:
    d = ListenConfig()
    return ListenConfig(sec.host("host", d.host), sec.integer("port", d.port, 0, 65535))


def _admin(sec: _Section) -> AdminConfig:
    d = AdminConfig()
    host, port = sec.host("host", d.host), sec.integer("port", d.port, 0, 65535)
    token = _secret_text(sec, "token", header_safe=True)
    if token is None and not _is_loopback(host):
        reason = f"an admin listener on {_quote(host)} (not loopback) needs token_env or token_file"
        raise sec.fail(None, reason)
    return AdminConfig(host, port, token[1] if token else None)


def _control(sec: _Section) -> ControlConfig:
    d = ControlConfig()
    socket = sec.text("socket", d.socket)
    if problem := _control_socket_problem(socket):
        raise sec.fail("socket", problem)
    uids = tuple(_integer(sec.ctx, p, v, 0, 2**32 - 2) for p, v in sec.items("allowed_uids"))
    upstreams = tuple(_upstream(sec.ctx, p, v) for p, v in sec.items("allowed_upstreams"))
    secret = _secret_text(sec, "secret", header_safe=False)
    if socket.startswith(_TCP) and secret is None:
        raise sec.fail("socket", "a tcp:// control socket needs secret_env or secret_file")
    if socket.startswith(_UNIX) and secret is not None:
        raise sec.fail(secret[0], "a unix: control socket checks uids; a secret is for tcp://")
    if socket.startswith(_TCP) and uids:
        raise sec.fail("allowed_uids", "uids can only be checked on a unix: control socket")
    lease = sec.seconds("lease_timeout_s", d.lease_timeout_s)
    grace = sec.seconds("reconnect_grace_s", d.reconnect_grace_s)
    return ControlConfig(socket, uids, upstreams, secret and secret[1], lease, grace)


def _upstream(ctx: _Context, key_path: str, value: object) -> str:
    url = _text(ctx, key_path, value)
    if problem := _upstream_problem(url):
        raise ctx.fail(key_path, problem)
    return url


def _workers(root: _Section) -> tuple[StaticWorkerConfig, ...]:
    workers: list[StaticWorkerConfig] = []
    for sec in root.sections("workers", ("id", "url")):
        worker_id = sec.text("id")
        if not _WORKER_ID.fullmatch(worker_id):
            raise sec.fail("id", f"must be 1 to 64 of A-Z a-z 0-9 . _ -, got {_quote(worker_id)}")
        url = _upstream(sec.ctx, _join(sec.path, "url"), sec.text("url"))
        for j, other in enumerate(workers):
            if other.id == worker_id:
                raise sec.fail("id", f"duplicate worker id {_quote(worker_id)} (also workers[{j}])")
            if other.url == url:
                raise sec.fail("url", f"duplicate worker url {_quote(url)} (also workers[{j}])")
        workers.append(StaticWorkerConfig(worker_id, url))
    return tuple(workers)


def _health(sec: _Section) -> HealthConfig:
    d = HealthConfig()
    path = sec.text("path", d.path)
    if not (path.startswith("/") and all("!" <= c <= "~" for c in path)):
        raise sec.fail(
            "path", f"expected a path starting with / in visible ASCII, got {_quote(path)}"
        )
    interval = sec.seconds("interval_s", d.interval_s)
    timeout = sec.seconds("timeout_s", d.timeout_s)
    return HealthConfig(path, interval, timeout, sec.integer("failures", d.failures, 1, 1000))


def _command_problem(command: str) -> str | None:
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(command)]
    except ValueError as exc:
        return f"malformed placeholder: {exc}"
    allowed = ", ".join(f"{{{p}}}" for p in _PLACEHOLDERS)
    for name, spec, conversion in fields:
        if name is not None and name not in _PLACEHOLDERS:
            return f"unknown placeholder {{{name}}}; allowed: {allowed} (write {{{{ for a brace)"
        if spec or conversion:
            return f"placeholder {{{name}}} takes no conversion or format spec"
    if "port" not in {name for name, _, _ in fields}:
        return "must contain {port}: each spawned worker listens on its own port"
    return None


def _spawn(root: _Section) -> SpawnConfig | None:
    if not root.has("spawn"):
        return None
    sec = root.child("spawn", ("command", "count", "base_port", "host", "stop_timeout_s"))
    d = SpawnConfig(command="")  # holds the field defaults
    command = sec.text("command")
    if problem := _command_problem(command):
        raise sec.fail("command", problem)
    count = sec.integer("count", d.count, 1, 256)
    base_port = sec.integer("base_port", d.base_port, 1, 65535)
    if base_port + count - 1 > 65535:
        raise sec.fail("count", f"ports {base_port}..{base_port + count - 1} go past 65535")
    stop = sec.seconds("stop_timeout_s", d.stop_timeout_s)
    return SpawnConfig(command, count, base_port, sec.host("host", d.host), stop)


def _claims(sec: _Section) -> ClaimsConfig:
    d = ClaimsConfig()
    return ClaimsConfig(
        sec.seconds("tombstone_ttl_s", d.tombstone_ttl_s),
        sec.integer("max_tombstones", d.max_tombstones),
        sec.seconds("recovery_window_s", d.recovery_window_s),
        sec.seconds("learned_idle_ttl_s", d.learned_idle_ttl_s),
    )


def _limits(sec: _Section) -> LimitsConfig:
    d = LimitsConfig()
    return LimitsConfig(
        max_header_bytes=sec.integer("max_header_bytes", d.max_header_bytes),
        max_headers=sec.integer("max_headers", d.max_headers),
        max_body_bytes=sec.optional_integer("max_body_bytes", 1, 2**63 - 1),
        header_timeout_s=sec.seconds("header_timeout_s", d.header_timeout_s),
        idle_timeout_s=sec.seconds("idle_timeout_s", d.idle_timeout_s),
        max_line_bytes=sec.integer("max_line_bytes", d.max_line_bytes),
        body_timeout_s=sec.seconds("body_timeout_s", d.body_timeout_s),
    )


def _timeouts(sec: _Section) -> TimeoutsConfig:
    d = TimeoutsConfig()
    return TimeoutsConfig(*(sec.seconds(k, getattr(d, k)) for k in _TIMEOUTS_KEYS))


def _log(sec: _Section) -> LogConfig:
    d = LogConfig()
    return LogConfig(
        sec.choice("format", d.format, ("json", "plain")),
        sec.flag("access", d.access),
        sec.choice("level", d.level, ("debug", "info", "warning", "error")),
    )
