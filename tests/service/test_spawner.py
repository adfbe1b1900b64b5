"""Tests for router.service.spawner: pure command rendering and backoff, then real processes."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import shlex
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from router.service.spawner import (
    SpawnedWorker,
    Spawner,
    SpawnSpec,
    next_restart,
    plan_workers,
    render_command,
    render_cwd,
    render_env,
    restart_delay,
)

pytestmark = pytest.mark.timeout(30)

# A worker: records its pid, process group, session, argv, environment and start time
# (CLOCK_MONOTONIC, shared by all processes) in <out>/<worker id>-<pid>.json, then sleeps.
# Modes: "sleep"; "grandchild" (starts a grandchild that exits 0.3 s after SIGTERM,
# leaving a .clean file); "ignore-term" (ignores SIGTERM, and so does its grandchild, which
# holds 512 MiB so that it is still dying for a while after SIGKILL).
WORKER_SCRIPT = """
import json, os, signal, subprocess, sys, time

out, mode = sys.argv[1], sys.argv[2]
if mode == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = None
if mode in ("grandchild", "ignore-term"):
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "grandchild.py")
    grandchild_mode = "graceful" if mode == "grandchild" else "heavy"
    grandchild = subprocess.Popen([sys.executable, script, out, grandchild_mode]).pid
    ready = os.path.join(out, "gc-%d.ready" % grandchild)
    deadline = time.monotonic() + 10
    while not os.path.exists(ready) and time.monotonic() < deadline:
        time.sleep(0.01)
env = {k: v for k, v in os.environ.items() if k.startswith(("EPISODE_ROUTER_", "SPAWN_TEST_"))}
record = {
    "pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0), "started_at": time.monotonic(),
    "argv": sys.argv[3:], "env": env, "grandchild": grandchild,
}
name = os.path.join(out, "%s-%d" % (env.get("EPISODE_ROUTER_WORKER_ID"), os.getpid()))
with open(name + ".tmp", "w") as f:
    json.dump(record, f)
os.replace(name + ".tmp", name + ".json")
time.sleep(60)
"""

GRANDCHILD_SCRIPT = """
import os, signal, sys, time

out, mode = sys.argv[1], sys.argv[2]

def finish(signum, frame):
    time.sleep(0.3)
    open(os.path.join(out, "gc-%d.clean" % os.getpid()), "w").close()
    os._exit(0)

if mode == "graceful":
    signal.signal(signal.SIGTERM, finish)
if mode == "heavy":
    # Memory to give back makes its exit take a while after SIGKILL (tens of ms).
    ballast = bytearray(512 * 1024 * 1024)
    for page in range(0, len(ballast), 4096):
        ballast[page] = 1
open(os.path.join(out, "gc-%d.ready" % os.getpid()), "w").close()
time.sleep(60)
"""

# A worker that crashes at once: appends a line to <out>/launches and exits 3.
CRASH_SCRIPT = """
import os, sys

with open(os.path.join(sys.argv[1], "launches"), "a") as f:
    f.write("launch\\n")
sys.exit(3)
"""


def literal(text: str) -> str:
    """Escape text for the command template, so that its braces stay braces."""
    return text.replace("{", "{{").replace("}", "}}")


def process_state(pid: int) -> tuple[str, int] | None:
    """Return (state letter, parent pid) from /proc, or None once the pid is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat_file:
            stat = stat_file.read()
    except FileNotFoundError:
        return None
    state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]  # the name may hold ") "
    return state, int(ppid)


def is_running(pid: int) -> bool:
    """Whether pid names a live process; a zombie counts as gone (it only waits to be reaped)."""
    state = process_state(pid)
    return state is not None and state[0] not in ("Z", "X")


