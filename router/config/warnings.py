"""What a valid config allows but most likely does not mean: warnings, never errors.

This module owns the checks a config passes and still cannot work as written, said to
the operator by `episode-router check-config` and logged when the router starts: a
seed that learns a cookie its kind never reads, `unclaimed: forward` in front of
several workers, a kind whose sessions can only expire, prefixes no route uses, an
edge check whose secret anyone can derive. What only a running router can see (a
seed reply that names no session) is counted and logged as it happens instead.

It is pure: it reads the `Config` and nothing else.
"""

from __future__ import annotations

from router.config.model import Config, SessionKindConfig

__all__ = ["config_warnings"]


def config_warnings(config: Config) -> list[str]:
    """One sentence for each thing `config` likely gets wrong, naming the key path."""
    warnings: list[str] = []
    workers = len(config.workers) + (config.spawn.count if config.spawn is not None else 0)
    for i, kind in enumerate(config.sessions):
        where = f"sessions[{i}] ({kind.name})"
        warnings.extend(f"{where}: {problem}" for problem in _kind_problems(kind, workers))
    routed = any(kind.seed or kind.close or kind.mcp or kind.path for kind in config.sessions)
    if config.path_prefixes and not routed:
        warnings.append(
            "path_prefixes: no kind has a seed or close route, an MCP path or a path "
            "pattern, so no prefix changes anything"
        )
    return warnings


def _kind_problems(kind: SessionKindConfig, workers: int) -> list[str]:
    problems: list[str] = []
    cookie = kind.cookie
    if cookie is not None and kind.seed is not None:
        for place in kind.seed.learn:
            if place.cookie is not None and place.cookie != cookie.name:
                problems.append(
                    f"the seed learns cookie {place.cookie!r} but the kind reads cookie "
                    f"{cookie.name!r}: a session it learns is never read back"
                )
    if (
        cookie is not None
        and cookie.signature is not None
        and cookie.signature.key == (cookie.name.encode())
    ):
        problems.append(
            "the cookie's secret is its own name (NeMo Gym signs with "
            "<ServerClass>___<config name>): edge verification refuses only forgers who "
            "do not know the server's class and config name"
        )
    if kind.unclaimed == "forward" and workers > 1:
        problems.append(
            f"unclaimed: forward with {workers} workers: a key no worker claimed goes to "
            "any of them, which holds no state for it"
        )
    if kind.seed is not None and kind.seed.learns_from_request and kind.close is None:
        problems.append(
            "its seed names its own session but it has no close route: its sessions end "
            "only when claims.learned_idle_ttl_s passes unused"
        )
    return problems
