"""What a benchmark run found: per-proxy figures, ratios to nginx, targets, table, JSON, chart.

This module owns the figures' meaning: CPU per forwarded request, added
latency (proxy p50 minus the direct-to-worker p50), the proxy-bound throughput
(trivial workers: how fast the proxy alone is) and the worker-bound throughput
(busy workers: what the throughput target is about), ratios to nginx measured
in the same run, and the issue's targets checked against them. It is pure except
for `write_chart`, which draws with matplotlib when it is installed. It never
runs a process or sends a request.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Figures",
    "Run",
    "TargetCheck",
    "check_targets",
    "format_table",
    "legend",
    "ratio",
    "to_json",
    "write_chart",
]

BASELINE = "nginx"  # ratios are to this peer, measured side by side in the same run
DIRECT = "direct"  # the row of requests sent straight to a worker
# The targets for the router (ratios to nginx, except the p99 bound).
MAX_CPU_RATIO = 1.5
MAX_ADDED_LATENCY_RATIO = 1.2
MAX_HALF_LOAD_P99_US = 1000.0
MIN_THROUGHPUT_RATIO = 0.9


@dataclass(slots=True)
class Figures:
    """One proxy's results (or why it has none)."""

    name: str
    status: str = "ok"  # "ok", "skipped" or "failed"
    reason: str = ""
    processes: int = 0  # the pids whose CPU time was summed
    cpu_us_per_request: float | None = None
    rps: float | None = None
    load_tool: str | None = None
    load_requests: int | None = None
    load_errors: int | None = None
    load_p50_us: float | None = None
    load_p99_us: float | None = None
    serial_p50_us: float | None = None
    serial_p99_us: float | None = None
    added_p50_us: float | None = None
    added_p99_us: float | None = None
    paced_rate_asked: float | None = None
    paced_rps: float | None = None
    paced_p50_us: float | None = None
    paced_p99_us: float | None = None
    paced_errors: int | None = None
    paced_tool: str | None = None  # "wrk" (think time per connection) or "bundled"
    # Worker-bound throughput: the same load against workers that spin work_us per request.
    bound_rps: float | None = None
    bound_requests: int | None = None
    bound_errors: int | None = None
    bound_tokens: int | None = None  # the token set, balanced over the workers for this proxy
    bound_proxy_cores: float | None = None  # the proxy's CPU seconds per second meanwhile
    bound_worker_cores: float | None = None  # the busy workers' CPU seconds per second, summed
    bound_problem: str = ""  # why the worker-bound run failed, when it did
    rss_mib: float | None = None
    # Every round's CPU µs per request and proxy-bound rps (the columns show the medians);
    # the rounds run interleaved, every proxy once per round.
    cpu_rounds: list[float] = field(default_factory=list)
    rps_rounds: list[float] = field(default_factory=list)
    cpu_ratio_rounds: list[float] = field(default_factory=list)  # to nginx's, round by round
    # Every round's serial p50 and p99, and its added p50 and p99 (the proxy's figure minus
    # the direct one measured just before it): the serial columns show their medians.
    serial_p50_rounds: list[float] = field(default_factory=list)
    serial_p99_rounds: list[float] = field(default_factory=list)
    added_p50_rounds: list[float] = field(default_factory=list)
    added_p99_rounds: list[float] = field(default_factory=list)
    added_ratio_rounds: list[float] = field(default_factory=list)  # to nginx's, round by round
    # The proxy's CPU µs (user + system, /proc) per serial request, each round, and their
    # median: what a lone request waits for the proxy to compute.
    serial_cpu_rounds: list[float] = field(default_factory=list)
    serial_cpu_us_per_request: float | None = None
    serial_user_rounds: list[float] = field(default_factory=list)  # its user part
    serial_user_us_per_request: float | None = None
    # The direct row's paced run: each worker's own p99. The p99 of all their requests
    # together lies between the least and the greatest of them.
    paced_p99_each: list[float] = field(default_factory=list)
    # The rounds (1-based) in which this proxy failed: its round lists then skip them, so
    # they no longer pair with another proxy's round by round.
    failed_rounds: list[int] = field(default_factory=list)
    ratios: dict[str, float | None] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class TargetCheck:
    """One of the issue's targets: what it asks, what was measured, and whether it is met."""

    target: str
    measured: str
    met: bool | None  # None: not measured in this run (a peer was skipped)


