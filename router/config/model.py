"""The configuration's shape: a frozen dataclass for every section, and every default.

This module owns what a `Config` holds and each field's default, each with a
one-line reason. The dataclasses are plain values: the checks on a file's
values live in the parsing modules (`router.config.parse` and those it calls).

It must never read a file or the environment, and never parse or check a value.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from router.directory.keys import DEFAULT_PREFIX
from router.directory.settings import (
    DEFAULT_CLAIM_TIMEOUT_S,
    DEFAULT_LEASE_TTL_S,
    DEFAULT_LOOKUP_TIMEOUT_MS,
)
from router.protocol import TCP, UNIX, split_host_port


@dataclass(frozen=True, slots=True)
class ListenConfig:
    """The public listener that agents connect to. Port 0 picks a free port."""

    # Agents reach the router from other hosts and containers.
    host: str = "0.0.0.0"
    # The usual unprivileged HTTP port.
    port: int = 8080
    # SO_REUSEPORT: several router processes of one host bind the same port and the
    # kernel spreads the connections over them (design §10, shape B). Off: a second
    # router on a taken port fails to start, as a mistake should.
    reuse_port: bool = False


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """The admin listener (metrics, health, drain). Port 0 picks a free port."""

    # The admin API can drain workers, so it stays private unless an operator opts in.
    host: str = "127.0.0.1"
    # Envoy's admin port, familiar to operators of sidecars.
    port: int = 9901
    # Loopback needs no token; any other host requires one (from token_env / token_file).
    token: str | None = None
    # Only the bind address (and localhost on loopback): a name a page could rebind
    # to this host is refused unless an operator lists it.
    allowed_hosts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """The control socket workers claim episodes on (design §3)."""

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
    # A worker runs far fewer episodes at once; at about 700 B a claim this bounds one
    # worker's claims (and one sync) to about 70 MB.
    max_claims_per_worker: int = 100_000
    # Twice the largest spawn, all reconnecting at once; at 64 KiB of partial line
    # each, those that may wait hold at most 32 MiB.
    max_connections_before_hello: int = 512
    # Sixteen times the largest spawn: each connection is a descriptor, each lease a
    # worker with its claims.
    max_connections: int = 4096
    # Only a worker's own sockets (by its uid) unless an operator names shared folders.
    worker_socket_dirs: tuple[str, ...] = ()

    @property
    def unix_path(self) -> str | None:
        """The Unix socket path, or None when the socket is TCP."""
        return self.socket[len(UNIX) :] if self.socket.startswith(UNIX) else None

    @property
    def tcp_address(self) -> tuple[str, int] | None:
        """The (host, port) of a tcp:// socket, or None when the socket is Unix."""
        return split_host_port(self.socket[len(TCP) :]) if self.socket.startswith(TCP) else None


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
    # How a spawned worker becomes live: it says hello on the control socket ("hello"),
    # or, for a server that never speaks the protocol, its health probe answers
    # ("probe": probed at health.path, as static workers are).
    register: str = "hello"
    # The workers' working directory; None: the router's own.
    cwd: str | None = None
    # Variables set for each worker, their values templates like the command's.
    env: tuple[tuple[str, str], ...] = ()


# What a spawn template (the command, an `env` value, `cwd`) may name of each worker:
# its private port, its id, the host it listens on, its index (0, 1, ...).
SPAWN_PLACEHOLDERS: Final = ("port", "worker_id", "host", "index")
# The variables the router sets for its spawned workers; inherited ones are dropped.
SPAWN_ENV_PREFIX: Final = "EPISODE_ROUTER_"


@dataclass(frozen=True, slots=True)
class SpawnedWorker:
    """One worker a `spawn:` section describes: its id, its private port and its url."""

    worker_id: str
    port: int
    url: str


def spawned_workers(count: int, base_port: int, host: str) -> tuple[SpawnedWorker, ...]:
    """The workers a `spawn:` section describes (design §5): ids "w0", "w1", ... on
    consecutive ports from `base_port`. The config check and the spawner both name
    spawned workers by this one rule."""
    shown = f"[{host}]" if ":" in host else host  # an IPv6 address in a URL
    return tuple(
        SpawnedWorker(f"w{index}", base_port + index, f"http://{shown}:{base_port + index}")
        for index in range(count)
    )


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

    # The episode token of design §2.
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
    """MCP Streamable HTTP protocol sessions (design §7)."""

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
    """Where a seed's new session key is found; exactly one is set. `request`: the key
    the seed request itself names in the kind's own source (the caller names the
    session), learned when the reply is a 2xx."""

    json_pointer: str | None = None
    header: str | None = None
    cookie: str | None = None
    request: bool = False


@dataclass(frozen=True, slots=True)
class RouteConfig:
    """A method and exact path; a seed route also says where its key is found."""

    method: str
    path: str
    # Filled in for every seed route by the parser (the first place the reply carries
    # wins; or the request alone); empty on close routes.
    learn: tuple[LearnConfig, ...] = ()

    @property
    def learns_from_request(self) -> bool:
        """The caller names the session in its seed request (`learn: request`)."""
        return any(place.request for place in self.learn)


