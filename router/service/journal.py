"""The state journal (design §3 "Restart"): what a restarted router replays.

With `state.path` set, every change the control plane makes to workers and
claims is appended to the file as one JSON line, and replayed into a fresh
`RouterCore` at start. From time to time the file is rewritten as a snapshot of
the live state, so it stays proportional to what is held, not to history.

Lines are written with `os.write` on an O_APPEND descriptor: the kernel has
them as soon as the call returns, so a `kill -9` of the router loses nothing it
acknowledged. Each line is written at once, except between `hold` and `flush`:
the control server holds the lines of all the requests in one read and flushes
them in one write before it sends their replies. There is no fsync: a crash of
the whole machine may lose the last moments, and the workers' `sync` after the
restart restores those claims.

`encode_*`, `decode_line` and `replay` are pure; `JournalFile` does the I/O.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from router.control import valid_worker_id
from router.core import Claim, ClaimState, RouterCore, Worker, WorkerOrigin, WorkerState
from router.protocol import parse_upstream, valid_boot

log = logging.getLogger("episode_router.journal")

JOURNAL_VERSION = 1
COMPACT_MIN_LINES = 10_000  # below this, rewriting costs more than it saves
# After a failed compaction (a full disk, say), wait this long before the next try: a
# snapshot is a full rewrite, and trying again every tick would only fail again, slowly.
COMPACT_RETRY_S = 30.0
# Errors are logged on the 1st, 10th, 100th... occurrence, never once per line.
_LOG_MARKS = (1, 10, 100, 1000, 10_000)


# One encoder for every line (json.dumps with arguments builds one per call), same
# output.
_JSON = json.JSONEncoder(separators=(",", ":"))


def _line(record: dict[str, Any]) -> bytes:
    return _JSON.encode(record).encode() + b"\n"


class JournalFile:
    """An append-only journal file with compaction. Implements the core's sink."""

    def __init__(self, path: str, *, clock: Callable[[], float]) -> None:
        self.path = path
        self._clock = clock  # wall clock: tombstone ages must survive a restart
        self._fd: int | None = None
        self._lock_fd: int | None = None  # the held lock file (lock)
        self._lines = 0
        self._held: list[bytes] | None = None  # lines appended since hold(), until flush()
        self.write_errors = 0
        self.compact_errors = 0
        self._compact_not_before: float | None = None  # monotonic; set by a failed compaction

    # -- the sink the core calls -------------------------------------------

    def worker(self, worker: Worker) -> None:
        self._append({"op": "worker", "id": worker.id, "url": worker.url, "boot": worker.boot})

    def drain(self, worker: Worker) -> None:
        self._append(_drain_record(worker))

    def claim(self, kind: str, key: str, worker: str) -> None:
        self._append({"op": "claim", "kind": kind, "key": key, "worker": worker})

    def learn(self, kind: str, key: str, worker: str) -> None:
        self._append({"op": "learn", "kind": kind, "key": key, "worker": worker})

    def release(self, kind: str, key: str, worker: str) -> None:
        self._append({"op": "release", "kind": kind, "key": key, "worker": worker})

    def forget(self, kind: str, key: str, worker: str) -> None:
        self._append({"op": "forget", "kind": kind, "key": key, "worker": worker})

    def link(self, claims: list[tuple[str, str]]) -> None:
        self._append({"op": "link", "claims": [list(pair) for pair in claims]})

    def sync(self, worker: str, claims: Iterable[tuple[str, str]]) -> None:
        self._append({"op": "sync", "worker": worker, "claims": sorted(claims)})

    def exited(self, worker: str) -> None:
        self._append({"op": "exited", "worker": worker})

    def hold(self) -> None:
        """Keep the lines appended from now on in memory until `flush`."""
        if self._held is None:
            self._held = []

    def flush(self) -> None:
        """Write the lines held since `hold` in one write, and stop holding."""
        held, self._held = self._held, None
        if held:
            self._write(b"".join(held), len(held))

    # -- I/O -----------------------------------------------------------------

    def lock(self) -> None:
        """Take the journal for this process: an exclusive lock on `<path>.lock`, held
        until close. Raises OSError naming the path when another process holds it.

        The journal file itself is replaced by each compaction (a rename), so it cannot
        carry the lock. Two routers on one state.path (another control socket, say)
        compacted over each other's file: a failed second start left the live router
        appending to a deleted file, and ended episodes came back unknown after its
        restart."""
        lock_path = f"{self.path}.lock"
        os.makedirs(os.path.dirname(os.path.abspath(lock_path)), exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(
                f"state.path {self.path}: another router uses this journal ({lock_path} is locked)"
            ) from None
        except OSError:
            os.close(fd)
            raise
        self._lock_fd = fd

    def read(self) -> list[bytes]:
        """Every line of the journal as it is on disk (empty if there is none)."""
        try:
            with open(self.path, "rb") as file:
                return file.read().splitlines()
        except FileNotFoundError:
            return []

    def compact(self, core: RouterCore, mono_now: float) -> None:
        """Rewrite the file as a snapshot of `core` (atomically, by rename), then
        append to it. Also how a run starts its journal, after the replay.

        Raises OSError when the snapshot cannot be written; the journal then goes
        on appending to the file it had, and the temporary file is removed if it can be.
        """
        records = snapshot(core, self._clock(), mono_now)
        tmp = f"{self.path}.tmp"
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        fd = -1
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            _write_all(fd, b"".join(_line(r) for r in records))
            os.fsync(fd)
            os.replace(tmp, self.path)
        except OSError:
            if fd >= 0:
                os.close(fd)
            # A half-written snapshot must not stay behind to fill the disk further.
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        # The snapshot's own descriptor goes on appending: it is the file now at the
        # path, and no second open can fail after the rename and leave none.
        self._close_appending()
        self._fd = fd
        self._lines = len(records)

    def compact_during_run(self, core: RouterCore, mono_now: float) -> bool:
        """`compact`, for a running router: a failure is counted in `compact_errors`,
        logged once in a while, and the next try waits COMPACT_RETRY_S. Returns
        whether the file was rewritten."""
        try:
            self.compact(core, mono_now)
        except OSError as exc:
            # Routing must go on: the old file still replays to the same state, only longer.
            self.compact_errors += 1
            self._compact_not_before = mono_now + COMPACT_RETRY_S
            if self.compact_errors in _LOG_MARKS:
                log.error(
                    "journal compaction failed; appending to the old file",
                    extra={"error": str(exc), "failures": self.compact_errors},
                )
            return False
        self._compact_not_before = None
        return True

    def wants_compaction(self, live_records: int, mono_now: float | None = None) -> bool:
        """Whether the file is long enough to rewrite, and (given `mono_now`) no
        failed compaction asks to wait."""
        if (
            mono_now is not None
            and self._compact_not_before is not None
            and mono_now < self._compact_not_before
        ):
            return False
        return self._lines > max(COMPACT_MIN_LINES, 2 * live_records)

    def close(self) -> None:
        """Stop appending, and let the journal go (its lock)."""
        self._close_appending()
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)  # the lock goes with it
            self._lock_fd = None

    def _close_appending(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _append(self, record: dict[str, Any]) -> None:
        if self._fd is None:
            return
        record["t"] = round(self._clock(), 3)
        if self._held is not None:
            self._held.append(_line(record))
        else:
            self._write(_line(record), 1)

    def _write(self, data: bytes, lines: int) -> None:
        """Append `data`, `lines` whole lines, to the file."""
        if self._fd is None:
            return
        try:
            _write_all(self._fd, data)
        except OSError as exc:
            # A full disk must not stop routing: the workers' sync restores
            # claims after a restart. Count the lines lost and say it once in a while.
            before, self.write_errors = self.write_errors, self.write_errors + lines
            if any(before < mark <= self.write_errors for mark in _LOG_MARKS):
                log.error("journal write failed", extra={"error": str(exc)})
            return
        self._lines += lines


def _write_all(fd: int, data: bytes) -> None:
    """Write all of `data`, or raise OSError."""
    written = os.write(fd, data)
    while written < len(data):  # a short write only near a full disk; finish or fail
        written += os.write(fd, data[written:])


def snapshot(core: RouterCore, wall_now: float, mono_now: float) -> list[dict[str, Any]]:
    """The records that rebuild `core`'s workers, claims and tombstones."""
    records: list[dict[str, Any]] = [{"op": "version", "v": JOURNAL_VERSION, "t": wall_now}]
    for worker in core.workers:
        if worker.origin is WorkerOrigin.STATIC:
            continue
        if worker.state is not WorkerState.EXITED:
            records.append(
                {"op": "worker", "id": worker.id, "url": worker.url, "boot": worker.boot}
            )
            if worker.draining:
                records.append(_drain_record(worker))
    linked: list[list[list[str]]] = []
    in_a_link: set[int] = set()
    for claim in core.claims.held():
        op = "learn" if claim.learned else "claim"
        records.append({"op": op, "kind": claim.kind, "key": claim.key, "worker": claim.worker})
        if claim.siblings and id(claim) not in in_a_link:
            group = (claim, *claim.siblings)
            in_a_link.update(id(member) for member in group)
            linked.append([[member.kind, member.key] for member in group])
    for claim in core.claims.tombstones():
        records.append(_tombstone_record(claim, wall_now - (mono_now - claim.since)))
    # After every claim they name, held or ended: one seed reply's claims stay one session.
    records.extend({"op": "link", "claims": pairs} for pairs in linked)
    return records


def _drain_record(worker: Worker) -> dict[str, Any]:
    # `by_worker`: the worker's process asked, so its next boot does not inherit the
    # drain (RouterCore.register); an operator's drain stays.
    return {
        "op": "drain",
        "id": worker.id,
        "on": worker.draining,
        "by_worker": worker.drained_by_worker,
    }


def _tombstone_record(claim: Claim, made_at_wall: float) -> dict[str, Any]:
    return {
        "op": "tomb",
        "kind": claim.kind,
        "key": claim.key,
        "worker": claim.worker,
        "state": claim.state.value,
        "t": round(made_at_wall, 3),
    }


# Why a restored worker's url must not be used (None when it may): the control
# policy's rule for a hello's url, given the uids a hello could come from.
UrlCheck = Callable[[str], str | None]
# What a replay raises on a line it cannot use: a damaged file (a truncated last line,
# bytes that are not UTF-8, nesting deeper than the parser goes, a number too large for
# a float) or a record of the wrong shape. Anything else is a bug, and is raised.
_UNUSABLE = (ValueError, TypeError, KeyError, AttributeError, RecursionError, OverflowError)


@dataclass(frozen=True, slots=True)
class SkippedLine:
    """A journal line a replay did not apply: its number (from 1) and why."""

    number: int
    reason: str


def replay(
    core: RouterCore,
    lines: Iterable[bytes],
    mono_now: float,
    wall_now: float,
    *,
    url_refusal: UrlCheck | None = None,
) -> list[SkippedLine]:
    """Apply journal lines to a fresh core. Returns the lines it skipped.

    A line that does not decode, or holds a record of the wrong shape, is skipped and
    the rest replay: a damaged journal never stops a start. A worker whose url
    `url_refusal` refuses (the hello policy) is not restored, and neither are the
    claims that name it. Journaled workers come back as `lost`, awaited by the
    recovery window: a same-boot hello restores them with their claims, a new boot
    retires them.
    """
    skipped: list[SkippedLine] = []
    dropped: set[str] = set()  # workers refused by the policy: their claims go too
    for number, raw in enumerate(lines, 1):
        try:
            record = json.loads(raw)
            if not isinstance(record, dict):
                raise TypeError(f"a record is an object, got {type(record).__name__}")
            made = _number(record.get("t", wall_now))
            at = mono_now - max(0.0, wall_now - made)
            _apply(core, record, at, url_refusal, dropped)
        except _UNUSABLE as exc:
            skipped.append(SkippedLine(number, _reason(exc)))
    # A learned claim's uses are not journaled (a write per request): read back, its
    # last use is its learning, and one in use all along would end at the first tick.
    # Each gets a whole idle TTL from the restart instead.
    core.claims.renew_learned(mono_now)
    for worker in core.workers:
        if worker.origin is WorkerOrigin.JOURNAL and worker.state is WorkerState.LIVE:
            core.lose(worker, mono_now)
            core.expect(worker.id)
    return skipped


def _reason(exc: BaseException) -> str:
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    if isinstance(exc, UnicodeDecodeError):
        return "not UTF-8"
    if isinstance(exc, KeyError):
        return f"no {exc.args[0]!r} field" if exc.args else "a field is missing"
    text = str(exc)
    return f"{type(exc).__name__}: {text[:120]}" if text else type(exc).__name__


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"`t` must be a number, got {type(value).__name__}")
    made = float(value)
    if not math.isfinite(made):
        raise ValueError("`t` is not finite")
    return made


