"""Pure tests for router.core.workers: lease states, what each allows, and balancing."""

from __future__ import annotations

import pytest

from router.core.workers import Worker, WorkerOrigin, WorkerRegistry, WorkerState

URL = "http://127.0.0.1:9001"


def worker(worker_id: str, *, state: WorkerState = WorkerState.LIVE, url: str = URL) -> Worker:
    made = Worker(worker_id, url, WorkerOrigin.CONTROL, 0.0, boot="b0")
    made.state = state
    return made


def registry(*workers: Worker) -> WorkerRegistry:
    found = WorkerRegistry()
    for each in workers:
        found.add(each)
    return found


def test_a_new_worker_is_live_not_draining_generation_zero() -> None:
    made = Worker("w0", URL, WorkerOrigin.STATIC, 7.0)
    assert (made.id, made.url, made.origin, made.boot) == ("w0", URL, WorkerOrigin.STATIC, None)
    assert (made.state, made.draining, made.generation, made.in_flight) == (
        WorkerState.LIVE,
        False,
        0,
        0,
    )
    assert (made.last_heard, made.lost_since, made.lease) == (7.0, None, None)
    assert repr(made) == f"Worker(w0 live {URL})"


@pytest.mark.parametrize(
    ("state", "draining", "accepts", "forwardable"),
    [
        (WorkerState.LIVE, False, True, True),
        (WorkerState.LIVE, True, False, True),
        (WorkerState.UNHEALTHY, False, False, True),
        (WorkerState.LOST, False, False, True),
        (WorkerState.EXITED, False, False, False),
        (WorkerState.EXITED, True, False, False),
    ],
)
def test_what_each_state_allows(
    state: WorkerState, draining: bool, accepts: bool, forwardable: bool
) -> None:
    made = worker("w0", state=state)
    made.draining = draining
    assert (made.accepts_new_sessions, made.forwardable) == (accepts, forwardable)


def test_registry_lookups() -> None:
    w0, w1 = worker("w0"), worker("w1", url="unix:/tmp/w1.sock")
    found = registry(w0, w1)
    assert (len(found), found.get("w0"), found.get("w1"), found.get("w2")) == (2, w0, w1, None)
    assert list(found) == [w0, w1]
    assert (found.by_url(URL), found.by_url("unix:/tmp/w1.sock")) == (w0, w1)
    assert found.by_url("http://127.0.0.1:9999") is None


def test_iterating_is_over_a_copy_so_adding_while_iterating_is_safe() -> None:
    found = registry(worker("w0"))
    for index, each in enumerate(found):
        found.add(worker(f"{each.id}-{index}"))
    assert [w.id for w in found] == ["w0", "w0-0"]


def test_add_with_a_known_id_replaces_the_record() -> None:
    old, new = worker("w0"), worker("w0", url="http://127.0.0.1:9002")
    found = registry(old)
    found.add(new)
    assert (len(found), found.get("w0")) == (1, new)


def test_by_url_ignores_exited_workers() -> None:
    gone = worker("w0", state=WorkerState.EXITED)
    found = registry(gone)
    assert found.by_url(URL) is None
    lost = worker("w1", state=WorkerState.LOST)
    found.add(lost)
    assert found.by_url(URL) is lost


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ((), False),
        ((WorkerState.LIVE,), True),
        ((WorkerState.UNHEALTHY, WorkerState.LOST, WorkerState.EXITED), False),
        ((WorkerState.EXITED, WorkerState.LIVE), True),
    ],
)
def test_any_live_counts_only_live_workers(states: tuple[WorkerState, ...], expected: bool) -> None:
    found = registry(*(worker(f"w{i}", state=s) for i, s in enumerate(states)))
    assert found.any_live() is expected


def test_pick_prefers_fewest_recent_sessions_then_in_flight_then_claims_then_lowest_id() -> None:
    w0, w1, w2 = worker("w0"), worker("w1"), worker("w2")
    found = registry(w2, w1, w0)  # insertion order must not matter
    claims = {"w0": 3, "w1": 1, "w2": 1}
    w1.in_flight, w2.in_flight = 5, 2
    assert found.pick(claims.__getitem__) is w0  # no recent sessions, none in flight

    w0.in_flight = 2
    assert found.pick(claims.__getitem__) is w2  # in flight tied: fewer claims

    w1.in_flight = 2
    assert found.pick(claims.__getitem__) is w1  # all else tied: the lowest id

    w1.recent = 1
    w2.recent_before = 1
    assert found.pick(claims.__getitem__) is w0  # recent sessions come first
    w0.in_flight = 100
    assert found.pick(claims.__getitem__) is w0  # ... before in flight
    w0.recent_before = 2
    assert found.pick(claims.__getitem__) is w1  # w0 used 2 lately; w1 and w2 tie: lowest id


def test_a_worker_forgets_its_recent_sessions_a_window_at_a_time() -> None:
    w0 = worker("w0")
    w0.recent = 3
    w0.roll_window(1)
    assert (w0.recent, w0.recent_before, w0.recent_sessions) == (0, 3, 3)
    w0.recent = 1
    w0.roll_window(1)
    assert (w0.recent, w0.recent_before, w0.recent_sessions) == (0, 1, 1)
    w0.recent = 5
    w0.roll_window(2)  # two windows passed: what was recent is not any more
    assert w0.recent_sessions == 0


@pytest.mark.parametrize(
    "unfit",
    ["draining", WorkerState.UNHEALTHY, WorkerState.LOST, WorkerState.EXITED],
    ids=str,
)
def test_pick_skips_workers_that_take_no_new_sessions(unfit: str | WorkerState) -> None:
    best, other = worker("w0"), worker("w1")
    if unfit == "draining":
        best.draining = True
    else:
        assert isinstance(unfit, WorkerState)
        best.state = unfit
    found = registry(best, other)
    claims = {"w0": 0, "w1": 50}
    assert found.pick(claims.__getitem__) is other
    other.draining = True
    assert found.pick(claims.__getitem__) is None


def test_pick_honours_exclude_and_returns_none_when_nobody_is_left() -> None:
    w0, w1 = worker("w0"), worker("w1")
    found = registry(w0, w1)
    no_claims = {"w0": 0, "w1": 0}.__getitem__
    assert found.pick(no_claims) is w0
    assert found.pick(no_claims, frozenset({"w0"})) is w1
    assert found.pick(no_claims, frozenset({"w0", "w1"})) is None
    assert WorkerRegistry().pick(no_claims) is None
