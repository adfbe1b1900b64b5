"""Pure tests for router.core.machine: routing decisions, leases, grace, recovery and static probes.

Each test is a playbook: steps against one core with a fake clock, asserting each
outcome and the whole state (claims, tombstones, workers, retirements) after it.
"""

from __future__ import annotations

from dataclasses import replace

from router.core.answers import Answer
from router.core.claims import ClaimRefusal, SyncResult
from router.core.machine import (
    ACTIVE_WINDOW_S,
    MAX_EXITED_WORKERS,
    CoreSettings,
    Forward,
    RouterCore,
)
from router.core.workers import WorkerOrigin
from tests.playbook import (
    CONFLICTS,
    Ans,
    At,
    Balance,
    C,
    Claim,
    Drain,
    Expect,
    Fwd,
    Learn,
    Lose,
    Playbook,
    Probe,
    R,
    Register,
    Release,
    Retire,
    Route,
    Sync,
    Tick,
    Ticked,
    W,
)

STATIC = WorkerOrigin.STATIC
JOURNAL = WorkerOrigin.JOURNAL
U0, U1, U2 = (f"http://127.0.0.1:900{i}" for i in range(3))

SETTINGS = CoreSettings(
    kinds={"episode": False, "open": True},  # "open": unknown keys are forwarded
    lease_timeout_s=15.0,
    reconnect_grace_s=5.0,
    tombstone_ttl_s=100.0,
    max_tombstones=1000,
    recovery_window_s=30.0,
    learned_idle_ttl_s=50.0,
    health_failures=2,
)


def started(settings: CoreSettings = SETTINGS) -> Playbook:
    """A core whose recovery window (none at all) ended with its first tick at t=0."""
    book = Playbook(replace(settings, recovery_window_s=0.0))
    return book.run([(Tick(), Ticked(recovery_ended=True))])


def two_workers() -> Playbook:
    """w0 (boot b0) holds ep1 and ep2; s0 (static) holds ep3; recovery is over."""
    return started().run(
        [
            (Register("w0", U0, boot="b0"), None, {W("w0"): "live"}),
            (Register("s0", U1, STATIC), None, {W("s0"): "live static"}),
            (Claim("w0", "ep1"), None, {C("ep1"): "held w0"}),
            (Claim("w0", "ep2"), None, {C("ep2"): "held w0"}),
            (Claim("s0", "ep3"), None, {C("ep3"): "held s0"}),
        ]
    )


# -- routing ---------------------------------------------------------------------


def test_held_keys_are_forwarded_to_their_worker_with_its_boot() -> None:
    two_workers().run(
        [
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
            (Route("ep3"), Fwd("s0", "ep3", None)),  # static workers have no boot
            # Kinds are separate: "open" has no ep1, and balances unknown keys.
            (Route("ep1", "open"), Fwd("s0", "ep1", None)),
        ]
    )


def test_tombstones_and_unknown_keys_get_the_answers_table() -> None:
    two_workers().run(
        [
            (Release("w0", "ep1"), True, {C("ep1"): "ended w0"}),
            (Route("ep1"), Ans("episode_ended", "ep1")),
            (Retire("s0"), 1, {W("s0"): "exited static", C("ep3"): "exited s0", R("s0"): 1}),
            (Route("ep3"), Ans("worker_exited", "ep3")),
            (Route("never"), Ans("unknown_episode", "never")),
            (Route("ep2", "no-such-kind"), Ans("unknown_episode", "ep2")),
            (Route("ep2"), Fwd("w0", "ep2", "b0")),
        ]
    )