async def eventually(check: Callable[[], bool], within_s: float = 5.0) -> None:
    """Wait until check() is true, for at most `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


class Harness:
    """One test's spawners, the exits they reported, and every process to clean up."""

    def __init__(self, tmp_path: Path) -> None:
        self.root = tmp_path
        self.out = tmp_path / "out"
        self.out.mkdir()
        (tmp_path / "worker.py").write_text(WORKER_SCRIPT)
        (tmp_path / "grandchild.py").write_text(GRANDCHILD_SCRIPT)
        (tmp_path / "crash.py").write_text(CRASH_SCRIPT)
        self.exits: list[tuple[str, int | None]] = []
        self.exit_times: list[float] = []
        self.fail_on_exit = False
        self.spawners: list[Spawner] = []

    def command(self, script: str, *args: str) -> str:
        fixed = [sys.executable, str(self.root / script), str(self.out), *args]
        return shlex.join([literal(arg) for arg in fixed]) + " {port} {worker_id} {host}"

    def spawner(
        self, command: str, *, count: int = 1, stop_timeout_s: float = 5.0, **kwargs: Any
    ) -> Spawner:
        spec = SpawnSpec(command, count, base_port=9001, stop_timeout_s=stop_timeout_s)
        spawner = Spawner(
            spec, control_address="unix:/run/test/control.sock", on_exit=self.on_exit, **kwargs
        )
        self.spawners.append(spawner)
        return spawner

    def on_exit(self, worker: SpawnedWorker, returncode: int | None) -> None:
        self.exits.append((worker.worker_id, returncode))
        self.exit_times.append(time.monotonic())
        if self.fail_on_exit:
            raise RuntimeError("on_exit callback broke")

    def records(self, worker_id: str | None = None) -> list[dict[str, Any]]:
        pattern = f"{worker_id}-*.json" if worker_id else "*.json"
        found = [json.loads(path.read_text()) for path in self.out.glob(pattern)]
        return sorted(found, key=lambda record: str(record["env"]["EPISODE_ROUTER_WORKER_ID"]))

    async def wait_records(self, count: int, worker_id: str | None = None) -> list[dict[str, Any]]:
        await eventually(lambda: len(self.records(worker_id)) >= count)
        return self.records(worker_id)

    def launches(self) -> int:
        path = self.out / "launches"
        return len(path.read_text().splitlines()) if path.exists() else 0

    async def close(self) -> None:
        for spawner in self.spawners:
            await asyncio.wait_for(spawner.stop(), 15)
        pids = [int(p.name[3:].split(".")[0]) for p in self.out.glob("gc-*.ready")]
        pids += [record["pid"] for record in self.records()]
        for pid in pids:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


@pytest.fixture
def orphans_stay_zombies() -> Iterator[list[int]]:
    """Make this process adopt orphans and never reap them, like a router running as PID 1.

    Yields a list the test fills with the pids it expects to adopt; they are reaped at the end.
    """
    if not sys.platform.startswith("linux"):
        pytest.skip("child subreapers are a Linux feature")
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())
    adopted: list[int] = []
    try:
        yield adopted
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for pid in adopted:
            if is_running(pid):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):  # it never became ours
                os.waitpid(pid, 0)


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    made = Harness(tmp_path)
    try:
        yield made
    finally:
        await made.close()


# -- pure: plan_workers, SpawnSpec --------------------------------------------------------------


def test_plan_workers_numbers_ids_and_consecutive_ports() -> None:
    spec = SpawnSpec("serve --port {port}", count=3, base_port=9001)
    assert plan_workers(spec) == (
        SpawnedWorker("w0", 9001, "http://127.0.0.1:9001"),
        SpawnedWorker("w1", 9002, "http://127.0.0.1:9002"),
        SpawnedWorker("w2", 9003, "http://127.0.0.1:9003"),
    )


