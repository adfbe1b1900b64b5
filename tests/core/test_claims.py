"""Pure tests for router.core.claims: held claims, tombstones, sync, expiry and the tombstone bound.

Every step asserts the table's whole state (`claims_snapshot` also checks that the
per-worker index, the counters and `lookup` agree with each other).
"""

from __future__ import annotations

from router.core.claims import ClaimRefusal, ClaimState, ClaimTable, SyncResult
from tests.playbook import C, claims_snapshot

TTL = 100.0
KEYS = [("episode", k) for k in ("a", "b", "c", "d", "e", "f", "g")] + [("mcp", "a")]


def new_table(*, max_tombstones: int = 1000) -> ClaimTable:
    return ClaimTable(tombstone_ttl_s=TTL, max_tombstones=max_tombstones)


def state(table: ClaimTable) -> dict[tuple[str, ...], object]:
    return claims_snapshot(table, KEYS)


def test_claim_then_reclaim_by_the_holder_is_idempotent_and_touches_it() -> None:
    table = new_table()
    assert table.claim("episode", "a", "w0", 1.0) is None
    assert state(table) == {C("a"): "held w0"}
    record = table.lookup("episode", "a")
    assert record is not None and (record.since, record.last_used) == (1.0, 1.0)

    assert table.claim("episode", "a", "w0", 5.0) is None
    assert state(table) == {C("a"): "held w0"}
    assert table.lookup("episode", "a") is record
    assert (record.since, record.last_used) == (1.0, 5.0)


def test_claim_of_a_key_another_worker_holds_is_a_conflict_naming_the_holder() -> None:
    table = new_table()
    table.claim("episode", "a", "w0", 1.0)
    assert table.claim("episode", "a", "w1", 2.0) == ClaimRefusal("conflict", "w0")
    assert state(table) == {C("a"): "held w0"}
    assert table.held_count("w1") == 0


def test_kinds_are_separate_namespaces() -> None:
    table = new_table()
    assert table.claim("episode", "a", "w0", 1.0) is None
    assert table.claim("mcp", "a", "w1", 1.0) is None
    assert state(table) == {C("a"): "held w0", C("a", "mcp"): "held w1"}
    assert table.lookup("other", "a") is None
    assert table.held_counts_by_kind() == {("w0", "episode"): 1, ("w1", "mcp"): 1}


def test_release_by_the_holder_leaves_an_ended_tombstone_that_refuses_reclaims() -> None:
    table = new_table()
    table.claim("episode", "a", "w0", 1.0)
    assert table.release("episode", "a", "w0", 2.0) is True
    assert state(table) == {C("a"): "ended w0"}
    assert (table.held_total, table.tombstone_count, table.held_by("w0")) == (0, 1, frozenset())

    # Idempotent: releasing again is fine and makes no second tombstone.
    assert table.release("episode", "a", "w0", 3.0) is True
    assert table.release("episode", "a", "w1", 3.0) is True
    assert state(table) == {C("a"): "ended w0"}
    assert table.tombstone_count == 1

    assert table.claim("episode", "a", "w0", 4.0) == ClaimRefusal("ended")
    assert table.claim("episode", "a", "w1", 4.0) == ClaimRefusal("ended")
    assert state(table) == {C("a"): "ended w0"}
    record = table.lookup("episode", "a")
    assert record is not None and record.since == 2.0


def test_release_by_another_worker_is_not_holder_and_changes_nothing() -> None:
    table = new_table()
    table.claim("episode", "a", "w0", 1.0)
    assert table.release("episode", "a", "w1", 2.0) is False
    assert state(table) == {C("a"): "held w0"}
    assert table.tombstone_count == 0


def test_release_of_an_unknown_key_makes_an_ended_tombstone() -> None:
    table = new_table()
    assert table.release("episode", "a", "w0", 1.0) is True
    assert state(table) == {C("a"): "ended w0"}
    assert table.held_count("w0") == 0
    assert table.claim("episode", "a", "w1", 2.0) == ClaimRefusal("ended")
    assert state(table) == {C("a"): "ended w0"}


