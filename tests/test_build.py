"""The build of the hot path: which one runs, and a stale editable build refused.

setup.py compiles the modules a forwarded request runs through with mypyc, and falls
back to pure Python where it cannot. These tests pin that the fallback is not taken
silently on a machine that can compile (for the editable install the README's
commands make), and that a compiled module older than its source is found
(tests/conftest.py refuses to run the suite against one).
"""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from router.build import build_name, compiled, stale_extensions

ROOT = Path(__file__).resolve().parents[1]
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def setup_constant(name: str) -> Any:
    """A constant of setup.py, read without running it."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def compiled_modules() -> list[str]:
    """The module names setup.py compiles (its COMPILED_MODULES)."""
    paths = setup_constant("COMPILED_MODULES")
    return [path.removesuffix(".py").replace("/", ".") for path in paths]


def can_compile() -> bool:
    """The C compiler Python was built with, and its headers: what mypyc needs."""
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return shutil.which(compiler) is not None and headers.exists()


def test_the_hot_path_is_compiled_wherever_it_can_be() -> None:
    if os.environ.get("EPISODE_ROUTER_PURE_PYTHON"):
        pytest.skip("installed as pure Python on purpose (EPISODE_ROUTER_PURE_PYTHON)")
    if not can_compile():
        pytest.skip("no C compiler or Python headers: the pure-Python build is expected")
    # A module mypyc could not compile leaves them all pure Python (setup.py builds all
    # or none) with a warning the install output buries; here it fails.
    modules = compiled_modules()
    assert len(modules) >= 10 and "router.edge.server" in modules
    for name in modules:
        module = importlib.import_module(name)
        assert (module.__file__ or "").endswith(SUFFIX), name
    assert (compiled(), build_name()) == (True, "compiled")


def test_the_version_names_the_build() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    result = subprocess.run(
        [sys.executable, "-m", "router.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert result.stdout.strip() == f"episode-router {version} ({build_name()})"


def test_a_compiled_module_older_than_its_build_is_stale(tmp_path: Path) -> None:
    (tmp_path / "setup.py").write_text("")  # a source checkout
    package = tmp_path / "pkg"
    package.mkdir()
    for name in ("fresh", "stale", "built_only", "relinked"):
        (package / f"{name}{SUFFIX}").write_bytes(b"")
    for name in ("fresh", "stale", "source_only", "relinked"):
        (package / f"{name}.py").write_text("")
    old, new = (1_000_000_000, 1_000_000_000), (2_000_000_000, 2_000_000_000)
    os.utime(package / f"fresh{SUFFIX}", new)
    os.utime(package / "fresh.py", old)
    os.utime(package / f"stale{SUFFIX}", old)
    os.utime(package / "stale.py", new)
    os.utime(package / f"built_only{SUFFIX}", old)
    os.utime(package / f"relinked{SUFFIX}", old)
    os.utime(package / "relinked.py", new)
    assert stale_extensions(package) == ["relinked.py", "stale.py"]
    # mypyc's shared library, rebuilt after every source, counts as their build: a shim
    # left as it was is not stale then.
    shared = tmp_path / f"0123abcd__mypyc{SUFFIX}"
    shared.write_bytes(b"")
    os.utime(shared, (3_000_000_000, 3_000_000_000))
    assert stale_extensions(package) == []


def test_only_a_source_checkout_is_judged(tmp_path: Path) -> None:
    package = tmp_path / "site-packages-like"
    package.mkdir()
    (package / f"mod{SUFFIX}").write_bytes(b"")
    (package / "mod.py").write_text("")
    os.utime(package / f"mod{SUFFIX}", (1_000_000_000, 1_000_000_000))
    assert stale_extensions(package) == []  # no setup.py beside it: an installed wheel


@pytest.mark.parametrize("arguments", setup_constant("TRAINING_RUNS"))
def test_the_profile_guided_builds_training_runs_are_ones_the_benchmark_takes(
    arguments: list[str],
) -> None:
    # setup.py trains its profile-guided build with these; a run that fails leaves the
    # plain build, with a line in the install's output that nobody reads.
    result = subprocess.run(
        [sys.executable, "-m", "bench.hotpath", "--runs", "1", "--requests", "200", *arguments],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(200 requests," in result.stdout


def _pins() -> dict[str, Version]:
    """constraints.txt's pins, by canonical name."""
    pins: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        requirement = Requirement(text)
        (specifier,) = requirement.specifier  # one exact pin a line
        assert specifier.operator == "==", f"not an exact pin: {line!r}"
        name = canonicalize_name(requirement.name)
        assert name not in pins, f"pinned twice: {name}"
        pins[name] = Version(specifier.version)
    return pins


def test_every_requirement_is_pinned_where_scripts_test_installs_it() -> None:
    """scripts/test installs at constraints.txt's versions (its build environment too):
    each requirement of the package, its test extra and its build has a pin there that
    the requirement takes, so a fresh clone's run is the one CI ran."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wanted = [
        *pyproject["build-system"]["requires"],
        *pyproject["project"]["dependencies"],
        *pyproject["project"]["optional-dependencies"]["test"],
    ]
    pins = _pins()
    for text in wanted:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{text!r} has no pin in constraints.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"constraints.txt pins {name}=={pins[name]}, which {text!r} does not take"
        )
    assert 'PIP_CONSTRAINT="$PWD/constraints.txt"' in (ROOT / "scripts" / "test").read_text()
