"""The state journal: what one run writes, the next one replays to the same state."""

from __future__ import annotations

import json
from pathlib import Path

from router.core.claims import ClaimState
from router.core.machine import CoreSettings, RouterCore
from router.core.workers import WorkerOrigin, WorkerState
from router.service.journal import COMPACT_MIN_LINES, COMPACT_RETRY_S, JournalFile, replay, snapshot

SETTINGS = CoreSettings(kinds={"episode": False}, tombstone_ttl_s=100.0, recovery_window_s=30.0)
WALL0 = 1_800_000_000.0


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run_with_journal(
    path: Path, settings: CoreSettings = SETTINGS
) -> tuple[RouterCore, JournalFile]:
    core = RouterCore(settings, 0.0)
    journal = JournalFile(str(path), clock=Clock(WALL0))
    journal.compact(core, 0.0)
    core.journal = journal
    return core, journal


def state(core: RouterCore) -> dict[str, object]:
    """Everything the journal is meant to carry across a restart."""
    claims = {(c.kind, c.key): (c.worker, c.state.value) for c in core.claims.held()}
    claims |= {(c.kind, c.key): (c.worker, c.state.value) for c in core.claims.tombstones()}
    workers = {
        w.id: (w.url, w.boot, w.draining, w.state is WorkerState.EXITED) for w in core.workers
    }
    return {"claims": claims, "workers": workers}


def restart(path: Path, mono_now: float = 0.0, wall_now: float = WALL0) -> RouterCore:
    core = RouterCore(SETTINGS, mono_now)
    lines = JournalFile(str(path), clock=Clock(wall_now)).read()
    assert replay(core, lines, mono_now, wall_now) == []
    return core


def test_claims_releases_drains_and_exits_survive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    w1 = core.register("w1", "http://127.0.0.1:9002", WorkerOrigin.CONTROL, 0.0, "b1")
    w2 = core.register("w2", "http://127.0.0.1:9003", WorkerOrigin.CONTROL, 0.0, "b2")
    assert core.claim(w0, "episode", "a", 1.0) is None
    assert core.claim(w0, "episode", "b", 1.0) is None
    assert core.claim(w1, "episode", "c", 1.0) is None
    assert core.claim(w2, "episode", "d", 1.0) is None
    assert core.claim(w1, "episode", "a", 1.0) is not None  # conflict: not journaled as held
    assert core.release(w0, "episode", "b", 2.0)
    core.set_draining(w1, True)
    core.sync(w1, [("episode", "c"), ("episode", "e")], 3.0)
    core.retire(w2, 4.0)
    journal.close()

    replayed = restart(path)

    assert state(replayed) == state(core)
    assert replayed.claims.lookup("episode", "b").state is ClaimState.ENDED  # type: ignore[union-attr]
    assert replayed.claims.lookup("episode", "d").state is ClaimState.EXITED  # type: ignore[union-attr]
    back_w0 = replayed.workers.get("w0")
    assert back_w0 is not None
    assert (back_w0.origin, back_w0.state) == (WorkerOrigin.JOURNAL, WorkerState.LOST)
    exited_w2 = replayed.workers.get("w2")
    assert exited_w2 is not None and exited_w2.state is WorkerState.EXITED


def _drained_pair(core: RouterCore) -> None:
    """w0 drained itself over the control socket; an operator drained w1."""
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    w1 = core.register("w1", "http://127.0.0.1:9002", WorkerOrigin.CONTROL, 0.0, "b1")
    core.set_draining(w0, True, by_worker=True)
    core.set_draining(w1, True)


def _drains(core: RouterCore) -> dict[str, tuple[bool, bool]]:
    return {w.id: (w.draining, w.drained_by_worker) for w in core.workers}


def _new_boots(core: RouterCore) -> dict[str, bool]:
    """Both processes restarted (new boots): which workers are still draining."""
    core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 1.0, "b0-next")
    core.register("w1", "http://127.0.0.1:9002", WorkerOrigin.CONTROL, 1.0, "b1-next")
    return {w.id: w.draining for w in core.workers}


