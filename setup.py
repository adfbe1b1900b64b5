"""Builds the forwarding hot path as C extensions with mypyc; the metadata is in pyproject.toml.

The modules a forwarded request runs through are plain, strictly typed Python
(`mypy --strict` checks them). mypyc, mypy's compiler, turns them into C extensions
with the same behaviour, which takes the router's CPU per forwarded request from
39.2-41.7 to about 25-26 µs (`python -m bench.hotpath`, one process, same machine).

The extensions are all or nothing, and optional: where mypyc or a C compiler is
missing, or fails, or with EPISODE_ROUTER_PURE_PYTHON=1 in the environment, the
package installs as pure Python and runs the same code, slower. `episode-router
--version` says which build is running. An editable install (`pip install -e .`)
builds them next to their sources: after editing one of these modules, install again
(the test suite refuses a stale build).
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The modules on the common path of a forwarded request, from the public socket to the
# worker's and back, with the decision in between. Not compiled: router/tokens.py (its
# checks of a decoded token's JSON types are what refuses a hostile token, and compiled
# code would raise TypeError at the annotation instead), the session formats other than
# the default token and where their values sit (router/formats.py, router/key_sources.py),
# the streamed reply, the metrics read from the live state (router/metrics_state.py: a
# scrape runs it, never a request), and everything off the hot path (config, control
# plane, admin, CLI), which gain little from it.
COMPILED_MODULES = [
    "router/answers.py",
    "router/app.py",
    "router/app_destination.py",
    "router/app_exchange.py",
    "router/claims.py",
    "router/core.py",
    "router/edge.py",
    "router/edge_clock.py",
    "router/edge_parse.py",
    "router/edge_request.py",
    "router/edge_serve.py",
    "router/edge_text.py",
    "router/edge_wire.py",
    "router/forward.py",
    "router/framing.py",
    "router/learn.py",
    "router/metrics.py",
    "router/metrics_counts.py",
    "router/metrics_labels.py",
    "router/relay.py",
    "router/relay_connection.py",
    "router/relay_exchange.py",
    "router/relay_lane.py",
    "router/relay_parser.py",
    "router/relay_pool.py",
    "router/relay_request.py",
    "router/relay_upload.py",
    "router/relay_wire.py",
    "router/sessions.py",
    "router/token_cache.py",
    "router/workers.py",
]


def _pure_python(why: str) -> list[Extension]:
    print(f"episode-router: installing as pure Python: {why}", file=sys.stderr)
    return []


def compiled_extensions() -> list[Extension]:
    if os.environ.get("EPISODE_ROUTER_PURE_PYTHON"):
        return _pure_python("EPISODE_ROUTER_PURE_PYTHON is set")
    try:
        from mypyc.build import mypycify  # a build requirement (pyproject.toml)

        extensions = mypycify(COMPILED_MODULES, opt_level="3")
    except (Exception, SystemExit) as exc:  # mypyc exits on a type error it finds
        return _pure_python(f"mypyc could not compile the hot path ({exc!r})")
    for extension in extensions:
        extension.optional = True  # a failed compile is judged below, for them all
    return extensions


class BuildAllOrNone(build_ext):
    """Builds every compiled module or none of them.

    mypyc's modules are thin shims over one shared library: a shim built without it
    would not import. So when any extension fails (optional ones only warn), every one
    built is removed and the package installs as pure Python.
    """

    def run(self) -> None:
        inplace, self.inplace = self.inplace, False
        # setuptools' own run(): distutils builds into the build directory, and an
        # in-place build then copies the results beside the sources.
        super(build_ext, self).run()
        built = [self.get_ext_fullpath(extension.name) for extension in self.extensions]
        missing = [path for path in built if not os.path.exists(path)]
        self.inplace = inplace
        if missing:
            # An editable install's copies from an earlier build go too.
            beside_sources = [self.get_ext_fullpath(ext.name) for ext in self.extensions]
            for path in built + (beside_sources if inplace else []):
                if os.path.exists(path):
                    os.remove(path)
            _pure_python(f"{len(missing)} of {len(built)} extensions did not build")
            return
        if inplace:
            self.copy_extensions_to_source()


setup(ext_modules=compiled_extensions(), cmdclass={"build_ext": BuildAllOrNone})
