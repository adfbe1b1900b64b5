"""The top-level sections other than `sessions`, and the whole `Config` built from them.

This module owns the parsing of listen, admin, control, workers, health,
spawn, claims, state, limits, timeouts and log, and the checks that span a
section or the file (an admin listener off loopback needs a token, a tcp://
control socket needs a secret, no two listeners share an address, spawned
workers can register: ids of their own, urls the control policy lets in).
The file-wide checks run on a `Config` value too (`check_config`), for a
reload's mix of two files.

It must never read the file or the environment itself: values come through
`Section`, secrets through `router.config.secrets`.
"""

from __future__ import annotations

import os
import re
import shlex
import string
from collections.abc import Mapping
from typing import Final

from router.config.addresses import (
    check_addresses,
    control_socket_problem,
    is_tcp_socket,
    upstream_problem,
)
from router.config.errors import join_key, quote
from router.config.model import (
    SPAWN_ENV_PREFIX,
    SPAWN_PLACEHOLDERS,
    AdminConfig,
    ClaimsConfig,
    Config,
    ControlConfig,
    DirectoryConfig,
    HealthConfig,
    LimitsConfig,
    ListenConfig,
    LogConfig,
    PeerConfig,
    SpawnConfig,
    StateConfig,
    StaticWorkerConfig,
    TimeoutsConfig,
    spawned_workers,
)
from router.config.patterns import compile_path_prefix
from router.config.reader import Context, Section, read_integer, read_text
from router.config.secrets import find_secret, inline_refused, secret_text
from router.config.sessions import read_sessions
from router.protocol import UNIX, is_host, is_loopback_host, split_host_port

TOP_KEYS: Final = (
    *("listen", "admin", "control", "workers", "health", "spawn", "sessions"),
    *("path_prefixes", "claims", "state", "limits", "timeouts", "log"),
    *("directory", "peer"),
)
_WORKER_ID: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL_KEYS: Final = (
    *("socket", "allowed_uids", "allowed_upstreams", "secret_env", "secret_file"),
    *("lease_timeout_s", "reconnect_grace_s"),
    *("max_claims_per_worker", "max_connections_before_hello", "max_connections"),
    "worker_socket_dirs",
)
# A hello line, which carries it, is bounded to 64 KiB before the hello is accepted: this
# fits even when JSON escapes every byte (six bytes each).
MAX_CONTROL_SECRET_BYTES: Final = 8 << 10
_CLAIMS_KEYS: Final = (
    "tombstone_ttl_s",
    "max_tombstones",
    "recovery_window_s",
    "learned_idle_ttl_s",
)
_LIMITS_KEYS: Final = (
    *("max_header_bytes", "max_headers", "max_body_bytes"),
    *("header_timeout_s", "idle_timeout_s", "max_line_bytes", "body_timeout_s"),
    *("body_buffer_bytes", "reply_buffer_bytes", "buffer_budget_bytes", "paced_share_percent"),
    "worker_connections",
    *("max_head_bytes", "max_held_head_bytes", "max_connections"),
)
_TIMEOUTS_KEYS: Final = ("connect_s", "first_byte_s", "stream_idle_s", "shutdown_grace_s")
_DIRECTORY_KEYS: Final = (
    *("url", "sentinel", "router_id", "prefix", "lease_ttl_s", "lookup_timeout_ms"),
    *("claim_timeout_s", "min_replicas", "password_env", "password_file", "key_prefix"),
)
_PEER_KEYS: Final = ("listen", "advertise", "secret_env", "secret_file", "direct")
# Router ids and prefixes go into Redis keys (design §10): a pod name fits.
_DIRECTORY_NAME: Final = re.compile(r"[A-Za-z0-9._-]{1,128}")