def test_requests_without_a_session_are_balanced() -> None:
    two_workers().run(
        [
            # s0 holds one claim, w0 two: the fewest claims wins.
            (Route(None, None), Fwd("s0", None, None)),
            (Route(None), Fwd("s0", None, None)),
            (Route("k", None), Fwd("s0", None, None)),
            (Claim("s0", "ep4"), None, {C("ep4"): "held s0"}),
            (Route(None, None), Fwd("s0", None, None)),  # 2 each: the lowest id
            (Claim("s0", "ep5"), None, {C("ep5"): "held s0"}),
            (Route(None, None), Fwd("w0", None, "b0")),
            (Balance(frozenset({"w0"})), Fwd("s0", None, None)),
            (Balance(frozenset({"w0", "s0"})), Ans("no_worker", None, 1.0)),
        ]
    )


def test_in_flight_breaks_ties_between_workers_with_as_many_claims() -> None:
    book = started().run(
        [
            (Register("w0", U0, boot="b0"), None, {W("w0"): "live"}),
            (Register("w1", U1, boot="b0"), None, {W("w1"): "live"}),
            (Route(None, None), Fwd("w0", None, "b0")),
        ]
    )
    book.worker("w0").in_flight = 3
    book.run([(Route(None, None), Fwd("w1", None, "b0"))])


def test_unknown_keys_of_a_forwarding_kind_are_balanced_but_tombstones_still_answer() -> None:
    two_workers().run(
        [
            (Route("fresh", "open"), Fwd("s0", "fresh", None)),
            (Claim("w0", "mine", "open"), None, {C("mine", "open"): "held w0"}),
            (Route("mine", "open"), Fwd("w0", "mine", "b0")),
            (Release("w0", "mine", "open"), True, {C("mine", "open"): "ended w0"}),
            (Route("mine", "open"), Ans("episode_ended", "mine")),
        ]
    )


def test_no_fit_worker_is_503_no_worker_but_held_keys_still_forward() -> None:
    two_workers().run(
        [
            (Drain("w0"), None, {W("w0"): "live draining"}),
            (Probe("s0", "timeout"), True, {W("s0"): "unhealthy static"}),
            (Route(None, None), Ans("no_worker", None, 1.0)),
            (Route("fresh", "open"), Ans("no_worker", "fresh", 1.0)),
            # A draining worker's episodes go on; so do an unhealthy one's.
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
            (Route("ep3"), Fwd("s0", "ep3", None)),
            (Drain("w0", on=False), None, {W("w0"): "live"}),
            (Route(None, None), Fwd("w0", None, "b0")),
        ]
    )


def test_no_worker_at_all() -> None:
    started().run(
        [
            (Route(None, None), Ans("no_worker", None, 1.0)),
            (Route("k", "open"), Ans("no_worker", "k", 1.0)),
            (Route("k"), Ans("unknown_episode", "k")),
        ]
    )


def test_conflicting_claims_are_counted() -> None:
    two_workers().run(
        [
            (Claim("s0", "ep1"), ClaimRefusal("conflict", "w0"), {CONFLICTS: 1}),
            (Claim("w0", "ep1"), None),
            (Claim("w0", "ep3"), ClaimRefusal("conflict", "s0"), {CONFLICTS: 2}),
            (Release("w0", "ep3"), False),
            (Route("ep3"), Fwd("s0", "ep3", None)),
        ]
    )


# -- recovery --------------------------------------------------------------------


def test_recovery_answers_503_for_unknown_keys_until_the_window_ends() -> None:
    Playbook(SETTINGS).run(
        [
            (Register("w0", U0, boot="b0"), None, {W("w0"): "live"}),
            (Claim("w0", "ep1"), None, {C("ep1"): "held w0"}),
            (Release("w0", "ep2"), True, {C("ep2"): "ended w0"}),
            At(12.0),
            (Route("ep9"), Ans("recovering", "ep9", 18.0)),
            # What the router knows is answered as usual, sessionless requests balanced.
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
            (Route("ep2"), Ans("episode_ended", "ep2")),
            (Route(None, None), Fwd("w0", None, "b0")),
            (Tick(), Ticked()),
            At(29.999),
            (Route("ep9"), Ans("recovering", "ep9", 30.0 - 29.999)),
            At(30.0),
            (Tick(), Ticked(recovery_ended=True)),
            (Route("ep9"), Ans("unknown_episode", "ep9")),
            At(31.0),
            (Tick(), Ticked()),
        ]
    )


