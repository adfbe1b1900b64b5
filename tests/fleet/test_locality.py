"""The host a router names itself by (design §10, shape B): the same for every process
of one host and namespaces, another in a network namespace of its own."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from router.fleet.locality import host_identity


def test_one_host_and_namespaces_name_themselves_alike() -> None:
    here = host_identity()
    assert here and not any(c.isspace() for c in here)
    child = subprocess.run(
        [sys.executable, "-c", "from router.fleet.locality import host_identity as h; print(h())"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert child.stdout.strip() == here


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_network_namespace_of_its_own_is_another_host() -> None:
    command = [
        "unshare",
        "--net",
        sys.executable,
        "-c",
        "from router.fleet.locality import host_identity as h; print(h())",
    ]
    child = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if child.returncode != 0:
        pytest.skip(f"no network namespace here: {child.stderr.strip()[:200]}")
    other = child.stdout.strip()
    here = host_identity()
    assert other and other != here
    assert other.split("/")[0] == here.split("/")[0]  # the same machine's boot
