"""Configuration: the YAML file of DESIGN §5 turned into frozen dataclasses.

This module owns the file's shape, its defaults and every check on it. An
unknown key, a wrong type or a bad value is a `ConfigError` that names the
file, the key path and the reason, raised before anything starts.
`parse_config` is pure: environment variables and file reads are injected.
`load_config` is the thin I/O wrapper around it.

It must never open a socket, start a task or log, and never put a secret's
value in an error message.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import os
import re
import string
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, NamedTuple

import yaml
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.hazmat.primitives.serialization import load_pem_public_key

from router.formats import compile_path_pattern, parse_json_pointer

__all__ = [
    "AdminConfig",
    "BodyFieldConfig",
    "ClaimsConfig",
    "Config",
    "ConfigError",
    "ControlConfig",
    "CookieSourceConfig",
    "HealthConfig",
    "LearnConfig",
    "LimitsConfig",
    "ListenConfig",
    "LogConfig",
    "McpSourceConfig",
    "PathSourceConfig",
    "RouteConfig",
    "SessionKindConfig",
    "SignatureConfig",
    "SpawnConfig",
    "StateConfig",
    "StaticWorkerConfig",
    "TimeoutsConfig",
    "TokenFormatConfig",
    "VerifyConfig",
    "default_config",
    "load_config",
    "parse_config",
]


class ConfigError(Exception):
    """A configuration that cannot be used: which file, which key and why.

    `str()` is `"{source}: {key_path}: {reason}"`; `key_path` looks like
    `sessions[1].token.verify.secret_env`, or `(root)` / `(file)` when the
    problem is the whole document or the file itself.
    """

    def __init__(self, source: str, key_path: str, reason: str) -> None:
        super().__init__(f"{source}: {key_path}: {reason}")
        self.source = source
        self.key_path = key_path
        self.reason = reason

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, str, str]]:
        return (ConfigError, (self.source, self.key_path, self.reason))


@dataclass(frozen=True, slots=True)
class ListenConfig:
    """The public listener that agents connect to. Port 0 picks a free port."""

    # Agents reach the router from other hosts and containers.
    host: str = "0.0.0.0"
    # The usual unprivileged HTTP port.
    port: int = 8080


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """The admin listener (metrics, health, drain). Port 0 picks a free port."""

    # The admin API can drain workers, so it stays private unless an operator opts in.
    host: str = "127.0.0.1"
    # Envoy's admin port, familiar to operators of sidecars.
    port: int = 9901
    # Loopback needs no token; any other host requires one (from token_env / token_file).
    token: str | None = None


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The control socket workers claim episodes on (DESIGN §3)."""

    # A Unix socket authenticates workers by uid, with no secret to distribute.
    socket: str = "unix:/run/episode-router/control.sock"
    # Only the router's own uid may say hello unless others are listed.
    allowed_uids: tuple[int, ...] = ()
    # Loopback and unix: upstreams only, so a worker cannot point the router elsewhere.
    allowed_upstreams: tuple[str, ...] = ()
    # A Unix socket needs none; a tcp:// socket requires one (from secret_env / secret_file).
    secret: str | None = None
    # Three missed 5 s pings: long enough to ride out a GC pause, short enough to notice a hang.
    lease_timeout_s: float = 15.0
    # One ping interval: a client that reconnects at once keeps its episodes.
    reconnect_grace_s: float = 5.0

    @property
    def unix_path(self) -> str | None:
        """The Unix socket path, or None when the socket is TCP."""
        return self.socket[len(_UNIX) :] if self.socket.startswith(_UNIX) else None

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        """The (host, port) of a tcp:// socket, or None when the socket is Unix."""
        return _split_host_port(self.socket[len(_TCP) :]) if self.socket.startswith(_TCP) else None


@dataclass(frozen=True, slots=True)
class StaticWorkerConfig:
    """A worker the router health-probes; it never speaks on the control socket."""

    id: str
    url: str


@dataclass(frozen=True, slots=True)
class HealthConfig:
    """How static and spawned workers are probed."""

    # The path most HTTP servers (NeMo Gym's included) already answer.
    path: str = "/health"
    # A worker that exits is noticed within about two seconds.
    interval_s: float = 1.0
    # A live local worker answers a probe in milliseconds.
    timeout_s: float = 1.0
    # One lost probe is not an exit.
    failures: int = 2


@dataclass(frozen=True, slots=True)
class SpawnConfig:
    """Worker processes the router starts itself, one per port."""

    command: str
    # One worker unless asked for more.
    count: int = 1
    # Next to the admin port, clear of common service ports.
    base_port: int = 9001
    # Spawned workers are private to this host.
    host: str = "127.0.0.1"
    # Time to finish in-flight calls after SIGTERM before SIGKILL.
    stop_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class VerifyConfig:
    """Edge verification of episode tokens: an HS256 secret or a PEM public key."""

    alg: str
    key: bytes


@dataclass(frozen=True, slots=True)
class SignatureConfig:
    """Edge check of an itsdangerous or Starlette signature with the server's own secret key."""

    # Any length: Starlette's secret_key and itsdangerous' keys are arbitrary strings.
    key: bytes
    # Off: the server applies its own max_age (SessionMiddleware's default is 14 days).
    max_age_s: float | None = None
    # None: itsdangerous' default salt; NeMo Gym's MCP token uses its own.
    salt: str | None = None


@dataclass(frozen=True, slots=True)
class TokenFormatConfig:
    """How a session header's value is read."""

    # The episode token of DESIGN §2.
    format: str = "jws"
    # The payload key holding the session id; only the itsdangerous format reads one.
    field: str | None = None
    # Off: workers check the nonce themselves; a key makes forgeries a 403 at the edge.
    verify: VerifyConfig | None = None
    # The itsdangerous format's edge check; off unless a key is given.
    signature: SignatureConfig | None = None


