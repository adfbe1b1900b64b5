"""The README's promises: its first lines and its raw-protocol worker actually work."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest
from router_fixtures import free_port, open_rig, router_config, token

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
async def test_the_node_worker_from_the_readme_serves_its_episode(tmp_path: Path) -> None:
    script = tmp_path / "worker.js"
    script.write_text(code_block("js"))
    port = free_port()
    async with open_rig(tmp_path) as rig:
        service = await rig.start_router(router_config(tmp_path))
        control = rig.control_address.removeprefix("unix:")
        node = await asyncio.create_subprocess_exec(
            "node", str(script), control, str(port), stdout=asyncio.subprocess.PIPE
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

            routed = await rig.request("POST", "/tool", episode=token("ep7"))
            assert (routed.status, routed.json()) == (200, {"worker": "node0", "path": "/tool"})
            # Step 5: a request the router meant for another process of this id.
            stale_boot = {"X-Episode-Router-Boot": "old-boot"}
            async with rig.http.get(f"http://127.0.0.1:{port}/t", headers=stale_boot) as stale:
                assert stale.status == 410
                assert (await stale.json())["error"] == "worker_exited"
        finally:
            node.kill()
            await node.wait()
