"""The places of `--max-streams` (`StreamLimitInterceptor`): a stream over the limit waits,
first come first served, and gives up after `max_wait`; the counts the gauges read follow.

The interceptor's wait on its own, on one event loop (the end-to-end behaviour over real gRPC:
tests/test_run_service.py, tests/test_operations_security.py).
"""

from __future__ import annotations

import asyncio

from nemo_gym_grpc.bridge.rpc.interceptors import StreamLimitInterceptor


def test_waiting_streams_get_places_in_arrival_order():
    async def scenario() -> list[str]:
        limit = StreamLimitInterceptor(max_streams=1, max_wait=30)
        assert await limit._place()  # the one place, taken at once
        order: list[str] = []

        async def wait(name: str) -> None:
            assert await limit._place()
            order.append(name)

        waiters = [asyncio.create_task(wait(name)) for name in ("a", "b", "c")]
        await asyncio.sleep(0.05)
        assert (limit.waiting, order) == (3, [])
        for _ in waiters:  # each stream that ends frees its place for the next in line
            limit._places.release()
            await asyncio.sleep(0.01)
        await asyncio.gather(*waiters)
        assert limit.waiting == 0
        return order

    assert asyncio.run(scenario()) == ["a", "b", "c"]


def test_a_stream_that_waits_past_max_wait_gets_no_place():
    async def scenario() -> tuple[bool, int]:
        limit = StreamLimitInterceptor(max_streams=1, max_wait=0.1)
        assert await limit._place()
        placed = await limit._place()
        return placed, limit.waiting

    assert asyncio.run(scenario()) == (False, 0)


def test_a_waiting_stream_that_is_cancelled_leaves_the_line():
    async def scenario() -> tuple[int, bool]:
        limit = StreamLimitInterceptor(max_streams=1, max_wait=0)  # 0: no bound of its own
        assert await limit._place()
        waiter = asyncio.create_task(limit._place())
        await asyncio.sleep(0.05)
        waiter.cancel()  # the client cancelled, or its deadline passed
        await asyncio.gather(waiter, return_exceptions=True)
        limit._places.release()
        return limit.waiting, await asyncio.wait_for(limit._place(), 1)

    assert asyncio.run(scenario()) == (0, True)