def build_config(root: Section) -> Config:
    config = Config(
        listen=_listen(root.child("listen", ("host", "port", "reuse_port"))),
        admin=_admin(
            root.child(
                "admin",
                ("host", "port", "token_env", "token_file", "allowed_hosts"),
                inline_refused("token"),
            )
        ),
        control=_control(root.child("control", _CONTROL_KEYS, inline_refused("secret"))),
        workers=_workers(root),
        health=_health(root.child("health", ("path", "interval_s", "timeout_s", "failures"))),
        spawn=_spawn(root),
        sessions=read_sessions(root),
        path_prefixes=_path_prefixes(root),
        claims=_claims(root.child("claims", _CLAIMS_KEYS)),
        state=StateConfig(path=root.child("state", ("path",)).optional_text("path")),
        limits=_limits(root.child("limits", _LIMITS_KEYS)),
        timeouts=_timeouts(root.child("timeouts", _TIMEOUTS_KEYS)),
        log=_log(root.child("log", ("format", "access", "level"))),
        directory=_directory(root),
        peer=_peer(root),
    )
    check_whole_config(root.ctx, config)
    return config


def check_whole_config(ctx: Context, config: Config) -> None:
    """The checks that span sections, on a whole `Config`.

    They run on every file after its sections, and again on the config a reload
    would run (the new file, with the restart-only sections the router keeps): a
    mix that no file held, so each section's own checks never saw it.
    """
    control = config.control
    if problem := _control_problem(
        control.socket, control.secret is not None, control.allowed_uids
    ):
        key, reason = problem
        raise ctx.fail("control" if key == "secret" else join_key("control", key), reason)
    if config.admin.token is None and not is_loopback_host(config.admin.host):
        raise ctx.fail("admin", _admin_token_reason(config.admin.host))
    if (config.directory is None) != (config.peer is None):
        raise ctx.fail(
            "directory" if config.directory is None else "peer",
            "`directory:` and `peer:` go together: routers that share a directory forward "
            "each other's episodes over the peer listener",
        )
    check_addresses(ctx, config)
    if config.spawn is not None:
        _check_spawned_workers(ctx, config, config.spawn)


def _check_spawned_workers(ctx: Context, config: Config, spawn: SpawnConfig) -> None:
    """Spawned workers must be able to register: an id of their own, a url the control
    policy lets say hello."""
    spawned = spawned_workers(spawn.count, spawn.base_port, spawn.host)  # the spawner's rule
    if not spawned:  # a SpawnConfig built in code; a parsed one has at least one
        raise ctx.fail("spawn.count", f"expected at least 1 worker, got {spawn.count!r}")
    ids = [worker.worker_id for worker in spawned]
    made = ids[0] if len(ids) == 1 else f"{ids[0]}..{ids[-1]}"
    for i, static in enumerate(config.workers):
        if static.id in ids:
            reason = (
                f"{quote(static.id)} is also a spawned worker's id (spawn makes {made}): "
                "one id cannot name two workers"
            )
            raise ctx.fail(f"workers[{i}].id", reason)
    if is_loopback_host(spawn.host):
        return
    allowed = set(config.control.allowed_upstreams)
    refused = [worker.url for worker in spawned if worker.url not in allowed]
    if refused:
        reason = (
            f"{quote(spawn.host)} is not loopback, and control.allowed_upstreams does not list "
            f"{quote(refused[0])}: the spawned workers could never say hello"
        )
        raise ctx.fail("spawn.host", reason)


