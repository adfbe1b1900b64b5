"""Typed reads of the parsed YAML: `Section`, one mapping from the file and its key path.

This module owns how a value is read and checked for its type and range
(strings, choices, hosts, flags, integers, seconds), how unknown and rejected
keys are refused, and the `Context` (source name, environment, file reader)
that every read shares. Each failure is a `ConfigError` naming the key path.

It must never know what a particular section or key means: that belongs to
the section parsers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from router.config.errors import ConfigError, describe, join_key, quote
from router.protocol import is_host

_MAX_SECONDS: Final = 1e9  # about 31 years: beyond this a value is a typo, and overflows timers
_MAX_INT: Final = 2**31 - 1
_MISSING: Final = object()


@dataclass(frozen=True, slots=True)
class Context:
    source: str
    env: Mapping[str, str]
    read_file: Callable[[str], bytes] | None

    def fail(self, key_path: str, reason: str) -> ConfigError:
        return ConfigError(self.source, key_path or "(root)", reason)


class Section:
    """One mapping from the file and its key path; typed reads that raise `ConfigError`."""

    __slots__ = ("_data", "ctx", "path")

    def __init__(
        self,
        ctx: Context,
        path: str,
        value: object,
        allowed: tuple[str, ...],
        rejected: Mapping[str, str] | None = None,
    ) -> None:
        self.ctx, self.path = ctx, path
        if not isinstance(value, dict):
            raise ctx.fail(path, f"expected a mapping, got {describe(value)}")
        for key in value:
            if not isinstance(key, str):
                raise ctx.fail(path, f"keys must be strings, got {describe(key)}")
            if rejected and key in rejected:
                raise ctx.fail(join_key(path, key), rejected[key])
            if key not in allowed:
                keys = ", ".join(allowed)
                raise ctx.fail(
                    join_key(path, key), f"unknown key {quote(key)}; allowed keys: {keys}"
                )
        self._data: dict[str, object] = value

    def fail(self, key: str | None, reason: str) -> ConfigError:
        return self.ctx.fail(self.path if key is None else join_key(self.path, key), reason)

    def has(self, key: str) -> bool:
        return self._data.get(key) is not None

    def value(self, key: str) -> object:
        """The raw value at `key` (None when absent), for keys that take more than one shape."""
        return self._data.get(key)

    def child(
        self, key: str, allowed: tuple[str, ...], rejected: Mapping[str, str] | None = None
    ) -> Section:
        value = self._data.get(key)
        value = {} if value is None else value  # `listen:` or `listen: null`: all defaults
        return Section(self.ctx, join_key(self.path, key), value, allowed, rejected)

    def items(self, key: str) -> list[tuple[str, object]]:
        """(key path, value) of each list item; absent or null is an empty list."""
        value = self._data.get(key)
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.fail(key, f"expected a list, got {describe(value)}")
        return [(f"{join_key(self.path, key)}[{i}]", item) for i, item in enumerate(value)]

    def sections(
        self, key: str, allowed: tuple[str, ...], rejected: Mapping[str, str] | None = None
    ) -> list[Section]:
        return [Section(self.ctx, p, v, allowed, rejected) for p, v in self.items(key)]

    def text(self, key: str, default: str | None = None) -> str:
        """A non-empty string; required when `default` is None."""
        value = self._data.get(key, _MISSING)
        if value is _MISSING and default is not None:
            return default
        if value is _MISSING:
            raise self.fail(key, "missing required key")
        return read_text(self.ctx, join_key(self.path, key), value)

    def optional_text(self, key: str) -> str | None:
        return self.text(key) if self.has(key) else None

    def choice(self, key: str, default: str | None, choices: tuple[str, ...]) -> str:
        value = self.text(key, default)
        if value not in choices:
            raise self.fail(key, f"must be one of {', '.join(choices)}; got {quote(value)}")
        return value

    def host(self, key: str, default: str) -> str:
        value = self.text(key, default)
        if not is_host(value):
            raise self.fail(key, f"expected a host name or IP address, got {quote(value)}")
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self._data.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {describe(value)}")
        return value

    def integer(self, key: str, default: int, low: int = 1, high: int = _MAX_INT) -> int:
        return read_integer(
            self.ctx, join_key(self.path, key), self._data.get(key, default), low, high
        )

    def optional_integer(self, key: str, low: int = 1, high: int = _MAX_INT) -> int | None:
        return self.integer(key, 0, low, high) if self.has(key) else None

    def seconds(self, key: str, default: float) -> float:
        value = self._data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            reason = f"expected a number of seconds, got {describe(value)}"
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


def read_text(ctx: Context, key_path: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ctx.fail(key_path, f"expected a non-empty string, got {describe(value)}")
    if "\0" in value:
        # No path, host, name or command can hold one (the OS would refuse it at run).
        raise ctx.fail(key_path, "must not contain a NUL character")
    return value


def read_integer(ctx: Context, key_path: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ctx.fail(key_path, f"expected an integer, got {describe(value)}")
    if not low <= value <= high:
        raise ctx.fail(key_path, f"must be between {low} and {high}, got {value}")
    return value