@dataclass(frozen=True, slots=True)
class CookieSourceConfig:
    """A cookie carrying the session key."""

    name: str
    # Starlette's SessionMiddleware, which NeMo Gym's servers use.
    format: str = "starlette"
    # The session dict key NeMo Gym stores its session id under.
    field: str = "session_id"
    # Off: the server verifies its own cookie; a key makes forgeries a 403 at the edge.
    signature: SignatureConfig | None = None


@dataclass(frozen=True, slots=True)
class McpSourceConfig:
    """MCP Streamable HTTP protocol sessions (DESIGN §7)."""

    # The MCP SDKs' default endpoint.
    path: str = "/mcp"
    # The MCP specification's session header.
    header: str = "Mcp-Session-Id"


@dataclass(frozen=True, slots=True)
class BodyFieldConfig:
    """A JSON request body field carrying the session key."""

    # An RFC 6901 JSON pointer into the request body.
    pointer: str
    # Request bodies that name a session are small; a larger body names none.
    max_bytes: int = 65536


@dataclass(frozen=True, slots=True)
class PathSourceConfig:
    """A request path pattern whose `{key}` segment is the session key."""

    pattern: str


@dataclass(frozen=True, slots=True)
class LearnConfig:
    """Where a seed reply carries the new session's key; exactly one is set."""

    json_pointer: str | None = None
    header: str | None = None
    cookie: str | None = None


@dataclass(frozen=True, slots=True)
class RouteConfig:
    """A method and exact path; a seed route also says where its reply carries the key."""

    method: str
    path: str
    # Filled in for every seed route by the parser; None on close routes.
    learn: LearnConfig | None = None


@dataclass(frozen=True, slots=True)
class SessionKindConfig:
    """A kind of session and where its key comes from (DESIGN §4); exactly one source is set."""

    name: str
    header: str | None = None
    token: TokenFormatConfig = TokenFormatConfig()
    cookie: CookieSourceConfig | None = None
    mcp: McpSourceConfig | None = None
    body_field: BodyFieldConfig | None = None
    path: PathSourceConfig | None = None
    # Kinds without seed or close routes rely on claims over the control socket.
    seed: RouteConfig | None = None
    close: RouteConfig | None = None
    # An unknown key is an error the agent should see (DESIGN §1).
    unclaimed: str = "reject"

    @property
    def source(self) -> str:
        """Where the key comes from: "header", "cookie", "mcp", "body_field" or "path"."""
        for source in ("cookie", "mcp", "body_field", "path"):
            if getattr(self, source) is not None:
                return source
        return "header"


@dataclass(frozen=True, slots=True)
class ClaimsConfig:
    """Lifetimes and bounds of the claim table."""

    # An hour outlives any retry loop a client runs against an ended episode.
    tombstone_ttl_s: float = 3600.0
    # Bounds memory under a flood of short episodes.
    max_tombstones: int = 1_000_000
    # Enough for workers to notice the restart, reconnect and re-sync.
    recovery_window_s: float = 30.0
    # Unmodified workers never release, so learned claims must expire.
    learned_idle_ttl_s: float = 3600.0


@dataclass(frozen=True, slots=True)
class StateConfig:
    """Where the router journals workers and claims across restarts."""

    # Journaling is opt-in; without it a restart recovers from workers' syncs.
    path: str | None = None


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Limits on what a client may send."""

    # h11's default: well above real request heads, far below abuse.
    max_header_bytes: int = 16384
    # http.client's limit; real clients send about twenty.
    max_headers: int = 100
    # Bodies stream through unbuffered, and tool calls may upload large payloads.
    max_body_bytes: int | None = None
    # A real client sends its head in milliseconds; this bounds slowloris.
    header_timeout_s: float = 10.0
    # nginx's keepalive_timeout and aiohttp's keep-alive default.
    idle_timeout_s: float = 75.0
    # Apache's LimitRequestLine and aiohttp's max_line_size.
    max_line_bytes: int = 8190


@dataclass(frozen=True, slots=True)
class TimeoutsConfig:
    """Timeouts towards workers and for shutdown."""

    # A local worker accepts in milliseconds; a refused connect is immediate.
    connect_s: float = 2.0
    # LLM-backed tool calls can take minutes before their first byte.
    first_byte_s: float = 300.0
    # SSE streams can be quiet for minutes; this is an idle bound, not a total.
    stream_idle_s: float = 300.0
    # Kubernetes' default termination grace period.
    shutdown_grace_s: float = 30.0


@dataclass(frozen=True, slots=True)
class LogConfig:
    """Logging."""

    # Log pipelines parse JSON lines.
    format: str = "json"
    # At RL request rates, access logs dwarf everything else.
    access: bool = False
    # Lifecycle events without per-request noise.
    level: str = "info"


# The default session kind: episode tokens (DESIGN §2) in their standard header.
_EPISODE_KIND: Final = SessionKindConfig("episode", "X-NeMo-Gym-Episode-Token", TokenFormatConfig())


@dataclass(frozen=True, slots=True)
class Config:
    """The whole router configuration. `default_config()` is `Config()`."""

    listen: ListenConfig = ListenConfig()
    admin: AdminConfig = AdminConfig()
    control: ControlConfig = ControlConfig()
    # Workers usually arrive over the control socket.
    workers: tuple[StaticWorkerConfig, ...] = ()
    health: HealthConfig = HealthConfig()
    # The router starts no processes unless asked.
    spawn: SpawnConfig | None = None
    # NeMo Gym's episode token header.
    sessions: tuple[SessionKindConfig, ...] = (_EPISODE_KIND,)
    claims: ClaimsConfig = ClaimsConfig()
    state: StateConfig = StateConfig()
    limits: LimitsConfig = LimitsConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    log: LogConfig = LogConfig()

    def session_kind(self, name: str) -> SessionKindConfig | None:
        """The session kind called `name`, or None."""
        return next((kind for kind in self.sessions if kind.name == name), None)


def default_config() -> Config:
    """All defaults; one session kind, "episode": JWS tokens in X-NeMo-Gym-Episode-Token."""
    return Config()


def parse_config(
    text: str,
    *,
    source: str = "<config>",
    env: Mapping[str, str] | None = None,
    read_file: Callable[[str], bytes] | None = None,
) -> Config:
    """Parse and check a YAML configuration; an empty document gives `default_config()`.

    `env` resolves `*_env` secrets and `read_file` reads `*_file` secrets; when
    either is None, a secret that needs it is an error. Raises `ConfigError`
    (prefixed with `source`) for every problem, YAML syntax included.
    """
    ctx = _Context(source, env or {}, read_file)
    data = _load_yaml(ctx, text)
    return Config() if data is None else _config(_Section(ctx, "", data, _TOP_KEYS))


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Read and parse the file at `path`; secrets come from `env` (default `os.environ`) and files.

    Raises `ConfigError`, whose message starts with `path`.
    """
    source = str(path)
    try:
        raw = _read_bounded(source, _MAX_CONFIG_BYTES)
    except OSError as exc:
        raise ConfigError(source, "(file)", f"cannot read: {exc.strerror or exc}") from None
    if len(raw) > _MAX_CONFIG_BYTES:
        raise ConfigError(source, "(file)", f"larger than {_MAX_CONFIG_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(source, "(file)", f"not UTF-8 (bad byte at offset {exc.start})") from None
    environ = os.environ if env is None else env
    return parse_config(text, source=source, env=environ, read_file=_read_secret_file)


def _read_bounded(path: str, limit: int) -> bytes:
    """At most `limit + 1` bytes of a file, so an endless file (/dev/zero) cannot hang us."""
    with open(path, "rb") as file:
        return file.read(limit + 1)


def _read_secret_file(path: str) -> bytes:
    return _read_bounded(path, _MAX_SECRET_FILE_BYTES)


# ---------------------------------------------------------------------------- YAML

_MAX_CONFIG_BYTES: Final = 1 << 20
_MAX_SECRET_FILE_BYTES: Final = 64 << 10
_MERGE_TAG: Final = "tag:yaml.org,2002:merge"


class _DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key_path: str, reason: str) -> None:
        super().__init__(reason)
        self.key_path = key_path
        self.reason = reason


