"""Builds the forwarding hot path as C extensions with mypyc; the metadata is in pyproject.toml.

The modules every forwarded request runs through are plain, strictly typed Python
(`mypy --strict` checks them). mypyc, mypy's compiler, turns them into C extensions
with the same behaviour, which takes the router's CPU per forwarded request from
39.7 to 33.7 µs (`python -m bench.hotpath`, one process, same machine and run).

The extensions are optional: where there is no C compiler (or with
EPISODE_ROUTER_PURE_PYTHON=1 in the environment) the package installs as pure Python,
and runs the same code, slower. `episode-router version` says which build is running.
An editable install (`pip install -e .`) builds them next to their sources: after
editing one of these modules, install again (the test suite refuses a stale build).
"""

from __future__ import annotations

import os

from setuptools import Extension, setup

# Every module on the path of a forwarded request, from the public socket to the
# worker's and back, with the decision in between. Not compiled: router/tokens.py
# (its checks of a decoded token's JSON types are what refuses a hostile token, and
# compiled code would raise TypeError at the annotation instead), and everything off
# the hot path (config, control plane, admin, CLI), which gains nothing from it.
COMPILED_MODULES = [
    "router/answers.py",
    "router/app.py",
    "router/claims.py",
    "router/core.py",
    "router/edge.py",
    "router/edge_request.py",
    "router/edge_wire.py",
    "router/forward.py",
    "router/framing.py",
    "router/learn.py",
    "router/metrics.py",
    "router/relay.py",
    "router/relay_pool.py",
    "router/relay_request.py",
    "router/relay_wire.py",
    "router/sessions.py",
    "router/workers.py",
]


def compiled_extensions() -> list[Extension]:
    if os.environ.get("EPISODE_ROUTER_PURE_PYTHON"):
        return []
    from mypyc.build import mypycify  # a build requirement (pyproject.toml)

    extensions = mypycify(COMPILED_MODULES, opt_level="3")
    for extension in extensions:
        extension.optional = True  # a failed compile leaves the pure-Python module
    return extensions


setup(ext_modules=compiled_extensions())