def test_recovery_also_ends_when_a_request_arrives_after_the_window() -> None:
    Playbook(SETTINGS).run(
        [
            At(45.0),
            (Route("ep9"), Ans("unknown_episode", "ep9")),
        ]
    )


def test_recovery_ends_early_once_every_expected_worker_synced_or_was_probed() -> None:
    Playbook(SETTINGS).run(
        [
            (Register("s0", U0, STATIC), None, {W("s0"): "live static"}),
            (Register("s1", U1, STATIC), None, {W("s1"): "live static"}),
            (Expect("s0"), None),
            (Expect("s1"), None),
            (Expect("w0"), None),
            At(1.0),
            (Probe("s0", "ok"), False),
            (Probe("s1", "refused", failures=1), False),  # not yet a verdict
            (Probe("s1", "timeout"), True, {W("s1"): "unhealthy static"}),  # nor this
            (Route("ep9"), Ans("recovering", "ep9", 29.0)),
            (Probe("s1", "refused", failures=2), True, {W("s1"): "exited static", R("s1"): 1}),
            (Route("ep9"), Ans("recovering", "ep9", 29.0)),
            (Register("w0", U2, boot="b0"), None, {W("w0"): "live"}),
            (Claim("w0", "ep1"), None, {C("ep1"): "held w0"}),
            (Route("ep9"), Ans("recovering", "ep9", 29.0)),  # a claim is not a sync
            At(2.0),
            (Sync("w0", (("episode", "ep1"),)), SyncResult(1, (), 0)),
            (Route("ep9"), Ans("unknown_episode", "ep9")),
            (Tick(), Ticked()),
        ]
    )


def test_recovery_never_ends_early_when_nobody_is_expected() -> None:
    Playbook(SETTINGS).run(
        [
            (Register("w0", U0, boot="b0"), None, {W("w0"): "live"}),
            (Sync("w0", ()), SyncResult(0, (), 0)),
            (Route("ep9"), Ans("recovering", "ep9", 30.0)),
            At(30.0),
            (Route("ep9"), Ans("unknown_episode", "ep9")),
        ]
    )


def test_a_sync_from_an_unexpected_worker_does_not_end_recovery() -> None:
    Playbook(SETTINGS).run(
        [
            (Expect("w0"), None),
            (Register("w1", U1, boot="b0"), None, {W("w1"): "live"}),
            (Sync("w1", ()), SyncResult(0, (), 0)),
            (Route("ep9"), Ans("recovering", "ep9", 30.0)),
        ]
    )


def journaled() -> Playbook:
    """A router restarted with two journaled workers (j0 and j1) and their learned claims."""
    return Playbook(SETTINGS).run(
        [
            (Register("j0", U0, JOURNAL, boot="b0"), None, {W("j0"): "live journal"}),
            (Lose("j0"), None, {W("j0"): "lost journal"}),
            (Register("j1", U1, JOURNAL, boot="b1"), None, {W("j1"): "live journal boot=b1"}),
            (Lose("j1"), None, {W("j1"): "lost journal boot=b1"}),
            (Expect("j0"), None),
            (Expect("j1"), None),
            (Learn("j0", "a"), None, {C("a"): "held j0 learned"}),
            (Learn("j1", "b"), None, {C("b"): "held j1 learned"}),
        ]
    )