class _StrictLoader(yaml.SafeLoader):
    """yaml.SafeLoader (no Python object tags) that refuses a mapping with the same key twice.

    Plain YAML keeps the last value silently: a second `port:` added at the end of a
    section would quietly win over the one an operator reviewed.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        _check_duplicate_keys(node)
        return super().construct_document(node)


def _check_duplicate_keys(root: yaml.Node) -> None:
    """Walk the node graph once (aliases included, so no blow-up) looking for repeated keys."""
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    visited: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            stack.extend(_mapping_children(node, path))


def _mapping_children(node: yaml.MappingNode, path: str) -> Iterator[tuple[yaml.Node, str]]:
    seen: set[str] = set()
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
            yield value_node, path
            continue
        key, line = key_node.value, key_node.start_mark.line + 1
        if key in seen:
            reason = (
                f"duplicate key {_quote(key)} (line {line}); YAML would silently keep the last one"
            )
            raise _DuplicateKeyError(_join(path, key), reason)
        seen.add(key)
        yield value_node, _join(path, key)


def _load_yaml(ctx: _Context, text: str) -> object:
    try:
        return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: no Python object tags
    except _DuplicateKeyError as exc:
        raise ctx.fail(exc.key_path, exc.reason) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = "; ".join(part for part in (exc.context, exc.problem) if part)
        raise ctx.fail("", f"invalid YAML{where}: {what}") from None
    except yaml.YAMLError as exc:
        raise ctx.fail("", f"invalid YAML: {exc}") from None
    except RecursionError:
        raise ctx.fail("", "YAML nested too deeply") from None


# ---------------------------------------------------------------------------- reading

_MAX_SECONDS: Final = 1e9  # about 31 years: beyond this a value is a typo, and overflows timers
_MAX_INT: Final = 2**31 - 1
_MISSING: Final = object()


@dataclass(frozen=True, slots=True)
class _Context:
    source: str
    env: Mapping[str, str]
    read_file: Callable[[str], bytes] | None

    def fail(self, key_path: str, reason: str) -> ConfigError:
        return ConfigError(self.source, key_path or "(root)", reason)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _quote(text: str) -> str:
    """A string from the file, quoted for an error message and cut short when long."""
    return repr(text[:60] + "..." if len(text) > 60 else text)


def _describe(value: object) -> str:
    """A value for an error message; never the repr of a container (alias bombs are huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int | float):
        return f"{'an integer' if isinstance(value, int) else 'a number'} ({value!r})"
    if isinstance(value, str):
        return f"a string ({_quote(value)})"
    if isinstance(value, list | dict):
        return "a list" if isinstance(value, list) else "a mapping"
    return f"a {type(value).__name__}"


