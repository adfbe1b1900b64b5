"""Where a forward goes: the destinations kept per worker and the public origin per Host."""

from __future__ import annotations

from router.app import destination as app_destination
from router.app.destination import destination, public_base
from router.core.machine import Forward
from router.core.workers import Worker, WorkerOrigin
from router.relay.wire import NO_EXTRA
from router.worker.boot import BOOT_HEADER


def _worker(worker_id: str = "w0", url: str = "http://127.0.0.1:9000") -> Worker:
    return Worker(worker_id, url, WorkerOrigin.CONTROL, now=0.0)


def test_the_public_origin_follows_each_host() -> None:
    # The last origin is reused while the Host is the same: a change is seen.
    for host in ["r.example:8080", "[::1]:8080", "r.example:8080", "r.example:8080", ""]:
        assert public_base(host) == f"http://{host}"


def test_a_destination_is_kept_while_the_workers_address_and_boot_stay() -> None:
    worker = _worker()
    upstream, extra, base = destination(Forward(worker, None, "b1"), "r.example")
    assert (upstream.worker_id, upstream.url) == ("w0", "http://127.0.0.1:9000")
    assert extra == {BOOT_HEADER: "b1"} and base == "http://r.example"
    again, _, _ = destination(Forward(worker, "s1", "b1"), "r.example")
    assert again is upstream


def test_a_new_boot_or_address_builds_the_destination_again() -> None:
    worker = _worker("w1")
    first, _, _ = destination(Forward(worker, None, "b1"), "h")
    reborn, extra, _ = destination(Forward(worker, None, "b2"), "h")
    assert reborn is not first and extra == {BOOT_HEADER: "b2"}
    worker.url = "http://127.0.0.1:9001"
    moved, _, _ = destination(Forward(worker, None, "b2"), "h")
    assert moved is not reborn and moved.url == "http://127.0.0.1:9001"


def test_a_worker_without_a_boot_gets_no_added_header() -> None:
    _, extra, _ = destination(Forward(_worker("static"), None, None), "h")
    assert extra is NO_EXTRA


def test_the_kept_destinations_cannot_grow_past_their_bound() -> None:
    for n in range(app_destination.MAX_KEPT_DESTINATIONS + 5):
        destination(Forward(_worker(f"gone-{n}"), None, None), "h")
    assert len(app_destination._DESTINATIONS) <= app_destination.MAX_KEPT_DESTINATIONS
