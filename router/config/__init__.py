"""Configuration: the YAML file of design §5 turned into frozen dataclasses.

This package owns the file's shape, its defaults and every check on it. An
unknown key, a wrong type or a bad value is a `ConfigError` that names the
file, the key path and the reason, raised before anything starts.
`parse_config` is pure: environment variables and file reads are injected.
`load_config` is the thin I/O wrapper around it.

Everything public is imported from here (`from router.config import Config`);
the modules behind it, each owning one part:

- `errors`: `ConfigError` and how keys and values are worded in its messages.
- `model`: the frozen dataclasses and their defaults.
- `parse`: `parse_config`, `load_config`, `default_config` and the strict YAML loader.
- `reader`: `Section`, typed reads of one mapping from the file.
- `sections`: the top-level sections other than `sessions`, and the whole `Config`.
- `sessions`: session kinds, their key sources and routes.
- `addresses`: what the config refuses of an address (the grammar is
  `router.protocol.addresses`'), control sockets (`is_tcp_socket`) and listener clashes.
- `secrets`: `*_env` / `*_file` secrets and public key files.
- `patterns`: the grammars of JSON pointers, path patterns and path prefixes.
- `warnings`: what a valid config likely gets wrong (`config_warnings`).

None of it may open a socket, start a task or log, or put a secret's value in
an error message.
"""

from __future__ import annotations

from router.config.addresses import is_tcp_socket
from router.config.errors import ConfigError
from router.config.model import (
    SPAWN_ENV_PREFIX,
    SPAWN_PLACEHOLDERS,
    AdminConfig,
    BodyFieldConfig,
    ClaimsConfig,
    Config,
    ControlConfig,
    CookieSourceConfig,
    DirectoryConfig,
    HealthConfig,
    LearnConfig,
    LimitsConfig,
    ListenConfig,
    LogConfig,
    McpSourceConfig,
    PathSourceConfig,
    PeerConfig,
    RouteConfig,
    SessionKindConfig,
    SignatureConfig,
    SpawnConfig,
    SpawnedWorker,
    StateConfig,
    StaticWorkerConfig,
    TimeoutsConfig,
    TokenFormatConfig,
    VerifyConfig,
    spawned_workers,
)
from router.config.parse import (
    check_config,
    default_config,
    load_config,
    parse_config,
)
from router.config.patterns import (
    compile_path_pattern,
    compile_path_prefix,
    parse_json_pointer,
)
from router.config.warnings import config_warnings

__all__ = [
    "SPAWN_ENV_PREFIX",
    "SPAWN_PLACEHOLDERS",
    "AdminConfig",
    "BodyFieldConfig",
    "ClaimsConfig",
    "Config",
    "ConfigError",
    "ControlConfig",
    "CookieSourceConfig",
    "DirectoryConfig",
    "HealthConfig",
    "LearnConfig",
    "LimitsConfig",
    "ListenConfig",
    "LogConfig",
    "McpSourceConfig",
    "PathSourceConfig",
    "PeerConfig",
    "RouteConfig",
    "SessionKindConfig",
    "SignatureConfig",
    "SpawnConfig",
    "SpawnedWorker",
    "StateConfig",
    "StaticWorkerConfig",
    "TimeoutsConfig",
    "TokenFormatConfig",
    "VerifyConfig",
    "check_config",
    "compile_path_pattern",
    "compile_path_prefix",
    "config_warnings",
    "default_config",
    "is_tcp_socket",
    "load_config",
    "parse_config",
    "parse_json_pointer",
    "spawned_workers",
]