def test_journaled_workers_not_back_when_the_window_ends_are_retired() -> None:
    journaled().run(
        [
            (Route("a"), Fwd("j0", "a", "b0")),  # still forwarded, with its old boot
            (Route(None, None), Ans("no_worker", None, 1.0)),
            At(10.0),
            (Tick(), Ticked()),  # the reconnect grace does not apply to them
            (Register("j0", U0, boot="b0"), None, {W("j0"): "live"}),
            (Sync("j0", ()), SyncResult(0, (), 1), {C("a"): "ended j0 learned"}),
            (Route("zzz"), Ans("recovering", "zzz", 20.0)),  # j1 is still expected
            At(30.0),
            (
                Tick(),
                Ticked(exited=("j1",), recovery_ended=True),
                {W("j1"): "exited journal boot=b1", C("b"): "exited j1 learned", R("j1"): 1},
            ),
            (Route("b"), Ans("worker_exited", "b")),
            (Tick(), Ticked()),
        ]
    )


def test_after_the_window_requests_get_401_and_the_next_tick_retires_journaled_workers() -> None:
    # A request past the window is answered as the window is over, but changes
    # nothing: only tick ends the window, so it reports what ending it did.
    journaled().run(
        [
            At(30.0),
            (Route("zzz"), Ans("unknown_episode", "zzz")),
            (
                Tick(),
                Ticked(exited=("j0", "j1"), recovery_ended=True),
                {
                    W("j0"): "exited journal",
                    W("j1"): "exited journal boot=b1",
                    C("a"): "exited j0 learned",
                    C("b"): "exited j1 learned",
                    R("j0"): 1,
                    R("j1"): 1,
                },
            ),
        ]
    )


def test_journaled_workers_back_with_their_boot_keep_their_claims() -> None:
    journaled().run(
        [
            (Register("j0", U0, boot="b0"), None, {W("j0"): "live"}),
            (Register("j1", U1, boot="b1"), None, {W("j1"): "live boot=b1"}),
            (Sync("j0", (("episode", "a"),)), SyncResult(1, (), 0)),
            (Sync("j1", (("episode", "b"),)), SyncResult(1, (), 0)),
            (Route("zzz"), Ans("unknown_episode", "zzz")),
            (Route("a"), Fwd("j0", "a", "b0")),
            (Route("b"), Fwd("j1", "b", "b1")),
            At(30.0),
            (Tick(), Ticked()),
        ]
    )


def test_a_journaled_worker_back_with_a_new_boot_loses_its_old_claims() -> None:
    journaled().run(
        [
            (
                Register("j0", U0, boot="new"),
                None,
                {W("j0"): "live g1 boot=new", C("a"): "exited j0 learned", R("j0"): 1},
            ),
            (Route("a"), Ans("worker_exited", "a")),
        ]
    )


# -- leases ----------------------------------------------------------------------


def test_a_lost_lease_is_forwarded_to_until_the_grace_ends_then_exits() -> None:
    two_workers().run(
        [
            At(10.0),
            (Lose("w0"), None, {W("w0"): "lost"}),
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
            (Balance(frozenset({"s0"})), Ans("no_worker", None, 1.0)),
            (Lose("w0"), None),  # losing again changes nothing (lost_since stays)
            At(14.999),
            (Tick(), Ticked()),
            At(15.0),
            (
                Tick(),
                Ticked(exited=("w0",)),
                {W("w0"): "exited", C("ep1"): "exited w0", C("ep2"): "exited w0", R("w0"): 1},
            ),
            (Route("ep1"), Ans("worker_exited", "ep1")),
            (Claim("s0", "ep1"), ClaimRefusal("worker_exited")),
            (Lose("w0"), None),
            At(30.0),
            (Tick(), Ticked()),
        ]
    )


def test_a_same_boot_register_within_the_grace_restores_the_worker_with_its_claims() -> None:
    two_workers().run(
        [
            At(10.0),
            (Lose("w0"), None, {W("w0"): "lost"}),
            At(14.0),
            (Register("w0", U0, boot="b0"), None, {W("w0"): "live"}),
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
            At(30.0),
            (Tick(), Ticked()),
        ]
    )


