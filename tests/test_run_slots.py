"""The agent slots of the runner (`--agent-concurrency`): a bounded wait that never loses or
leaks a slot, whether the time runs out or the waiter is cancelled."""

from __future__ import annotations

import asyncio

from nemo_gym_grpc.bridge.balancer import acquire_within


async def test_a_free_slot_is_taken_and_a_busy_one_times_out_without_leaking():
    semaphore = asyncio.Semaphore(1)
    assert await acquire_within(semaphore, 1.0)
    assert not await acquire_within(semaphore, 0.05)  # held: the time runs out
    semaphore.release()
    assert await acquire_within(semaphore, 1.0)  # the timed-out wait took nothing
    assert semaphore.locked()
    semaphore.release()
    assert not semaphore.locked()


async def test_a_cancelled_waiter_takes_no_slot():
    semaphore = asyncio.Semaphore(1)
    await semaphore.acquire()
    waiter = asyncio.ensure_future(acquire_within(semaphore, 30.0))
    await asyncio.sleep(0.01)
    semaphore.release()  # wakes the waiter ...
    waiter.cancel()  # ... which is cancelled before it runs again
    await asyncio.gather(waiter, return_exceptions=True)
    assert not semaphore.locked()  # the slot was given back
    assert await acquire_within(semaphore, 1.0)
