"""Builds the forwarding hot path as C extensions with mypyc; the metadata is in pyproject.toml.

The modules a forwarded request runs through are plain, strictly typed Python
(`mypy --strict` checks them). mypyc, mypy's compiler, turns them into C extensions
with the same behaviour, at a lower CPU cost per forwarded request (measured:
docs/performance.md, "The hot path's trims").

The extensions are all or nothing, and optional: where mypyc or a C compiler is
missing, or fails, or with EPISODE_ROUTER_PURE_PYTHON=1 in the environment, the
package installs as pure Python and runs the same code, slower. `episode-router
--version` says which build is running. An editable install (`pip install -e .`)
builds them next to their sources: after editing one of these modules, install again
(the test suite refuses a stale build).

With gcc, and the benchmark beside the sources (bench/, as in a source checkout and
the image's build stage), the build is profile-guided, as CPython's release builds
are: it compiles the extensions instrumented, forwards 40,000 requests through them on
loopback (`bench.hotpath`, a few seconds), and compiles them again with what that run
counted, so gcc lays the forwarding path out together and moves what it never ran
out of its way. mypyc's output is large (about 1.8 MB of code) and a request that
arrives after a wait finds little of it in the CPU's caches: laid out so, the router
spends less user CPU per request and adds less latency, one request at a time and
under load (docs/performance.md). EPISODE_ROUTER_PGO=0 skips it (an install then
takes about a minute less); any step that fails (the instrumented compile, the
training run, the compile with the profile) falls back to the plain build, and says so.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The modules on the common path of a forwarded request, from the public socket to the
# worker's and back, with the decision in between. Not compiled: router/tokens/jws.py (its
# checks of a decoded token's JSON types are what refuses a hostile token, and compiled
# code would raise TypeError at the annotation instead), the session formats other than
# the default token and where their values sit (router/sessions/formats.py,
# router/sessions/sources.py), the streamed reply, the metrics read from the live state
# (router/metrics/state.py: a scrape runs it, never a request), and everything off the
# hot path (config, control plane, admin, CLI), which gain little from it.
COMPILED_MODULES = [
    "router/core/answers.py",
    "router/app/handler.py",
    "router/app/destination.py",
    "router/app/exchange.py",
    "router/core/claims.py",
    "router/core/machine.py",
    "router/edge/server.py",
    "router/edge/clock.py",
    "router/edge/parsing.py",
    "router/edge/request.py",
    "router/edge/serving.py",
    "router/edge/head_text.py",
    "router/edge/wire.py",
    "router/relay/contract.py",
    "router/edge/framing.py",
    "router/sessions/learning.py",
    "router/metrics/registry.py",
    "router/metrics/counts.py",
    "router/metrics/labels.py",
    "router/relay/forwarder.py",
    "router/relay/connection.py",
    "router/relay/exchange.py",
    "router/relay/lane.py",
    "router/relay/reply_parser.py",
    "router/relay/pool.py",
    "router/relay/request.py",
    "router/relay/upload.py",
    "router/relay/wire.py",
    "router/sessions/reader.py",
    "router/tokens/cache.py",
    "router/core/workers.py",
    # A fleet router's request path: the lookup cache and what its answer means, the
    # owner key, the peer hop's signature, the answers a lookup decides and the fleet
    # link the handler asks (its cached answers, the lease, the incarnation).
    "router/directory/cache.py",
    "router/directory/keys.py",
    "router/directory/meaning.py",
    "router/fleet/answers.py",
    "router/fleet/signature.py",
    "router/fleet/link.py",
    # The peer listener checks every hop's X-Forwarded-For (`is_ip`): interpreted, it
    # was a fortieth of the receiving router's CPU (perf on bench.fleet's forwarded load).
    "router/protocol/addresses.py",
    # A miss's lookup: the batcher, the directory client and the records it decodes
    # (the first ask of an absent key under load, bench.fleet's rows on 4,096 episodes,
    # interleaved in one hour: +10.9 us a request over a router without a directory
    # with these three interpreted, +8.2 us compiled; at 256 episodes 8.9-9.0 vs 6.5-7.8).
    "router/directory/batcher.py",
    "router/directory/client.py",
    "router/directory/records.py",
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


SOURCES = Path(__file__).resolve().parent

# Both builds: mypyc's functions call each other across its one shared library, and
# gcc may inline and call them directly only when no other library can replace them.
GCC_FLAGS = ["-fno-semantic-interposition"]
PROFILE_GENERATE = ["-fprofile-generate"]
# Code the training run never reached stays optimised as without a profile (partial
# training): a chunked upload or a 410 is not made slower for being rare here.
PROFILE_USE = ["-fprofile-use", "-fprofile-partial-training", "-fprofile-correction"]
# mypyc builds with -Werror; the profile's inlining can raise warnings of its own, and
# a failed compile here would only fall back to the plain build.
PROFILE_USE += ["-Wno-missing-profile", "-Wno-error"]
# The training run: the forwarding path at one connection and at sixteen.
TRAINING_RUNS = [["--connections", "1"], ["--connections", "16"]]
TRAINING_TIMEOUT_S = 300


def _say(message: str) -> None:
    print(f"episode-router: {message}", file=sys.stderr)


class BuildAllOrNone(build_ext):
    """Builds every compiled module or none of them, profile-guided where it can.

    mypyc's modules are thin shims over one shared library: a shim built without it
    would not import. So when any extension fails (optional ones only warn), every one
    built is removed and the package installs as pure Python.
    """

    def run(self) -> None:
        inplace, self.inplace = self.inplace, False
        guided = self._guided()
        if guided:
            self._add_flags(GCC_FLAGS + PROFILE_GENERATE, PROFILE_GENERATE)
            self._build()
            if self._missing():
                _say("plain build: the instrumented one did not build")
                guided = False
            else:
                guided = self._train()
            self._drop_flags(PROFILE_GENERATE)
            if guided:
                self._add_flags(PROFILE_USE, [])
            self.force = True  # the same sources again, with other flags
        self._build()
        if guided and self._missing():  # a gcc that refuses a flag: the plain build then
            _say("plain build: the profile-guided one did not build")
            guided = False
            self._drop_flags(PROFILE_USE)
            self._build()
        built = self._outputs()
        missing = self._missing()
        self.inplace = inplace
        if missing:
            # An editable install's copies from an earlier build go too.
            beside_sources = self._outputs()  # inplace again: the paths beside them
            for path in built + (beside_sources if inplace else []):
                if os.path.exists(path):
                    os.remove(path)
            _pure_python(f"{len(missing)} of {len(built)} extensions did not build")
            return
        if inplace:
            self.copy_extensions_to_source()
        if guided:
            _say("built profile-guided")

    def _build(self) -> None:
        # setuptools' own run(): distutils builds into the build directory, and an
        # in-place build then copies the results beside the sources. It replaces the
        # compiler's name with the compiler it makes: a second build needs the name.
        # The outputs of a build before go first: distutils would skip an extension it
        # finds up to date (the instrumented build then never made), and it keeps the
        # old file where an optional extension fails (a failure then never seen).
        for path in self._outputs():
            if os.path.exists(path):
                os.remove(path)
        compiler = self.compiler
        super(build_ext, self).run()
        self.compiler = compiler

    def _outputs(self) -> list[str]:
        return [self.get_ext_fullpath(extension.name) for extension in self.extensions]

    def _missing(self) -> list[str]:
        return [path for path in self._outputs() if not os.path.exists(path)]

    def _add_flags(self, compile_flags: list[str], link_flags: list[str]) -> None:
        for extension in self.extensions:
            extension.extra_compile_args = [*extension.extra_compile_args, *compile_flags]
            extension.extra_link_args = [*extension.extra_link_args, *link_flags]

    def _drop_flags(self, flags: list[str]) -> None:
        for extension in self.extensions:
            extension.extra_compile_args = [
                flag for flag in extension.extra_compile_args if flag not in flags
            ]
            extension.extra_link_args = [
                flag for flag in extension.extra_link_args if flag not in flags
            ]

    def _guided(self) -> bool:
        """Whether to build profile-guided: gcc, the benchmark present, not turned off."""
        if not self.extensions or os.environ.get("EPISODE_ROUTER_PGO", "1") == "0":
            return False
        if not (SOURCES / "bench" / "hotpath.py").is_file():
            _say("plain build: no bench/ to train a profile-guided one with")
            return False
        # The compiler's own macros: clang defines __GNUC__ too, and a wrapper (ccache)
        # answers --version for itself.
        try:
            macros = subprocess.run(
                [*_compiler(), "-dM", "-E", "-x", "c", os.devnull],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout
        except (OSError, subprocess.SubprocessError):
            macros = ""
        if "__GNUC__" not in macros or "__clang__" in macros:
            _say("plain build: the profile-guided one needs gcc")
            return False
        return True

    def _train(self) -> bool:
        """Runs the instrumented build's training; True when it ran and counted."""
        temp = Path(self.build_temp)
        for stale in temp.rglob("*.gcda"):  # counts from an earlier build would merge in
            stale.unlink()
        with tempfile.TemporaryDirectory(prefix="episode-router-pgo-") as folder:
            tree = Path(folder)
            skip = shutil.ignore_patterns("*.so", "*.pyd", "__pycache__")
            for package in ("router", "bench"):
                shutil.copytree(SOURCES / package, tree / package, ignore=skip)
            for path in self._outputs():
                target = tree / os.path.relpath(path, self.build_lib)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, target)
            # Ahead of the build's own path (pip's isolated build finds its packages
            # through it), so the training imports the extensions just built.
            search = os.pathsep.join(filter(None, [folder, os.environ.get("PYTHONPATH")]))
            env = {**os.environ, "PYTHONPATH": search}
            check = "from router.build import compiled; assert compiled(), 'not compiled'"
            commands = [[sys.executable, "-c", check]] + [
                [sys.executable, "-m", "bench.hotpath", "--runs", "1", *arguments]
                for arguments in TRAINING_RUNS
            ]
            for command in commands:
                try:
                    result = subprocess.run(
                        command,
                        cwd=folder,
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=TRAINING_TIMEOUT_S,
                    )
                except (OSError, subprocess.SubprocessError) as exc:
                    _say(f"plain build: the profile-guided training failed ({exc!r})")
                    return False
                if result.returncode != 0:
                    tail = (result.stdout + result.stderr).strip().splitlines()[-5:]
                    _say("plain build: the profile-guided training failed:")
                    for line in tail:
                        print(f"  {line}", file=sys.stderr)
                    return False
        if not any(temp.rglob("*.gcda")):
            _say("plain build: the profile-guided training counted nothing")
            return False
        return True


def _compiler() -> list[str]:
    """The C compiler distutils will call (CC, else the one Python was built with)."""
    return shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")


setup(ext_modules=compiled_extensions(), cmdclass={"build_ext": BuildAllOrNone})