def _directory(root: Section) -> DirectoryConfig | None:
    if not root.has("directory"):
        return None
    sec = root.child("directory", _DIRECTORY_KEYS, inline_refused("password"))
    d = DirectoryConfig()
    url = sec.optional_text("url")
    master: str | None = None
    nodes: tuple[str, ...] = ()
    if sec.has("sentinel"):
        sentinel = sec.child("sentinel", ("master", "nodes"))
        master = sentinel.text("master")
        nodes = tuple(_sentinel_node(sec.ctx, p, v) for p, v in sentinel.items("nodes"))
        if not nodes:
            raise sentinel.fail("nodes", "list at least one sentinel (host:port)")
    if (url is None) == (master is None):
        raise sec.fail(None, "set one of `url` (a Redis) and `sentinel` (a primary under Sentinel)")
    if url is not None and (problem := _redis_url_problem(url)):
        raise sec.fail("url", problem)
    router_id = sec.optional_text("router_id") or _pod_name(sec.ctx.env)  # null: the default
    prefix = sec.text("prefix", d.prefix)
    for key, value in (("router_id", router_id), ("prefix", prefix)):
        if not _DIRECTORY_NAME.fullmatch(value):
            raise sec.fail(key, f"must be 1-128 characters of [A-Za-z0-9._-], got {quote(value)}")
    lease = sec.seconds("lease_ttl_s", d.lease_ttl_s)
    if lease < 1.5:
        # The heartbeat runs every third of a lease: below half a second a beat is a
        # scheduling hiccup away from a fenced router.
        raise sec.fail("lease_ttl_s", f"must be at least 1.5 s, got {lease!r}")
    password = find_secret(sec, "password", 1)
    return DirectoryConfig(
        url=url,
        sentinel_master=master,
        sentinel_nodes=nodes,
        router_id=router_id,
        prefix=prefix,
        lease_ttl_s=lease,
        lookup_timeout_ms=sec.integer("lookup_timeout_ms", d.lookup_timeout_ms, 1, 60_000),
        claim_timeout_s=sec.seconds("claim_timeout_s", d.claim_timeout_s),
        min_replicas=sec.optional_integer("min_replicas", 0, 16),
        password=password[1].decode("utf-8", "surrogateescape") if password else None,
        key_prefix=sec.flag("key_prefix", d.key_prefix),
    )


def _pod_name(env: Mapping[str, str]) -> str:
    """The router id by default: the pod name Kubernetes puts in HOSTNAME, else the host's
    name (one router a host; several processes on one host name themselves)."""
    return env.get("HOSTNAME") or os.uname().nodename


def _redis_url_problem(url: str) -> str | None:
    if url.startswith("unix:"):
        path = url[len("unix:") :].removeprefix("//")
        return None if path.startswith("/") else "a unix: socket path is absolute"
    if not url.startswith(("redis://", "rediss://")):
        return f"expected redis://host:port/db, rediss://... or unix:/path, got {quote(url)}"
    if "@" in url.partition("://")[2].partition("/")[0]:
        return "credentials in the url are inline secrets: use password_env or password_file"
    return None


def _sentinel_node(ctx: Context, key_path: str, value: object) -> str:
    node = read_text(ctx, key_path, value)
    if split_host_port(node) is None:
        raise ctx.fail(key_path, f"expected host:port, got {quote(node)}")
    return node


def _peer(root: Section) -> PeerConfig | None:
    if not root.has("peer"):
        return None
    sec = root.child("peer", _PEER_KEYS, inline_refused("secret"))
    d = PeerConfig()
    listen = sec.text("listen", f"{d.host}:{d.port}")
    # Port 0: the kernel picks one (tests); the advertised address then names it.
    parsed = split_host_port(listen.removesuffix(":0") + ":1" if listen.endswith(":0") else listen)
    if parsed is None:
        raise sec.fail("listen", f"expected host:port, got {quote(listen)}")
    if listen.endswith(":0"):
        parsed = (parsed[0], 0)
    advertise = sec.optional_text("advertise")
    if advertise is not None and split_host_port(advertise) is None:
        raise sec.fail("advertise", f"expected host:port, got {quote(advertise)}")
    secret = secret_text(sec, "secret", header_safe=False)
    if secret is None:
        raise sec.fail(None, "the peer hop is signed: set secret_env or secret_file")
    direct = sec.flag("direct", d.direct)
    return PeerConfig(parsed[0], parsed[1], advertise, secret[1], direct)


def _listen(sec: Section) -> ListenConfig:
    d = ListenConfig()
    return ListenConfig(
        sec.host("host", d.host),
        sec.integer("port", d.port, 0, 65535),
        sec.flag("reuse_port", d.reuse_port),
    )