def test_who_drained_a_worker_survives_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    _drained_pair(core)
    journal.close()

    replayed = restart(path)

    assert _drains(replayed) == {"w0": (True, True), "w1": (True, False)}
    # The worker's own drain ends with its process; the operator's stays.
    assert _new_boots(replayed) == {"w0": False, "w1": True}


def test_who_drained_a_worker_survives_compaction(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    _drained_pair(core)
    journal.compact(core, 1.0)
    journal.close()

    replayed = restart(path)

    assert _drains(replayed) == {"w0": (True, True), "w1": (True, False)}
    assert _new_boots(replayed) == {"w0": False, "w1": True}


def test_a_drain_journaled_without_who_asked_replays_as_an_operators() -> None:
    lines = [
        b'{"op":"version","v":1,"t":1800000000.0}',
        b'{"op":"worker","id":"w0","url":"http://127.0.0.1:9001","boot":"b0","t":1800000000.0}',
        b'{"op":"drain","id":"w0","on":true,"t":1800000000.0}',
    ]
    core = RouterCore(SETTINGS, 0.0)
    assert replay(core, lines, 0.0, WALL0) == []

    assert _drains(core) == {"w0": (True, False)}
    assert _new_boots(core)["w0"] is True  # as before the field existed


def test_replayed_workers_are_expected_and_recovery_ends_when_they_sync(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    core.claim(w0, "episode", "a", 1.0)
    journal.close()

    replayed = restart(path, mono_now=500.0)
    assert replayed.recovering(500.0)
    assert replayed.route("episode", "zzz", 500.0).code == "recovering"  # type: ignore[union-attr]
    back = replayed.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 501.0, "b0")
    replayed.sync(back, [("episode", "a")], 501.0)
    assert not replayed.recovering(501.0)
    assert replayed.route("episode", "zzz", 501.0).code == "unknown_episode"  # type: ignore[union-attr]


def test_tombstone_ages_carry_over_in_wall_time(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    core.claim(w0, "episode", "old", 0.0)
    core.release(w0, "episode", "old", 0.0)  # written at wall WALL0
    journal.close()

    # 60 s of wall time later the tombstone is 60 s old: 40 s left of its 100 s TTL.
    replayed = restart(path, mono_now=7.0, wall_now=WALL0 + 60)
    assert replayed.claims.lookup("episode", "old") is not None
    replayed.claims.expire(7.0 + 39.0)
    assert replayed.claims.lookup("episode", "old") is not None
    replayed.claims.expire(7.0 + 40.0)
    assert replayed.claims.lookup("episode", "old") is None


def test_compaction_rewrites_a_snapshot_that_replays_to_the_same_state(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    for i in range(COMPACT_MIN_LINES // 2 + 10):
        core.claim(w0, "episode", f"k{i}", 1.0)
        core.release(w0, "episode", f"k{i}", 1.0)
    core.claim(w0, "episode", "live", 1.0)
    live = core.claims.held_total + core.claims.tombstone_count + len(core.workers)
    assert not journal.wants_compaction(10 * live)
    assert journal.wants_compaction(live // 10)
    journal.compact(core, 1.0)
    lines = path.read_bytes().splitlines()
    assert len(lines) == 1 + 1 + 1 + core.claims.tombstone_count  # version, worker, claim, tombs
    journal.close()
    assert state(restart(path)) == state(core)


def test_a_failed_compaction_keeps_appending_to_the_old_file_and_waits_to_retry(
    tmp_path: Path,
) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    for i in range(COMPACT_MIN_LINES + 1):
        core.claim(w0, "episode", f"k{i}", 1.0)
        core.release(w0, "episode", f"k{i}", 1.0)
    before = path.read_bytes()
    (tmp_path / "journal.tmp").mkdir()  # the snapshot cannot be written (as on a full disk)
    assert journal.wants_compaction(1, 10.0)

    assert journal.compact_during_run(core, 10.0) is False

    assert journal.compact_errors == 1
    assert path.read_bytes() == before  # the old file, untouched
    core.claim(w0, "episode", "after", 11.0)  # and still appended to
    assert path.read_bytes().splitlines()[-1].startswith(b'{"op":"claim"')
    assert b'"key":"after"' in path.read_bytes()
    assert not journal.wants_compaction(1, 10.0 + COMPACT_RETRY_S - 1)  # not every tick
    assert journal.wants_compaction(1, 10.0 + COMPACT_RETRY_S)

    (tmp_path / "journal.tmp").rmdir()
    assert journal.compact_during_run(core, 10.0 + COMPACT_RETRY_S) is True
    assert not (tmp_path / "journal.tmp").exists()
    assert len(path.read_bytes().splitlines()) < len(before.splitlines())  # the snapshot
    journal.close()
    assert state(restart(path)) == state(core)


def test_a_compaction_that_fails_midway_removes_its_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    (tmp_path / "journal").unlink()
    (tmp_path / "journal").mkdir()  # the rename over it fails, after the snapshot was written

    assert journal.compact_during_run(core, 1.0) is False

    assert journal.compact_errors == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal"]
    journal.close()


def test_a_torn_or_foreign_line_is_skipped_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    core.claim(w0, "episode", "a", 1.0)
    journal.close()
    with path.open("ab") as file:
        file.write(b'{"op":"claim","kind":"episode","key":"tor')  # a write cut short

    replayed = RouterCore(SETTINGS, 0.0)
    # A worker whose url no hello may give (a lone surrogate: no path to connect to).
    no_path = b'{"op":"worker","id":"w9","url":"unix:/tmp/w\\ud800.sock","boot":"b9"}'
    lines = [*path.read_bytes().splitlines(), b'{"op":"format-c:"}', b"[]", no_path]
    assert len(replay(replayed, lines, 0.0, WALL0)) == 4
    assert state(replayed) == state(core)


def test_snapshot_leaves_out_static_workers_and_exited_ones() -> None:
    core = RouterCore(SETTINGS, 0.0)
    core.register("s0", "http://127.0.0.1:9001", WorkerOrigin.STATIC, 0.0)
    gone = core.register("w1", "http://127.0.0.1:9002", WorkerOrigin.CONTROL, 0.0, "b1")
    core.claim(gone, "episode", "x", 0.0)
    core.retire(gone, 1.0)
    records = snapshot(core, WALL0, 1.0)
    assert [r["op"] for r in records] == ["version", "tomb"]
    assert records[1] | {"t": 0} == {
        "op": "tomb",
        "kind": "episode",
        "key": "x",
        "worker": "w1",
        "state": "worker_exited",
        "t": 0,
    }


def test_journal_lines_are_plain_json_one_per_change(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    w0 = core.register("w0", "unix:/run/w0.sock", WorkerOrigin.CONTROL, 0.0, "b0")
    core.claim(w0, "episode", "a", 1.0)
    journal.close()
    records = [json.loads(line) for line in path.read_bytes().splitlines()]
    assert [(r["op"], r.get("key")) for r in records] == [
        ("version", None),
        ("worker", None),
        ("claim", "a"),
    ]
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_learned_claim_in_use_before_a_restart_gets_a_whole_idle_ttl_after_it(
    tmp_path: Path,
) -> None:
    # Its uses are not journaled: read back, it would look idle since it was learned.
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    assert core.learn(w0, "episode", "cookie-1", 0.0) is None
    journal.close()
    ttl = SETTINGS.learned_idle_ttl_s

    replayed = restart(path, mono_now=2 * ttl, wall_now=WALL0 + 2 * ttl)
    replayed.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 2 * ttl, "b0")

    replayed.tick(2 * ttl + ttl / 2)
    claim = replayed.claims.lookup("episode", "cookie-1")
    assert claim is not None and claim.state is ClaimState.HELD
    replayed.tick(3 * ttl)
    assert claim.state is ClaimState.ENDED  # idle a whole TTL since the restart


def test_a_learned_claim_ended_for_idleness_stays_ended_after_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "journal"
    core, journal = run_with_journal(path)
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    assert core.learn(w0, "episode", "cookie-1", 0.0) is None
    core.tick(SETTINGS.learned_idle_ttl_s)
    assert core.claims.lookup("episode", "cookie-1").state is ClaimState.ENDED
    journal.close()

    replayed = restart(path, mono_now=1.0, wall_now=WALL0 + 1.0)

    claim = replayed.claims.lookup("episode", "cookie-1")
    assert claim is not None and claim.state is ClaimState.ENDED


def test_one_journal_is_taken_by_one_process_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "state" / "journal"
    first = JournalFile(str(path), clock=Clock(WALL0))
    first.lock()
    first.compact(RouterCore(SETTINGS, 0.0), 0.0)  # the file is replaced; the lock stays
    second = JournalFile(str(path), clock=Clock(WALL0))
    try:
        second.lock()
    except OSError as exc:
        assert "another router uses this journal" in str(exc) and str(path) in str(exc)
    else:
        raise AssertionError("a second lock on one journal was granted")
    first.close()
    second.lock()  # free again once its holder let go
    second.close()


def test_claims_one_seed_reply_taught_stay_one_session_after_a_restart(tmp_path: Path) -> None:
    settings = CoreSettings(kinds={"cookie": False, "token": False}, recovery_window_s=30.0)
    path = tmp_path / "journal"
    core, journal = run_with_journal(path, settings)
    w0 = core.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 0.0, "b0")
    for kind in ("cookie", "token"):
        assert core.learn(w0, kind, "s1", 0.0) is None
    core.link_learned([("cookie", "s1"), ("token", "s1")])
    journal.close()

    for compacted in (False, True):
        replayed = RouterCore(settings, 1.0)
        lines = JournalFile(str(path), clock=Clock(WALL0 + 1)).read()
        assert replay(replayed, lines, 1.0, WALL0 + 1) == []
        again = replayed.register("w0", "http://127.0.0.1:9001", WorkerOrigin.CONTROL, 1.0, "b0")
        assert replayed.release_learned(again, "cookie", "s1", 2.0)  # a close with the cookie
        token = replayed.claims.lookup("token", "s1")
        assert token is not None and token.state is ClaimState.ENDED, compacted
        if not compacted:  # the same, from the snapshot a start writes
            fresh = RouterCore(settings, 0.0)
            assert replay(fresh, lines, 0.0, WALL0) == []
            rewritten = JournalFile(str(path), clock=Clock(WALL0))
            rewritten.compact(fresh, 0.0)
            rewritten.close()
            assert b'"op":"link"' in path.read_bytes()


# --- a damaged journal never stops a start ----------------------------------------------

GOOD_LINES = [
    b'{"op":"version","v":1,"t":1800000000.0}',
    b'{"op":"worker","id":"w0","url":"http://127.0.0.1:9001","boot":"b0","t":1800000000.0}',
    b'{"op":"claim","kind":"episode","key":"a","worker":"w0","t":1800000000.0}',
]
DAMAGED = [
    (b"[" * 1000 + b"]" * 1000, "nested too deeply"),  # 2 KB that the parser recurses into
    (b'{"op":"claim","kind":' + b"[" * 100_000, "nested too deeply"),
    (b'{"op":"claim","kind":"episode","key":"\xff\xfe","worker":"w0"}', "not UTF-8"),
    (b'{"op":"claim","kind":"episode","key":"tor', "JSONDecodeError"),  # a torn last line
    (b'{"op":"claim","kind":1,"key":"b","worker":"w0"}', "`kind` must be a string"),
    (b'{"op":"claim","kind":"episode","key":["b"],"worker":"w0"}', "`key` must be"),
    (b'{"op":"claim","kind":"episode","key":"b","worker":"w0","t":1e400}', "not finite"),
    (b'{"op":"claim","kind":"episode","key":"b","worker":"w0","t":"soon"}', "`t` must be"),
    (b'{"op":"sync","worker":"w0","claims":[["episode"]]}', "`claims` must be"),
    (b'{"op":"sync","worker":"w0","claims":{"a":1}}', "`claims` must be"),
    (b'{"op":"link","claims":[[1,2]]}', "`claims` must be"),
    (b'{"op":"tomb","kind":"episode","key":"c","worker":"w0","state":"zombie"}', "zombie"),
    (b'{"op":"worker","id":{"x":1},"url":"http://127.0.0.1:1","boot":"b"}', "`id` must be"),
    (b'{"op":"worker","id":"w 1","url":"http://127.0.0.1:1","boot":"b"}', "not a worker id"),
    (b'{"op":"worker","id":"w1","url":"http://127.0.0.1:1","boot":["b"]}', "not a boot"),
    (b'{"op":"drain","id":7,"on":true}', "`id` must be"),
    (b'{"op":"claim","kind":"episode","key":"b"}', "no 'worker' field"),
    (b'{"op":' + b"9" * 5000 + b"}", "ValueError"),  # past Python's digit limit
    (b'{"op":{"x":1}}', "unknown journal op"),
    (b'"just a string"', "a record is an object"),
    (b"\x00\x01\x02", "JSONDecodeError"),
]


def test_every_damaged_line_is_skipped_by_number_and_reason_and_the_rest_replays() -> None:
    lines = [*GOOD_LINES]
    for damaged, _reason in DAMAGED:
        lines.append(damaged)
    lines.append(b'{"op":"claim","kind":"episode","key":"z","worker":"w0","t":1800000000.0}')
    replayed = RouterCore(SETTINGS, 0.0)

    skipped = replay(replayed, lines, 0.0, WALL0)

    assert [line.number for line in skipped] == list(range(4, 4 + len(DAMAGED)))
    for line, (damaged, reason) in zip(skipped, DAMAGED, strict=True):
        assert reason in line.reason, (damaged[:60], line.reason)
        assert len(line.reason) < 200
    # Everything before and after the damage is there.
    assert {c.key for c in replayed.claims.held_by("w0")} == {"a", "z"}
    assert replayed.workers.get("w1") is None


def test_a_journal_nested_a_thousand_deep_does_not_stop_a_start(tmp_path: Path) -> None:
    """The attacker's file: the router used to exit at start with RecursionError."""
    path = tmp_path / "journal"
    path.write_bytes(b"\n".join([*GOOD_LINES, b"[" * 1000 + b"]" * 1000]) + b"\n")
    replayed = RouterCore(SETTINGS, 0.0)
    lines = JournalFile(str(path), clock=lambda: WALL0).read()
    assert replay(replayed, lines, 0.0, WALL0)[0].number == 4
    assert {c.key for c in replayed.claims.held_by("w0")} == {"a"}


def test_a_journaled_worker_the_hello_policy_refuses_is_dropped_with_its_claims() -> None:
    lines = [
        *GOOD_LINES,
        b'{"op":"worker","id":"evil","url":"http://127.0.0.1:8080","boot":"b1"}',
        b'{"op":"claim","kind":"episode","key":"e1","worker":"evil"}',
        b'{"op":"learn","kind":"episode","key":"e2","worker":"evil"}',
        b'{"op":"sync","worker":"evil","claims":[["episode","e3"]]}',
    ]
    replayed = RouterCore(SETTINGS, 0.0)

    def refusal(url: str) -> str | None:
        return "The url is one of the router's own listeners." if url.endswith(":8080") else None

    skipped = replay(replayed, lines, 0.0, WALL0, url_refusal=refusal)

    assert [(s.number, s.reason) for s in skipped] == [
        (4, "ValueError: worker evil not restored: The url is one of the router's own listeners.")
    ]
    assert replayed.workers.get("evil") is None
    assert all(replayed.claims.lookup("episode", k) is None for k in ("e1", "e2", "e3"))
    assert {c.key for c in replayed.claims.held_by("w0")} == {"a"}
