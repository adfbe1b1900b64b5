"""What a router publishes of its workers for the routers on its host (design §10, shape
B), as its workers come, go and change process: pure, no event loop."""

from __future__ import annotations

from router.core import Worker, WorkerOrigin, WorkerState
from router.directory.records import encode_worker
from router.fleet.worker_table import PublishedWorkers, published_value, worker_reference


def hello(worker_id: str = "w0", boot: str | None = "b0") -> Worker:
    return Worker(worker_id, "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, boot)


def test_only_a_worker_that_said_hello_with_its_boot_is_published() -> None:
    worker = hello()
    assert worker_reference(worker) == "0/w0"
    assert published_value(worker) == encode_worker("http://127.0.0.1:9001", "b0")
    static = Worker("s0", "http://127.0.0.1:9002", WorkerOrigin.STATIC, 0.0)
    journal = Worker("j0", "http://127.0.0.1:9003", WorkerOrigin.JOURNAL, 0.0, "b1")
    for unpublished in (static, journal, hello(boot=None)):
        assert worker_reference(unpublished) == "" and published_value(unpublished) == ""
    for state in (WorkerState.LOST, WorkerState.EXITED):
        worker.state = state
        assert published_value(worker) == ""  # withdrawn: its keys go through its router
    worker.state = WorkerState.UNHEALTHY
    assert published_value(worker) != ""  # its sessions go on


def test_changes_wait_once_each_and_only_what_differs_is_written() -> None:
    table = PublishedWorkers()
    worker = hello()
    assert table.changed(worker)
    assert table.take() == [("0/w0", encode_worker("http://127.0.0.1:9001", "b0"))]
    assert not table.changed(worker)  # nothing new: no write
    worker.state = WorkerState.LOST
    assert table.changed(worker)
    worker.state = WorkerState.LIVE  # back before the write went out: nothing to write
    assert not table.changed(worker)
    assert table.take() == []
    assert len(table) == 1


def test_a_new_process_withdraws_its_predecessor_under_a_reference_of_its_own() -> None:
    table = PublishedWorkers()
    worker = hello()
    table.changed(worker)
    table.take()
    worker.generation += 1  # a hello with a new boot
    worker.boot = "b1"
    table.changed(worker)
    assert sorted(table.take()) == [
        ("0/w0", ""),
        ("1/w0", encode_worker("http://127.0.0.1:9001", "b1")),
    ]
    assert len(table) == 1


def test_a_failed_write_waits_again_unless_a_later_change_supersedes_it() -> None:
    table = PublishedWorkers()
    one, two = hello("w1"), hello("w2")
    table.changed(one)
    table.changed(two)
    changes = table.take()
    two.state = WorkerState.LOST
    table.changed(two)  # a newer change of w2 waits already
    table.failed(changes)
    assert dict(table.take()) == {
        "0/w1": encode_worker("http://127.0.0.1:9001", "b0"),
        "0/w2": "",
    }


def test_a_new_incarnation_writes_every_worker_anew() -> None:
    table = PublishedWorkers()
    live, lost = hello("w1"), hello("w2")
    lost.state = WorkerState.LOST
    table.changed(live)
    table.take()
    table.restart([live, lost])
    assert table.take() == [("0/w1", encode_worker("http://127.0.0.1:9001", "b0"))]