def _text(record: dict[str, Any], field: str) -> str:
    value = record[field]
    if not isinstance(value, str):
        raise TypeError(f"`{field}` must be a string, got {type(value).__name__}")
    return value


def _pairs(record: dict[str, Any]) -> list[tuple[str, str]]:
    value = record["claims"]
    if not isinstance(value, list) or not all(
        isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)
        for pair in value
    ):
        raise TypeError("`claims` must be a list of [kind, key] strings")
    return [(kind, key) for kind, key in value]


def _apply(
    core: RouterCore,
    record: dict[str, Any],
    at: float,
    url_refusal: UrlCheck | None,
    dropped: set[str],
) -> None:
    op = record["op"]
    claims = core.claims
    if op == "worker":
        _restore_worker(core, record, at, url_refusal, dropped)
    elif op == "drain":
        worker = core.workers.get(_text(record, "id"))
        if worker is not None:
            worker.draining = bool(record["on"])
            # Absent in journals written before it was recorded: an operator's drain, as then.
            worker.drained_by_worker = worker.draining and bool(record.get("by_worker", False))
    elif op in ("claim", "learn", "release", "tomb", "forget"):
        kind, key, holder = _text(record, "kind"), _text(record, "key"), _text(record, "worker")
        if holder in dropped:
            return
        if op == "release":
            claims.release(kind, key, holder, at)
        elif op == "forget":
            claims.forget_held(kind, key, holder)
        elif op == "tomb":
            claims.restore_tombstone(kind, key, holder, ClaimState(record["state"]), at)
        else:
            claims.claim(kind, key, holder, at, learned=op == "learn")
    elif op == "link":
        core.link_learned(_pairs(record))
    elif op == "sync":
        holder = _text(record, "worker")
        if holder not in dropped:
            claims.sync(holder, _pairs(record), at)
    elif op == "exited":
        holder = _text(record, "worker")
        worker = core.workers.get(holder)
        if worker is not None:
            worker.state = WorkerState.EXITED
        claims.worker_exited(holder, at)
    elif op != "version":
        raise ValueError(f"unknown journal op {str(op)[:40]!r}")


def _restore_worker(
    core: RouterCore,
    record: dict[str, Any],
    at: float,
    url_refusal: UrlCheck | None,
    dropped: set[str],
) -> None:
    worker_id, url, boot = _text(record, "id"), _text(record, "url"), record["boot"]
    if not valid_worker_id(worker_id):
        raise ValueError(f"not a worker id: {worker_id[:70]!r}")
    if boot is not None and not (isinstance(boot, str) and valid_boot(boot)):
        raise ValueError("not a boot")
    if isinstance(parse_upstream(url), str):  # as a hello's (an older router's journal)
        raise ValueError(f"not an upstream url: {url[:70]!r}")
    refused = url_refusal(url) if url_refusal is not None else None
    if refused is not None:
        # Its claims with it: they would be forwarded to where the policy says no.
        dropped.add(worker_id)
        raise ValueError(f"worker {worker_id} not restored: {refused}")
    dropped.discard(worker_id)
    core.register(worker_id, url, WorkerOrigin.JOURNAL, at, boot)
