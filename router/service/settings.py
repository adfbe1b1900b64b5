"""What each part of a router is built from: a `Config` turned into that part's settings.

`RouterService` builds its parts from these at start and, for what a reload may
change, hands the running parts the values they give then, so the two never
disagree: `core_settings` (the core), `session_kinds` (the public handler's
session reader), `forward_timeouts` (the forwarder), `edge_limits` (the public
server), `control_policy` (the control socket) and `spawn_spec` (the spawner).
`warn_of_a_short_lease` says at start what a config allows but the protocol
advises against.

Pure but for that one warning and where `control.worker_socket_dirs` really are
(their links resolved): nothing here opens a socket, starts a task or
changes a part that is running; the caller hands the values on.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import posixpath
from collections.abc import Iterable, Mapping

from router.config import Config, SpawnConfig
from router.control import ControlPolicy
from router.core import CoreSettings
from router.directory import DirectorySettings, SentinelTarget, sentinel_nodes
from router.edge import EdgeLimits
from router.protocol import UpstreamAddress
from router.relay import BufferLimits, ForwardTimeouts
from router.service.listeners import connection_limit, open_file_limit
from router.service.spawner import SpawnSpec, plan_workers
from router.sessions import SessionKind, kind_from_config

log = logging.getLogger("episode_router")

# design §3: the longest a worker keeping the protocol may stay silent on its connection.
WORKER_SILENCE_MAX_S = 5.0


def core_settings(config: Config) -> CoreSettings:
    return CoreSettings(
        kinds={kind.name: kind.unclaimed == "forward" for kind in config.sessions},
        mcp_kinds=frozenset(kind.name for kind in config.sessions if kind.mcp is not None),
        lease_timeout_s=config.control.lease_timeout_s,
        reconnect_grace_s=config.control.reconnect_grace_s,
        tombstone_ttl_s=config.claims.tombstone_ttl_s,
        max_tombstones=config.claims.max_tombstones,
        recovery_window_s=config.claims.recovery_window_s,
        learned_idle_ttl_s=config.claims.learned_idle_ttl_s,
        health_failures=config.health.failures,
    )


def session_kinds(config: Config) -> list[SessionKind]:
    return [kind_from_config(kind) for kind in config.sessions]


def forward_timeouts(config: Config) -> ForwardTimeouts:
    timeouts = config.timeouts
    return ForwardTimeouts(
        connect_s=timeouts.connect_s,
        first_byte_s=timeouts.first_byte_s,
        stream_idle_s=timeouts.stream_idle_s,
    )


def forward_buffering(config: Config) -> BufferLimits:
    """What the forwarder holds in memory so slow clients cost no worker connection."""
    limits = config.limits
    return BufferLimits(
        body_bytes=limits.body_buffer_bytes,
        reply_bytes=limits.reply_buffer_bytes,
        budget_bytes=limits.buffer_budget_bytes,
        paced_share=limits.paced_share_percent / 100,
    )


def edge_limits(config: Config) -> EdgeLimits:
    """The public server's per-connection bounds (the connection limit from the open-file
    limit when the config sets none)."""
    limits = config.limits
    return EdgeLimits(
        header_timeout_s=limits.header_timeout_s,
        idle_timeout_s=limits.idle_timeout_s,
        max_line_bytes=limits.max_line_bytes,
        max_header_bytes=limits.max_header_bytes,
        max_headers=limits.max_headers,
        body_timeout_s=limits.body_timeout_s,
        max_head_bytes=limits.max_head_bytes,
        max_held_head_bytes=limits.max_held_head_bytes,
        max_connections=limits.max_connections or connection_limit(open_file_limit()),
    )


def control_policy(
    config: Config, router_boot: str, bound: Iterable[UpstreamAddress] = ()
) -> ControlPolicy:
    """Who may say hello on the control socket, for the router of boot `router_boot`
    whose listeners are bound at `bound` (besides the config's own addresses)."""
    control = config.control
    return ControlPolicy(
        own_uid=os.getuid(),
        allowed_uids=frozenset(control.allowed_uids),
        allowed_upstreams=frozenset(control.allowed_upstreams),
        secret=control.secret,
        router_boot=router_boot,
        spawned_ids=_spawned_ids(config, register="hello"),
        probed_ids=_spawned_ids(config, register="probe"),
        max_claims_per_worker=control.max_claims_per_worker,
        max_connections_before_hello=control.max_connections_before_hello,
        max_connections=control.max_connections,
        own_listeners=own_listeners(config, bound),
        # Where each folder really is: a socket is judged by where its path leads.
        worker_socket_dirs=tuple(os.path.realpath(d) for d in control.worker_socket_dirs),
    )


def own_listeners(
    config: Config, bound: Iterable[UpstreamAddress] = ()
) -> tuple[UpstreamAddress, ...]:
    """The addresses the config binds (a port 0 is known only once bound: `bound`),
    spelled as `parse_upstream` spells a worker url."""
    listeners = [
        *bound,
        UpstreamAddress("", config.listen.host, config.listen.port),
        UpstreamAddress("", config.admin.host, config.admin.port),
    ]
    tcp = config.control.tcp_address
    if tcp is not None:
        listeners.append(UpstreamAddress("", tcp[0], tcp[1]))
    unix_path = config.control.unix_path
    if unix_path is not None:
        listeners.append(UpstreamAddress(posixpath.normpath(unix_path), "", 0))
    return tuple(
        UpstreamAddress(a.path, _spelled(a.host), a.port) for a in listeners if a.path or a.port
    )


def _spelled(host: str) -> str:
    """A host as parse_upstream spells it (an IP compressed, a name lower-cased)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower()


def _spawned_ids(config: Config, *, register: str) -> frozenset[str]:
    spawn = config.spawn
    if spawn is None or spawn.register != register:
        return frozenset()
    return frozenset(worker.worker_id for worker in plan_workers(spawn_spec(spawn)))


def spawn_spec(spawn: SpawnConfig) -> SpawnSpec:
    """The worker processes the spawner starts and how it stops them."""
    return SpawnSpec(
        command=spawn.command,
        count=spawn.count,
        base_port=spawn.base_port,
        host=spawn.host,
        stop_timeout_s=spawn.stop_timeout_s,
        register=spawn.register,
        cwd=spawn.cwd,
        env=spawn.env,
    )


def warn_of_a_short_lease(lease_timeout_s: float) -> None:
    """A lease under two of the protocol's silences suits only workers that ping more
    often than it asks (tests do): one that sends something every 5 s would be taken
    as lost whenever a ping is a little late, or every time at 5 s and under.
    Allowed, but said at start."""
    if lease_timeout_s < 2 * WORKER_SILENCE_MAX_S:
        log.warning(
            "control.lease_timeout_s is under 10 s: a worker that pings only every 5 s, "
            "as the protocol allows, may be taken as lost",
            extra={"lease_timeout_s": lease_timeout_s},
        )


def directory_settings(config: Config, peer_address: str, host: str = "") -> DirectorySettings:
    """The directory client's settings, with the peer address this router advertises
    and the host it shares with routers it forwards to straight (when `peer.direct`)."""
    directory = config.directory
    assert directory is not None
    assert config.peer is not None
    return DirectorySettings(
        router_id=directory.router_id,
        peer_address=peer_address,
        prefix=directory.prefix,
        lease_ttl_s=directory.lease_ttl_s,
        lookup_timeout_ms=directory.lookup_timeout_ms,
        claim_timeout_s=directory.claim_timeout_s,
        tombstone_ttl_s=config.claims.tombstone_ttl_s,
        min_replicas=directory.replicas_to_wait_for,
        key_prefixes=directory.key_prefix,
        host=host if config.peer.direct else "",
    )


def directory_target(config: Config) -> str | SentinelTarget:
    """Where the directory is: a Redis address, or a primary found through Sentinel."""
    directory = config.directory
    assert directory is not None
    if directory.sentinel_master is not None:
        return SentinelTarget(directory.sentinel_master, sentinel_nodes(directory.sentinel_nodes))
    assert directory.url is not None
    return directory.url


def advertised_peer(config: Config, bound_port: int, env: Mapping[str, str]) -> str:
    """The address peers dial: `peer.advertise`, else the listen host with the bound
    port, or POD_IP (the downward API) when the listen host is a wildcard. Raises
    ValueError when nothing says where the router can be reached."""
    peer = config.peer
    assert peer is not None
    if peer.advertise is not None:
        return peer.advertise
    host = peer.host
    if host in ("0.0.0.0", "::"):
        pod_ip = env.get("POD_IP", "")
        if not pod_ip:
            raise ValueError(
                "peer.listen is a wildcard address: set peer.advertise, or POD_IP "
                "(the downward API's status.podIP) so peers know where to forward"
            )
        host = pod_ip
    return f"[{host}]:{bound_port}" if ":" in host else f"{host}:{bound_port}"