@dataclass(frozen=True, slots=True)
class SessionKindConfig:
    """A kind of session and where its key comes from (design §4); exactly one source is set."""

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
    # An unknown key is an error the agent should see (design §1).
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
    # nginx's client_body_timeout: the longest silence while a request body arrives.
    body_timeout_s: float = 60.0
    # A body this large is read whole before a worker connection is taken, so a slow
    # upload costs its own bytes, not a connection: tool-call bodies fit (0: never).
    body_buffer_bytes: int = 1024 * 1024
    # A reply of known length this large is read whole and its connection reused at
    # once, so a slow reader does not hold the worker (nginx's proxy_buffering; 0: never).
    reply_buffer_bytes: int = 1024 * 1024
    # All such bodies and replies held at once, per process: 256 full buffers.
    buffer_budget_bytes: int = 256 * 1024 * 1024
    # Streamed uploads and replies relayed at a client's pace may hold this share of a
    # worker's pool (Envoy's pending limits): the rest serves requests whose bodies are in.
    paced_share_percent: int = 50
    # Connections the router keeps to one worker at most: uvicorn's and aiohttp's own
    # backlog is far larger, and a few hundred tool calls in flight per worker is plenty.
    worker_connections: int = 256
    # A whole head, every line and what llhttp holds of a field not yet ended: twice
    # nginx's 4 x 8 KiB, so a target of max_line_bytes with a field of max_header_bytes
    # still fits when its first read also carried the requests before it.
    max_head_bytes: int = 65536
    # The unfinished heads of all public connections together: 1,024 maximal heads,
    # whatever the number of connections that send them.
    max_held_head_bytes: int = 64 * 1024 * 1024
    # None: from the open-file limit (router.service.listeners.connection_limit), so a
    # flood of connections cannot take the descriptors the control socket needs.
    max_connections: int | None = None


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


@dataclass(frozen=True, slots=True)
class DirectoryConfig:
    """The claims directory on Redis that several routers share (design §10)."""

    # redis://host:port/db, rediss://..., or unix:/path; None when `sentinel` is used.
    url: str | None = None
    # A primary under Sentinel: its master name and the sentinels' host:port.
    sentinel_master: str | None = None
    sentinel_nodes: tuple[str, ...] = ()
    # Resolved when the file is read: the pod name (HOSTNAME), one router a pod.
    router_id: str = ""
    # One fleet per Redis needs no configuration; several fleets share one with several.
    prefix: str = DEFAULT_PREFIX
    # A dead pod's episodes turn 410 at most one lease after its last heartbeat.
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    # A miss waits at most this for its owner before 503 `recovering`.
    lookup_timeout_ms: int = DEFAULT_LOOKUP_TIMEOUT_MS
    # A worker waits at most this for its claim before `directory_unavailable`.
    claim_timeout_s: float = DEFAULT_CLAIM_TIMEOUT_S
    # None: 1 under Sentinel (a failover must not lose an acknowledged claim), else 0.
    min_replicas: int | None = None
    # Redis AUTH, from password_env / password_file (never inline).
    password: str | None = None
    # Off: keys are looked up. On: the hello reply offers "<router id>:<epoch>:", and a
    # key that starts with a live peer's goes there with no lookup (design §10).
    key_prefix: bool = False

    @property
    def replicas_to_wait_for(self) -> int:
        if self.min_replicas is not None:
            return self.min_replicas
        return 1 if self.sentinel_master is not None else 0


@dataclass(frozen=True, slots=True)
class PeerConfig:
    """The peer listener other routers of the fleet forward to (design §10): never the
    public port, and not exposed by the Service."""

    # Every interface of the pod: peers reach it at the pod IP.
    host: str = "0.0.0.0"
    # Next to the admin port (9901) and the metrics.
    port: int = 9903
    # host:port peers dial; None: the listen address, or POD_IP with the port when the
    # listen host is a wildcard (resolved at start, once the port is bound).
    advertise: str | None = None
    # Signs every hop (HMAC-SHA256), from secret_env / secret_file: the same on every router.
    secret: str = ""
    # Routers on one host (shape B) forward a key's request straight to the worker that
    # holds it (with its boot), not through its router's peer listener: one router's
    # work for a request instead of two. Routers elsewhere are never sent a worker.
    direct: bool = True


# The default session kind: episode tokens (design §2) in their standard header.
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
    # Workers route on the path as it is sent, unless they strip a prefix first (NeMo
    # Gym's /ng-rollout/{rollout_id}); routes then match the path behind one.
    path_prefixes: tuple[str, ...] = ()
    claims: ClaimsConfig = ClaimsConfig()
    state: StateConfig = StateConfig()
    limits: LimitsConfig = LimitsConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    log: LogConfig = LogConfig()
    # One router alone, its table the only one, unless a fleet shares a directory.
    directory: DirectoryConfig | None = None
    peer: PeerConfig | None = None

    def session_kind(self, name: str) -> SessionKindConfig | None:
        """The session kind called `name`, or None."""
        return next((kind for kind in self.sessions if kind.name == name), None)

    @property
    def session_headers(self) -> tuple[str, ...]:
        """The request headers the session kinds read a key from (a cookie kind reads
        Cookie), as the file spells them."""
        names: list[str] = []
        for kind in self.sessions:
            if kind.header is not None:
                names.append(kind.header)
            if kind.mcp is not None:
                names.append(kind.mcp.header)
            if kind.cookie is not None:
                names.append("Cookie")
        return tuple(names)
