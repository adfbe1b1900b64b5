"""The `episode-router` command: check-config, token mint, status, demo banner."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from router.cli import demo_banner, demo_config, format_status, main
from router.tokens import SigningKey, parse_token
from tests.router_fixtures import Rig, open_rig


def test_check_config_accepts_the_example_and_names_what_it_read(
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = Path(__file__).resolve().parent.parent / "config" / "router.example.yaml"
    assert main(["check-config", str(example)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{example}: ok (listen 0.0.0.0:8080; kinds: episode")


def test_check_config_warns_of_what_a_valid_file_likely_gets_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    likely_wrong = tmp_path / "router.yaml"
    likely_wrong.write_text(
        "sessions:\n"
        "  - name: resources\n"
        "    cookie: {name: SimpleWeatherResourcesServer___single_tool}\n"
        "    seed: {method: POST, path: /seed, learn: {cookie: ResourcesServer___resources}}\n"
    )
    assert main(["check-config", str(likely_wrong)]) == 0  # valid: a warning, not an error
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{likely_wrong}: ok")
    assert lines[1].startswith("warning: sessions[0] (resources): the seed learns cookie")


@pytest.mark.parametrize("command", [["check-config"], ["run", "--config"]])
def test_a_config_path_that_is_a_fifo_is_refused_at_once(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "router.yaml"
    os.mkfifo(fifo)  # no writer: a blocking read would wait for ever
    assert main([*command, str(fifo)]) == 2
    err = capsys.readouterr().err
    assert err == f"episode-router: {fifo}: (file): cannot read: not a regular file (a FIFO)\n"


def test_check_config_refuses_a_bad_file_with_path_key_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: {port: 80800}\n")
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"episode-router: {bad}: listen.port: ")


def test_token_mint_signs_with_the_secret_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    secret = b"s" * 32
    monkeypatch.setenv("EPISODE_TOKEN_SECRET", secret.decode())
    assert main(["token", "mint", "--ep", "ep7", "--att", "2", "--ttl", "60"]) == 0
    minted = capsys.readouterr().out.strip()
    parsed = parse_token(minted, now=time.time(), verifier=SigningKey.hs256(secret).verifier())
    assert (parsed.key, parsed.exp is not None) == ("ep7-a2", True)


def test_token_mint_without_a_secret_says_its_key_is_random(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("EPISODE_TOKEN_SECRET", raising=False)
    assert main(["token", "mint", "--ep", "ep7"]) == 0
    captured = capsys.readouterr()
    assert parse_token(captured.out.strip(), now=time.time()).key == "ep7-a0"  # unverified
    assert "EPISODE_TOKEN_SECRET is not set: signed with a random key" in captured.err


def test_token_mint_refuses_a_bad_episode_id(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["token", "mint", "--ep", "bad id"]) == 2
    assert capsys.readouterr().err.startswith("episode-router: ")


def test_the_status_table_lines_up() -> None:
    table = format_status(
        [
            {"id": "w0", "state": "live", "draining": False, "claims": 3, "in_flight": 0,
             "pid": 41, "url": "http://127.0.0.1:9001"},
            {"id": "worker-10", "state": "lost", "draining": True, "claims": 12, "in_flight": 1,
             "pid": None, "url": "unix:/run/w.sock"},
        ]
    )  # fmt: skip
    assert table.splitlines() == [
        "id         state  draining  claims  in_flight  pid   url",
        "w0         live   False     3       0          41    http://127.0.0.1:9001",
        "worker-10  lost   True      12      1          None  unix:/run/w.sock",
    ]


def test_the_demo_needs_no_config_and_prints_working_commands(tmp_path: Path) -> None:
    config = demo_config(3, 8081, 9902, 19001, str(tmp_path / "c.sock"))
    assert config.spawn is not None and config.spawn.count == 3
    assert "-m router.demo --port {port} --worker-id {worker_id}" in config.spawn.command
    assert config.control.socket == f"unix:{tmp_path}/c.sock"
    banner = demo_banner(8081, 9902, 3)
    assert "curl -s -X POST http://127.0.0.1:8081/episodes" in banner
    assert "status --admin http://127.0.0.1:9902" in banner


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with open_rig(tmp_path) as rig:
        yield rig


async def test_status_reads_the_admin_api_of_a_running_router(
    rig: Rig, capsys: pytest.CaptureFixture[str]
) -> None:
    await rig.start_router()
    worker = await rig.add_worker("w0")
    await worker.claim("ep-a0")
    admin = f"http://127.0.0.1:{rig.router.admin_port}"
    code = await asyncio.to_thread(main, ["status", "--admin", admin, "--json"])
    assert code == 0
    views = json.loads(capsys.readouterr().out)["workers"]
    assert [(v["id"], v["state"], v["claims"]) for v in views] == [("w0", "live", 1)]
    code = await asyncio.to_thread(main, ["status", "--admin", admin])
    assert code == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:4] == ["w0", "live", "False", "1"]
    # A kind whose seed replies name no session is said loudly.
    rig.router.core.learn_missed("resources")
    code = await asyncio.to_thread(main, ["status", "--admin", admin])
    assert code == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("warning: 1 seed reply named no session where kind 'resources' looks")


def test_status_says_when_the_router_cannot_be_reached(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--admin", "http://127.0.0.1:1"]) == 1
    assert "cannot read http://127.0.0.1:1/admin/workers" in capsys.readouterr().err
