"""The build of the hot path: which one runs, and a stale editable build refused.

setup.py compiles the modules a forwarded request runs through with mypyc, and falls
back to pure Python where it cannot. These tests pin that the fallback is not taken
silently on a machine that can compile, and that a compiled module older than its
source is found (tests/conftest.py refuses to run the suite against one).
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from router import app, edge, relay
from router.build import build_name, compiled, stale_extensions

SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def can_compile() -> bool:
    """A C compiler and Python's headers: what mypyc needs to build the extensions."""
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which("cc") is not None and headers.exists()


def test_the_hot_path_is_compiled_wherever_it_can_be() -> None:
    if os.environ.get("EPISODE_ROUTER_PURE_PYTHON"):
        pytest.skip("installed as pure Python on purpose (EPISODE_ROUTER_PURE_PYTHON)")
    if not can_compile():
        pytest.skip("no C compiler or Python headers: the pure-Python build is expected")
    # A module mypyc could not compile falls back to its source without a word at
    # install time; here it fails.
    for module in (app, edge, relay):
        assert (module.__file__ or "").endswith(SUFFIX), module.__name__
    assert (compiled(), build_name()) == (True, "compiled")


def test_the_version_names_the_build() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.startswith("episode-router 0.1.0 (")
    assert result.stdout.strip().endswith(f"({build_name()})")


def test_a_compiled_module_older_than_its_source_is_stale(tmp_path: Path) -> None:
    for name in ("fresh", "stale", "built_only"):
        (tmp_path / f"{name}{SUFFIX}").write_bytes(b"")
    (tmp_path / "fresh.py").write_text("")
    (tmp_path / "stale.py").write_text("")
    (tmp_path / "source_only.py").write_text("")
    os.utime(tmp_path / f"fresh{SUFFIX}", (2_000_000_000, 2_000_000_000))
    os.utime(tmp_path / "fresh.py", (1_000_000_000, 1_000_000_000))
    os.utime(tmp_path / f"stale{SUFFIX}", (1_000_000_000, 1_000_000_000))
    os.utime(tmp_path / "stale.py", (2_000_000_000, 2_000_000_000))
    assert stale_extensions(tmp_path) == ["stale.py"]
