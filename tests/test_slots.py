"""balancer.Slots, the slots of upstream replicas (`--max-in-flight`) and agents
(`--agent-concurrency`): the bound, first-come first-served hand-over, the bounded wait, and
that no cancellation or timeout can leak or lose a slot."""

from __future__ import annotations

import asyncio
import random

import pytest

from nemo_gym_grpc.bridge.flows.balancer import EXPIRY_GRID, Slots, SlotTimeout


async def test_at_most_size_holders_served_in_arrival_order() -> None:
    slots = Slots(2)
    order: list[int] = []
    peak = 0

    async def one(index: int) -> None:
        nonlocal peak
        async with slots.use():
            order.append(index)
            peak = max(peak, slots.in_flight)
            await asyncio.sleep(0.001)

    await asyncio.gather(*(one(i) for i in range(20)))
    assert order == list(range(20))
    assert peak == 2
    assert (slots.in_flight, slots.waiting) == (0, 0)


async def test_a_bounded_wait_times_out_without_leaking_and_reports_its_wait() -> None:
    slots = Slots(1)
    async with slots.use(1.0) as queued:
        assert queued == 0.0  # a free slot: no wait
        with pytest.raises(SlotTimeout) as timed_out:
            async with slots.use(0.05):
                raise AssertionError("the body must not run")
        assert 0.05 - EXPIRY_GRID <= timed_out.value.queued < 0.5  # its end is on the grid
        waiter = asyncio.ensure_future(_hold(slots, 5.0))
        await asyncio.sleep(0.01)
        assert slots.waiting == 1
    assert await waiter > 0.0  # it got the slot given back, after waiting for it
    assert (slots.in_flight, slots.waiting) == (0, 0)


async def _hold(slots: Slots, wait: float) -> float:
    async with slots.use(wait) as queued:
        return queued


async def test_a_waiter_cancelled_as_it_was_handed_a_slot_passes_it_on() -> None:
    slots = Slots(1)
    holder = slots.use()
    await holder.__aenter__()
    first = asyncio.ensure_future(_hold(slots, 30.0))
    second = asyncio.ensure_future(_hold(slots, 30.0))
    await asyncio.sleep(0)
    await holder.__aexit__(None, None, None)  # the slot is handed to `first` ...
    first.cancel()  # ... which is cancelled before it runs
    assert await second >= 0.0  # so the slot went on to `second`
    assert first.cancelled()
    assert (slots.in_flight, slots.waiting) == (0, 0)


async def test_random_cancels_and_timeouts_never_leak_a_slot() -> None:
    rng = random.Random(7)
    slots = Slots(3)
    peak = 0

    async def one() -> None:
        nonlocal peak
        try:
            async with slots.use(rng.choice([None, 0.0, 0.001, 0.01])):
                peak = max(peak, slots.in_flight)
                await asyncio.sleep(rng.random() / 500)
        except SlotTimeout:
            pass

    tasks = [asyncio.ensure_future(one()) for _ in range(300)]
    for _ in range(60):
        await asyncio.sleep(0.0005)
        rng.choice(tasks).cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert peak <= 3
    assert (slots.in_flight, slots.waiting) == (0, 0)
    assert not slots._expiries  # every wait's end is gone with it, its timer cancelled
    assert await _hold(slots, 0.0) == 0.0  # every slot is free again


async def test_waits_that_end_together_share_one_timer() -> None:
    slots = Slots(1)
    loop = asyncio.get_running_loop()
    async with slots.use():
        timers, started = len(loop._scheduled), loop.time()  # type: ignore[attr-defined]
        waiters = [asyncio.ensure_future(_hold(slots, 0.1)) for _ in range(500)]
        # one pass of the loop: every waiter has begun its wait and no timer has fired, however
        # long the pass took (a timer due during it fires in a later pass; with a sleep of 10 ms
        # here, a stall of 0.1 s on a busy machine let some waits end first: a CI run)
        await asyncio.sleep(0)
        assert slots.waiting == 500
        added = len(loop._scheduled) - timers  # type: ignore[attr-defined]
        steps = (loop.time() - started) / EXPIRY_GRID  # the grid steps their waits began over
        assert added <= steps + 2  # one timer per step their ends fall in (500 before)
        done = await asyncio.gather(*waiters, return_exceptions=True)
    assert all(isinstance(result, SlotTimeout) for result in done)
    assert (slots.in_flight, slots.waiting) == (0, 0)
    assert not slots._expiries
