"""The layering of design §9, checked: the import contracts in pyproject.toml hold.

`lint-imports` (import-linter) reads the package's imports and checks each contract:
the parts import only the parts below them, the pure parts import no event loop, HTTP
stack, socket or I/O part, the edge never imports the relay or the app, and the worker
client imports only the shared wire contract. The checks below run it on the package
as it is, and on copies with one forbidden import added, to show that each contract
can fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(cwd: Path, package_parent: Path) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail(
            "lint-imports is not installed: install the test extra (pip install -e '.[test]')"
        )
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_import_contracts_hold() -> None:
    result = lint_imports(ROOT, ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("core/claims.py", "import asyncio", "The pure parts import no event loop"),
        ("sessions/reader.py", "import socket", "The pure parts import no event loop"),
        ("config/model.py", "import aiohttp", "The pure parts import no event loop"),
        ("protocol/control.py", "import router.control", "Each part imports only the parts"),
        ("edge/wire.py", "import router.relay.pool", "The edge never imports the relay"),
        ("worker/lines.py", "import router.core.claims", "The worker client imports only"),
        ("metrics/labels.py", "import router.app", "Each part imports only the parts"),
        ("directory/records.py", "import redis", "The pure parts import no event loop"),
        ("directory/meaning.py", "import asyncio", "The pure parts import no event loop"),
        ("directory/client.py", "import router.config", "Each part imports only the parts"),
    ],
)
def test_a_forbidden_import_breaks_a_contract(
    tmp_path: Path, module: str, line: str, broken: str
) -> None:
    shutil.copytree(ROOT / "router", tmp_path / "router", ignore=shutil.ignore_patterns("*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "router" / module
    target.write_text(target.read_text() + f"\n{line}  # added by the test\n")
    result = lint_imports(tmp_path, tmp_path)
    assert result.returncode != 0, result.stdout
    assert f"{broken}" in result.stdout.split("Broken contracts")[-1], result.stdout
