"""What the micro-benchmarks report: one measured figure, its target and its verdict.

Shared by `bench.micro` (the pure parts) and `bench.netmicro` (the ones on real
sockets), so neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["STREAM_TARGET_GROWTH", "Figure", "GiB", "MiB", "judge"]

MiB = 1 << 20
GiB = 1 << 30
# "A 1 GiB body streams through with at most this much more RSS" (request or reply).
STREAM_TARGET_GROWTH = 32 * MiB


@dataclass(frozen=True, slots=True)
class Figure:
    """One measured figure, with the target it answers (if any) and whether it meets it."""

    bench: str
    name: str
    value: float
    unit: str
    target: str = ""
    met: bool | None = None  # None: no target, or not judged (a quick run)
    note: str = ""

    def line(self) -> str:
        verdict = {True: "  [met]", False: "  [NOT met]", None: ""}[self.met]
        target = f"  (target: {self.target})" if self.target else ""
        note = f"  {self.note}" if self.note else ""
        return f"{self.bench:9} {self.name}: {self.value:,.2f} {self.unit}{target}{verdict}{note}"


def judge(full: bool, ok: bool) -> bool | None:
    """A target's verdict: judged only at full size."""
    return ok if full else None