def test_worker_exited_buries_all_its_claims_at_once_and_leaves_others_alone() -> None:
    table = new_table()
    table.claim("episode", "a", "w0", 1.0)
    table.claim("mcp", "a", "w0", 1.0)
    table.claim("episode", "b", "w1", 1.0)
    table.release("episode", "c", "w0", 1.0)
    assert state(table) == {
        C("a"): "held w0",
        C("a", "mcp"): "held w0",
        C("b"): "held w1",
        C("c"): "ended w0",
    }

    assert table.worker_exited("w0", 2.0) == 2
    assert state(table) == {
        C("a"): "exited w0",
        C("a", "mcp"): "exited w0",
        C("b"): "held w1",
        C("c"): "ended w0",
    }
    assert (table.held_total, table.tombstone_count) == (1, 3)

    assert table.claim("episode", "a", "w0", 3.0) == ClaimRefusal("worker_exited")
    assert table.claim("mcp", "a", "w2", 3.0) == ClaimRefusal("worker_exited")
    assert table.release("episode", "a", "w0", 3.0) is True
    assert table.worker_exited("w0", 3.0) == 0
    assert table.worker_exited("nobody", 3.0) == 0
    assert state(table) == {
        C("a"): "exited w0",
        C("a", "mcp"): "exited w0",
        C("b"): "held w1",
        C("c"): "ended w0",
    }
    assert table.tombstone_count == 3


def test_sync_replaces_the_workers_set_under_the_claim_rules() -> None:
    table = new_table()
    table.claim("episode", "a", "w0", 1.0)  # held, not listed: ends
    table.claim("episode", "b", "w0", 1.0)  # held and listed: kept
    table.claim("episode", "c", "w1", 1.0)  # another worker's: conflict
    table.release("episode", "d", "w0", 1.0)  # ended: refused
    table.claim("episode", "e", "w2", 1.0)
    table.worker_exited("w2", 1.0)  # exited: refused
    before = state(table)
    assert before == {
        C("a"): "held w0",
        C("b"): "held w0",
        C("c"): "held w1",
        C("d"): "ended w0",
        C("e"): "exited w2",
    }

    listed = [("episode", k) for k in ("f", "e", "d", "c", "b", "b")]
    result = table.sync("w0", listed, 2.0)

    assert result == SyncResult(
        accepted=2,  # b (again) and f (new)
        refused=(
            ("episode", "c", ClaimRefusal("conflict", "w1")),
            ("episode", "d", ClaimRefusal("ended")),
            ("episode", "e", ClaimRefusal("worker_exited")),
        ),
        ended=1,
    )
    assert state(table) == {
        C("a"): "ended w0",
        C("b"): "held w0",
        C("c"): "held w1",
        C("d"): "ended w0",
        C("e"): "exited w2",
        C("f"): "held w0",
    }
    assert table.held_count("w0") == 2


def test_empty_sync_ends_everything_the_worker_held() -> None:
    table = new_table()
    table.claim("episode", "a", "w0", 1.0)
    table.claim("mcp", "a", "w0", 1.0)
    table.claim("episode", "b", "w1", 1.0)
    assert table.sync("w0", [], 2.0) == SyncResult(0, (), 2)
    assert state(table) == {C("a"): "ended w0", C("a", "mcp"): "ended w0", C("b"): "held w1"}
    assert table.held_by("w0") == frozenset()


def test_sync_of_a_worker_that_held_nothing_claims_its_keys() -> None:
    table = new_table()
    assert table.sync("w0", [("episode", "a"), ("mcp", "a")], 1.0) == SyncResult(2, (), 0)
    assert state(table) == {C("a"): "held w0", C("a", "mcp"): "held w0"}


def test_tombstones_expire_at_exactly_the_ttl_and_the_key_becomes_unknown() -> None:
    table = new_table()
    table.release("episode", "a", "w0", 10.0)
    table.claim("episode", "b", "w0", 10.0)
    table.worker_exited("w0", 20.0)
    assert state(table) == {C("a"): "ended w0", C("b"): "exited w0"}

    assert table.expire(10.0 + TTL - 0.001) == 0
    assert state(table) == {C("a"): "ended w0", C("b"): "exited w0"}

    assert table.expire(10.0 + TTL) == 1
    assert state(table) == {C("b"): "exited w0"}
    assert table.lookup("episode", "a") is None

    assert table.claim("episode", "a", "w1", 111.0) is None
    assert state(table) == {C("a"): "held w1", C("b"): "exited w0"}

    assert table.expire(20.0 + TTL) == 1
    assert state(table) == {C("a"): "held w1"}
    assert table.expire(10_000.0) == 0  # held claims never expire this way
    assert state(table) == {C("a"): "held w1"}


