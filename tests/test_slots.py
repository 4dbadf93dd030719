"""bridge.slots.Slots: the bound, first-come first-served hand-over, the bounded wait, and
that no cancellation or timeout can leak or lose a slot."""

from __future__ import annotations

import asyncio
import random

from nemo_gym_grpc.bridge.slots import Slots


async def test_at_most_size_holders_served_in_arrival_order() -> None:
    slots = Slots(2)
    order: list[int] = []
    peak = 0

    async def one(index: int) -> None:
        nonlocal peak
        assert await slots.acquire()
        order.append(index)
        peak = max(peak, slots.held)
        await asyncio.sleep(0.001)
        slots.release()

    await asyncio.gather(*(one(i) for i in range(20)))
    assert order == list(range(20))
    assert peak == 2
    assert (slots.held, slots.waiting) == (0, 0)


async def test_a_bounded_wait_gives_up_and_leaves_the_slot_to_the_next() -> None:
    slots = Slots(1)
    assert slots.take()
    assert not slots.take()
    assert await slots.acquire(0.02) is False
    waiter = asyncio.ensure_future(slots.acquire(5.0))
    await asyncio.sleep(0.01)
    assert slots.waiting == 1
    slots.release()
    assert await waiter is True
    assert (slots.held, slots.waiting) == (1, 0)


async def test_a_waiter_cancelled_as_it_was_handed_a_slot_passes_it_on() -> None:
    slots = Slots(1)
    assert slots.take()
    first = asyncio.ensure_future(slots.acquire())
    second = asyncio.ensure_future(slots.acquire())
    await asyncio.sleep(0)
    slots.release()  # handed to `first` ...
    first.cancel()  # ... which is cancelled before it runs
    assert await second is True  # so the slot went on to `second`
    assert first.cancelled()
    assert (slots.held, slots.waiting) == (1, 0)


async def test_random_cancels_and_timeouts_never_leak_a_slot() -> None:
    rng = random.Random(7)
    slots = Slots(3)
    peak = 0

    async def one() -> None:
        nonlocal peak
        if await slots.acquire(rng.choice([None, 0.0, 0.001, 0.01])):
            peak = max(peak, slots.held)
            try:
                await asyncio.sleep(rng.random() / 500)
            finally:
                slots.release()

    tasks = [asyncio.ensure_future(one()) for _ in range(300)]
    for _ in range(60):
        await asyncio.sleep(0.0005)
        rng.choice(tasks).cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert peak <= 3
    assert (slots.held, slots.waiting) == (0, 0)
    assert await slots.acquire(0.0)  # every slot is free again