def _admin(sec: Section) -> AdminConfig:
    d = AdminConfig()
    host, port = sec.host("host", d.host), sec.integer("port", d.port, 0, 65535)
    token = secret_text(sec, "token", header_safe=True)
    if token is None and not is_loopback_host(host):
        raise sec.fail(None, _admin_token_reason(host))
    names = tuple(_host_name(sec.ctx, p, v) for p, v in sec.items("allowed_hosts"))
    return AdminConfig(host, port, token[1] if token else None, names)


def _host_name(ctx: Context, key_path: str, value: object) -> str:
    """A host a client may name in an admin request's Host (lower-cased; no port)."""
    name = read_text(ctx, key_path, value)
    if not is_host(name):
        raise ctx.fail(key_path, f"expected a host name or an IP address, got {quote(name)}")
    return name.lower()


def _admin_token_reason(host: str) -> str:
    return f"an admin listener on {quote(host)} (not loopback) needs token_env or token_file"


def _control(sec: Section) -> ControlConfig:
    d = ControlConfig()
    socket = sec.text("socket", d.socket)
    if problem := control_socket_problem(socket):
        raise sec.fail("socket", problem)
    uids = tuple(read_integer(sec.ctx, p, v, 0, 2**32 - 2) for p, v in sec.items("allowed_uids"))
    upstreams = tuple(_upstream(sec.ctx, p, v) for p, v in sec.items("allowed_upstreams"))
    secret = secret_text(sec, "secret", header_safe=False)
    if secret is not None and len(secret[1].encode()) > MAX_CONTROL_SECRET_BYTES:
        reason = f"the secret must be at most {MAX_CONTROL_SECRET_BYTES} bytes"
        raise sec.fail(secret[0], reason + ": a hello carrying it must fit the 64 KiB line bound")
    if mismatch := _control_problem(socket, secret is not None, uids):
        key, reason = mismatch
        raise sec.fail(secret[0] if key == "secret" and secret else key, reason)
    lease = sec.seconds("lease_timeout_s", d.lease_timeout_s)
    grace = sec.seconds("reconnect_grace_s", d.reconnect_grace_s)
    # At most 2,000,000: the most claims one sync reply is sized to count.
    claims = sec.integer("max_claims_per_worker", d.max_claims_per_worker, 1, 2_000_000)
    waiting = sec.integer("max_connections_before_hello", d.max_connections_before_hello)
    most = sec.integer("max_connections", d.max_connections)
    dirs = tuple(_folder(sec.ctx, p, v) for p, v in sec.items("worker_socket_dirs"))
    return ControlConfig(
        socket, uids, upstreams, secret and secret[1], lease, grace, claims, waiting, most, dirs
    )


def _folder(ctx: Context, key_path: str, value: object) -> str:
    folder = read_text(ctx, key_path, value)
    if not folder.startswith("/") or "\0" in folder:
        raise ctx.fail(key_path, f"expected an absolute folder path, got {quote(folder)}")
    return folder


def _control_problem(
    socket: str, has_secret: bool, uids: tuple[int, ...]
) -> tuple[str, str] | None:
    """(key, reason) when the socket's kind and its authentication do not go together."""
    if is_tcp_socket(socket) and not has_secret:
        return "socket", "a tcp:// control socket needs secret_env or secret_file"
    if socket.startswith(UNIX) and has_secret:
        return "secret", "a unix: control socket checks uids; a secret is for tcp://"
    if is_tcp_socket(socket) and uids:
        return "allowed_uids", "uids can only be checked on a unix: control socket"
    return None


def _upstream(ctx: Context, key_path: str, value: object) -> str:
    url = read_text(ctx, key_path, value)
    if problem := upstream_problem(url):
        raise ctx.fail(key_path, problem)
    return url


