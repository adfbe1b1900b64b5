"""The batcher's event-loop half: what callers of one loop turn send, and what each hears.

A fake `send` at the boundary records the keys of each script call it is asked for and
answers from them (or fails the calls the test names); no Redis.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from router.directory.batcher import Batcher
from router.directory.errors import DirectoryReplyError, DirectoryTimeout, DirectoryUnavailable


class RecordingSend:
    """A batch's script call: records its keys, answers each key with `key.upper()`,
    and raises `fail_with` for a call holding one of `failing`."""

    def __init__(self, failing: Sequence[str] = (), fail_with: Exception | None = None) -> None:
        self.calls: list[list[str]] = []
        self.failing = set(failing)
        self.fail_with = fail_with
        self.hold: asyncio.Event | None = None  # set: every call waits for it

    async def __call__(self, keys: list[str], seconds_left: float) -> list[str]:
        self.calls.append(list(keys))
        if self.hold is not None:
            await self.hold.wait()
        if self.fail_with is not None and self.failing & set(keys):
            raise self.fail_with
        return [key.upper() for key in keys]


async def test_the_keys_of_ask_each_and_ask_in_one_loop_turn_go_out_in_one_call() -> None:
    send = RecordingSend()
    batcher: Batcher[str, str] = Batcher("claim", send, deadline_s=1.0)

    many, again, one = await asyncio.gather(
        batcher.ask_each(["a", "b", "c"]),
        batcher.ask_each(["c", "d"]),  # "c" twice: asked once, answered to both
        batcher.ask("e"),
    )

    assert send.calls == [["a", "b", "c", "d", "e"]]
    assert (many, again, one) == (["A", "B", "C"], ["C", "D"], "E")


async def test_ask_each_is_cut_into_calls_of_the_limit_and_a_failed_call_fails_only_its_keys() -> (
    None
):
    send = RecordingSend(failing=["d"], fail_with=DirectoryTimeout("late"))
    batcher: Batcher[str, str] = Batcher("claim", send, deadline_s=1.0, limit=2)

    answers = await batcher.ask_each(["a", "b", "c", "d", "e"])

    assert send.calls == [["a", "b"], ["c", "d"], ["e"]]
    assert answers[:2] == ["A", "B"] and answers[4] == "E"
    assert all(isinstance(answer, DirectoryTimeout) for answer in answers[2:4])


async def test_ask_each_of_no_keys_sends_nothing() -> None:
    send = RecordingSend()
    batcher: Batcher[str, str] = Batcher("claim", send, deadline_s=1.0)
    assert await batcher.ask_each([]) == []
    await asyncio.sleep(0)
    assert send.calls == []


async def test_a_batch_cancelled_in_flight_answers_ask_each_with_directory_unavailable() -> None:
    send = RecordingSend()
    send.hold = asyncio.Event()
    batcher: Batcher[str, str] = Batcher("release", send, deadline_s=1.0)
    asked = asyncio.ensure_future(batcher.ask_each(["a", "b"]))
    for _ in range(10):  # the ask, the flush, the batch's task waiting in send
        if send.calls:
            break
        await asyncio.sleep(0)
    assert send.calls == [["a", "b"]]
    for task in list(batcher._tasks):
        task.cancel()

    answers = await asyncio.wait_for(asked, 1.0)

    assert len(answers) == 2
    assert all(isinstance(answer, DirectoryUnavailable) for answer in answers)


async def test_a_caller_of_ask_each_that_gave_up_leaves_the_others_answered() -> None:
    send = RecordingSend()
    send.hold = asyncio.Event()
    batcher: Batcher[str, str] = Batcher("claim", send, deadline_s=1.0)
    gave_up = asyncio.ensure_future(batcher.ask_each(["a"]))
    stays = asyncio.ensure_future(batcher.ask_each(["a", "b"]))
    await asyncio.sleep(0)
    gave_up.cancel()
    send.hold.set()

    assert await asyncio.wait_for(stays, 1.0) == ["A", "B"]
    assert gave_up.cancelled()
    assert send.calls == [["a", "b"]]


class CallbackStart:
    """A send that needs no task: records its keys and keeps `answered`, to be called
    later (as a reply's loop callback would); declines while `up` is False and raises
    `fail_with` when set."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], float]] = []
        self.answered: list[Callable[[Sequence[str] | Exception], None]] = []
        self.up = True
        self.fail_with: Exception | None = None

    def __call__(
        self,
        keys: list[str],
        seconds_left: float,
        answered: Callable[[Sequence[str] | Exception], None],
    ) -> bool:
        if not self.up:
            return False
        if self.fail_with is not None:
            raise self.fail_with
        self.calls.append((list(keys), seconds_left))
        self.answered.append(answered)
        return True


async def test_a_started_batch_is_answered_by_its_callback_once() -> None:
    send, start = RecordingSend(), CallbackStart()
    batcher: Batcher[str, str] = Batcher("lookup", send, 1.0, start=start)
    asked = asyncio.gather(batcher.ask("a"), batcher.ask_each(["b", "a"]))
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the flush ran: one call, no task, nothing on `send`
    assert [keys for keys, _ in start.calls] == [["a", "b"]] and send.calls == []
    assert 0.5 < start.calls[0][1] <= 1.0  # what is left of the batch's deadline
    answered = start.answered[0]
    answered(["A", "B"])
    answered(DirectoryUnavailable("late"))  # a second answer is ignored
    one, each = await asyncio.wait_for(asked, 1.0)
    assert one == "A" and each == ["B", "A"]


async def test_a_started_batch_fails_its_callers_with_its_error_or_a_short_answer() -> None:
    start = CallbackStart()
    batcher: Batcher[str, str] = Batcher("lookup", RecordingSend(), 1.0, start=start)
    failed = asyncio.ensure_future(batcher.ask("a"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    start.answered[0](DirectoryTimeout("past its deadline"))
    short = asyncio.ensure_future(batcher.ask_each(["b", "c"]))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    start.answered[1](["B"])  # one answer for two keys
    (outcome,) = await asyncio.wait_for(asyncio.gather(failed, return_exceptions=True), 1.0)
    assert isinstance(outcome, DirectoryTimeout)
    answers = await asyncio.wait_for(short, 1.0)
    assert len(answers) == 2 and all(isinstance(a, DirectoryReplyError) for a in answers)


async def test_a_start_that_declines_sends_the_task_way_and_one_that_raises_fails_its_callers() -> (
    None
):
    send, start = RecordingSend(), CallbackStart()
    batcher: Batcher[str, str] = Batcher("lookup", send, 1.0, start=start)
    start.up = False
    assert await asyncio.wait_for(batcher.ask("a"), 1.0) == "A"
    assert send.calls == [["a"]] and start.calls == []
    start.up, start.fail_with = True, RuntimeError("a bug of the sender's")
    results = await asyncio.wait_for(
        asyncio.gather(batcher.ask("b"), batcher.ask_each(["c"]), return_exceptions=True), 1.0
    )
    assert isinstance(results[0], RuntimeError)  # answered, not left waiting
    assert isinstance(results[1], list) and isinstance(results[1][0], RuntimeError)