def test_a_new_boot_retires_the_old_claims_and_starts_a_new_generation() -> None:
    two_workers().run(
        [
            At(10.0),
            (Lose("w0"), None, {W("w0"): "lost"}),
            (
                Register("w0", U0, boot="b1"),
                None,
                {
                    W("w0"): "live g1 boot=b1",
                    C("ep1"): "exited w0",
                    C("ep2"): "exited w0",
                    R("w0"): 1,
                },
            ),
            (Route("ep1"), Ans("worker_exited", "ep1")),
            (Claim("w0", "ep1"), ClaimRefusal("worker_exited")),
            (Claim("w0", "ep4"), None, {C("ep4"): "held w0"}),
            (Route("ep4"), Fwd("w0", "ep4", "b1")),
            At(30.0),
            (Tick(), Ticked()),
        ]
    )


def test_a_silent_lease_is_lost_after_the_lease_timeout() -> None:
    started().run(
        [
            (Register("w0", U0, boot="b0"), None, {W("w0"): "live"}),
            (Register("w1", U1, boot="b0"), None, {W("w1"): "live"}),
            (Claim("w0", "ep1"), None, {C("ep1"): "held w0"}),
            At(14.999),
            (Tick(leased=("w0",)), Ticked()),
            At(15.0),
            (Tick(leased=("w0",)), Ticked(lost=("w0",)), {W("w0"): "lost"}),
            (Tick(leased=("w0",)), Ticked()),  # already lost: reported once
            (Route("ep1"), Fwd("w0", "ep1", "b0")),
            At(20.0),
            (
                Tick(leased=()),
                Ticked(exited=("w0",)),
                {W("w0"): "exited", C("ep1"): "exited w0", R("w0"): 1},
            ),
            At(90.0),
            (Tick(leased=()), Ticked()),  # w1's lease is not checked: never silent
        ]
    )


def test_lose_applies_to_live_and_unhealthy_workers_only() -> None:
    two_workers().run(
        [
            (Probe("s0", "timeout"), True, {W("s0"): "unhealthy static"}),
            (Lose("s0"), None, {W("s0"): "lost static"}),
            (
                Retire("w0"),
                2,
                {W("w0"): "exited", C("ep1"): "exited w0", C("ep2"): "exited w0", R("w0"): 1},
            ),
            (Lose("w0"), None),
        ]
    )


def test_on_retire_is_called_once_per_retirement() -> None:
    two_workers().run(
        [
            (
                Retire("w0"),
                2,
                {W("w0"): "exited", C("ep1"): "exited w0", C("ep2"): "exited w0", R("w0"): 1},
            ),
            (Lose("w0"), None),
            At(50.0),
            (Tick(), Ticked()),
            # The same boot after an exit is a new generation, not a restore.
            (Register("w0", U0, boot="b0"), None, {W("w0"): "live g1"}),
            (Claim("w0", "ep5"), None, {C("ep5"): "held w0"}),
            (Retire("w0"), 1, {W("w0"): "exited g1", C("ep5"): "exited w0", R("w0"): 2}),
        ]
    )


# -- static workers ----------------------------------------------------------------


def test_static_worker_exits_after_enough_refused_probes_and_comes_back_new() -> None:
    two_workers().run(
        [
            (Probe("s0", "ok"), False),
            (Probe("s0", "refused", failures=1), False),
            (Route("ep3"), Fwd("s0", "ep3", None)),
            (
                Probe("s0", "refused", failures=2),
                True,
                {W("s0"): "exited static", C("ep3"): "exited s0", R("s0"): 1},
            ),
            (Probe("s0", "refused", failures=3), False),
            (Route("ep3"), Ans("worker_exited", "ep3")),
            (Probe("s0", "ok"), True, {W("s0"): "live static g1"}),
            # Its old sessions stay 410; new ones are its own.
            (Route("ep3"), Ans("worker_exited", "ep3")),
            (Claim("s0", "ep3"), ClaimRefusal("worker_exited")),
            (Claim("s0", "ep4"), None, {C("ep4"): "held s0"}),
            (Route("ep4"), Fwd("s0", "ep4", None)),
        ]
    )


