"""Spawn mode's plan: which workers to start, with which command and environment, and when
to restart them.

This module owns the pure half of the `spawn:` configuration (design §3
"Restart", §5): the validated SpawnSpec, the workers it describes, the argument
vector rendered from the operator's command template, each child's environment,
and the restart backoff. `router.service.spawner.Spawner` runs the processes from it.

It must never start or signal a process, read the environment or a clock, or
do any I/O: the caller passes in the inherited environment and how long a
process ran. Bad input is a ValueError naming the key and the value.
"""

from __future__ import annotations

import math
import shlex
import string
from collections.abc import Mapping
from dataclasses import dataclass

from router.config import SPAWN_ENV_PREFIX, SPAWN_PLACEHOLDERS, SpawnedWorker, spawned_workers

__all__ = [
    "ENV_PREFIX",
    "FIRST_BACKOFF_S",
    "MAX_BACKOFF_S",
    "PLACEHOLDERS",
    "STABLE_RUN_S",
    "SpawnSpec",
    "SpawnedWorker",
    "check_env",
    "child_env",
    "next_restart",
    "plan_workers",
    "render_command",
    "render_cwd",
    "render_env",
    "restart_delay",
]

PLACEHOLDERS = SPAWN_PLACEHOLDERS
ENV_PREFIX = SPAWN_ENV_PREFIX  # the variables this router sets; inherited ones are dropped
STABLE_RUN_S = 10.0  # a process that ran longer was not crash-looping: the backoff starts over
FIRST_BACKOFF_S = 0.5  # the second restart in a row waits this long, then it doubles
MAX_BACKOFF_S = 10.0  # a broken command costs one attempt per 10 s; a fixed one is back soon

_FORMATTER = string.Formatter()


@dataclass(frozen=True, slots=True)
class SpawnSpec:
    """What to spawn: `count` copies of `command`, on ports from `base_port` up.

    `command` is a template split like a shell would (no shell runs it), with the
    placeholders `{port}`, `{worker_id}` and `{host}`; `{{` and `}}` are literal
    braces. Raises ValueError for a count, port range, host or timeout that
    cannot work.
    """

    command: str
    count: int
    base_port: int
    host: str = "127.0.0.1"
    stop_timeout_s: float = 10.0
    # "hello": the workers say hello on the control socket; "probe": they never do, and
    # are health-probed instead.
    register: str = "hello"
    cwd: str | None = None  # a template, as the command's arguments are
    env: tuple[tuple[str, str], ...] = ()  # (name, template) set for each worker

    def __post_init__(self) -> None:
        if not _is_int(self.count) or self.count < 1:
            raise ValueError(f"spawn count must be an integer of at least 1, got {self.count!r}")
        if not _is_int(self.base_port) or not 1 <= self.base_port <= 65535:
            raise ValueError(f"spawn base_port must be a port (1-65535), got {self.base_port!r}")
        if self.base_port + self.count - 1 > 65535:
            raise ValueError(
                f"spawn ports {self.base_port}..{self.base_port + self.count - 1} "
                "run past 65535: lower base_port or count"
            )
        if not self.host or any(c.isspace() or c in "/@?#[]\0" for c in self.host):
            raise ValueError(f"spawn host must be a bare host name or address, got {self.host!r}")
        timeout = self.stop_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(f"spawn stop_timeout_s must be positive, got {timeout!r}")
        if not math.isfinite(timeout):
            raise ValueError(f"spawn stop_timeout_s must be finite, got {timeout!r}")
        if self.register not in ("hello", "probe"):
            raise ValueError(f"spawn register must be hello or probe, got {self.register!r}")

    @property
    def probed(self) -> bool:
        """The workers never say hello: the router probes their health instead."""
        return self.register == "probe"


def plan_workers(spec: SpawnSpec) -> tuple[SpawnedWorker, ...]:
    """Return the workers `spec` describes: ids "w0", "w1", ... on consecutive ports."""
    return spawned_workers(spec.count, spec.base_port, spec.host)


def render_command(spec: SpawnSpec, worker: SpawnedWorker) -> list[str]:
    """Return the argument vector that starts `worker`.

    The template is split into arguments first and each argument is formatted
    afterwards, so a placeholder's value always stays inside the argument it
    was written in. Raises ValueError for a template that cannot be split, is
    empty, or names anything but the placeholders (PLACEHOLDERS).
    """
    try:
        template = shlex.split(spec.command)
    except ValueError as exc:
        raise ValueError(f"spawn command cannot be split into arguments: {exc}") from None
    if not template:
        raise ValueError("spawn command is empty")
    values = _values(spec, worker)
    return [_render_argument(argument, values) for argument in template]


