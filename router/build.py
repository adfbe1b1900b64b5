"""Which build of the forwarding hot path is running: mypyc's C extensions or pure Python.

setup.py compiles the hot modules when the machine has a C compiler and installs them
as pure Python when it has none; both run the same code. Operators see which one runs
in `episode-router --version` and in the "router started" log line.
"""

from __future__ import annotations

import importlib.machinery
from pathlib import Path

import router
from router.edge import server as edge_server

__all__ = ["build_name", "compiled", "stale_extensions"]


def compiled() -> bool:
    """True when the hot path runs as compiled extensions (the edge stands for them all:
    setup.py builds them together)."""
    return (edge_server.__file__ or "").endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def build_name() -> str:
    """ "compiled" or "pure-python"."""
    return "compiled" if compiled() else "pure-python"


def stale_extensions(package: Path | None = None) -> list[str]:
    """The sources of the compiled modules in `package` (this one by default) that are
    newer than their build: an editable install whose sources changed since it was
    built. Python imports the extension, so the edit does not run until
    `pip install -e .` builds it again.

    Only a source checkout is judged (a setup.py beside the package): an installed
    wheel's files carry no build times worth comparing. A module counts as built when
    its own extension or mypyc's shared library beside the package (rebuilt whenever
    any module changes) is newer than its source.
    """
    folder = package if package is not None else Path(router.__file__ or "").parent
    if not (folder.parent / "setup.py").is_file():
        return []
    stale = []
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        shared = [path.stat().st_mtime for path in folder.parent.glob(f"*__mypyc{suffix}")]
        for extension in folder.rglob(f"*{suffix}"):
            source = extension.with_name(extension.name[: -len(suffix)] + ".py")
            built = max([extension.stat().st_mtime, *shared])
            if source.exists() and source.stat().st_mtime > built:
                stale.append(source.relative_to(folder).as_posix())
    return sorted(stale)