def test_a_static_worker_that_times_out_is_unhealthy_until_a_probe_succeeds() -> None:
    two_workers().run(
        [
            (Probe("s0", "timeout"), True, {W("s0"): "unhealthy static"}),
            (Probe("s0", "timeout"), False),
            (Probe("s0", "refused", failures=1), False),
            (Route(None, None), Fwd("w0", None, "b0")),
            (Route("ep3"), Fwd("s0", "ep3", None)),
            (Probe("s0", "ok"), True, {W("s0"): "live static"}),
            (Route(None, None), Fwd("s0", None, None)),
        ]
    )


# -- expiry ------------------------------------------------------------------------


def test_tick_expires_tombstones_after_their_ttl() -> None:
    two_workers().run(
        [
            At(10.0),
            (Release("w0", "ep1"), True, {C("ep1"): "ended w0"}),
            At(109.999),
            (Tick(), Ticked()),
            At(110.0),
            (Tick(), Ticked(), {C("ep1"): None}),
            (Route("ep1"), Ans("unknown_episode", "ep1")),
        ]
    )


def test_tick_ends_idle_learned_claims_and_requests_keep_them_alive() -> None:
    two_workers().run(
        [
            (Learn("s0", "lc1"), None, {C("lc1"): "held s0 learned"}),
            (Learn("s0", "lc2"), None, {C("lc2"): "held s0 learned"}),
            At(30.0),
            (Route("lc2"), Fwd("s0", "lc2", None)),
            At(50.0),
            (Tick(), Ticked(), {C("lc1"): "ended s0 learned"}),
            (Route("lc1"), Ans("episode_ended", "lc1")),
            At(79.999),
            (Tick(), Ticked()),
            At(80.0),
            (Tick(), Ticked(), {C("lc2"): "ended s0 learned"}),
            At(1000.0),
            (Tick(), Ticked(), {C("lc1"): None, C("lc2"): None}),  # the tombstones expire
            (Route("ep1"), Fwd("w0", "ep1", "b0")),  # control claims never idle out
        ]
    )


def test_max_tombstones_bounds_memory_and_an_evicted_key_is_unknown() -> None:
    started(replace(SETTINGS, max_tombstones=2)).run(
        [
            (Register("w0", U0, boot="b0"), None, {W("w0"): "live"}),
            (Release("w0", "k1"), True, {C("k1"): "ended w0"}),
            At(1.0),
            (Release("w0", "k2"), True, {C("k2"): "ended w0"}),
            At(2.0),
            (Release("w0", "k3"), True, {C("k1"): None, C("k3"): "ended w0"}),
            (Route("k1"), Ans("unknown_episode", "k1")),
            (Route("k2"), Ans("episode_ended", "k2")),
        ]
    )


def test_a_removed_static_worker_is_forgotten_and_its_sessions_stay_410() -> None:
    core = RouterCore(SETTINGS, 0.0)  # recovering, waiting for both static workers
    s0 = core.register("s0", U0, STATIC, 0.0)
    s1 = core.register("s1", U1, STATIC, 0.0)
    core.expect("s0")
    core.expect("s1")
    assert core.claims.claim("episode", "ep3", "s1", 0.0) is None
    core.mark_recovered("s0", 1.0)
    assert core.recovering(1.0)

    core.remove(s1, 2.0)

    assert [w.id for w in core.workers] == ["s0"]
    assert not core.recovering(2.0)  # no longer waits for the worker it forgot
    claim = core.claims.lookup("episode", "ep3")
    assert claim is not None and claim.state.value == "worker_exited"
    answer = core.route("episode", "ep3", 3.0)
    assert isinstance(answer, Answer) and answer.code == "worker_exited"
    assert core.probe_result(s1, "ok", 0, 4.0)  # a late probe's answer changes the object...
    picked = core.balance(None)
    assert isinstance(picked, Forward) and picked.worker is s0  # ...but brings nothing back


