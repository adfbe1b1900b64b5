"""What every fuzz target in this folder shares: atheris instrumentation, seeding the
corpus, and the replay mode that runs without atheris.

A target imports the router under `instrumented()` and ends with
`sys.exit(run(sys.argv, NAME, check, seeds))`. Run as scripts (`python
fuzz/fuzz_tokens.py`), the targets find this module beside them.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path


def instrumented() -> contextlib.AbstractContextManager[object]:
    """atheris' coverage instrumentation of the router's modules, when fuzzing."""
    if "--replay" in sys.argv:
        return contextlib.nullcontext()
    atheris = importlib.import_module("atheris")
    manager: contextlib.AbstractContextManager[object] = atheris.instrument_imports(
        include=["router"]
    )
    return manager


def run(
    argv: list[str], name: str, check: Callable[[bytes], None], seeds: Callable[[], list[bytes]]
) -> int:
    """Fuzz with atheris, or with --replay run the seeds and the given files once."""
    if "--replay" in argv:
        for data in [*seeds(), *(Path(a).read_bytes() for a in argv[1:] if a != "--replay")]:
            check(data)
        return 0
    corpora = [a for a in argv[1:] if not a.startswith("-")]
    if not corpora:
        corpora = [str(Path(tempfile.gettempdir()) / "episode-router-fuzz" / name)]
        argv = [*argv, corpora[0]]
    _seed(Path(corpora[0]), seeds)
    atheris = importlib.import_module("atheris")
    atheris.Setup(argv, check)
    atheris.Fuzz()  # libFuzzer exits the process itself
    return 0


def _seed(folder: Path, seeds: Callable[[], list[bytes]]) -> None:
    """Writes the seeds into an empty (or missing) corpus folder."""
    folder.mkdir(parents=True, exist_ok=True)
    if any(folder.iterdir()):
        return
    for index, data in enumerate(seeds()):
        (folder / f"seed-{index}").write_bytes(data)
