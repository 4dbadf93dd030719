"""The stream machinery (`bridge.rpc.streams`) on its own, with scripted answers (fast tier): every
item read gets exactly one result whatever order the answers finish in, results finishing while
a message is being sent go out in the next one, at most `max_stream_items` items are held at
once, a duplicate request_id is refused alone, no response message is over the send limit (a
result alone over it is its item's failure), and a stream over its bytes or the bridge over its
budget (each item counted with its state) reads no further message until results go out (every
byte given back). The real services
over real gRPC and NeMo Gym: test_bridge.py, test_faults*.py, test_run_service.py,
test_message_limits.py."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import Counter
from collections.abc import AsyncIterator
from types import SimpleNamespace

from google.rpc import code_pb2

from nemo_gym_grpc.bridge.rpc import kinds, streams
from nemo_gym_grpc.bridge.rpc.budget import ITEM_STATE_BYTES, Budget, item_bytes
from nemo_gym_grpc.bridge.rpc.verify_service import VerifyService
from nemo_gym_grpc.shared import reasons
from nemo_gym_grpc.v1 import verify_pb2
from tests.support.waiting import until


class Scripted:
    """Answers each item after a random pause; counts the items answering at once."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.running = 0
        self.peak = 0

    async def answer(self, request: verify_pb2.VerifyRequest, deadline: float | None):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.rng.random() / 100)
        finally:
            self.running -= 1
        return verify_pb2.VerifyResponse(request_id=request.request_id, reward=1.0)


def kind(
    scripted: Scripted, max_stream_items: int = 4096, max_message_bytes: int = 64 << 20
) -> kinds.Kind:
    """VerifyStream's kind (`VerifyService`), with the scripted answers in place of a
    Verifier's."""
    verifier = SimpleNamespace(
        verify=scripted.answer,
        failed=lambda request, error: verify_pb2.VerifyResponse(
            request_id=request.request_id, error=error.to_status()
        ),
    )
    service = VerifyService(
        verifier,  # type: ignore[arg-type]
        max_stream_items=max_stream_items,
        max_batch_items=max_stream_items,
        max_message_bytes=max_message_bytes,
    )
    return service._kind


async def messages(
    ids: list[str], per_message: int
) -> AsyncIterator[verify_pb2.VerifyStreamRequest]:
    for start in range(0, len(ids), per_message):
        yield verify_pb2.VerifyStreamRequest(
            items=[
                verify_pb2.VerifyRequest(request_id=i, resources_server="s")
                for i in ids[start : start + per_message]
            ]
        )
        await asyncio.sleep(0.005)  # the next message comes while results are going out


async def run(stream: streams._Stream, ids: list[str], per_message: int) -> list[list]:
    """The messages the stream sends for `ids`; fails if it has not ended within 30 s."""

    async def send() -> list[list]:
        reader = asyncio.create_task(stream.read(messages(ids, per_message)))
        sent = []
        async for message in stream.results():
            sent.append(list(message.results))
            await asyncio.sleep(0)  # sending takes a turn: results finish meanwhile
        await reader
        return sent

    return await asyncio.wait_for(send(), 30)


async def test_every_item_gets_exactly_one_result_in_fewer_messages_than_items() -> None:
    for seed in range(5):
        ids = [f"item-{seed}-{i}" for i in range(300)]
        stream = streams._Stream(kind(Scripted(seed)), None)
        sent = await run(stream, ids, per_message=37)
        got = Counter(r.request_id for message in sent for r in message)
        assert got == Counter(ids)
        assert len(sent) < len(ids)  # results that finish together share a message
        assert (stream.accepted, stream.sent, stream.failed) == (300, 300, 0)


async def test_at_most_max_stream_items_are_held_at_once() -> None:
    scripted = Scripted(1)
    stream = streams._Stream(kind(scripted, max_stream_items=8), None)
    sent = await run(stream, [f"i{n}" for n in range(100)], per_message=8)
    assert sum(len(m) for m in sent) == 100
    assert scripted.peak <= 8


async def test_a_duplicate_request_id_in_flight_is_refused_alone() -> None:
    stream = streams._Stream(kind(Scripted(2)), None)
    sent = await run(stream, ["a", "b", "a", "c"], per_message=4)
    results = [r for message in sent for r in message]
    assert Counter(r.request_id for r in results) == Counter(["a", "a", "b", "c"])
    refused = [r for r in results if r.HasField("error")]
    assert len(refused) == 1 and refused[0].request_id == "a"
    assert "already in flight" in refused[0].error.message
    assert stream.failed == 1
    assert reasons.INVALID_ITEM in str(refused[0].error.details)