def _workers(root: Section) -> tuple[StaticWorkerConfig, ...]:
    workers: list[StaticWorkerConfig] = []
    for sec in root.sections("workers", ("id", "url")):
        worker_id = sec.text("id")
        if not _WORKER_ID.fullmatch(worker_id):
            raise sec.fail("id", f"must be 1 to 64 of A-Z a-z 0-9 . _ -, got {quote(worker_id)}")
        url = _upstream(sec.ctx, join_key(sec.path, "url"), sec.text("url"))
        for j, other in enumerate(workers):
            if other.id == worker_id:
                raise sec.fail("id", f"duplicate worker id {quote(worker_id)} (also workers[{j}])")
            if other.url == url:
                raise sec.fail("url", f"duplicate worker url {quote(url)} (also workers[{j}])")
        workers.append(StaticWorkerConfig(worker_id, url))
    return tuple(workers)


def _health(sec: Section) -> HealthConfig:
    d = HealthConfig()
    path = sec.text("path", d.path)
    if not (path.startswith("/") and all("!" <= c <= "~" for c in path)):
        raise sec.fail(
            "path", f"expected a path starting with / in visible ASCII, got {quote(path)}"
        )
    interval = sec.seconds("interval_s", d.interval_s)
    timeout = sec.seconds("timeout_s", d.timeout_s)
    return HealthConfig(path, interval, timeout, sec.integer("failures", d.failures, 1, 1000))


def _template_problem(template: str) -> str | None:
    """Why `template` (the spawn command, an `env` value, `cwd`) cannot be rendered for
    a worker, or None: only the known placeholders, with no conversion or format spec."""
    try:
        fields = [(name, spec, conv) for _, name, spec, conv in string.Formatter().parse(template)]
    except ValueError as exc:
        return f"malformed placeholder: {exc}"
    allowed = ", ".join(f"{{{p}}}" for p in SPAWN_PLACEHOLDERS)
    for name, spec, conversion in fields:
        if name is not None and name not in SPAWN_PLACEHOLDERS:
            return f"unknown placeholder {{{name}}}; allowed: {allowed} (write {{{{ for a brace)"
        if spec or conversion:
            return f"placeholder {{{name}}} takes no conversion or format spec"
    return None


def _command_problem(command: str) -> str | None:
    if problem := _template_problem(command):
        return problem
    # Split here as the spawner will (no shell runs it): a template it cannot split
    # would pass this check and stop `run` later.
    try:
        arguments = shlex.split(command)
    except ValueError as exc:
        return f"cannot be split into arguments the way a shell would: {exc}"
    return (
        None if arguments else "names no program to run"
    )  # a NUL byte, which no argument can hold, is refused as any text's is


_SPAWN_KEYS: Final = (
    *("command", "count", "base_port", "host", "stop_timeout_s"),
    *("register", "cwd", "env"),
)


def _spawn(root: Section) -> SpawnConfig | None:
    if not root.has("spawn"):
        return None
    sec = root.child("spawn", _SPAWN_KEYS)
    d = SpawnConfig(command="")  # holds the field defaults
    command = sec.text("command")
    if problem := _command_problem(command):
        raise sec.fail("command", problem)
    count = sec.integer("count", d.count, 1, 256)
    base_port = sec.integer("base_port", d.base_port, 1, 65535)
    if base_port + count - 1 > 65535:
        raise sec.fail("count", f"ports {base_port}..{base_port + count - 1} go past 65535")
    stop = sec.seconds("stop_timeout_s", d.stop_timeout_s)
    register = sec.choice("register", d.register, ("hello", "probe"))
    cwd = sec.optional_text("cwd")
    if cwd is not None and (problem := _template_problem(cwd)):
        raise sec.fail("cwd", problem)
    host = sec.host("host", d.host)
    env = _spawn_env(sec)
    if not any("port" in _fields(template) for template in (command, *(v for _, v in env))):
        reason = (
            "must contain {port}, or one of spawn.env's values must: each spawned worker "
            "listens on its own port"
        )
        raise sec.fail("command", reason)
    return SpawnConfig(command, count, base_port, host, stop, register, cwd, env)


def _fields(template: str) -> set[str]:
    """The placeholders `template` names (a checked one: it parses)."""
    return {name for _, name, _, _ in string.Formatter().parse(template) if name}


