"""Config reload (SIGHUP, POST /admin/reload): what a new config may change live.

`plan_reload(old, new)` compares two validated configs and sorts every changed
section into what the running router applies (session kinds, static workers,
health probes, claims, limits, timeouts, logging, control-socket policy) and
what only a restart can change (listen and admin addresses, the control socket
path, spawn, the journal path). The claim table and in-flight requests are
never touched by a reload. The router then runs a mix of two files (the new
one, with the restart-only sections it runs now), and `effective_config`
refuses a mix that would not pass the checks every config passes at start.
Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from router.config import Config, ConfigError, ControlConfig, check_config, is_tcp_socket

# Sections a running router cannot change: they name sockets it holds open or
# processes and files it owns. The reason is said back to the operator.
RESTART_ONLY = {
    "listen": "the public listener is bound at start",
    "admin": "the admin listener is bound at start",
    "spawn": "spawned workers are started with the router",
    "state": "the journal is opened at start",
    "directory": "the router registers in the directory at start",
    "peer": "the peer listener is bound at start",
}
CONTROL_RESTART_ONLY = {"socket": "the control socket is bound at start"}
# What authenticates a hello goes with the socket's kind (a secret for tcp://, uids for
# unix:): a file that moves the socket to the other kind changes these at its restart.
_SOCKET_AUTH = {
    "secret": "it goes with the control socket's kind, which changes at a restart",
    "allowed_uids": "they go with the control socket's kind, which changes at a restart",
}


@dataclass(frozen=True, slots=True)
class ReloadPlan:
    applied: tuple[str, ...]  # config sections (or keys) that change now
    needs_restart: tuple[str, ...]  # "section: reason" lines, left as they were

    @property
    def changes_anything(self) -> bool:
        return bool(self.applied)


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    """What changes between `old` and `new`, and what of it waits for a restart."""
    applied: list[str] = []
    restart: list[str] = []
    for section in fields(Config):
        name = section.name
        before, after = getattr(old, name), getattr(new, name)
        if before == after:
            continue
        if name in RESTART_ONLY:
            restart.append(f"{name}: {RESTART_ONLY[name]}")
        elif name == "control":
            live, later = _control_changes(before, after)
            applied.extend(f"control.{key}" for key in live)
            restart.extend(f"control.{key}: {_RESTART_REASONS[key]}" for key in later)
        else:
            applied.append(name)
    return ReloadPlan(tuple(applied), tuple(restart))


def effective_config(old: Config, new: Config, *, source: str = "<config>") -> Config:
    """The config the router runs after the reload: `new`, except what needs a restart.

    A file that moves the control socket to the other kind (unix: and tcp://) keeps
    the running secret and uids too until the restart: they go with the socket.

    Raises ConfigError (prefixed with `source`, the new file) when that mix fails
    the checks every config passes at start: a static worker at the running public
    port, one with a running spawned worker's id.
    """
    kept = {name: getattr(old, name) for name in RESTART_ONLY}
    control = replace(new.control, socket=old.control.socket)
    if _kind_moves(old.control, new.control):
        control = replace(control, secret=old.control.secret, allowed_uids=old.control.allowed_uids)
    target = replace(new, control=control, **kept)
    try:
        check_config(target, source=source)
    except ConfigError as exc:
        reason = f"{exc.reason} (with the running {_KEPT}, which only a restart changes)"
        raise ConfigError(exc.source, exc.key_path, reason) from None
    return target


_KEPT = ", ".join([*RESTART_ONLY, *(f"control.{key}" for key in CONTROL_RESTART_ONLY)])


_RESTART_REASONS = {**CONTROL_RESTART_ONLY, **_SOCKET_AUTH}


def _kind_moves(before: ControlConfig, after: ControlConfig) -> bool:
    """The control socket moves between unix: and tcp:// (at the restart)."""
    return is_tcp_socket(before.socket) != is_tcp_socket(after.socket)


def _control_changes(before: ControlConfig, after: ControlConfig) -> tuple[list[str], list[str]]:
    waits = set(CONTROL_RESTART_ONLY) | (set(_SOCKET_AUTH) if _kind_moves(before, after) else set())
    live: list[str] = []
    later: list[str] = []
    for field in fields(ControlConfig):
        key = field.name
        if getattr(before, key) != getattr(after, key):
            (later if key in waits else live).append(key)
    return live, later
