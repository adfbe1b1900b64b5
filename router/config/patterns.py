"""The small grammars in the config's values that the router applies to requests: RFC 6901
JSON pointers (`learn.json_pointer`, `body_field.pointer`), path patterns with one
`{key}` segment (`path.pattern`) and the path prefixes workers strip (`path_prefixes`).

The config checks each value with these functions when it is read, and the session
reader (`router.sessions`) compiles the same value with the same function, so no value
passes the check that the reader then reads otherwise. A malformed pointer or pattern
is a ValueError saying why.

It is pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final

__all__ = ["compile_path_pattern", "compile_path_prefix", "parse_json_pointer"]

_POINTER_ESCAPE: Final = re.compile(r"~(?![01])")
# RFC 3986 pchar: unreserved, pct-encoded, sub-delims, ":" and "@".
_PATH_SEGMENT: Final = re.compile(r"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|%[0-9A-Fa-f]{2})+")
_KEY_PLACEHOLDER: Final = "{key}"
_PLACEHOLDER: Final = re.compile(r"\{[A-Za-z_][A-Za-z0-9_]*\}")


def parse_json_pointer(pointer: str) -> tuple[str, ...]:
    """The reference tokens of an RFC 6901 JSON pointer, unescaped ("~1" is "/", "~0" is "~").

    "" is the whole document. Raises ValueError for a pointer that does not
    start with "/" or has a "~" not followed by 0 or 1.
    """
    if not pointer:
        return ()
    if not pointer.startswith("/"):
        raise ValueError("a JSON pointer starts with '/'")
    if _POINTER_ESCAPE.search(pointer):
        raise ValueError("'~' in a JSON pointer must be followed by 0 or 1 (~0 is ~, ~1 is /)")
    return tuple(t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/"))


def compile_path_pattern(pattern: str) -> Callable[[str], str | None]:
    """A matcher for `pattern`, like "/rollouts/{key}/stop": it gives a path's key, or None.

    The pattern starts with "/", has exactly one "{key}" segment and at least
    one literal segment; literal segments are RFC 3986 path characters and
    match exactly. The matcher takes a request's raw path (a query string is
    ignored) and returns the key segment exactly as written there, with no
    percent-decoding, since workers read the same raw path; an empty key
    segment does not match. Callers check the key with `raw_session_key`.
    Raises ValueError for a bad pattern.
    """
    segments = _pattern_segments(pattern)
    index = segments.index(_KEY_PLACEHOLDER)

    def match(path: str) -> str | None:
        parts = path.partition("?")[0].split("/")
        if len(parts) != len(segments) + 1 or parts[0]:
            return None
        del parts[0]
        key = parts[index]
        parts[index] = _KEY_PLACEHOLDER
        return key if key and parts == segments else None

    return match


def _pattern_segments(pattern: str) -> list[str]:
    if not pattern.startswith("/"):
        raise ValueError("a path pattern starts with '/'")
    segments = pattern[1:].split("/")
    if segments.count(_KEY_PLACEHOLDER) != 1:
        raise ValueError("a path pattern has exactly one {key} segment")
    literals = [s for s in segments if s != _KEY_PLACEHOLDER]
    if not literals:
        raise ValueError(
            "a path pattern needs a literal segment besides {key}, "
            "or every one-segment path (/health, /seed_session) would name a session"
        )
    for segment in literals:
        if "{" in segment or "}" in segment or "*" in segment:
            raise ValueError(f"{segment!r}: {{key}} must be a whole segment; '*' is not supported")
        if not _PATH_SEGMENT.fullmatch(segment):
            raise ValueError(f"{segment!r} is not a path segment (empty, or not URL characters)")
    return segments


def compile_path_prefix(pattern: str) -> Callable[[str], str | None]:
    """A matcher for a prefix that workers strip from a path before they route it, like
    "/ng-rollout/{rollout_id}": it gives the rest of a path that starts with the prefix
    (from its "/" on), or None.

    The pattern starts with "/" and is made of literal segments (RFC 3986 path
    characters, matched exactly) and whole-segment placeholders (`{name}`, any
    non-empty segment), with at least one literal segment. The rest of a matching path
    is at least "/". Raises ValueError for a bad pattern.
    """
    segments = _prefix_segments(pattern)
    count = len(segments)

    def rest(path: str) -> str | None:
        parts = path.split("/", count + 1)
        if len(parts) != count + 2 or parts[0]:
            return None
        for segment, part in zip(segments, parts[1:], strict=False):
            if part == "" or (segment is not None and part != segment):
                return None
        return "/" + parts[count + 1]

    return rest


def _prefix_segments(pattern: str) -> list[str | None]:
    """The literal segments of a prefix pattern, None for each placeholder."""
    if not pattern.startswith("/") or pattern.endswith("/"):
        raise ValueError("a path prefix starts with '/' and does not end with one")
    segments: list[str | None] = []
    for segment in pattern[1:].split("/"):
        if _PLACEHOLDER.fullmatch(segment):
            segments.append(None)
        elif "{" in segment or "}" in segment or not _PATH_SEGMENT.fullmatch(segment):
            raise ValueError(
                f"{segment!r} is neither a path segment nor a whole-segment {{placeholder}}"
            )
        else:
            segments.append(segment)
    if all(segment is None for segment in segments):
        raise ValueError("a path prefix needs a literal segment, or every path would match it")
    return segments