class _Section:
    """One mapping from the file and its key path; typed reads that raise `ConfigError`."""

    __slots__ = ("_data", "ctx", "path")

    def __init__(
        self,
        ctx: _Context,
        path: str,
        value: object,
        allowed: tuple[str, ...],
        rejected: Mapping[str, str] | None = None,
    ) -> None:
        self.ctx, self.path = ctx, path
        if not isinstance(value, dict):
            raise ctx.fail(path, f"expected a mapping, got {_describe(value)}")
        for key in value:
            if not isinstance(key, str):
                raise ctx.fail(path, f"keys must be strings, got {_describe(key)}")
            if rejected and key in rejected:
                raise ctx.fail(_join(path, key), rejected[key])
            if key not in allowed:
                keys = ", ".join(allowed)
                raise ctx.fail(_join(path, key), f"unknown key {_quote(key)}; allowed keys: {keys}")
        self._data: dict[str, object] = value

    def fail(self, key: str | None, reason: str) -> ConfigError:
        return self.ctx.fail(self.path if key is None else _join(self.path, key), reason)

    def has(self, key: str) -> bool:
        return self._data.get(key) is not None

    def value(self, key: str) -> object:
        """The raw value at `key` (None when absent), for keys that take more than one shape."""
        return self._data.get(key)

    def child(
        self, key: str, allowed: tuple[str, ...], rejected: Mapping[str, str] | None = None
    ) -> _Section:
        value = self._data.get(key)
        value = {} if value is None else value  # `listen:` or `listen: null`: all defaults
        return _Section(self.ctx, _join(self.path, key), value, allowed, rejected)

    def items(self, key: str) -> list[tuple[str, object]]:
        """(key path, value) of each list item; absent or null is an empty list."""
        value = self._data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {_describe(value)}")
        return [(f"{_join(self.path, key)}[{i}]", item) for i, item in enumerate(value)]

    def sections(
        self, key: str, allowed: tuple[str, ...], rejected: Mapping[str, str] | None = None
    ) -> list[_Section]:
        return [_Section(self.ctx, p, v, allowed, rejected) for p, v in self.items(key)]

    def text(self, key: str, default: str | None = None) -> str:
        """A non-empty string; required when `default` is None."""
        value = self._data.get(key, _MISSING)
        if value is _MISSING and default is not None:
            return default
        if value is _MISSING:
            raise self.fail(key, "missing required key")
        return _text(self.ctx, _join(self.path, key), value)

    def optional_text(self, key: str) -> str | None:
        return self.text(key) if self.has(key) else None

    def choice(self, key: str, default: str | None, choices: tuple[str, ...]) -> str:
        value = self.text(key, default)
        if value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}; got {_quote(value)}")
        return value

    def host(self, key: str, default: str) -> str:
        value = self.text(key, default)
        if not _is_host(value):
            raise self.fail(key, f"expected a host name or IP address, got {_quote(value)}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self._data.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {_describe(value)}")
        return value

    def integer(self, key: str, default: int, low: int = 1, high: int = _MAX_INT) -> int:
        return _integer(self.ctx, _join(self.path, key), self._data.get(key, default), low, high)

    def optional_integer(self, key: str, low: int = 1, high: int = _MAX_INT) -> int | None:
        return self.integer(key, 0, low, high) if self.has(key) else None

    def seconds(self, key: str, default: float) -> float:
        value = self._data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            reason = f"expected a number of seconds, got {_describe(value)}"
            raise self.fail(key, reason + _exponent_hint(value))
        if not (math.isfinite(value) and 0 < value <= _MAX_SECONDS):
            raise self.fail(key, f"must be above 0 and at most {_MAX_SECONDS:.0f}, got {value!r}")
        return float(value)


def _exponent_hint(value: object) -> str:
    """YAML 1.1 reads 1e3 (no dot, or no exponent sign) as a string; say how to write it."""
    if not isinstance(value, str) or "e" not in value.lower():
        return ""
    try:
        float(value)
    except ValueError:
        return ""
    return " (YAML needs a dot and a signed exponent, like 1.0e+3)"


def _text(ctx: _Context, key_path: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ctx.fail(key_path, f"expected a non-empty string, got {_describe(value)}")
    return value


def _integer(ctx: _Context, key_path: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ctx.fail(key_path, f"expected an integer, got {_describe(value)}")
    if not low <= value <= high:
        raise ctx.fail(key_path, f"must be between {low} and {high}, got {value}")
    return value


# ---------------------------------------------------------------------------- addresses

_UNIX: Final = "unix:"
_TCP: Final = "tcp://"
_HTTP: Final = "http://"
_HOSTNAME: Final = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,251}[A-Za-z0-9_])?")
_MAX_SUN_PATH: Final = 107  # sockaddr_un.sun_path is 108 bytes with the trailing NUL
_WILDCARDS: Final = frozenset({"0.0.0.0", "::"})


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _is_host(host: str) -> bool:
    return _is_ip(host) or _HOSTNAME.fullmatch(host) is not None


def _is_loopback(host: str) -> bool:
    return host.lower() == "localhost" or (_is_ip(host) and ipaddress.ip_address(host).is_loopback)


def _split_host_port(text: str) -> tuple[str, int] | None:
    """ "host:port" or "[v6]:port" split, or None when malformed; the port is not range-checked."""
    host, sep, port = text.rpartition(":")
    if not sep or not (port.isascii() and port.isdigit()) or len(port) > 5:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        return (host, int(port)) if ":" in host and _is_ip(host) else None
    return (host, int(port)) if ":" not in host and _is_host(host) else None


def _unix_path_problem(path: str) -> str | None:
    if not path or "\0" in path:
        return "a unix: socket needs a path"
    if len(path.encode("utf-8", "surrogateescape")) > _MAX_SUN_PATH:
        return f"unix socket path longer than {_MAX_SUN_PATH} bytes"
    return None


def _upstream_problem(url: str) -> str | None:
    """Why `url` is not "http://host:port" or "unix:/absolute/path", or None."""
    expected = f"expected http://host:port or unix:/absolute/path, got {_quote(url)}"
    if url.startswith(_UNIX):
        path = url[len(_UNIX) :]
        return expected if not path.startswith("/") else _unix_path_problem(path)
    address = _split_host_port(url[len(_HTTP) :]) if url.startswith(_HTTP) else None
    return expected if address is None or not 1 <= address[1] <= 65535 else None