def test_tombstone_bound_evicts_the_oldest_first() -> None:
    table = new_table(max_tombstones=2)
    table.release("episode", "a", "w0", 1.0)
    table.release("episode", "b", "w0", 2.0)
    assert state(table) == {C("a"): "ended w0", C("b"): "ended w0"}

    table.claim("episode", "c", "w0", 3.0)
    table.release("episode", "c", "w0", 3.0)
    assert state(table) == {C("b"): "ended w0", C("c"): "ended w0"}
    assert table.tombstone_count == 2

    # The evicted key is unknown again: it may be claimed.
    assert table.lookup("episode", "a") is None
    assert table.claim("episode", "a", "w1", 4.0) is None
    assert state(table) == {C("a"): "held w1", C("b"): "ended w0", C("c"): "ended w0"}


def test_worker_exited_past_the_bound_keeps_only_the_newest_tombstones() -> None:
    table = new_table(max_tombstones=2)
    table.release("episode", "a", "w0", 1.0)
    for key in ("b", "c", "d"):
        table.claim("episode", key, "w1", 2.0)
    assert table.worker_exited("w1", 3.0) == 3
    snapshot = state(table)
    assert table.tombstone_count == 2
    assert C("a") not in snapshot
    assert list(snapshot.values()) == ["exited w1", "exited w1"]
    forgotten = [k for k in ("b", "c", "d") if C(k) not in snapshot]
    assert len(forgotten) == 1
    assert table.claim("episode", forgotten[0], "w2", 4.0) is None


def test_idle_learned_claims_end_after_the_idle_ttl_and_use_keeps_them() -> None:
    table = new_table()
    assert table.claim("episode", "a", "w0", 0.0, learned=True) is None
    assert table.claim("episode", "b", "w0", 0.0, learned=True) is None
    table.claim("episode", "c", "w0", 0.0)  # a control claim: never idles out
    record = table.lookup("episode", "b")
    assert record is not None
    table.touch(record, 50.0)
    assert state(table) == {
        C("a"): "held w0 learned",
        C("b"): "held w0 learned",
        C("c"): "held w0",
    }

    assert len(table.expire_idle_learned(99.999, idle_ttl_s=100.0)) == 0
    assert len(table.expire_idle_learned(100.0, idle_ttl_s=100.0)) == 1
    assert state(table) == {
        C("a"): "ended w0 learned",
        C("b"): "held w0 learned",
        C("c"): "held w0",
    }
    assert table.claim("episode", "a", "w0", 101.0) == ClaimRefusal("ended")

    assert len(table.expire_idle_learned(150.0, idle_ttl_s=100.0)) == 1
    assert len(table.expire_idle_learned(10_000.0, idle_ttl_s=100.0)) == 0
    assert state(table) == {
        C("a"): "ended w0 learned",
        C("b"): "ended w0 learned",
        C("c"): "held w0",
    }
    ended = table.lookup("episode", "b")
    assert ended is not None and (ended.state, ended.since) == (ClaimState.ENDED, 150.0)


def test_readers_report_per_worker_counts() -> None:
    table = new_table()
    for key in ("a", "b"):
        table.claim("episode", key, "w0", 1.0)
    table.claim("mcp", "a", "w0", 1.0)
    table.claim("episode", "c", "w1", 1.0)
    assert (table.held_count("w0"), table.held_count("w1"), table.held_count("w9")) == (3, 1, 0)
    assert table.held_total == 4
    assert {(c.kind, c.key) for c in table.held_by("w0")} == {
        ("episode", "a"),
        ("episode", "b"),
        ("mcp", "a"),
    }
    assert table.held_counts_by_kind() == {
        ("w0", "episode"): 2,
        ("w0", "mcp"): 1,
        ("w1", "episode"): 1,
    }
    assert list(table.tombstones()) == []


