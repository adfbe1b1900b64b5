"""The README's promises: its first lines and its raw-protocol worker actually work."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest

from router.config import AdminConfig, ControlConfig, ListenConfig, default_config
from router.service import RouterService

README = Path(__file__).resolve().parent.parent / "README.md"


def code_block(language: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, f"expected one {language} block in the README"
    return str(blocks[0])


def test_first_lines_give_the_demo_and_the_test_command() -> None:
    head = README.read_text().splitlines()[:8]
    text = "\n".join(head)
    assert "episode-router demo" in text
    assert "python -m pytest" in text
    ci = (README.parent / ".ci" / "run").read_text()
    test_command = next(line for line in head if "pytest" in line).strip("`")
    # CI runs the README's own test command, as written there.
    assert test_command in ci


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
async def test_the_node_worker_from_the_readme_claims_an_episode(tmp_path: Path) -> None:
    script = tmp_path / "worker.js"
    script.write_text(code_block("js"))
    socket = tmp_path / "control.sock"
    config = dataclasses.replace(
        default_config(),
        listen=ListenConfig(host="127.0.0.1", port=0),
        admin=AdminConfig(host="127.0.0.1", port=0),
        control=ControlConfig(socket=f"unix:{socket}"),
    )
    service = RouterService(config)
    await service.start()
    node = await asyncio.create_subprocess_exec(
        "node", str(script), str(socket), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert node.stdout is not None
        replies = []
        async with asyncio.timeout(10):
            while len(replies) < 3:
                replies.append(json.loads(await node.stdout.readline()))
        assert replies[0] == {"id": 1, "ok": True, "router": service.boot}
        assert replies[1] == {"id": 2, "ok": True, "accepted": 0, "refused": []}
        assert replies[2] == {"id": 3, "ok": True}
        claim = service.core.claims.lookup("episode", "ep7-a0")
        assert claim is not None and claim.worker == "node0"
    finally:
        node.kill()
        await node.wait()
        await service.stop()
