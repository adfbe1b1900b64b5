"""Which urls a worker may be reached at (design §3 "Who may say hello"):
`router.control.worker_urls` alone, then through a hello on the control session.

The unix socket rules run on real socket files under tmp_path, chowned where the
test runs as root (the confused deputy needs a router that can open what the
worker cannot).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from router.control.server import ControlServer
from router.control.session import ControlPolicy, ControlSession, Peer
from router.control.worker_urls import SocketFacts, url_refusal
from router.core.machine import CoreSettings, RouterCore
from router.protocol import UpstreamAddress, parse_upstream

FRIEND = 3000  # a uid control.allowed_uids lists


def _address(url: str) -> UpstreamAddress:
    address = parse_upstream(url)
    assert not isinstance(address, str)
    return address


def _refusal(url: str, **policy: object) -> str | None:
    args: dict[str, object] = {
        "allowed_upstreams": (),
        "own_listeners": (),
        "socket_dirs": (),
        "owners": frozenset({FRIEND}),
        "look_up": lambda path: SocketFacts(path, FRIEND),
    }
    args.update(policy)
    return url_refusal(_address(url), **args)  # type: ignore[arg-type]


LISTENERS = (
    UpstreamAddress("", "0.0.0.0", 8080),  # the public port, a wildcard bind
    UpstreamAddress("", "127.0.0.1", 9901),  # admin
    UpstreamAddress("", "::1", 7000),  # a tcp:// control socket
    UpstreamAddress("/run/router/control.sock", "", 0),  # a unix: control socket
)


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080",
        "http://127.0.0.2:8080",  # a wildcard bind takes all of 127/8
        "http://localhost:8080",
        "http://[::1]:8080",
        "http://127.0.0.1:9901",
        "http://LOCALHOST:9901",
        "http://[::1]:7000",
        "http://localhost:7000",
        "unix:/run/router/./control.sock",
    ],
)
def test_the_routers_own_listeners_are_refused_as_worker_urls(url: str) -> None:
    assert _refusal(url, own_listeners=LISTENERS) == (
        "The url is one of the router's own listeners."
    )


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8081", "http://127.0.0.2:9901", "http://127.0.0.1:7000"]
)
def test_other_ports_and_other_loopback_addresses_of_a_bound_one_are_not_the_routers(
    url: str,
) -> None:
    # 127.0.0.1:7000 is not [::1]:7000: two sockets (the address grammar, design §3).
    assert _refusal(url, own_listeners=LISTENERS) is None


def test_an_allowed_upstream_on_the_routers_wildcard_port_off_loopback_is_taken() -> None:
    # Names and interfaces are never looked up: only a loopback address is known local.
    allowed = ("http://10.0.0.7:8080",)
    assert (
        _refusal("http://10.0.0.7:8080", own_listeners=LISTENERS, allowed_upstreams=allowed) is None
    )
    assert _refusal("http://10.0.0.8:8080", own_listeners=LISTENERS) is not None


def test_a_unix_socket_must_be_the_workers_own_or_under_a_socket_dir() -> None:
    roots = lambda path: SocketFacts(path, 0)  # noqa: E731
    assert _refusal("unix:/run/w.sock") is None  # FRIEND's own
    assert "not the worker's own" in str(_refusal("unix:/run/w.sock", look_up=roots))
    assert _refusal("unix:/run/w/a.sock", look_up=roots, socket_dirs=("/run/w",)) is None
    assert _refusal("unix:/run/w/a.sock", look_up=roots, socket_dirs=("/run/w/",)) is None
    # A folder's name is not a prefix of another's.
    assert _refusal("unix:/run/wx/a.sock", look_up=roots, socket_dirs=("/run/w",)) is not None
    absent = lambda path: SocketFacts(path, None)  # noqa: E731
    assert "names no socket" in str(_refusal("unix:/run/w.sock", look_up=absent))


def test_a_link_out_of_a_socket_dir_is_judged_where_it_leads() -> None:
    leads_out = lambda path: SocketFacts("/root/admin.sock", 0)  # noqa: E731
    refused = _refusal("unix:/run/w/a.sock", look_up=leads_out, socket_dirs=("/run/w",))
    assert refused is not None


def test_over_tcp_a_unix_url_needs_a_socket_dir() -> None:
    assert "worker_socket_dirs" in str(_refusal("unix:/run/w.sock", owners=None))
    assert _refusal("unix:/run/w/a.sock", owners=None, socket_dirs=("/run/w",)) is None


# --- through a hello, on real socket files ------------------------------------------------


@pytest.fixture
def sockets(tmp_path: Path) -> Iterator[Path]:
    made: list[socket.socket] = []

    def bind(name: str) -> Path:
        path = tmp_path / name
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        made.append(sock)
        return path

    (tmp_path / "mine").mkdir()
    bind("root-only.sock").chmod(0o600)
    bind("mine/w.sock")
    yield tmp_path
    for sock in made:
        sock.close()


def _hello(peer: Peer, url: str, **policy: object) -> dict[str, object]:
    core = RouterCore(CoreSettings(kinds={"episode": False}, recovery_window_s=0.0), 0.0)
    control = ControlPolicy(
        os.getuid(), frozenset({FRIEND}), frozenset(), "s" * 16, "router-boot", **policy
    )  # type: ignore[arg-type]
    session = ControlSession(core, control, peer)
    message = {"op": "hello", "id": 1, "v": 1, "worker": "w0", "url": url, "boot": "b0"}
    if peer.tcp:
        message["auth"] = "s" * 16
    return session.handle(message, 0.0)


@pytest.mark.skipif(os.getuid() != 0, reason="chown needs root")
def test_a_worker_cannot_name_a_socket_only_the_router_may_open(sockets: Path) -> None:
    """The confused deputy: a uid listed in allowed_uids names a root-only socket."""
    os.chown(sockets / "mine" / "w.sock", FRIEND, FRIEND)
    friend = Peer(uid=FRIEND, tcp=False)
    refused = _hello(friend, f"unix:{sockets}/root-only.sock")
    assert refused["ok"] is False and refused["error"] == "forbidden"
    assert "not the worker's own" in str(refused["detail"])
    # Its own socket is fine; so is any socket under a configured folder.
    assert _hello(friend, f"unix:{sockets}/mine/w.sock")["ok"] is True
    dirs = (str(sockets),)
    assert _hello(friend, f"unix:{sockets}/root-only.sock", worker_socket_dirs=dirs)["ok"]


def test_a_socket_of_the_peers_own_uid_is_taken_and_a_missing_one_refused(
    sockets: Path,
) -> None:
    me = Peer(uid=os.getuid(), tcp=False)
    assert _hello(me, f"unix:{sockets}/mine/w.sock")["ok"] is True
    assert _hello(me, f"unix:{sockets}/gone.sock")["error"] == "forbidden"
    # Under the folder by its name, out of it where the link leads: refused.
    (sockets / "dir").mkdir()
    (sockets / "dir" / "out.sock").symlink_to(sockets / "root-only.sock")
    stranger = Peer(uid=FRIEND, tcp=False)
    dirs = (str(sockets / "dir"),)
    assert _hello(stranger, f"unix:{sockets}/dir/out.sock", worker_socket_dirs=dirs)["ok"] is False


def test_a_hello_naming_the_routers_public_port_is_forbidden() -> None:
    me = Peer(uid=os.getuid(), tcp=False)
    listeners = (UpstreamAddress("", "0.0.0.0", 8080),)
    reply = _hello(me, "http://localhost:8080", own_listeners=listeners)
    assert reply["error"] == "forbidden" and "own listeners" in str(reply["detail"])
    assert _hello(me, "http://localhost:8081", own_listeners=listeners)["ok"] is True


# --- the confused deputy, with a real peer of another uid --------------------------------


def _hello_as(uid: int, control_path: str, urls: list[str]) -> list[dict[str, object]]:
    """Say hello with each of `urls` from a forked process running as `uid` (its peer
    credentials are the kernel's, not a test's), one connection each; their replies."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no event loop, no pytest, only a socket
        code = 1
        try:
            os.close(read_end)
            os.setgid(uid)
            os.setuid(uid)
            replies = []
            for url in urls:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                    sock.settimeout(5)
                    sock.connect(control_path)
                    hello = {"op": "hello", "id": 1, "v": 1, "worker": "w0", "url": url}
                    sock.sendall(json.dumps({**hello, "boot": "b0"}).encode() + b"\n")
                    replies.append(sock.makefile("rb").readline().decode())
            os.write(write_end, json.dumps(replies).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    return [json.loads(line) for line in json.loads(data)]


def _deputy_folder() -> tuple[Path, list[socket.socket]]:
    """A folder the other uid may traverse (tmp_path's parents are mode 0700), with a
    socket only root may open and one of the friend's own."""
    folder = Path(tempfile.mkdtemp(prefix="episode-router-deputy-"))
    folder.chmod(0o711)
    made = []
    for name, owner in (("root-only.sock", 0), ("friend.sock", FRIEND)):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(folder / name))
        made.append(sock)
        os.chown(folder / name, owner, owner)
        (folder / name).chmod(0o600)
    return folder, made


@pytest.mark.skipif(os.getuid() != 0, reason="a peer of another uid needs root")
async def test_a_peer_of_an_allowed_uid_cannot_make_a_root_router_its_deputy() -> None:
    folder, made = _deputy_folder()
    try:
        core = RouterCore(CoreSettings(kinds={"episode": False}), time.monotonic())
        policy = ControlPolicy(0, frozenset({FRIEND}), frozenset(), None, "router-boot")
        server = ControlServer(core, policy, on_lease_lost=lambda _worker: None)
        control = str(folder / "control.sock")
        await server.start(f"unix:{control}")
        try:
            os.chmod(control, 0o666)  # the friend may connect
            urls = [f"unix:{folder}/root-only.sock", f"unix:{folder}/friend.sock"]
            deputy, own = await asyncio.to_thread(_hello_as, FRIEND, control, urls)
        finally:
            await server.close()
    finally:
        for sock in made:
            sock.close()
        shutil.rmtree(folder, ignore_errors=True)
    assert deputy["ok"] is False and deputy["error"] == "forbidden"
    assert "not the worker's own" in str(deputy["detail"])
    assert own["ok"] is True