@dataclass(slots=True)
class Run:
    """A whole run: settings, machine, each proxy's figures, the targets."""

    settings: dict[str, Any]
    machine: dict[str, Any]
    figures: list[Figures]
    targets: list[TargetCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def by_name(self, name: str) -> Figures | None:
        return next((f for f in self.figures if f.name == name and f.status == "ok"), None)


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or None when either is missing or base is not positive."""
    if value is None or base is None or base <= 0:
        return None
    return value / base


def fill_ratios(run: Run) -> None:
    """Sets every proxy's ratios to nginx: CPU, proxy-bound and worker-bound throughput,
    added p50 latency; and the CPU and added p50 ratios round by round."""
    base = run.by_name(BASELINE)
    for figures in run.figures:
        if figures.status != "ok" or figures.name == DIRECT:
            continue
        if base is not None and not figures.failed_rounds and not base.failed_rounds:
            figures.cpu_ratio_rounds = _round_ratios(figures.cpu_rounds, base.cpu_rounds)
            figures.added_ratio_rounds = _round_ratios(
                figures.added_p50_rounds, base.added_p50_rounds
            )
        figures.ratios = {
            "cpu": ratio(figures.cpu_us_per_request, base.cpu_us_per_request if base else None),
            "rps": ratio(figures.rps, base.rps if base else None),
            "bound_rps": ratio(figures.bound_rps, base.bound_rps if base else None),
            "added_p50": ratio(figures.added_p50_us, base.added_p50_us if base else None),
        }


def _round_ratios(mine: Sequence[float], theirs: Sequence[float]) -> list[float]:
    """Each round's figure over the baseline's same round: none unless both have as many
    rounds; a round where the baseline's figure is not positive is left out."""
    if len(mine) != len(theirs):
        return []
    return [m / t for m, t in zip(mine, theirs, strict=True) if t > 0]


def _direct_p99_shown(direct: Figures) -> str:
    """The workers' own paced p99: the range their p99s span (where the p99 of all their
    requests lies), or the one figure known."""
    each = direct.paced_p99_each
    if len(each) > 1 and min(each) < max(each):
        return f"{min(each):.0f}-{max(each):.0f} us (each worker's p99)"
    return f"{direct.paced_p99_us:.0f} us"


def _check(
    target: str, measured: float | None, shown: str, ok: bool, why: str = "nginx skipped"
) -> TargetCheck:
    if measured is None:
        return TargetCheck(target, f"not measured ({why})", None)
    return TargetCheck(target, shown, ok)


def _paced_shown(f: Figures) -> str:
    if f.paced_p99_us is None:
        return "not measured"
    shown = f"{f.paced_p99_us:.0f} us"
    if f.paced_rps is not None:
        shown += f" at {f.paced_rps:,.0f} rps"
    return shown + (f" ({f.paced_tool})" if f.paced_tool else "")


def check_targets(run: Run) -> list[TargetCheck]:
    """The router's targets that this run measures (the micro-benchmarks check the rest)."""
    router = run.by_name("router")
    if router is None:
        return []
    r = router.ratios
    cpu, bound, added = r.get("cpu"), r.get("bound_rps"), r.get("added_p50")
    half = router.paced_p99_us
    paced = _paced_shown(router)
    direct = run.by_name(DIRECT)
    if half is not None and direct is not None and direct.paced_p99_us is not None:
        # The machine's own floor: the workers alone, paced directly at the same total rate.
        paced += f"; direct to the workers: {_direct_p99_shown(direct)}"
    no_bound = "nginx skipped" if router.bound_rps is not None else "no worker-bound run"
    return [
        _check(
            f"CPU per request <= {MAX_CPU_RATIO}x nginx",
            cpu,
            f"{cpu:.2f}x" if cpu is not None else "",
            cpu is not None and cpu <= MAX_CPU_RATIO,
        ),
        _check(
            f"serial added latency p50 <= {MAX_ADDED_LATENCY_RATIO}x nginx",
            added,
            f"{added:.2f}x" if added is not None else "",
            added is not None and added <= MAX_ADDED_LATENCY_RATIO,
        ),
        TargetCheck(
            f"p99 <= {MAX_HALF_LOAD_P99_US:g} us at half of saturation",
            paced,
            half <= MAX_HALF_LOAD_P99_US if half is not None else None,
        ),
        _check(
            f"throughput >= {MIN_THROUGHPUT_RATIO:.0%} of nginx, workers the bottleneck",
            bound,
            f"{bound:.1%} (worker-bound rps)" if bound is not None else "",
            bound is not None and bound >= MIN_THROUGHPUT_RATIO,
            no_bound,
        ),
    ]


# --- output ----------------------------------------------------------------------------------


def _cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


_COLUMNS = (
    "proxy",
    "CPU us/req",
    "x nginx",
    "rps",
    "x nginx",
    "worker-bound rps",
    "x nginx",
    "serial p50",
    "p99",
    "added p50",
    "x nginx",
    "paced rps",
    "p50",
    "p99",
    "RSS MiB",
)


def _row(f: Figures) -> tuple[str, ...]:
    r = f.ratios
    return (
        f.name,
        _cell(f.cpu_us_per_request, 1),
        _times(r.get("cpu")),
        _cell(f.rps),
        _times(r.get("rps")),
        _cell(f.bound_rps),
        _times(r.get("bound_rps")),
        _cell(f.serial_p50_us),
        _cell(f.serial_p99_us),
        _cell(f.added_p50_us),
        _times(r.get("added_p50")),
        _cell(f.paced_rps),
        _cell(f.paced_p50_us),
        _cell(f.paced_p99_us),
        _cell(f.rss_mib, 1),
    )


def _wrapped(head: str, items: Sequence[str], end: str, width: int = 92) -> list[str]:
    """`head` then `items` joined by ", ", wrapped between items at `width`, then `end`."""
    lines = [head]
    for index, item in enumerate(items):
        text = item + (", " if index < len(items) - 1 else end)
        if len(lines[-1]) + len(text.rstrip()) > width and lines[-1].strip():
            lines[-1] = lines[-1].rstrip()
            lines.append("     ")
        lines[-1] += text
    return lines


def legend(settings: Mapping[str, Any], figures: Sequence[Figures]) -> list[str]:
    """The lines under the table that say how each column was measured."""
    connections = settings.get("connections", "?")
    tool = {"wrk": "wrk", "bundled": "the bundled generator"}.get(
        str(settings.get("load_tool")), "the load"
    )
    workers = settings.get("workers")
    work_us = settings.get("work_us") or 0
    measured = [f for f in figures if f.status == "ok" and f.name != DIRECT]
    lines = [
        "(latencies in microseconds; added = proxy p50 - the direct-to-worker p50 just before it;",
        f" rps: proxy-bound: {tool} at {connections} connections to trivial workers,"
        " how fast the proxy alone is;",
    ]
    rounds = settings.get("rounds") or 1
    if isinstance(rounds, int) and rounds > 1:
        spread = [
            f"{f.name} " + " ".join(f"{r:.2f}" for r in f.cpu_ratio_rounds)
            for f in measured
            if f.name != BASELINE and f.cpu_ratio_rounds
        ]
        added = [
            f"{f.name} " + " ".join(f"{r:.2f}" for r in f.added_ratio_rounds)
            for f in measured
            if f.name != BASELINE and f.added_ratio_rounds
        ]
        lines += [
            f" CPU us/req, proxy-bound rps, serial p50/p99 and added p50: medians of {rounds}"
            " rounds, every",
            "   proxy once a round (each round's added p50 against the direct p50 just before it);",
        ]
        if spread:
            lines += _wrapped("   CPU x nginx round by round: ", spread, ";")
        if added:
            lines += _wrapped("   serial added p50 x nginx round by round: ", added, ";")
    serial_cpu = [
        f"{f.name} {f.serial_cpu_us_per_request:.1f}"
        + (
            f" ({f.serial_user_us_per_request:.1f} user)"
            if f.serial_user_us_per_request is not None
            else ""
        )
        for f in measured
        if f.serial_cpu_us_per_request is not None
    ]
    if serial_cpu:
        lines += _wrapped(" serial CPU us/req (user + system, while serial): ", serial_cpu, ";")
    if work_us > 0 and isinstance(workers, int):
        ceiling = workers * 1e6 / work_us
        lines += [
            f" worker-bound rps: the same to {workers} workers that spin {work_us:g} us per request"
            f" (at most {ceiling:,.0f} rps",
            "   in all), so the workers are the bottleneck: the throughput target's figure;",
        ]
        cores = [
            f"{f.name} {f.bound_proxy_cores:.2f} / {f.bound_worker_cores:.2f}"
            for f in measured
            if f.bound_proxy_cores is not None and f.bound_worker_cores is not None
        ]
        if cores:
            lines += _wrapped("   cores used meanwhile (proxy / workers): ", cores, ";")
    else:
        lines.append(" worker-bound rps: not measured (--work-us 0);")
    asked = next((f.paced_rate_asked for f in measured if f.paced_rate_asked), None)
    tools = {f.paced_tool for f in measured if f.paced_tool}
    if tools == {"wrk"}:
        how = "wrk, each connection waiting C/rate before each request (closed loop)"
    elif tools == {"bundled"}:
        how = "the bundled generator, each connection on a fixed schedule"
    else:
        how = " and ".join(sorted(tools)) or "not run"
    lines += [
        " paced: every proxy asked for half the router's proxy-bound rps"
        + (f" ({asked:,.0f})" if asked else "")
        + ", paced rps achieved;",
        f"   by {how}",
    ]
    direct = next((f for f in figures if f.status == "ok" and f.name == DIRECT), None)
    if direct is not None and direct.paced_p99_us is not None:
        lines[-1] += ";"
        lines += _direct_paced_legend(settings, direct)
    lines[-1] += ")"
    return lines


def _direct_paced_legend(settings: Mapping[str, Any], direct: Figures) -> list[str]:
    """How the direct row's paced figures were measured: the machine's own p99 floor."""
    workers = settings.get("workers")
    connections = settings.get("connections")
    if isinstance(workers, int) and workers > 0 and isinstance(connections, int):
        each = f"rate/{workers} on {max(1, connections // workers)} connections"
        who = f"the {workers} workers"
    else:
        each, who = "its share of the rate and connections", "the workers"
    by = {"wrk": ", a wrk each", "bundled": ", the bundled generator"}.get(
        direct.paced_tool or "", ""
    )
    return [
        f" paced, direct row: {who} at once, each straight at {each}{by};",
        "   paced rps: their sum; p50, p99: the worst worker's (an upper bound on the combined"
        " p99)",
    ]


def format_table(run: Run) -> str:
    """The table a person reads: one row per proxy measured, then the skipped and targets."""
    rows = [_COLUMNS] + [_row(f) for f in run.figures if f.status == "ok"]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.extend(legend(run.settings, run.figures))
    build = run.machine.get("router_build")
    if build:
        lines.append(f"router build: {build} (episode-router --version)")
    for f in run.figures:
        if f.status != "ok":
            lines.append(f"{f.status}: {f.name}: {f.reason}")
    for f in run.figures:
        if f.status == "ok" and f.load_errors:
            lines.append(f"warning: {f.name}: {f.load_errors} errors under load")
        if f.status == "ok" and f.paced_errors:
            lines.append(f"warning: {f.name}: {f.paced_errors} errors at the paced rate")
        if f.status == "ok" and f.bound_errors:
            lines.append(f"warning: {f.name}: {f.bound_errors} errors in the worker-bound run")
        if f.status == "ok" and f.bound_problem:
            lines.append(f"warning: {f.name}: worker-bound run failed: {f.bound_problem}")
    if run.targets:
        lines.append("targets (router):")
        for check in run.targets:
            verdict = {True: "met", False: "NOT met", None: "n/a"}[check.met]
            lines.append(f"  {verdict:8} {check.target}: {check.measured}")
    lines.extend(run.notes)
    return "\n".join(lines)


def to_json(run: Run) -> str:
    """The whole run as JSON (figures, ratios, targets, settings, machine)."""
    data = {
        "settings": run.settings,
        "machine": run.machine,
        "proxies": [dataclasses.asdict(f) for f in run.figures],
        "skipped": {f.name: f.reason for f in run.figures if f.status == "skipped"},
        "failed": {f.name: f.reason for f in run.figures if f.status == "failed"},
        "targets": [dataclasses.asdict(t) for t in run.targets],
        "notes": run.notes,
    }
    return json.dumps(data, indent=2) + "\n"


_PANELS: Sequence[tuple[str, str, str | None]] = (
    ("cpu_us_per_request", "CPU per forwarded request (us, lower is better)", "cpu"),
    ("rps", "proxy-bound throughput at {connections} connections (req/s)", "rps"),
    ("bound_rps", "worker-bound throughput, workers spin {work_us} us (req/s)", "bound_rps"),
    ("added_p50_us", "serial added latency p50 (us)", "added_p50"),
    ("paced_p99_us", "p99 at half the router's saturation rate (us)", None),
)


def write_chart(run: Run, path: Path) -> str | None:
    """Draws the run's five figures as bar charts into `path` (PNG).
    Returns None when done, else why no chart was drawn (matplotlib missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "no chart: matplotlib is not installed (pip install matplotlib)"
    measured = [f for f in run.figures if f.status == "ok" and f.name != DIRECT]
    figure, axes = plt.subplots(2, 3, figsize=(15, 7))
    axes.flat[-1].axis("off")  # five panels on a 2 x 3 grid
    for axis, (attribute, title, ratio_key) in zip(axes.flat, _PANELS, strict=False):
        names = [f.name for f in measured]
        values = [getattr(f, attribute) or 0.0 for f in measured]
        colours = ["#d62728" if n == "router" else "#1f77b4" for n in names]
        bars = axis.bar(names, values, color=colours)
        labels = [_bar_label(f, attribute, ratio_key) for f in measured]
        axis.bar_label(bars, labels=labels, fontsize=8)
        connections = run.settings.get("connections", "?")
        work_us = f"{run.settings.get('work_us') or 0:g}"
        axis.set_title(title.format(connections=connections, work_us=work_us), fontsize=10)
        axis.margins(y=0.15)
    figure.suptitle(_chart_title(run.machine), fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def _bar_label(f: Figures, attribute: str, ratio_key: str | None) -> str:
    value = getattr(f, attribute)
    if value is None:
        return "n/a"
    ratio_value = f.ratios.get(ratio_key) if ratio_key else None
    return f"{value:,.0f}" + (f"\n{ratio_value:.2f}x nginx" if ratio_value is not None else "")


def _chart_title(machine: Mapping[str, Any]) -> str:
    cpus = machine.get("cpus", "?")
    return f"episode-router vs peers, {cpus} cores, loopback, sticky on the token header"