def sized(request_id: str, reply_bytes: int) -> verify_pb2.VerifyResponse:
    """A result whose `reply_json` holds `reply_bytes` bytes."""
    return verify_pb2.VerifyResponse(
        request_id=request_id, reward=1.0, reply_json="r" * reply_bytes
    )


def test_results_that_finish_together_are_split_under_the_message_limit() -> None:
    limit = 10_000
    results = [sized(f"r{i}", 3_000) for i in range(7)] + [sized("huge", 20_000)]
    messages = list(kinds.fitted(kind(Scripted(0), max_message_bytes=limit), results))
    assert all(m.ByteSize() <= limit for m in messages)
    got = [r for m in messages for r in m.results]
    assert [r.request_id for r in got] == [f"r{i}" for i in range(7)] + ["huge"]
    assert [len(m.results) for m in messages] == [3, 3, 2]  # the huge one as its failure
    huge = got[-1]
    assert huge.HasField("error") and huge.error.code == code_pb2.FAILED_PRECONDITION
    assert reasons.RESULT_TOO_LARGE in str(huge.error.details) and "20" in huge.error.message


def test_results_that_fit_go_out_in_one_message() -> None:
    results = [sized(f"r{i}", 100) for i in range(64)]
    (message,) = kinds.fitted(kind(Scripted(0)), results)
    assert [r.request_id for r in message.results] == [f"r{i}" for i in range(64)]


async def test_a_stream_counts_a_result_sent_once_its_message_was_taken() -> None:
    async def answer(request, deadline):
        return sized(request.request_id, 1_500)

    small = dataclasses.replace(kind(Scripted(3), max_message_bytes=4_000), answer=answer)
    stream = streams._Stream(small, None)
    ids = [f"i{n}" for n in range(40)]
    sent = await run(stream, ids, per_message=40)
    assert sorted(r.request_id for m in sent for r in m) == sorted(ids)
    assert all(len(m) <= 2 for m in sent)  # 2 x 1.5 KB fit 4 KB, 3 do not
    assert (stream.accepted, stream.sent) == (40, 40)


async def test_a_unary_result_over_the_message_limit_is_its_items_failure() -> None:
    async def answer(request, deadline):
        return sized(request.request_id, 20_000)

    small = dataclasses.replace(kind(Scripted(0), max_message_bytes=10_000), answer=answer)
    context = SimpleNamespace(time_remaining=lambda: None)
    item = verify_pb2.VerifyRequest(request_id="u", resources_server="s")
    result = await streams.unary(small, item, context)  # type: ignore[arg-type]
    assert result.request_id == "u" and result.error.code == code_pb2.FAILED_PRECONDITION
    assert result.ByteSize() < 10_000


def padded_item(request_id: str) -> verify_pb2.VerifyRequest:
    """An item of about 1,010 bytes."""
    return verify_pb2.VerifyRequest(
        request_id=request_id, resources_server="s", row_json="x" * 1000
    )


# What one `padded_item` counts against the byte limits while in flight.
PADDED_BYTES = item_bytes(padded_item("i0"))
# Seconds a reader that should be held back gets to go on (wrongly) before its count is checked.
SETTLE = 0.05


def padded(ids: list[str], per_message: int) -> list[verify_pb2.VerifyStreamRequest]:
    """Messages of `per_message` `padded_item`s each."""
    items = [padded_item(i) for i in ids]
    return [
        verify_pb2.VerifyStreamRequest(items=items[k : k + per_message])
        for k in range(0, len(items), per_message)
    ]


async def fed(
    batches: list[verify_pb2.VerifyStreamRequest],
) -> AsyncIterator[verify_pb2.VerifyStreamRequest]:
    for batch in batches:
        yield batch


async def drain(stream: streams._Stream) -> list[str]:
    return [r.request_id async for message in stream.results() for r in message.results]


