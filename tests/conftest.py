"""Refuses to run the suite against a stale compiled build of the hot path.

An editable install compiles the hot modules beside their sources (setup.py), and
Python imports a compiled module before its source: after an edit, the tests would
run the old code and pass or fail for the wrong reason.
"""

from __future__ import annotations

import pytest

from router.build import stale_extensions


def pytest_sessionstart(session: pytest.Session) -> None:
    stale = stale_extensions()
    if stale:
        pytest.exit(
            f"the compiled build of {', '.join(stale)} is older than the source: "
            "build it again with `pip install -e .` (or remove the .so files)",
            returncode=4,
        )
