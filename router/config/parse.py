"""Reading a configuration: `parse_config` (pure), `load_config` (the file), `default_config`.

This module owns the entry points (and `check_config`, the cross-section checks on a
`Config` that was not parsed from one file) and the YAML step: a safe loader that also
refuses a mapping with the same key twice, YAML errors turned into
`ConfigError`s with their line and column, and bounded reads of the config
file and of secret files. The sections themselves are parsed by
`router.config.sections`.

It must never open a socket, start a task or log; only `load_config` and the
secret file reader it hands on touch the file system.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import yaml

from router.config.errors import ConfigError, join_key, quote
from router.config.model import Config
from router.config.reader import Context, Section
from router.config.secrets import MAX_SECRET_FILE_BYTES
from router.config.sections import TOP_KEYS, build_config, check_whole_config


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
    ctx = Context(source, env or {}, read_file)
    data = _load_yaml(ctx, text)
    return Config() if data is None else build_config(Section(ctx, "", data, TOP_KEYS))


def check_config(config: Config, *, source: str = "<config>") -> None:
    """Run the checks that span sections (addresses, control authentication, spawned
    workers' ids and urls) on a `Config` no file was parsed into: one built in code, or
    a reload's mix of two files. Raises `ConfigError` prefixed with `source`."""
    check_whole_config(Context(source, {}, None), config)


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
    """At most `limit + 1` bytes of a regular file. Anything else (a FIFO, a device, a
    directory) is refused before a byte is read: a FIFO with no writer blocks a read
    for ever, and an endless device (/dev/zero) never ends one. Opened non-blocking,
    so that not even the open waits for a FIFO's writer."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotARegularFile(f"not a regular file ({_file_kind(mode)})")
        chunks: list[bytes] = []
        size = 0
        while size <= limit:
            chunk = os.read(fd, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


class NotARegularFile(OSError):
    """A config or secret path names something other than a regular file."""


def _file_kind(mode: int) -> str:
    kinds = (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a file")


def _read_secret_file(path: str) -> bytes:
    return _read_bounded(path, MAX_SECRET_FILE_BYTES)


# ---------------------------------------------------------------------------- YAML

_MAX_CONFIG_BYTES: Final = 1 << 20
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
                f"duplicate key {quote(key)} (line {line}); YAML would silently keep the last one"
            )
            raise _DuplicateKeyError(join_key(path, key), reason)
        seen.add(key)
        yield value_node, join_key(path, key)


def _load_yaml(ctx: Context, text: str) -> object:
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
