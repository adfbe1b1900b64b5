"""The documentation's promises: the README's first lines, the worker guide's Node.js
worker, the links between the documents, and the design sections the code cites."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from pathlib import Path

import pytest

from bench.launch import free_port
from tests.router_fixtures import open_rig, router_config, token

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DESIGN = DOCS / "design.md"
WORKER_GUIDE = DOCS / "guides" / "writing-a-worker.md"
# Where the code cites the design document's sections.
CITING_FOLDERS = ("router", "tests", "bench", "fuzz", "stress")
CITING_SUFFIXES = frozenset({".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".js", ".sh"})

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", flags=re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", flags=re.M)
DESIGN_SECTION = re.compile(r"^## (\d+)\.\s", flags=re.M)
# "design §3", "design §4", and the sections listed after one: "design §1, §3 and §8".
CITATION = re.compile(r"design\s*§\s*(\d+)((?:\s*(?:,|and|or|/)\s*§\s*\d+)*)", flags=re.I)


def code_block(path: Path, language: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)
    assert len(blocks) == 1, f"expected one {language} block in {path.relative_to(ROOT)}"
    return str(blocks[0])


def documents() -> list[Path]:
    return [README, ROOT / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """The text without its code blocks and code spans, where links are not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor a heading gets, as GitHub makes it."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_first_lines_give_the_demo_and_the_test_command() -> None:
    lines = README.read_text().splitlines()
    assert lines[0] == "# episode-router"
    assert lines[1] == ""
    assert lines[2].startswith("Try it")
    demo = lines[3]
    assert demo.startswith("`") and demo.endswith("`")
    assert demo.strip("`").endswith("episode-router demo")
    test_line = next(i for i, line in enumerate(lines[:8]) if line.startswith("Run the whole"))
    test_command = lines[test_line + 1]
    assert test_command.startswith("`") and test_command.endswith("`")
    test_command = test_command.strip("`")
    # CI runs the README's own test command, as written there.
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in ci
    # And the script it names is in the repository.
    program, _, script = test_command.partition(" ")
    if program == "bash":
        assert (ROOT / script).is_file(), f"the README's test command runs {script}: missing"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
async def test_the_node_worker_from_the_worker_guide_serves_its_episode(tmp_path: Path) -> None:
    script = tmp_path / "worker.js"
    script.write_text(code_block(WORKER_GUIDE, "js"))
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


def test_every_relative_link_in_the_documentation_leads_somewhere() -> None:
    broken = []
    for document in documents():
        for target in LINK.findall(prose(document.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            linked = (document.parent / path).resolve() if path else document
            where = f"{document.relative_to(ROOT)}: {target}"
            if not linked.exists() or not linked.is_relative_to(ROOT):
                broken.append(f"{where} (no such file)")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_design_has_the_sections_the_code_cites() -> None:
    sections = {int(number) for number in DESIGN_SECTION.findall(DESIGN.read_text())}
    assert sections >= set(range(1, 11)), sorted(sections)
    missing = []
    for folder in CITING_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in CITING_SUFFIXES or "__pycache__" in path.parts:
                continue
            text = path.read_text(errors="replace")
            for match in CITATION.finditer(text):
                cited = [int(match[1]), *map(int, re.findall(r"\d+", match[2]))]
                line = text.count("\n", 0, match.start()) + 1
                missing += [
                    f"{path.relative_to(ROOT)}:{line}: §{number}"
                    for number in cited
                    if number not in sections
                ]
    assert not missing, "design sections cited but not in docs/design.md:\n" + "\n".join(missing)
