"""The fuzz targets in `fuzz/` run: briefly under atheris, and in replay mode over their seeds.

Each target is a process of its own, as it is run by hand (`python fuzz/fuzz_tokens.py
-runs=100000`). Here every target gets a few thousand coverage-guided inputs, started
from its seeds in an empty corpus folder under `tmp_path` (where a crash file would be
written too), and must exit 0. Replay mode needs no atheris and checks the seeds.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("tokens", "control", "formats", "headers")
RUNS = 2000
TIMEOUT_S = 60.0  # a run takes seconds; a hung fuzzer must not hang the suite


def target(name: str) -> Path:
    path = ROOT / "fuzz" / f"fuzz_{name}.py"
    assert path.is_file(), f"no fuzz target at {path}"
    return path


def finish(process: subprocess.Popen[bytes], deadline: float) -> tuple[int, str]:
    """(exit status, the tail of its output) once it ends; killed at the deadline."""
    try:
        output, _ = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate()
        return -9, output.decode(errors="replace")[-3000:]
    return process.returncode, output.decode(errors="replace")[-3000:]


def test_every_target_survives_a_short_coverage_guided_run(tmp_path: Path) -> None:
    if importlib.util.find_spec("atheris") is None:
        pytest.fail("atheris is not installed: install the test extra (pip install -e '.[test]')")
    processes = {}
    for name in TARGETS:  # all at once: each is mostly interpreter start-up
        corpus = tmp_path / f"corpus-{name}"
        argv = [
            sys.executable,
            str(target(name)),
            f"-runs={RUNS}",
            f"-artifact_prefix={tmp_path}/{name}-",
            "-print_final_stats=1",
            str(corpus),
        ]
        processes[name] = subprocess.Popen(
            argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + TIMEOUT_S
    results = {name: finish(process, deadline) for name, process in processes.items()}
    failed = {name: out for name, (status, out) in results.items() if status != 0}
    assert not failed, "\n\n".join(f"--- fuzz_{name} ---\n{out}" for name, out in failed.items())
    for name, (_, output) in results.items():
        assert f"Done {RUNS} runs" in output, f"fuzz_{name} did not run {RUNS} inputs:\n{output}"
        assert (tmp_path / f"corpus-{name}" / "seed-0").is_file(), f"fuzz_{name} was not seeded"
    assert not list(tmp_path.glob("*-crash-*")), "a target left a crash file"


@pytest.mark.parametrize("name", TARGETS)
def test_a_target_replays_its_seeds_without_atheris(name: str, tmp_path: Path) -> None:
    extra = tmp_path / "input"
    extra.write_bytes(b"\x00\xff\n--\n:\n")  # any file given is replayed too
    argv = [sys.executable, str(target(name)), "--replay", str(extra)]
    result = subprocess.run(argv, cwd=tmp_path, capture_output=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