def test_only_the_latest_exited_workers_are_kept_and_their_sessions_stay_410() -> None:
    settings = replace(SETTINGS, recovery_window_s=0.0, max_tombstones=10_000)
    core = RouterCore(settings, 0.0)
    static = core.register("s0", U0, STATIC, 0.0)
    core.retire(static, 0.0)  # configured: kept whatever the count, probed to come back
    count = MAX_EXITED_WORKERS + 10
    for i in range(count):  # a pool whose every process had a fresh id
        worker = core.register(f"c{i}", U1, WorkerOrigin.CONTROL, 1.0, boot=f"b{i}")
        assert core.claims.claim("episode", f"ep{i}", worker.id, 1.0) is None
        core.retire(worker, 2.0)

    kept = {w.id for w in core.workers}
    assert kept == {"s0"} | {f"c{i}" for i in range(10, count)}
    for i in (0, count - 1):  # forgotten or kept, its sessions answer the same
        answer = core.route("episode", f"ep{i}", 3.0)
        assert isinstance(answer, Answer) and answer.code == "worker_exited"
    back = core.register("c0", U1, WorkerOrigin.CONTROL, 4.0, boot="new")
    assert back.state.value == "live" and len(core.workers) == MAX_EXITED_WORKERS + 2
    core.retire(core.workers.get("c10") or back, 5.0)  # c10 exits again: now the latest
    core.retire(back, 5.0)
    assert "c10" in {w.id for w in core.workers}
    assert "c11" not in {w.id for w in core.workers}  # the longest exited went instead


def test_balancing_weighs_sessions_used_lately_not_claims_nobody_uses() -> None:
    """design §4: a server that never closes keeps its claims for learned_idle_ttl_s;
    after a worker restarts, new sessions follow what is in use, and the restarted
    worker is not flooded for holding no old claims."""
    core = RouterCore(replace(SETTINGS, recovery_window_s=0.0), 0.0)
    core.tick(0.0)
    urls = [f"http://127.0.0.1:{9001 + i}" for i in range(4)]
    workers = [core.register(f"w{i}", urls[i], WorkerOrigin.CONTROL, 0.0, "b") for i in range(4)]
    for i in range(100):  # 25 sessions each, learned and used at the start
        assert core.learn(workers[i % 4], "open", f"old{i}", 1.0) is None
    core.retire(workers[3], 2.0)  # w3 restarts: its sessions end, it holds nothing now
    restarted = core.register("w3", urls[3], WorkerOrigin.CONTROL, 2.0, "b2")
    assert core.claims.held_count("w3") == 0 and core.claims.held_count("w0") == 25

    # While the others' sessions are in use, the idle restarted worker takes new ones.
    decision = core.balance(None)
    assert isinstance(decision, Forward) and decision.worker is restarted

    # Two activity windows later nobody used the old sessions: they weigh nothing, and
    # new sessions spread evenly.
    now = 2 * ACTIVE_WINDOW_S + 5.0
    core.tick(now)
    picks: dict[str, int] = {}
    for i in range(100):
        decision = core.balance(None)
        assert isinstance(decision, Forward)
        picks[decision.worker.id] = picks.get(decision.worker.id, 0) + 1
        assert core.learn(decision.worker, "open", f"new{i}", now) is None
    assert picks == {"w0": 25, "w1": 25, "w2": 25, "w3": 25}
    # A session in use counts once a window however many calls it makes.
    for _ in range(10):
        core.route("open", "new0", now + 1.0)
    assert [w.recent_sessions for w in workers[:3]] == [25, 25, 25]
