"""Configuration errors: `ConfigError`, and how the file's keys and values appear in its messages.

This module owns the one error every configuration check raises, and the
wording helpers its messages share: a key path (`join_key`), a string from the
file (`quote`, cut short when long) and a value of any type (`describe`).

It must never put a whole container or a secret's value into a message.
"""

from __future__ import annotations


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


def join_key(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def quote(text: str) -> str:
    """A string from the file, quoted for an error message and cut short when long."""
    return repr(text[:60] + "..." if len(text) > 60 else text)


def describe(value: object) -> str:
    """A value for an error message; never the repr of a container (alias bombs are huge)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, int | float):
        return f"{'an integer' if isinstance(value, int) else 'a number'} ({value!r})"
    if isinstance(value, str):
        return f"a string ({quote(value)})"
    if isinstance(value, list | dict):
        return "a list" if isinstance(value, list) else "a mapping"
    return f"a {type(value).__name__}"