def _control_socket_problem(spec: str) -> str | None:
    if spec.startswith(_UNIX):
        return _unix_path_problem(spec[len(_UNIX) :])
    address = _split_host_port(spec[len(_TCP) :]) if spec.startswith(_TCP) else None
    if address is None or not 1 <= address[1] <= 65535:
        return f"expected unix:PATH or tcp://HOST:PORT, got {_quote(spec)}"
    if not _is_loopback(address[0]):
        return (
            f"a tcp:// control socket must be on loopback (127.0.0.0/8, ::1, localhost), "
            f"got {_quote(address[0])}: the control protocol is not encrypted"
        )
    return None


class _Bound(NamedTuple):
    """A port range the router binds or starts a process on."""

    key_path: str
    host: str
    first: int
    last: int


def _hosts_clash(bound_host: str, host: str, *, wildcard_clashes_any: bool) -> bool:
    a, b = bound_host.lower(), host.lower()
    if a in _WILDCARDS and (wildcard_clashes_any or _is_loopback(b) or b in _WILDCARDS):
        return True
    if b in _WILDCARDS and wildcard_clashes_any:
        return True
    aliases = {"localhost", "127.0.0.1", "::1"}
    return a == b or (a == "localhost" and b in aliases) or (b == "localhost" and a in aliases)


def _bound_ranges(config: Config) -> list[_Bound]:
    bound = [
        _Bound("listen.port", config.listen.host, config.listen.port, config.listen.port),
        _Bound("admin.port", config.admin.host, config.admin.port, config.admin.port),
    ]
    tcp = config.control.tcp_address
    if tcp is not None:
        bound.append(_Bound("control.socket", tcp[0], tcp[1], tcp[1]))
    if config.spawn is not None:
        spawn = config.spawn
        last = spawn.base_port + spawn.count - 1
        bound.append(_Bound("spawn.base_port", spawn.host, spawn.base_port, last))
    return [b for b in bound if b.first != 0]  # port 0: the kernel picks a free port


def _check_addresses(ctx: _Context, config: Config) -> None:
    """No two listeners (or spawned ports) on one address, and no worker at one of them."""
    bound = _bound_ranges(config)
    for i, later in enumerate(bound):
        for earlier in bound[:i]:
            ports = earlier.first <= later.last and later.first <= earlier.last
            if ports and _hosts_clash(earlier.host, later.host, wildcard_clashes_any=True):
                raise ctx.fail(later.key_path, f"address clashes with {earlier.key_path}")
    for i, worker in enumerate(config.workers):
        if not worker.url.startswith(_HTTP):
            continue
        host, port = _split_host_port(worker.url[len(_HTTP) :]) or ("", 0)
        for b in bound:
            clash = _hosts_clash(b.host, host, wildcard_clashes_any=False)
            if clash and b.first <= port <= b.last:
                raise ctx.fail(f"workers[{i}].url", f"is the router's own {b.key_path} address")


# ---------------------------------------------------------------------------- secrets

_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_INLINE_SECRET: Final = "inline secrets are not allowed; use {0}_env or {0}_file"
_MIN_SHARED_SECRET: Final = 16  # bytes: guessing must be hopeless for a listener on the network
_MIN_HS256_SECRET: Final = 32  # bytes: RFC 7518 §3.2, a key at least as long as the hash


def _inline(base: str) -> dict[str, str]:
    return {base: _INLINE_SECRET.format(base)}


def _from_env(sec: _Section, key: str) -> bytes:
    name = sec.text(key)
    if not _ENV_NAME.fullmatch(name):
        raise sec.fail(key, f"{_quote(name)} is not an environment variable name")
    value = sec.ctx.env.get(name)
    if not value:
        raise sec.fail(key, f"environment variable {name} is not set or is empty")
    return value.encode("utf-8", "surrogateescape")


def _from_file(sec: _Section, key: str) -> bytes:
    path = sec.text(key)
    if sec.ctx.read_file is None:
        raise sec.fail(key, f"cannot read {_quote(path)}: no file reader is available here")
    try:
        data = sec.ctx.read_file(path)
    except OSError as exc:
        raise sec.fail(key, f"cannot read {_quote(path)}: {exc.strerror or exc}") from None
    if len(data) > _MAX_SECRET_FILE_BYTES:
        raise sec.fail(key, f"{_quote(path)} is larger than {_MAX_SECRET_FILE_BYTES} bytes")
    return data


def _strip_newline(data: bytes) -> bytes:
    """One trailing newline goes: editors and `echo` add it, and it is never part of a secret."""
    return data[:-2] if data.endswith(b"\r\n") else data[:-1] if data.endswith(b"\n") else data


def _secret(sec: _Section, base: str, min_bytes: int) -> tuple[str, bytes] | None:
    """(key, secret) from `{base}_env` or `{base}_file` (at most one), or None if neither is set."""
    keys = [k for k in (f"{base}_env", f"{base}_file") if sec.has(k)]
    if len(keys) > 1:
        raise sec.fail(keys[1], f"set only one of {base}_env and {base}_file")
    return (keys[0], _read_secret(sec, keys[0], min_bytes)) if keys else None


def _read_secret(sec: _Section, key: str, min_bytes: int) -> bytes:
    """The secret a `*_env` or `*_file` key names, at least `min_bytes` long."""
    value = _from_env(sec, key) if key.endswith("_env") else _strip_newline(_from_file(sec, key))
    if len(value) < min_bytes:
        unit = "byte" if min_bytes == 1 else "bytes"
        raise sec.fail(key, f"the secret must be at least {min_bytes} {unit}, got {len(value)}")
    return value


def _secret_text(sec: _Section, base: str, *, header_safe: bool) -> tuple[str, str] | None:
    found = _secret(sec, base, _MIN_SHARED_SECRET)
    if found is None:
        return None
    key, value = found
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        raise sec.fail(key, "the secret is not UTF-8") from None
    if header_safe and not all("!" <= c <= "~" for c in text):
        raise sec.fail(key, "the token must be visible ASCII: it travels in an HTTP header")
    return key, text