def test_counts_by_kind_add_up_plain_learned_and_linked_claims_of_one_kind() -> None:
    table = new_table()
    table.claim("episode", "a", "w0", 1.0)
    table.claim("episode", "b", "w0", 1.0, learned=True)
    table.claim("mcp", "b", "w0", 1.0, learned=True)
    table.claim("episode", "c", "w1", 1.0, learned=True)
    b, mcp_b = table.lookup("episode", "b"), table.lookup("mcp", "b")
    assert b is not None and mcp_b is not None
    b.siblings, mcp_b.siblings = (mcp_b,), (b,)
    assert table.held_counts_by_kind() == {
        ("w0", "episode"): 2,
        ("w0", "mcp"): 1,
        ("w1", "episode"): 1,
    }


def test_siblings_given_to_one_claim_leave_the_others_of_its_kind_alone() -> None:
    table = new_table()
    for key in ("a", "b"):
        table.claim("episode", key, "w0", 1.0, learned=True)
    table.claim("episode", "c", "w0", 1.0)
    table.claim("mcp", "a", "w0", 1.0, learned=True)
    a, b, c = (table.lookup("episode", key) for key in ("a", "b", "c"))
    mcp_a = table.lookup("mcp", "a")
    assert a is not None and b is not None and c is not None and mcp_a is not None

    a.siblings = (mcp_a,)
    assert (a.siblings, b.siblings, c.siblings, mcp_a.siblings) == ((mcp_a,), (), (), ())
    assert (a.kind, a.learned, c.kind, c.learned) == ("episode", True, "episode", False)

    table.release("episode", "a", "w0", 2.0)
    assert (a.state, a.siblings, a.kind, a.learned) == (ClaimState.ENDED, (mcp_a,), "episode", True)
    assert state(table) == {
        C("a"): "ended w0 learned",
        C("b"): "held w0 learned",
        C("c"): "held w0",
        C("a", "mcp"): "held w0 learned",
    }


def test_a_worker_releasing_most_of_its_claims_keeps_its_index_short_and_exact() -> None:
    table = new_table()
    keys = [("episode", f"k{i}") for i in range(200)]
    for _, key in keys:
        table.claim("episode", key, "w0", 1.0)
    table.claim("episode", "other", "w1", 1.0)
    for released, (_, key) in enumerate(keys[:190], start=1):
        assert table.release("episode", key, "w0", 2.0) is True
        assert table.held_count("w0") == 200 - released
        # Ended claims are dropped from the index once they outnumber the held
        # ones (plus a slack of 16): the index never keeps many dead records.
        assert len(table._held_by_worker["w0"].claims) <= 2 * (200 - released) + 16
    assert {c.key for c in table.held_by("w0")} == {f"k{i}" for i in range(190, 200)}
    snapshot = claims_snapshot(table, keys)  # checks index, counts and lookup agree
    assert sum(view == "held w0" for view in snapshot.values()) == 10

    for _, key in keys[190:]:
        table.release("episode", key, "w0", 3.0)
    assert (table.held_count("w0"), table.held_by("w0"), table.held_total) == (0, frozenset(), 1)
    assert "w0" not in table._held_by_worker


def test_learned_claims_that_ended_otherwise_are_not_expired_again() -> None:
    table = new_table()
    for key in ("a", "b"):
        table.claim("episode", key, "w0", 0.0, learned=True)
    table.claim("episode", "c", "w1", 0.0, learned=True)
    table.release("episode", "a", "w0", 1.0)
    assert table.worker_exited("w0", 2.0) == 1
    assert len(table.expire_idle_learned(10_000.0, idle_ttl_s=100.0)) == 1
    assert state(table) == {
        C("a"): "ended w0 learned",
        C("b"): "exited w0 learned",
        C("c"): "ended w1 learned",
    }
    since = [c.since for c in table.tombstones()]
    assert since == [1.0, 2.0, 10_000.0]
    assert len(table.expire_idle_learned(20_000.0, idle_ttl_s=100.0)) == 0