def test_plan_workers_brackets_an_ipv6_host_in_the_url() -> None:
    spec = SpawnSpec("serve", count=1, base_port=65535, host="::1")
    assert plan_workers(spec) == (SpawnedWorker("w0", 65535, "http://[::1]:65535"),)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"count": 0}, "count must be an integer of at least 1"),
        ({"count": True}, "count must be an integer"),
        ({"base_port": 0}, "base_port must be a port"),
        ({"base_port": 65536}, "base_port must be a port"),
        ({"base_port": 65535, "count": 2}, "run past 65535"),
        ({"host": ""}, "bare host"),
        ({"host": "127.0.0.1 --evil"}, "bare host"),
        ({"host": "[::1]"}, "bare host"),
        ({"stop_timeout_s": 0}, "must be positive"),
        ({"stop_timeout_s": float("nan")}, "must be positive"),
        ({"stop_timeout_s": float("inf")}, "must be finite"),
    ],
)
def test_spawn_spec_rejects_values_that_cannot_work(changes: dict[str, Any], message: str) -> None:
    fields: dict[str, Any] = {"command": "serve", "count": 1, "base_port": 9001, **changes}
    with pytest.raises(ValueError, match=message):
        SpawnSpec(**fields)


# -- pure: render_command -----------------------------------------------------------------------


def render(
    template: str, worker: SpawnedWorker | None = None, host: str = "127.0.0.1"
) -> list[str]:
    spec = SpawnSpec(template, count=1, base_port=9001, host=host)
    return render_command(spec, worker or plan_workers(spec)[0])


def test_render_command_fills_every_placeholder() -> None:
    assert render("python -m srv --port {port} --id={worker_id} --listen {host}:{port}") == [
        "python",
        "-m",
        "srv",
        "--port",
        "9001",
        "--id=w0",
        "--listen",
        "127.0.0.1:9001",
    ]


def test_the_env_and_the_folder_are_rendered_for_each_worker() -> None:
    spec = SpawnSpec(
        "/venv/bin/python app.py",
        count=2,
        base_port=9001,
        cwd="/srv/{worker_id}",
        env=(("CONFIG", "host: {host}\nport: {port}\n"), ("NAME", "w-{index}")),
        register="probe",
    )
    first, second = plan_workers(spec)
    assert spec.probed
    assert render_cwd(spec, second) == "/srv/w1"
    assert render_env(spec, first) == {"CONFIG": "host: 127.0.0.1\nport: 9001\n", "NAME": "w-0"}
    assert render_env(spec, second)["NAME"] == "w-1"
    assert render_command(spec, first) == ["/venv/bin/python", "app.py"]
    assert render_cwd(SpawnSpec("srv {port}", 1, 9001), first) is None
    with pytest.raises(ValueError, match="register must be hello or probe"):
        SpawnSpec("srv {port}", 1, 9001, register="never")


def test_render_command_keeps_a_quoted_argument_whole() -> None:
    assert render("""srv --name 'my worker {worker_id}' --flag "a b" c\\ d""") == [
        "srv",
        "--name",
        "my worker w0",
        "--flag",
        "a b",
        "c d",
    ]


def test_render_command_value_cannot_inject_arguments() -> None:
    worker = SpawnedWorker("w0 --evil 'x' ; rm", 9001, "http://127.0.0.1:9001")
    assert render("srv --id {worker_id} --port {port}", worker) == [
        "srv",
        "--id",
        "w0 --evil 'x' ; rm",
        "--port",
        "9001",
    ]


def test_render_command_honours_literal_braces_and_format_specs() -> None:
    assert render("srv {{json}} --port {port:06d} {host!r}") == [
        "srv",
        "{json}",
        "--port",
        "009001",
        "'127.0.0.1'",
    ]


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("srv --x {nope}", r"names \{nope\}; known: \{port\}, \{worker_id\}, \{host\}"),
        ("srv {}", r"names \{\}"),
        ("srv {0}", r"names \{0\}"),
        ("srv {port.real}", r"names \{port.real\}"),
        ("srv {host[0]}", r"names \{host\[0\]\}"),
        ("srv {port", "expected '}'"),
        ("srv port}", "Single '}'"),
        ("srv {port:{x}}", "'x'"),
        ("srv {host:d}", "Unknown format code"),
        ("srv 'unclosed", "cannot be split into arguments"),
        ("", "spawn command is empty"),
        ("   ", "spawn command is empty"),
    ],
)
def test_render_command_rejects_a_bad_template(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        render(template)


# -- pure: restart backoff ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("failures", "delay"),
    [
        (0, 0.0),
        (1, 0.5),
        (2, 1.0),
        (3, 2.0),
        (4, 4.0),
        (5, 8.0),
        (6, 10.0),
        (7, 10.0),
        (10**6, 10.0),
    ],
)
def test_restart_delay_table(failures: int, delay: float) -> None:
    assert restart_delay(failures) == delay