def render_cwd(spec: SpawnSpec, worker: SpawnedWorker) -> str | None:
    """The working directory `worker` starts in (None: the router's own)."""
    return None if spec.cwd is None else _render_argument(spec.cwd, _values(spec, worker))


def render_env(spec: SpawnSpec, worker: SpawnedWorker) -> dict[str, str]:
    """The variables `spec.env` sets for `worker`, each value rendered."""
    values = _values(spec, worker)
    return {name: _render_argument(template, values) for name, template in spec.env}


def _values(spec: SpawnSpec, worker: SpawnedWorker) -> dict[str, object]:
    index = worker.port - spec.base_port
    return {"port": worker.port, "worker_id": worker.worker_id, "host": spec.host, "index": index}


def _render_argument(argument: str, values: Mapping[str, object]) -> str:
    try:
        fields = [field for _, field, _, _ in _FORMATTER.parse(argument) if field is not None]
    except ValueError as exc:
        raise ValueError(f"spawn command argument {argument!r}: {exc}") from None
    for field in fields:
        if field not in values:
            known = ", ".join(f"{{{name}}}" for name in PLACEHOLDERS)
            raise ValueError(
                f"spawn command argument {argument!r} names {{{field}}}; known: {known}"
            )
    try:
        rendered = argument.format_map(values)
    except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
        raise ValueError(f"spawn command argument {argument!r}: {exc}") from None
    if "\0" in rendered:
        raise ValueError(f"spawn command argument {argument!r} contains a NUL byte")
    return rendered


def restart_delay(consecutive_failures: int) -> float:
    """Return the seconds to wait before a restart.

    `consecutive_failures` counts the restarts already made since the worker
    last ran longer than STABLE_RUN_S: 0 gives an immediate restart, then 0.5,
    1, 2, 4, 8 and 10 s from there on. Raises ValueError when negative.
    """
    if consecutive_failures < 0:
        raise ValueError(f"consecutive_failures must be >= 0, got {consecutive_failures}")
    if consecutive_failures == 0:
        return 0.0
    # The exponent is capped so that a worker failing for days never overflows a float.
    return min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2.0 ** min(consecutive_failures - 1, 32))


def next_restart(consecutive_failures: int, ran_s: float | None) -> tuple[float, int]:
    """Return (delay before the restart, the count to carry to the next exit).

    `ran_s` is how long the process that just exited ran, or None when it never
    started. A run longer than STABLE_RUN_S starts the count over.
    """
    if ran_s is not None and ran_s > STABLE_RUN_S:
        consecutive_failures = 0
    return restart_delay(consecutive_failures), consecutive_failures + 1


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def child_env(
    worker: SpawnedWorker,
    control_address: str,
    secret: str | None,
    extra_env: Mapping[str, str],
    *,
    inherited: Mapping[str, str],
) -> dict[str, str]:
    """Return the environment `worker` starts with.

    `inherited` (the router's own environment) minus every EPISODE_ROUTER_*
    variable, then `extra_env`, then the variables this router sets: CONTROL,
    WORKER_ID, WORKER_URL, and SECRET when there is one.
    """
    env = {key: value for key, value in inherited.items() if not key.startswith(ENV_PREFIX)}
    env.update(extra_env)
    env[ENV_PREFIX + "CONTROL"] = control_address
    env[ENV_PREFIX + "WORKER_ID"] = worker.worker_id
    env[ENV_PREFIX + "WORKER_URL"] = worker.url
    if secret is not None:
        env[ENV_PREFIX + "SECRET"] = secret
    return env


def check_env(extra_env: Mapping[str, str], control_address: str, secret: str | None) -> None:
    """Raise ValueError when a variable name or value could not be passed to a process, or
    when `extra_env` sets a variable the router sets itself."""
    for key, value in extra_env.items():
        if not key or "=" in key or "\0" in key:
            raise ValueError(f"spawn environment variable name {key!r} is not valid")
        if key.startswith(ENV_PREFIX):
            raise ValueError(f"spawn environment variable {key} is set by the router itself")
        if "\0" in value:
            raise ValueError(f"spawn environment variable {key} contains a NUL byte")
    if "\0" in control_address:
        raise ValueError("control address contains a NUL byte")
    if secret is not None and "\0" in secret:
        raise ValueError("control secret contains a NUL byte")