def _public_key_problem(alg: str, pem: bytes) -> str | None:
    try:
        key = load_pem_public_key(pem)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        return "the file is not a PEM public key (SubjectPublicKeyInfo)"
    if alg == "EdDSA" and not isinstance(key, ed25519.Ed25519PublicKey):
        return "EdDSA needs an Ed25519 public key"
    if alg == "ES256" and not (
        isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1)
    ):
        return "ES256 needs a P-256 (secp256r1) public key"
    return None


# ---------------------------------------------------------------------------- sections

_TOP_KEYS: Final = (
    *("listen", "admin", "control", "workers", "health", "spawn", "sessions"),
    *("claims", "state", "limits", "timeouts", "log"),
)
_WORKER_ID: Final = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PLACEHOLDERS: Final = ("port", "worker_id", "host")
_SESSION_NAME: Final = re.compile(r"[a-z0-9_]{1,32}")
# RFC 9110 token characters without '_': the router drops such headers (DESIGN §8).
_HEADER_NAME: Final = re.compile(r"[!#$%&'*+.^`|~0-9A-Za-z-]{1,128}")
_RESERVED_HEADERS: Final = frozenset(
    {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade"}
    | {"host", "content-length", "cookie", "forwarded"}
)
_RESERVED_PREFIXES: Final = ("proxy-", "x-forwarded-", "x-episode-router-")
_ALGS: Final = ("HS256", "EdDSA", "ES256")
_KEY_SOURCES: Final = ("secret_env", "secret_file", "public_key_file")  # HS256: 2, others: 1
_INLINE_KEYS: Final = {
    **_inline("secret"),
    "key": _INLINE_SECRET.format("secret") + " (or public_key_file)",
    "public_key": "inline keys are not allowed; use public_key_file",
}
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
    *("header_timeout_s", "idle_timeout_s", "max_line_bytes"),
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


# ---------------------------------------------------------------------------- session kinds

_SESSION_KEYS: Final = (
    *("name", "header", "token", "cookie", "mcp", "body_field", "path"),
    *("seed", "close", "unclaimed"),
)
_SOURCES: Final = ("header", "cookie", "mcp", "body_field", "path")
_TOKEN_CHAR: Final = r"[!#$%&'*+.^_`|~0-9A-Za-z-]"  # RFC 9110 tchar
# RFC 6265 cookie-name: a token, where '_' is fine (cookies are not headers).
_COOKIE_NAME: Final = re.compile(_TOKEN_CHAR + "{1,128}")
_METHOD: Final = re.compile(_TOKEN_CHAR + "{1,32}")
# Headers of replies, which the router reads as they come: '_' included.
_REPLY_HEADER: Final = re.compile(_TOKEN_CHAR + "{1,128}")
_UNREADABLE_REPLY_HEADERS: Final = frozenset(
    {"connection", "keep-alive", "te", "trailer", "transfer-encoding", "upgrade", "content-length"}
)
_MAX_BODY_FIELD_BYTES: Final = 16 << 20  # buffering more than this per request is not routing
_ALSO: Final = "is also read by {other}"
_TOKEN_KEYS: Final = ("format", "field", "verify")
_COOKIE_KEYS: Final = ("name", "format", "field", "verify")
_LEARN_KEYS: Final = ("json_pointer", "header", "cookie")
_SECRET_KEYS: Final = ("secret_env", "secret_file")
_COOKIE_SIGNATURE_REJECTED: Final = {
    **_INLINE_KEYS,
    "salt": "Starlette's SessionMiddleware signs with itsdangerous' default salt",
    "alg": "Starlette cookies are signed with HMAC-SHA1 by itsdangerous; alg is for jws tokens",
}
_TOKEN_SIGNATURE_REJECTED: Final = {
    **_INLINE_KEYS,
    "max_age_s": "URLSafeSerializer tokens carry no timestamp, so they have no age",
    "alg": "itsdangerous tokens are signed with HMAC-SHA1; alg is for jws tokens",
}


class _Mark(NamedTuple):
    """Something at most one kind may read: its key path in the kind, identity and complaint."""

    key: str
    identity: tuple[str, str]
    # "{other}" stands for the earlier kind; replaced, not formatted, since paths hold braces.
    reason: str


def _sessions(root: _Section) -> tuple[SessionKindConfig, ...]:
    if not root.has("sessions"):
        return Config().sessions
    sections = root.sections("sessions", _SESSION_KEYS)
    if not sections:
        raise root.fail("sessions", "needs at least one kind; leave it out for the default kind")
    kinds: list[SessionKindConfig] = []
    owners: dict[tuple[str, str], int] = {}
    for i, sec in enumerate(sections):
        kind = _session_kind(sec)
        for mark in _marks(kind):
            j = owners.setdefault(mark.identity, i)
            if j != i:
                raise sec.fail(mark.key, mark.reason.replace("{other}", f"sessions[{j}]"))
        _check_routes(sec, kind, kinds)
        kinds.append(kind)
    return tuple(kinds)


def _marks(kind: SessionKindConfig) -> list[_Mark]:
    duplicate = f"duplicate session kind {_quote(kind.name)} (also {{other}})"
    marks = [_Mark("name", ("name", kind.name), duplicate)]
    if kind.header is not None:
        marks.append(_header_mark("header", kind.header))
    if kind.mcp is not None:
        marks.append(_Mark("mcp", ("mcp", ""), "only one kind may read MCP sessions: {other} does"))
        marks.append(_header_mark("mcp.header", kind.mcp.header))
    if kind.cookie is not None:
        name = kind.cookie.name
        marks.append(_Mark("cookie.name", ("cookie", name), f"cookie {_quote(name)} {_ALSO}"))
    if kind.body_field is not None:
        pointer = kind.body_field.pointer
        marks.append(
            _Mark("body_field", ("body", pointer), f"body field {_quote(pointer)} {_ALSO}")
        )
    if kind.path is not None:
        pattern = kind.path.pattern
        marks.append(_Mark("path", ("path", pattern), f"path {_quote(pattern)} {_ALSO}"))
    return marks


def _header_mark(key: str, header: str) -> _Mark:
    return _Mark(key, ("header", header.lower()), f"header {_quote(header)} {_ALSO}")


def _check_routes(sec: _Section, kind: SessionKindConfig, earlier: list[SessionKindConfig]) -> None:
    """A seed route may be shared by kinds, and so may a close route; one route is never both."""
    seed, close = _route_id(kind.seed), _route_id(kind.close)
    if seed is not None and seed == close:
        raise sec.fail("close", f"{seed} is also this kind's seed route")
    for j, other in enumerate(earlier):
        if seed is not None and seed == _route_id(other.close):
            raise sec.fail("seed", f"{seed} is the close route of sessions[{j}]")
        if close is not None and close == _route_id(other.seed):
            raise sec.fail("close", f"{close} is the seed route of sessions[{j}]")


def _route_id(route: RouteConfig | None) -> str | None:
    return None if route is None else f"{route.method} {route.path}"


def _session_kind(sec: _Section) -> SessionKindConfig:
    name = sec.text("name")
    if not _SESSION_NAME.fullmatch(name):
        raise sec.fail("name", f"must be 1 to 32 of a-z 0-9 _, got {_quote(name)}")
    source = _source(sec)
    if source != "header" and sec.has("token"):
        raise sec.fail("token", f"only a header kind reads a token; this kind reads a {source}")
    kind = SessionKindConfig(
        name,
        header=_kind_header(sec) if source == "header" else None,
        token=_token_format(sec.child("token", _TOKEN_KEYS)),
        cookie=_cookie(sec.child("cookie", _COOKIE_KEYS)) if source == "cookie" else None,
        mcp=_mcp(sec.child("mcp", ("path", "header"))) if source == "mcp" else None,
        body_field=_body_field(sec) if source == "body_field" else None,
        path=_path_source(sec) if source == "path" else None,
        unclaimed=sec.choice("unclaimed", "reject", ("reject", "forward")),
    )
    return dataclasses.replace(kind, seed=_seed(sec, kind), close=_close(sec))


def _source(sec: _Section) -> str:
    found = [key for key in _SOURCES if sec.has(key)]
    if len(found) == 1:
        return found[0]
    if not found:
        reason = f"needs a key source: one of {', '.join(_SOURCES)} (`mcp: {{}}` for MCP defaults)"
        raise sec.fail(None, reason)
    raise sec.fail(found[1], f"a kind reads one key source; this one also has {found[0]}")


def _kind_header(sec: _Section) -> str:
    header = sec.text("header")
    if problem := _header_problem(header):
        raise sec.fail("header", problem)
    return header


def _header_problem(header: str) -> str | None:
    lower = header.lower()
    if "_" in header:
        return "header names with '_' are dropped by the router (they read as '-' behind WSGI)"
    if not _HEADER_NAME.fullmatch(header):
        return f"not an HTTP header name: {_quote(header)}"
    if lower in _RESERVED_HEADERS or lower.startswith(_RESERVED_PREFIXES):
        return f"{_quote(header)} is rewritten or stripped by the router"
    return None


def _token_format(sec: _Section) -> TokenFormatConfig:
    token_format = sec.choice("format", "jws", ("jws", "raw", "itsdangerous"))
    if token_format == "itsdangerous":
        return _itsdangerous_token(sec)
    if sec.has("field"):
        raise sec.fail("field", "only the itsdangerous format reads a field")
    if token_format == "raw" and sec.has("verify"):
        raise sec.fail("verify", "a raw token is the key itself: it carries no signature to verify")
    if not sec.has("verify"):
        return TokenFormatConfig(token_format)
    verify = sec.child("verify", ("alg", *_KEY_SOURCES), _INLINE_KEYS)
    return TokenFormatConfig(token_format, None, _verify(verify))


def _itsdangerous_token(sec: _Section) -> TokenFormatConfig:
    if not sec.has("field"):
        reason = "the itsdangerous format needs the payload field holding the key (NeMo Gym: sid)"
        raise sec.fail("field", reason)
    field = sec.text("field")
    if not sec.has("verify"):
        return TokenFormatConfig("itsdangerous", field)
    verify = sec.child("verify", (*_SECRET_KEYS, "salt"), _TOKEN_SIGNATURE_REJECTED)
    return TokenFormatConfig("itsdangerous", field, None, _signature(verify))


def _verify(sec: _Section) -> VerifyConfig:
    alg = sec.choice("alg", None, _ALGS)
    sources = [k for k in _KEY_SOURCES if sec.has(k)]
    wanted = _KEY_SOURCES[:2] if alg == "HS256" else _KEY_SOURCES[2:]
    if len(sources) != 1:
        got = " and ".join(sources) or "none"
        reason = f"needs exactly one key source, got {got}; for {alg}: {' or '.join(wanted)}"
        raise sec.fail(None, reason)
    if sources[0] not in wanted:
        raise sec.fail(sources[0], f"{alg} takes its key from {' or '.join(wanted)}")
    if alg == "HS256":
        return VerifyConfig(alg, _read_secret(sec, sources[0], _MIN_HS256_SECRET))
    pem = _from_file(sec, "public_key_file")
    if problem := _public_key_problem(alg, pem):
        raise sec.fail("public_key_file", problem)
    return VerifyConfig(alg, pem)


def _signature(sec: _Section) -> SignatureConfig:
    """The server's own secret (any length: it is the server's choice) and the optional checks."""
    secret = _secret(sec, "secret", 1)
    if secret is None:
        raise sec.fail(None, "needs the server's secret key: secret_env or secret_file")
    max_age = sec.seconds("max_age_s", 0) if sec.has("max_age_s") else None
    return SignatureConfig(secret[1], max_age, sec.optional_text("salt"))


def _cookie(sec: _Section) -> CookieSourceConfig:
    name = _cookie_name(sec, "name")
    cookie_format = sec.choice("format", "starlette", ("starlette", "raw"))
    if cookie_format == "raw":
        for key in ("field", "verify"):
            if sec.has(key):
                raise sec.fail(
                    key, "a raw cookie's value is the key itself: no field, no signature"
                )
        return CookieSourceConfig(name, cookie_format)
    field = sec.text("field", CookieSourceConfig("").field)
    if not sec.has("verify"):
        return CookieSourceConfig(name, cookie_format, field)
    verify = sec.child("verify", (*_SECRET_KEYS, "max_age_s"), _COOKIE_SIGNATURE_REJECTED)
    return CookieSourceConfig(name, cookie_format, field, _signature(verify))


def _cookie_name(sec: _Section, key: str) -> str:
    name = sec.text(key)
    if not _COOKIE_NAME.fullmatch(name):
        raise sec.fail(
            key, f"not a cookie name (1 to 128 RFC 6265 token characters): {_quote(name)}"
        )
    return name


def _mcp(sec: _Section) -> McpSourceConfig:
    d = McpSourceConfig()
    path = _exact_path(sec, "path", d.path)
    header = sec.text("header", d.header)
    if problem := _header_problem(header):
        raise sec.fail("header", problem)
    return McpSourceConfig(path, header)


def _body_field(sec: _Section) -> BodyFieldConfig:
    if isinstance(sec.value("body_field"), str):
        field = sec.text("body_field")
        if field.startswith("/"):
            reason = f"a field name; for a JSON pointer write {{pointer: {field}}}"
            raise sec.fail("body_field", reason)
        return BodyFieldConfig("/" + field.replace("~", "~0").replace("/", "~1"))
    body = sec.child("body_field", ("pointer", "max_bytes"))
    pointer = _json_pointer(body, "pointer")
    max_bytes = body.integer("max_bytes", BodyFieldConfig("").max_bytes, 1, _MAX_BODY_FIELD_BYTES)
    return BodyFieldConfig(pointer, max_bytes)


def _json_pointer(sec: _Section, key: str) -> str:
    pointer = sec.text(key)
    try:
        parse_json_pointer(pointer)
    except ValueError as exc:
        raise sec.fail(key, f"not an RFC 6901 JSON pointer: {exc}; got {_quote(pointer)}") from None
    return pointer


def _path_source(sec: _Section) -> PathSourceConfig:
    pattern = sec.text("path")
    try:
        compile_path_pattern(pattern)
    except ValueError as exc:
        raise sec.fail("path", f"{exc}; got {_quote(pattern)}") from None
    return PathSourceConfig(pattern)


def _exact_path(sec: _Section, key: str, default: str | None = None) -> str:
    path = sec.text(key, default)
    if not (path.startswith("/") and all("!" <= c <= "~" and c not in "?#" for c in path)):
        reason = f"expected an exact path: /, then visible ASCII without ? or #; got {_quote(path)}"
        raise sec.fail(key, reason)
    return path


def _route(sec: _Section) -> RouteConfig:
    method = sec.text("method").upper()
    if not _METHOD.fullmatch(method):
        raise sec.fail("method", f"not an HTTP method: {_quote(method)}")
    return RouteConfig(method, _exact_path(sec, "path"))


def _seed(sec: _Section, kind: SessionKindConfig) -> RouteConfig | None:
    if not sec.has("seed"):
        return None
    if kind.mcp is not None:
        reason = "an mcp kind learns Mcp-Session-Id from every reply on its path; it has no seed"
        raise sec.fail("seed", reason)
    seed = sec.child("seed", ("method", "path", "learn"))
    route = _route(seed)
    if seed.has("learn"):
        return dataclasses.replace(route, learn=_learn(seed.child("learn", _LEARN_KEYS)))
    if kind.cookie is not None:
        return dataclasses.replace(route, learn=LearnConfig(cookie=kind.cookie.name))
    if kind.header is not None:
        return dataclasses.replace(route, learn=LearnConfig(header=kind.header))
    reason = f"a {kind.source} kind needs learn: {{json_pointer, header or cookie}} to find its key"
    raise seed.fail("learn", reason)


def _learn(sec: _Section) -> LearnConfig:
    found = [key for key in _LEARN_KEYS if sec.has(key)]
    if len(found) != 1:
        got = " and ".join(found) or "none"
        raise sec.fail(None, f"needs exactly one of json_pointer, header, cookie; got {got}")
    if found[0] == "json_pointer":
        return LearnConfig(json_pointer=_json_pointer(sec, "json_pointer"))
    if found[0] == "cookie":
        return LearnConfig(cookie=_cookie_name(sec, "cookie"))
    header = sec.text("header")
    if not _REPLY_HEADER.fullmatch(header):
        raise sec.fail("header", f"not an HTTP header name: {_quote(header)}")
    if header.lower() == "set-cookie":
        raise sec.fail("header", "write learn: {cookie: NAME} to read a cookie from Set-Cookie")
    if header.lower() in _UNREADABLE_REPLY_HEADERS:
        raise sec.fail("header", f"{_quote(header)} is a framing header, never a session key")
    return LearnConfig(header=header)


def _close(sec: _Section) -> RouteConfig | None:
    if not sec.has("close"):
        return None
    rejected = {"learn": "a close route releases the claim on a 2xx reply; it learns nothing"}
    return _route(sec.child("close", ("method", "path"), rejected))