def test_restart_delay_rejects_a_negative_count() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        restart_delay(-1)


@pytest.mark.parametrize(
    ("failures", "ran_s", "expected"),
    [
        (0, None, (0.0, 1)),  # the first start failed: retried at once
        (1, None, (0.5, 2)),  # still cannot start: backs off
        (0, 0.2, (0.0, 1)),  # the first crash restarts at once
        (1, 0.2, (0.5, 2)),
        (4, 3.0, (4.0, 5)),
        (9, 10.0, (10.0, 10)),  # exactly 10 s is not yet a stable run
        (9, 10.5, (0.0, 1)),  # a run over 10 s starts the count over
    ],
)
def test_next_restart_counts_fast_failures(
    failures: int, ran_s: float | None, expected: tuple[float, int]
) -> None:
    assert next_restart(failures, ran_s) == expected


# -- Spawner set-up errors ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "kwargs", "message"),
    [
        ("srv {nope}", {}, r"names \{nope\}"),
        ("srv", {"extra_env": {"EPISODE_ROUTER_WORKER_ID": "x"}}, "set by the router itself"),
        ("srv", {"extra_env": {"A=B": "x"}}, "name 'A=B' is not valid"),
        ("srv", {"extra_env": {"": "x"}}, "name '' is not valid"),
        ("srv", {"extra_env": {"A": "x\0y"}}, "A contains a NUL byte"),
        ("srv", {"secret": "s\0"}, "secret contains a NUL byte"),
        ("srv", {"control_address": "unix:/x\0"}, "control address contains a NUL byte"),
    ],
)
def test_spawner_rejects_a_setup_that_cannot_start(
    command: str, kwargs: dict[str, Any], message: str
) -> None:
    spec = SpawnSpec(command, count=2, base_port=9001)
    arguments: dict[str, Any] = {"control_address": "unix:/c.sock", "on_exit": print, **kwargs}
    with pytest.raises(ValueError, match=message):
        Spawner(spec, **arguments)


def test_pid_is_none_before_start_and_for_an_unknown_worker() -> None:
    spawner = Spawner(
        SpawnSpec("srv", count=1, base_port=9001), control_address="unix:/c", on_exit=print
    )
    assert spawner.workers == (SpawnedWorker("w0", 9001, "http://127.0.0.1:9001"),)
    assert spawner.pid("w0") is None
    assert spawner.pid("w9") is None


# -- real processes -----------------------------------------------------------------------------