async def test_a_stream_over_its_bytes_reads_no_further_message_until_results_go_out() -> None:
    async def answer(request, deadline):
        return sized(request.request_id, 2_000)

    limit = 5 * PADDED_BYTES
    limited = dataclasses.replace(kind(Scripted(0)), answer=answer, max_stream_bytes=limit)
    stream = streams._Stream(limited, None)
    ids = [f"i{n}" for n in range(20)]
    reader = asyncio.create_task(stream.read(fed(padded(ids, 2))))
    # nobody reads the results meanwhile: 3 messages of 2 items (each ~1 KB, counted twice, and
    # its state) reached 6 of 5; it waits
    await until(lambda: stream.accepted >= 6, 10, "6 items accepted")
    await asyncio.sleep(SETTLE)
    assert stream.accepted == 6
    assert sorted(await drain(stream)) == sorted(ids)
    await reader
    assert stream._held == 0 and limited.budget.held == 0  # every byte given back as sent


async def test_the_bridge_budget_holds_every_stream_until_results_go_out() -> None:
    async def answer(request, deadline):
        return sized(request.request_id, 2_000)

    budget = Budget(5 * PADDED_BYTES)
    shared = dataclasses.replace(kind(Scripted(0)), answer=answer, budget=budget)
    first, second = streams._Stream(shared, None), streams._Stream(shared, None)
    reading = [
        asyncio.create_task(first.read(fed(padded([f"a{n}" for n in range(20)], 2)))),
        asyncio.create_task(second.read(fed(padded([f"b{n}" for n in range(4)], 2)))),
    ]
    await until(lambda: first.accepted >= 6 and second.accepted >= 2, 10, "8 items accepted")
    await asyncio.sleep(SETTLE)
    assert (first.accepted, second.accepted) == (6, 2)  # the second: one message, then waits
    assert len(await drain(first)) == 20
    assert len(await drain(second)) == 4
    await asyncio.gather(*reading)
    assert shared.budget.held == 0


async def test_small_items_count_their_state_against_the_budget() -> None:
    """An item's task and state cost the bridge about 5 KB whatever its size (`budget.py`), so
    a budget of 10 items' state holds the reader after about 10 items of a few bytes each."""

    async def answer(request, deadline):
        return sized(request.request_id, 10)

    budget = Budget(10 * ITEM_STATE_BYTES)
    small = dataclasses.replace(kind(Scripted(0)), answer=answer, budget=budget)
    stream = streams._Stream(small, None)
    tiny = [verify_pb2.VerifyRequest(request_id=f"t{n}", resources_server="s") for n in range(100)]
    batches = [verify_pb2.VerifyStreamRequest(items=tiny[k : k + 4]) for k in range(0, 100, 4)]
    reader = asyncio.create_task(stream.read(fed(batches)))  # nobody reads the results
    await until(lambda: stream.accepted >= 12, 10, "12 items accepted")
    await asyncio.sleep(SETTLE)
    assert stream.accepted == 12  # 3 messages of 4 reached 10 items' state; then it waits
    assert len(await drain(stream)) == 100
    await reader
    assert budget.held == 0


async def test_a_stream_that_ends_early_gives_its_bytes_back() -> None:
    async def hang(request, deadline):
        await asyncio.Event().wait()

    hung = dataclasses.replace(kind(Scripted(0)), answer=hang, budget=Budget(1 << 30))
    context = SimpleNamespace(time_remaining=lambda: None, peer=lambda: "ipv4:127.0.0.1:1")
    call = streams.serve(hung, fed(padded(["a", "b", "c"], 3)), context)  # type: ignore[arg-type]
    pending = asyncio.ensure_future(anext(call))
    in_flight = sum(item_bytes(padded_item(i)) for i in "abc")
    await until(lambda: hung.budget.held == in_flight, 10, "the 3 items in flight")
    pending.cancel()  # the call ends (e.g. its client went away)
    await asyncio.gather(pending, return_exceptions=True)
    await call.aclose()
    assert hung.budget.held == 0


async def test_a_unary_item_counts_against_the_budget_and_waits_while_it_is_full() -> None:
    seen: list[int] = []

    async def answer(request, deadline):
        seen.append(full.budget.held)
        return sized(request.request_id, 10)

    full = dataclasses.replace(kind(Scripted(0)), answer=answer, budget=Budget(10_000))
    context = SimpleNamespace(time_remaining=lambda: None)
    item = verify_pb2.VerifyRequest(request_id="u", resources_server="s", row_json="x" * 1000)
    full.budget.take(10_000)  # the streams hold it all
    call = asyncio.ensure_future(streams.unary(full, item, context))  # type: ignore[arg-type]
    await asyncio.sleep(0.05)
    assert not call.done() and not seen  # waits, nothing sent upstream
    full.budget.give(10_000)
    assert (await call).reward == 1.0
    assert seen == [item_bytes(item)]  # counted while it ran
    assert full.budget.held == 0
