"""Where the router spends its CPU: py-spy samples of the router under load, summarised.

This module owns reading py-spy's collapsed stacks (`--format raw`: one line per
distinct stack, frames joined by `;`, then a sample count) into the functions
that take the most samples, by self time and by total time. The summary is
pure; `record` runs py-spy on a pid. It never changes the profiled process
beyond py-spy's own sampling.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Hotspot",
    "by_package",
    "find_py_spy",
    "format_hotspots",
    "format_packages",
    "record",
    "top_functions",
]

SAMPLE_RATE = 250  # samples per second: enough for a few-second run, light on the router
_LINE_NUMBER = re.compile(r":\d+\)$")  # frames differ only by line: fold them per function
_PYTHON_FILE = re.compile(r"\(([^():]+)\.py[:)]")  # `f (aiohttp/client.py:12)` -> aiohttp/client


@dataclass(frozen=True, slots=True)
class Hotspot:
    """A function and the share of samples it was running in (self) or under (total)."""

    function: str
    self_share: float
    total_share: float


def _function(frame: str) -> str:
    """`handle (router/app/handler.py:88)` -> `handle (router/app/handler.py)`."""
    return _LINE_NUMBER.sub(")", frame.strip())


def top_functions(collapsed: str, count: int = 20) -> list[Hotspot]:
    """The `count` functions with the most self samples, with their total shares.
    Lines that are not `stack samples` are ignored."""
    self_samples: Counter[str] = Counter()
    total_samples: Counter[str] = Counter()
    samples = 0
    for line in collapsed.splitlines():
        stack, _, number = line.rpartition(" ")
        if not stack or not number.isdigit():
            continue
        weight = int(number)
        frames = [_function(frame) for frame in stack.split(";") if frame.strip()]
        if not frames:
            continue
        samples += weight
        self_samples[frames[-1]] += weight
        for function in set(frames):
            total_samples[function] += weight
    if samples == 0:
        return []
    return [
        Hotspot(function, n / samples, total_samples[function] / samples)
        for function, n in self_samples.most_common(count)
    ]


def _package(frames: list[str]) -> str:
    """Who a sample's time belongs to: the garbage collector, epoll, a libc call
    (syscalls, mostly), or the package of the innermost Python frame."""
    leaf = frames[-1]
    if any(frame.startswith("gc_collect") for frame in frames):
        return "garbage collector"
    if leaf.startswith("epoll_"):
        return "waiting in epoll"
    if "(libc.so" in leaf:
        return "libc (system calls)"
    for frame in reversed(frames):
        match = _PYTHON_FILE.search(frame)
        if match is not None:
            return match.group(1).split("/")[0]
    return "interpreter"


def by_package(collapsed: str) -> list[tuple[str, float]]:
    """The share of samples per package (see `_package`), largest first."""
    counts: Counter[str] = Counter()
    for line in collapsed.splitlines():
        stack, _, number = line.rpartition(" ")
        frames = [frame.strip() for frame in stack.split(";") if frame.strip()]
        if frames and number.isdigit():
            counts[_package(frames)] += int(number)
    total = sum(counts.values())
    return [(name, n / total) for name, n in counts.most_common()] if total else []


def format_packages(shares: list[tuple[str, float]]) -> str:
    """A table: share, package."""
    return "\n".join(f"{share:6.1%}  {name}" for name, share in shares)


def format_hotspots(hotspots: list[Hotspot]) -> str:
    """A table: self %, total %, function."""
    lines = ["  self   total  function"]
    lines += [f"{h.self_share:6.1%}  {h.total_share:6.1%}  {h.function}" for h in hotspots]
    return "\n".join(lines)


def find_py_spy() -> str | None:
    """py-spy beside this interpreter or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def record(
    binary: str, pid: int, seconds: float, output: Path, *, native: bool
) -> subprocess.Popen[bytes]:
    """Starts py-spy sampling `pid` for `seconds` into `output` (collapsed stacks);
    the caller drives the load meanwhile and then waits for the process."""
    argv = [
        binary,
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(max(1, round(seconds))),
        "--rate",
        str(SAMPLE_RATE),
        "--format",
        "raw",
        "--output",
        str(output),
    ]
    if native:
        argv.append("--native")
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