async def test_children_get_argv_environment_and_their_own_process_group(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SPAWN_TEST_INHERITED", "from-router")
    monkeypatch.setenv("EPISODE_ROUTER_STALE", "from-an-older-router")
    spawner = harness.spawner(
        harness.command("worker.py", "sleep"),
        count=2,
        secret="s3cret",
        extra_env={"SPAWN_TEST_EXTRA": "extra"},
    )
    await spawner.start()
    records = await harness.wait_records(2)

    for index, record in enumerate(records):
        worker_id, port = f"w{index}", 9001 + index
        assert record["argv"] == [str(port), worker_id, "127.0.0.1"]
        assert record["env"] == {
            "EPISODE_ROUTER_CONTROL": "unix:/run/test/control.sock",
            "EPISODE_ROUTER_WORKER_ID": worker_id,
            "EPISODE_ROUTER_WORKER_URL": f"http://127.0.0.1:{port}",
            "EPISODE_ROUTER_SECRET": "s3cret",
            "SPAWN_TEST_INHERITED": "from-router",
            "SPAWN_TEST_EXTRA": "extra",
        }
        assert spawner.pid(worker_id) == record["pid"]
        assert record["pgid"] == record["pid"] == os.getpgid(record["pid"])
        assert record["sid"] == record["pid"]
    assert os.getpgid(records[0]["pid"]) != os.getpgid(0)

    await spawner.stop()
    assert [is_running(record["pid"]) for record in records] == [False, False]
    assert (spawner.pid("w0"), spawner.pid("w1")) == (None, None)
    assert harness.exits == []


async def test_without_a_secret_the_child_sees_no_secret_at_all(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EPISODE_ROUTER_SECRET", "inherited-must-not-leak")
    spawner = harness.spawner(harness.command("worker.py", "sleep"))
    await spawner.start()
    [record] = await harness.wait_records(1)
    assert record["env"] == {
        "EPISODE_ROUTER_CONTROL": "unix:/run/test/control.sock",
        "EPISODE_ROUTER_WORKER_ID": "w0",
        "EPISODE_ROUTER_WORKER_URL": "http://127.0.0.1:9001",
    }


async def test_a_killed_worker_is_reported_then_restarted_with_a_new_pid(
    harness: Harness,
) -> None:
    spawner = harness.spawner(harness.command("worker.py", "sleep"), count=2)
    await spawner.start()
    first_w0, first_w1 = await harness.wait_records(2)

    killed_at = time.monotonic()
    os.kill(first_w1["pid"], signal.SIGKILL)
    await eventually(lambda: len(harness.records("w1")) == 2, within_s=3)
    restarted_in = time.monotonic() - killed_at

    [second_w1] = [r for r in harness.records("w1") if r["pid"] != first_w1["pid"]]
    assert restarted_in < 1.5
    assert harness.exits == [("w1", -signal.SIGKILL)]
    assert harness.exit_times[0] < second_w1["started_at"]  # reported before the restart
    assert not is_running(first_w1["pid"])
    assert spawner.pid("w1") == second_w1["pid"]
    assert os.getpgid(second_w1["pid"]) == second_w1["pid"]
    assert spawner.pid("w0") == first_w0["pid"]
    assert harness.records("w0") == [first_w0]

    await spawner.stop()
    assert not is_running(first_w0["pid"])
    assert not is_running(second_w1["pid"])
    assert harness.exits == [("w1", -signal.SIGKILL)]


async def test_a_worker_restarted_after_set_secret_gets_the_new_secret(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload rotates the control secret: the running worker keeps the one it started
    with, the process that replaces it must say hello with the new one."""
    spawner = harness.spawner(harness.command("worker.py", "sleep"), secret="old-secret")
    await spawner.start()
    [first] = await harness.wait_records(1)
    monkeypatch.setenv("SPAWN_TEST_LATE", "set-after-start")  # the start's environment stays

    spawner.set_secret("new-secret")
    os.kill(first["pid"], signal.SIGKILL)
    await eventually(lambda: len(harness.records("w0")) == 2, within_s=3)

    [second] = [r for r in harness.records("w0") if r["pid"] != first["pid"]]
    assert first["env"]["EPISODE_ROUTER_SECRET"] == "old-secret"
    assert second["env"] == {**first["env"], "EPISODE_ROUTER_SECRET": "new-secret"}
    with pytest.raises(ValueError, match="secret contains a NUL byte"):
        spawner.set_secret("bad\0secret")
    spawner.set_secret(None)
    os.kill(second["pid"], signal.SIGKILL)
    await eventually(lambda: len(harness.records("w0")) == 3, within_s=3)
    [third] = [r for r in harness.records("w0") if r["pid"] not in (first["pid"], second["pid"])]
    assert "EPISODE_ROUTER_SECRET" not in third["env"]


async def test_stop_ends_the_whole_group_and_waits_for_a_graceful_grandchild(
    harness: Harness,
) -> None:
    spawner = harness.spawner(harness.command("worker.py", "grandchild"), stop_timeout_s=5.0)
    await spawner.start()
    [record] = await harness.wait_records(1)
    grandchild = record["grandchild"]
    assert is_running(grandchild)
    assert os.getpgid(grandchild) == record["pid"]

    began = time.monotonic()
    await spawner.stop()
    took = time.monotonic() - began

    assert not is_running(record["pid"])
    assert not is_running(grandchild)
    # The grandchild finished its own SIGTERM handler (0.3 s) instead of being killed.
    assert (harness.out / f"gc-{grandchild}.clean").exists()
    assert 0.25 < took < 3.0
    assert spawner.pid("w0") is None
    assert harness.exits == []


async def test_stop_does_not_wait_for_zombies_that_nobody_reaps(
    orphans_stay_zombies: list[int], harness: Harness
) -> None:
    spawner = harness.spawner(harness.command("worker.py", "grandchild"), stop_timeout_s=5.0)
    await spawner.start()
    [record] = await harness.wait_records(1)
    grandchild = record["grandchild"]
    orphans_stay_zombies.append(grandchild)

    began = time.monotonic()
    await spawner.stop()
    took = time.monotonic() - began

    # The grandchild outlived its parent, was adopted here and is a zombie now.
    assert process_state(grandchild) == ("Z", os.getpid())
    assert (harness.out / f"gc-{grandchild}.clean").exists()
    assert 0.25 < took < 2.0  # not the 5 s stop timeout
    assert harness.exits == []


async def test_stop_kills_a_group_that_ignores_sigterm_after_the_timeout(
    harness: Harness,
) -> None:
    spawner = harness.spawner(harness.command("worker.py", "ignore-term"), stop_timeout_s=0.5)
    await spawner.start()
    [record] = await harness.wait_records(1)
    grandchild = record["grandchild"]

    began = time.monotonic()
    await spawner.stop()
    took = time.monotonic() - began

    assert 0.5 <= took < 3.0
    assert not is_running(record["pid"])
    assert not is_running(grandchild)
    assert not (harness.out / f"gc-{grandchild}.clean").exists()
    assert harness.exits == []


async def test_a_command_that_cannot_start_is_retried_with_growing_delays(
    harness: Harness,
) -> None:
    spawner = harness.spawner("no-such-command-for-spawn-tests --port {port}")
    await spawner.start()
    assert spawner.pid("w0") is None
    await eventually(lambda: len(harness.exits) >= 4, within_s=4)

    assert harness.exits[:4] == [("w0", None)] * 4
    t = harness.exit_times
    gaps = [t[1] - t[0], t[2] - t[1], t[3] - t[2]]
    assert gaps[0] < 0.3  # the first restart is immediate
    assert 0.45 <= gaps[1] < 1.0
    assert 0.95 <= gaps[2] < 1.6

    began = time.monotonic()
    await spawner.stop()  # now inside a 2 s delay: returns at once
    assert time.monotonic() - began < 0.3
    assert len(harness.exits) == 4


async def test_a_broken_on_exit_callback_does_not_stop_supervision(harness: Harness) -> None:
    harness.fail_on_exit = True
    spawner = harness.spawner("no-such-command-for-spawn-tests")
    await spawner.start()
    await eventually(lambda: len(harness.exits) >= 2, within_s=3)
    assert harness.exits[:2] == [("w0", None), ("w0", None)]


async def test_stop_during_a_restart_delay_does_not_restart(harness: Harness) -> None:
    spawner = harness.spawner(harness.command("crash.py"))
    await spawner.start()
    # The first crash restarts at once; the second waits 0.5 s, and stop() lands in that wait.
    await eventually(lambda: len(harness.exits) >= 2, within_s=3)
    assert harness.exits == [("w0", 3), ("w0", 3)]
    assert harness.launches() == 2

    began = time.monotonic()
    await spawner.stop()
    assert time.monotonic() - began < 0.3
    await asyncio.sleep(0.8)  # past the 0.5 s delay
    assert harness.exits == [("w0", 3), ("w0", 3)]
    assert harness.launches() == 2
    assert spawner.pid("w0") is None


async def test_start_runs_once_and_stop_is_idempotent(harness: Harness) -> None:
    spawner = harness.spawner(harness.command("worker.py", "sleep"))
    await spawner.start()
    with pytest.raises(RuntimeError, match="starts once"):
        await spawner.start()
    [record] = await harness.wait_records(1)
    await spawner.stop()
    await spawner.stop()
    assert not is_running(record["pid"])
    with pytest.raises(RuntimeError, match="not after stop"):
        await spawner.start()

    never_started = harness.spawner(harness.command("worker.py", "sleep"))
    await never_started.stop()
    assert never_started.pid("w0") is None
    assert harness.records() == [record]


# A previous run's worker behind a wrapper: listens on <port>, writes its pid to <out>, sleeps.
LISTENER_SCRIPT = """
import os, socket, sys, time

port, out = int(sys.argv[1]), sys.argv[2]
server = socket.create_server(("127.0.0.1", port))
with open(out + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(out + ".tmp", out)
time.sleep(60)
"""


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("lease_down_at_stop", [False, True])
async def test_stop_ends_an_adopted_worker_started_through_a_wrapper(
    harness: Harness, tmp_path: Path, lease_down_at_stop: bool
) -> None:
    """The pid on an adopted worker's control connection is the server, a child of the
    wrapper shell that leads the group: stopping signals that group, not a group
    numbered like the server's pid (there is none; the whole group would be left).
    With its control connection down when the router stops (a reconnect's backoff),
    the pid last seen on it is the one used."""
    (tmp_path / "listener.py").write_text(LISTENER_SCRIPT)
    port, pid_file = free_loopback_port(), tmp_path / "server.pid"
    lease_down = [False]
    listener = shlex.join([sys.executable, str(tmp_path / "listener.py"), str(port), str(pid_file)])
    # Started like a previous router started its workers: a session and group of its own.
    wrapper = await asyncio.create_subprocess_exec(
        "/bin/sh", "-c", f"{listener}; echo worker-ended", start_new_session=True
    )
    try:
        await eventually(pid_file.exists)
        server = int(pid_file.read_text())
        assert os.getpgid(server) == wrapper.pid != server
        spec = SpawnSpec("never-run {port}", count=1, base_port=port, stop_timeout_s=5.0)
        spawner = Spawner(
            spec,
            control_address="unix:/run/test/control.sock",
            on_exit=harness.on_exit,
            adopted_pid=lambda worker_id: None if lease_down[0] else server,
        )
        harness.spawners.append(spawner)
        await asyncio.wait_for(spawner.start(), 5)  # adopted: the port is served
        assert spawner.pid("w0") is None
        lease_down[0] = lease_down_at_stop

        await asyncio.wait_for(spawner.stop(), 10)

        assert not is_running(server), "the adopted server outlived stop()"
        assert await asyncio.wait_for(wrapper.wait(), 5) == -signal.SIGTERM
        assert harness.exits == []
    finally:
        if wrapper.returncode is None or is_running(server):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(wrapper.pid, signal.SIGKILL)  # the group it leads: ours
        await asyncio.wait_for(wrapper.wait(), 5)


async def test_stop_leaves_an_adopted_worker_that_already_exited_alone(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """A pid that no longer runs has no group to look up: nothing is signalled. The
    adoption is said as a warning, on the router's own logger (JSON with the rest)."""
    gone = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
    await asyncio.wait_for(gone.wait(), 5)
    with socket.create_server(("127.0.0.1", 0)) as held:  # something serves the port
        port = held.getsockname()[1]
        spec = SpawnSpec("never-run {port}", count=1, base_port=port, stop_timeout_s=5.0)
        spawner = Spawner(
            spec,
            control_address="unix:/run/test/control.sock",
            on_exit=harness.on_exit,
            adopted_pid=lambda worker_id: gone.pid,
        )
        harness.spawners.append(spawner)
        with caplog.at_level(logging.WARNING, logger="episode_router.spawn"):
            await asyncio.wait_for(spawner.start(), 5)
        await asyncio.wait_for(spawner.stop(), 5)
    assert harness.exits == []
    [adopting] = [r for r in caplog.records if "adopting the process there" in r.getMessage()]
    assert (adopting.name, adopting.levelno) == ("episode_router.spawn", logging.WARNING)