def _spawn_env(sec: Section) -> tuple[tuple[str, str], ...]:
    """`env`: variable names to templates, rendered for each worker."""
    value = sec.value("env")
    if value is None:
        return ()
    names = tuple(value) if isinstance(value, dict) else ()
    env = sec.child("env", tuple(name for name in names if isinstance(name, str)))
    pairs: list[tuple[str, str]] = []
    for name in names:
        if not _ENV_NAME.fullmatch(name):
            raise env.fail(name, "not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)")
        if name.startswith(SPAWN_ENV_PREFIX):
            raise env.fail(name, f"{SPAWN_ENV_PREFIX}* variables are set by the router itself")
        template = env.text(name)
        if problem := _template_problem(template):
            raise env.fail(name, problem)
        pairs.append((name, template))
    return tuple(pairs)


def _path_prefixes(root: Section) -> tuple[str, ...]:
    """`path_prefixes`: the prefixes workers strip before routing, each a pattern of
    literal segments and whole-segment placeholders."""
    prefixes: list[str] = []
    for key_path, value in root.items("path_prefixes"):
        prefix = read_text(root.ctx, key_path, value)
        try:
            compile_path_prefix(prefix)
        except ValueError as exc:
            raise root.ctx.fail(key_path, f"{exc}; got {quote(prefix)}") from None
        if prefix in prefixes:
            raise root.ctx.fail(key_path, f"{quote(prefix)} is listed twice")
        prefixes.append(prefix)
    return tuple(prefixes)


def _claims(sec: Section) -> ClaimsConfig:
    d = ClaimsConfig()
    return ClaimsConfig(
        sec.seconds("tombstone_ttl_s", d.tombstone_ttl_s),
        sec.integer("max_tombstones", d.max_tombstones),
        sec.seconds("recovery_window_s", d.recovery_window_s),
        sec.seconds("learned_idle_ttl_s", d.learned_idle_ttl_s),
    )


def _limits(sec: Section) -> LimitsConfig:
    d = LimitsConfig()
    return LimitsConfig(
        max_header_bytes=sec.integer("max_header_bytes", d.max_header_bytes),
        max_headers=sec.integer("max_headers", d.max_headers),
        max_body_bytes=sec.optional_integer("max_body_bytes", 1, 2**63 - 1),
        header_timeout_s=sec.seconds("header_timeout_s", d.header_timeout_s),
        idle_timeout_s=sec.seconds("idle_timeout_s", d.idle_timeout_s),
        max_line_bytes=sec.integer("max_line_bytes", d.max_line_bytes),
        body_timeout_s=sec.seconds("body_timeout_s", d.body_timeout_s),
        body_buffer_bytes=sec.integer("body_buffer_bytes", d.body_buffer_bytes, 0),
        reply_buffer_bytes=sec.integer("reply_buffer_bytes", d.reply_buffer_bytes, 0),
        buffer_budget_bytes=sec.integer("buffer_budget_bytes", d.buffer_budget_bytes, 0),
        paced_share_percent=sec.integer("paced_share_percent", d.paced_share_percent, 1, 100),
        worker_connections=sec.integer("worker_connections", d.worker_connections, 1, 65536),
        max_head_bytes=sec.integer("max_head_bytes", d.max_head_bytes, low=1024),
        max_held_head_bytes=sec.integer("max_held_head_bytes", d.max_held_head_bytes, low=1024),
        max_connections=sec.optional_integer("max_connections"),
    )


def _timeouts(sec: Section) -> TimeoutsConfig:
    d = TimeoutsConfig()
    return TimeoutsConfig(*(sec.seconds(k, getattr(d, k)) for k in _TIMEOUTS_KEYS))


def _log(sec: Section) -> LogConfig:
    d = LogConfig()
    return LogConfig(
        sec.choice("format", d.format, ("json", "plain")),
        sec.flag("access", d.access),
        sec.choice("level", d.level, ("debug", "info", "warning", "error")),
    )
