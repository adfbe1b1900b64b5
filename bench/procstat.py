"""Process accounting read from /proc: CPU time, resident memory and process trees.

This module owns the parsing of `/proc/<pid>/stat` and `/proc/<pid>/status` and the
sums over a process and its descendants (nginx's master and workers). Parsing is
pure; the readers are thin. It never signals or changes a process.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "CLOCK_TICKS",
    "ProcStat",
    "cpu_seconds",
    "cpu_split_seconds",
    "descendants",
    "parse_stat",
    "parse_status_kib",
    "peak_rss_bytes",
    "rss_bytes",
    "run_seconds",
    "tree_cpu_seconds",
    "tree_cpu_split_seconds",
    "tree_run_seconds",
]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # utime and stime are counted in these
PROC = Path("/proc")


@dataclass(frozen=True, slots=True)
class ProcStat:
    """The fields of one `/proc/<pid>/stat` line the benchmark reads."""

    pid: int
    ppid: int
    utime_ticks: int
    stime_ticks: int

    @property
    def cpu_seconds(self) -> float:
        """User plus system time of the process (all its threads), in seconds."""
        return (self.utime_ticks + self.stime_ticks) / CLOCK_TICKS


def parse_stat(line: str) -> ProcStat:
    """Parses a `/proc/<pid>/stat` line. Raises ValueError on a malformed one.

    The command name (field 2) is in parentheses and may hold spaces or
    parentheses itself, so the fields are counted from the last `)`.
    """
    close = line.rfind(")")
    if close < 0 or "(" not in line[:close]:
        raise ValueError(f"not a /proc stat line: {line[:80]!r}")
    pid = int(line[: line.index("(")].strip())
    rest = line[close + 1 :].split()
    # rest[0] is field 3 (state); ppid is field 4, utime 14, stime 15.
    if len(rest) < 13:
        raise ValueError(f"a /proc stat line with {len(rest) + 2} fields: {line[:80]!r}")
    return ProcStat(
        pid=pid, ppid=int(rest[1]), utime_ticks=int(rest[11]), stime_ticks=int(rest[12])
    )


def parse_status_kib(text: str, field: str) -> int:
    """The value of a `kB` field (`VmRSS`, `VmHWM`) of `/proc/<pid>/status`, in KiB.

    Raises KeyError when the field is absent (a zombie has no VmRSS).
    """
    prefix = field + ":"
    for line in text.splitlines():
        if line.startswith(prefix):
            return int(line[len(prefix) :].split()[0])
    raise KeyError(field)


def read_stat(pid: int) -> ProcStat | None:
    """The process's stat, or None when it is gone."""
    try:
        return parse_stat((PROC / str(pid) / "stat").read_text())
    except (OSError, ValueError):
        return None


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) the process has used; 0.0 when it is gone."""
    stat = read_stat(pid)
    return stat.cpu_seconds if stat is not None else 0.0


def run_seconds(pid: int) -> float:
    """CPU time the process's threads have run, to the nanosecond (their schedstat;
    /proc's stat counts clock ticks, too coarse for a few µs a request); 0.0 when it
    is gone."""
    total_ns = 0
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return 0.0
    for task in tasks:
        try:
            total_ns += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
    return total_ns / 1e9


def cpu_split_seconds(pid: int) -> tuple[float, float]:
    """User and system time (all threads) the process has used; zeros when it is gone."""
    stat = read_stat(pid)
    if stat is None:
        return 0.0, 0.0
    return stat.utime_ticks / CLOCK_TICKS, stat.stime_ticks / CLOCK_TICKS


def children_of(pid: int, stats: Iterable[ProcStat]) -> list[int]:
    """The pids among `stats` whose parent is `pid`."""
    return [stat.pid for stat in stats if stat.ppid == pid]


def _all_stats() -> list[ProcStat]:
    stats = []
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = read_stat(int(entry.name))
            if stat is not None:
                stats.append(stat)
    return stats


def descendants(pid: int) -> list[int]:
    """`pid` and every live process below it (nginx's workers, for example)."""
    stats = _all_stats()
    found = [pid]
    index = 0
    while index < len(found):
        found.extend(children_of(found[index], stats))
        index += 1
    return found


def tree_cpu_seconds(pids: Iterable[int]) -> float:
    """The CPU time used by all of `pids`, summed."""
    return sum(cpu_seconds(pid) for pid in pids)


def tree_run_seconds(pids: Iterable[int]) -> float:
    """The CPU time all of `pids` have run, summed, to the nanosecond (schedstat)."""
    return sum(run_seconds(pid) for pid in pids)


def tree_cpu_split_seconds(pids: Iterable[int]) -> tuple[float, float]:
    """The user and the system time used by all of `pids`, each summed."""
    splits = [cpu_split_seconds(pid) for pid in pids]
    return sum(user for user, _ in splits), sum(system for _, system in splits)


def _status_kib(pid: int, field: str) -> int:
    try:
        return parse_status_kib((PROC / str(pid) / "status").read_text(), field)
    except (OSError, KeyError, ValueError):
        return 0


def rss_bytes(pid: int) -> int:
    """The process's resident set size now, in bytes (0 when it is gone)."""
    return _status_kib(pid, "VmRSS") * 1024


def peak_rss_bytes(pid: int) -> int:
    """The process's peak resident set size so far (VmHWM), in bytes."""
    return _status_kib(pid, "VmHWM") * 1024
