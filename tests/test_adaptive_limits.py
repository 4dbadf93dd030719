"""The adaptive concurrency limit (bridge/flows/limits.py): it keeps a standing queue of
QUEUE_LOW..QUEUE_HIGH calls at a CPU-bound server, grows to the ceiling on a server whose latency
does not grow with load (a burst's first answers at a cold server do not grow it by a burst),
drops at once from far past the knee, steps down no further than the queue it saw, follows a
latency step both ways, re-measures a slow server rarely, is shared by two bridges in front of
one server (bridges told their share keep one queue between them, also when told while they
run), ignores failures, and the slots of a replica follow it.

The first tests drive the rule with server models (`run`: latency as a function of the calls
in flight; `serve`: each call's answer time from when it was sent), a stand-in for the
servers a benchmark runs; the last one runs it over real HTTP in
front of a scripted server that answers one request at a time (tests/support/canned_http.py),
as a single-process CPU-bound NeMo Gym server does.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable
from typing import NamedTuple

import aiohttp
import pytest
from prometheus_client import generate_latest

from nemo_gym_grpc.bridge.flows.balancer import Balancer, Replica
from nemo_gym_grpc.bridge.flows.limits import (
    CALIBRATION_SAMPLES,
    CONFIRM_LOAD,
    GROWTH,
    INITIAL_LIMIT,
    QUEUE_HIGH,
    QUEUE_LOW,
    Limit,
)
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.bridge.nemo_gym.replies import ReplyBudget
from nemo_gym_grpc.v1 import verify_pb2
from tests.support.canned_http import CannedServer, canned
from tests.support.verifiers import verifier_for

CEILING = 256


class Clock:
    """Model time: each call ends `latency / load` seconds after the one before (a server
    with `load` calls in flight answers that many per `latency`)."""

    now = 0.0


def re_measuring(size: int) -> bool:
    """Whether a limit of `size` slots is re-measuring (`Limit.size`: then at most
    CALIBRATION_SAMPLES - 1)."""
    return size < CALIBRATION_SAMPLES


def run(limit: Limit, latency, samples: int, ramp: bool = True) -> list[int]:
    """Feed `limit` `samples` calls under full demand (as many in flight as it allows), with
    `ramp` the first INITIAL_LIMIT sent one after another as a burst's are (1, 2, ... in
    flight); `latency(load)` seconds each. Returns its size after each."""
    sizes = []
    for n in range(samples):
        load = n + 1 if ramp and n < INITIAL_LIMIT else limit.size
        rtt = latency(load)
        Clock.now += rtt / load
        sizes.append(limit.sample(rtt, load, Clock.now))
    return sizes


def serve(limit: Limit, done_at: Callable[[float, float], float], calls: int) -> list[Answer]:
    """`limit` in front of a server model under full demand, for `calls` answers: whenever the
    limit has free slots, calls fill them at once, each with the load the balancer reads
    (every call in flight, those sent with it included); `done_at(sent, last)` is the time a
    call sent at `sent` is answered, `last` that of the call sent before it (0.0 for the
    first), calls answered in the order sent. Returns what each answer saw."""
    sent: collections.deque[tuple[float, int, float]] = collections.deque()  # (at, load, done)
    now, last, answers = 0.0, 0.0, []
    while len(answers) < calls:
        at, free = now + 1e-5, limit.size - len(sent)  # (the bridge hands them on)
        for _ in range(free):
            last = done_at(at, last)
            sent.append((at, limit.size, last))
        at, load, now = sent.popleft()
        answers.append(Answer(now, len(sent) + 1, limit.sample(now - at, load, now)))
    return answers


class Answer(NamedTuple):
    at: float  # model seconds
    in_flight: int  # calls in flight when it came, itself included
    size: int  # the limit's size after it


def test_a_cpu_bound_server_keeps_a_small_standing_queue():
    limit = Limit(CEILING)
    sizes = run(limit, lambda load: 0.002 * load, 5000)  # one call at a time, 2 ms each
    late = sizes[-2000:]  # about 5 s
    steady = [size for size in late if not re_measuring(size)]
    assert len(late) - len(steady) < len(late) / 20, late  # re-measuring: a few calls at most
    # `load` calls in flight queue load - 1 of them: the limit is a queue of LOW..HIGH plus one
    assert all(QUEUE_LOW <= size <= QUEUE_HIGH + 2 for size in steady), late[-20:]
    assert abs(limit.no_load - 0.002) < 1e-9


def test_a_server_whose_latency_does_not_grow_gets_the_ceiling_within_a_few_round_trips():
    for ceiling in (CEILING, 16384):
        limit = Limit(ceiling)
        answers = serve(limit, lambda sent, last: sent + 1.0, 3 * ceiling)  # 1 s each
        reached = next(a.at for a in answers if a.size == ceiling)
        # from the first answers, GROWTH times per round trip of 1 s: 20 -> 160 -> ... 16,384
        trips = math.ceil(math.log(ceiling / INITIAL_LIMIT, GROWTH))
        assert reached - answers[0].at <= trips + 0.01, (reached, trips)


def test_one_round_trips_answers_grow_the_limit_at_most_growth_times():
    limit = Limit(16384)
    sizes = run(limit, lambda load: 1.0, INITIAL_LIMIT)  # the first round trip's answers
    # GROWTH - 1 per answer with QUEUE_LOW or more in flight: not twice per answer
    assert 2 * INITIAL_LIMIT < sizes[-1] <= GROWTH * INITIAL_LIMIT, sizes


def test_a_cold_server_is_not_sent_more_than_one_growth_past_its_first_limit():
    # the first answer 12 ms late: a no-load latency ten times too high at first, so the first
    # answers of a burst read as no queue. They met only the short queue ahead of them (the
    # calls behind them are the queue): they must not grow the limit by a whole burst.
    limit = Limit(16384)
    # one call at a time, 1 ms each, the very first 12 ms more
    answers = serve(limit, lambda sent, last: max(sent, last) + 0.001 + 0.012 * (not last), 3000)
    assert max(a.in_flight for a in answers) <= GROWTH * (INITIAL_LIMIT + 3), answers[:200]
    assert QUEUE_LOW <= limit.limit <= QUEUE_HIGH + 2, limit.limit


def test_a_limit_far_past_the_knee_drops_at_once():
    limit = Limit(CEILING)
    run(limit, lambda load: 0.002 * load, 3000)  # one call at a time: the no-load latency
    run(limit, lambda load: 0.002, 2000, ramp=False)  # now latency flat: the ceiling
    assert limit.size == CEILING
    run(limit, lambda load: 0.002 * load, 1, ramp=False)  # now one call at a time
    assert QUEUE_LOW <= limit.limit <= QUEUE_LOW + 2, limit.limit  # (its slots re-measure)


def test_one_window_that_meets_a_queue_takes_the_limit_down_to_that_queue_not_to_one():
    limit = Limit(16384)
    now = 0.0
    for _ in range(16384):  # latency flat at 1 s, no-load calls among them: the ceiling
        now += 1.0 / 16384
        limit.sample(1.0, 1, now)
        limit.sample(1.0, limit.size, now)
    assert limit.size == 16384
    for _ in range(16384):  # then a whole window answered in 1.5 s: a queue of 5,461 each
        now += 1.5 / 16384
        limit.sample(1.5, 16384, now)
    # each answer a step down, but not past where that queue would be QUEUE_LOW
    assert 16384 / 1.5 <= limit.size <= 16384 / 1.5 + QUEUE_HIGH, limit.size


def test_slow_calls_after_a_pause_do_not_look_like_a_server_without_a_queue():
    limit = Limit(CEILING)
    run(limit, lambda load: 0.002 * load, 3000)  # one call at a time, 2 ms each
    for _ in range(8):  # rounds of a trainer, each after a pause of 10 s
        Clock.now += 10.0
        # the first calls of a round connect anew (uvicorn closed the idle connections)
        cold = run(limit, lambda load: 0.030 + 0.002 * load, INITIAL_LIMIT)
        warm = run(limit, lambda load: 0.002 * load, 500, ramp=False)
        assert max(cold + warm) <= QUEUE_HIGH + 2, (cold, warm[:40])
    assert abs(limit.no_load - 0.002) < 1e-9


def test_a_slow_server_whose_latency_grows_with_load_is_rarely_re_measured():
    # an LLM judge: 1 s alone, 5% more per call in flight. Each re-measurement sends it one
    # call at a time for a few of its round trips.
    limit = Limit(CEILING)
    Clock.now = 0.0
    late = run(limit, lambda load: 1.0 + 0.05 * load, 20000)[-10000:]
    calibrating = [size for size in late if re_measuring(size)]
    assert len(calibrating) < len(late) / 100, len(calibrating)


def test_a_cold_first_answer_does_not_space_out_the_re_measurements():
    # a first answer of 200 ms at a 2 ms server: once re-measured, the next re-measurement
    # comes after CALIBRATE_AFTER (3 s) of queue, not after 60 times that first answer (12 s)
    limit = Limit(CEILING)
    limit.sample(0.200, 1, 0.0)
    now = 0.0
    while limit.no_load > 0.002 and now < 60.0:  # a queue, then the re-measurement's calls
        now += 0.01
        calibrating = re_measuring(limit.size)
        limit.sample(0.002 if calibrating else 0.500, 1 if calibrating else 30, now)
    measured = now
    # a queue of 24 calls at 2 ms each
    while not re_measuring(limit.size) and now < measured + 10.0:
        now += 0.01
        limit.sample(0.050, 25, now)
    assert now - measured < 3.5, now - measured


def test_a_cold_servers_first_answers_are_re_measured_at_the_first_queue():
    limit = Limit(CEILING)
    Clock.now = 0.0
    run(limit, lambda load: 0.030 + 0.002 * load, INITIAL_LIMIT)  # first request, new sockets
    assert limit.no_load > 0.030  # a first guess, ten times too high
    while Clock.now < 2.0:  # well before CALIBRATE_AFTER
        run(limit, lambda load: 0.002 * load, 1, ramp=False)
    assert abs(limit.no_load - 0.002) < 1e-9
    assert QUEUE_LOW <= limit.size <= QUEUE_HIGH + 2, limit.size


def test_a_re_measurement_sends_one_call_alone_then_the_others_together():
    # two round trips of a slow server, not three: the call alone is the no-load latency even
    # at a server that serves one call at a time; the others can only find it lower
    limit = Limit(CEILING)
    limit.sample(0.002, 1, 0.0)
    assert limit.sample(0.100, 30, 0.01) == 1  # the first queue: re-measured at once
    assert limit.sample(0.004, 2, 0.02) == 1  # sent with another in flight: not alone
    assert limit.sample(0.003, 1, 0.03) == CALIBRATION_SAMPLES - 1 == 2
    assert limit.sample(0.006, 2, 0.04) == 2
    assert limit.sample(0.005, 2, 0.04) >= QUEUE_LOW and limit.no_load == 0.003


def test_a_re_measurement_sends_no_more_calls_than_the_limit_it_ends_with():
    limit = Limit(CEILING, share=8)  # its share of the queue: 1.5 calls
    limit.sample(0.002, 1, 0.0)
    assert limit.sample(1.0, 13, 0.01) == 1  # re-measured; it ends at 13 x 2 ms / 1 s + 1.5
    assert limit.sample(0.003, 1, 0.02) == 1  # so the other two go one at a time


def test_one_slow_answer_among_many_that_met_no_queue_is_no_reason_to_re_measure():
    # the tail of a burst of thousands on a busy machine: one answer slow, the rest not.
    # A re-measurement begun on it would be waited out by the next burst, one call at a time.
    limit = Limit(16384)
    Clock.now = 0.0
    run(limit, lambda load: 1.0, 20000)  # latency flat: the ceiling, re-measured never
    limit.sample(1.0, 1, Clock.now)  # a no-load call; then 66 s (66 round trips) at load
    sizes = [limit.sample(1.0 + 0.01 * (k % 3), 16384, Clock.now + 0.011 * k) for k in range(6000)]
    assert min(sizes) == 16384
    assert limit.sample(1.66, 6812, Clock.now + 66.1) == 1  # a queue, long since a no-load call
    assert limit.sample(1.02, 6000, Clock.now + 66.2) == 16384  # sent before it: no queue
    assert limit.sample(1.60, 50, Clock.now + 66.3) == 16384  # and the clock began anew


def test_a_first_re_measurement_is_called_off_only_by_as_much_load_without_a_queue():
    # a bridge's first burst at a server whose latency is flat (never re-measured), under
    # CONFIRM_LOAD calls at once: one slow answer at its tail begins the first re-measurement
    # at once, which an answer sent with fewer calls in flight does not call off (the no-load
    # latency may still be a cold server's) and one sent with as many does
    limit = Limit(CONFIRM_LOAD - 100)
    Clock.now = 0.0
    run(limit, lambda load: 1.0, 2 * CONFIRM_LOAD)
    assert limit.size == CONFIRM_LOAD - 100
    assert limit.sample(2.5, 600, Clock.now + 0.1) == 1
    assert limit.sample(1.02, 500, Clock.now + 0.2) == 1
    assert limit.sample(1.02, 600, Clock.now + 0.3) == CONFIRM_LOAD - 100


def test_thousands_at_once_without_a_queue_are_no_cold_servers_first_guess():
    # the same burst with 16,384 at once: no server whose latency grows with load answers so
    # many within the tolerance of a cold guess, so a slow tail is a queue to step back from,
    # not a re-measurement that would hold the next burst for two round trips
    limit = Limit(16384)
    Clock.now = 0.0
    run(limit, lambda load: 1.0, 20000)
    assert limit.size == 16384
    size = limit.sample(2.5, 6812, Clock.now + 0.1)  # far past the knee: where its queue is low
    assert 6812 / 2.5 < size <= 6812 / 2.5 + QUEUE_HIGH, size
    assert limit.sample(1.0, 2000, Clock.now + 0.2) == size + GROWTH - 1  # and grows again


def test_latency_noise_at_thousands_in_flight_is_not_read_as_far_past_the_knee():
    limit = Limit(16384)
    run(limit, lambda load: 0.5, 20000)  # latency flat: the ceiling
    assert limit.size == 16384
    (size,) = run(limit, lambda load: 0.6, 1, ramp=False)  # 20% slower: 2,700 "queued"
    assert size >= 16384 - 10, size


def test_two_bridges_in_front_of_one_server_share_its_queue():
    first, second = Limit(CEILING), Limit(CEILING)
    sizes = []
    for _ in range(4000):
        rtt = 0.002 * (first.size + second.size)  # one server, one call at a time
        Clock.now += 0.001
        sizes.append(
            (first.sample(rtt, first.size, Clock.now), second.sample(rtt, second.size, Clock.now))
        )
    late = sizes[-1000:]  # about 1 s
    # each keeps its own queue of LOW..HIGH in front of the other's: the total at most twice
    # one bridge's, shared fairly (outside the few calls of a re-measurement)
    settled = [(a, b) for a, b in late if QUEUE_LOW <= a + b <= 2 * QUEUE_HIGH + 2]
    assert len(settled) >= 0.95 * len(late), collections.Counter(late).most_common(5)
    assert all(abs(a - b) <= 2 for a, b in settled), settled[-20:]


def one_server(limits: list[Limit], samples: int) -> list[int]:
    """`samples` rounds of one call per limit at a server that answers one call at a time;
    the limits' total after each round."""
    totals = []
    for _ in range(samples):
        rtt = 0.002 * sum(limit.size for limit in limits)
        Clock.now += 0.001
        totals.append(sum(limit.sample(rtt, limit.size, Clock.now) for limit in limits))
    return totals


def one_queue(totals: list[int], count: int) -> None:
    """The last 2,000 totals (about 2 s) are, but for 5%, one bridge's queue of LOW..HIGH
    (unshared: `count` times that, above)."""
    late = totals[-2000:]
    settled = [total for total in late if QUEUE_LOW <= total <= QUEUE_HIGH + count]
    assert len(settled) >= 0.95 * len(late), collections.Counter(late).most_common(5)


@pytest.mark.parametrize("count", [2, 4, 8])
def test_bridges_told_their_share_keep_one_queue_between_them(count):
    one_queue(one_server([Limit(CEILING, share=count) for _ in range(count)], 8000), count)


def test_bridges_told_their_share_while_running_come_to_one_queue():
    balancers = [Balancer(CEILING, adaptive=True) for _ in range(4)]
    limits = [balancer.replica("http://gym").limit for balancer in balancers]
    unshared = one_server(limits, 8000)[-2000:]
    assert sum(unshared) / len(unshared) > 2 * QUEUE_HIGH  # four queues
    for balancer in balancers:  # what `serve --sharing-bridges-file` does when the fleet grew
        balancer.reshare(4)
    one_queue(one_server(limits, 8000), 4)
    assert balancers[0].replica("http://judge").limit.share == 4  # replicas to come too


def test_a_latency_step_is_followed_both_ways():
    limit = Limit(CEILING)
    run(limit, lambda load: 0.010, 300)
    assert limit.size == CEILING
    stepped = Clock.now
    slow: list[int] = []
    while len(slow) < 2000 and (not slow or slow[-1] != CEILING):  # 10 -> 500 ms: a step
        slow += run(limit, lambda load: 0.500, 1, ramp=False)
    assert Clock.now - stepped < 10.0 and min(slow) == 1 and abs(limit.no_load - 0.5) < 1e-9
    back = run(limit, lambda load: 0.010, 50, ramp=False)
    assert min(back) == CEILING and limit.no_load == 0.010


async def test_a_burst_of_failures_moves_nothing_and_starves_no_server():
    items = [
        verify_pb2.VerifyRequest(request_id=f"i{n}", resources_server="s", completion="B")
        for n in range(60)
    ]
    with CannedServer("127.0.0.5") as server:
        server.answer("POST /verify", canned(503, b"overloaded"))
        async with aiohttp.ClientSession() as session:
            verifier = verifier_for(Upstreams({"s": server.url}), session)
            failed = await asyncio.gather(*(verifier.verify(i, None) for i in items[:30]))
            (replica,) = verifier.balancer.replicas()
            after_failures = (replica.limit.limit, replica.limit.no_load)
            server.answer("POST /verify", canned(200, b'{"reward": 1.0}'))
            scored = await asyncio.gather(*(verifier.verify(i, None) for i in items[30:]))
    assert all(r.error.code for r in failed)  # 503s, retried, then failed
    assert after_failures == (INITIAL_LIMIT, float("inf"))
    assert all(r.reward == 1.0 for r in scored)


async def test_the_slots_follow_the_limit():
    replica = Replica("http://127.0.0.1:1", CEILING, adaptive=True)
    replica.resize(1)
    held = replica.use()
    await held.__aenter__()
    waiting = asyncio.ensure_future(replica.use().__aenter__())
    await asyncio.sleep(0.01)
    assert not waiting.done() and replica.waiting == 1
    replica.resize(2)  # grows: the waiter gets the new slot at once
    await asyncio.wait_for(waiting, 1)
    assert replica.in_flight == 2
    replica.resize(1)  # shrinks: a slot given back goes, none is handed on
    third = asyncio.ensure_future(replica.use().__aenter__())
    await held.__aexit__(None, None, None)
    await asyncio.sleep(0.01)
    assert replica.in_flight == 1 and not third.done()
    third.cancel()


async def test_over_http_a_one_at_a_time_server_gets_its_queue_not_the_ceiling():
    items = [
        verify_pb2.VerifyRequest(request_id=f"i{n}", resources_server="s", completion="B")
        for n in range(400)
    ]
    with CannedServer("127.0.0.5", work=0.002, one_at_a_time=True) as server:
        server.answer("POST /verify", canned(200, b'{"reward": 1.0}'))
        async with aiohttp.ClientSession() as session:
            verifier = verifier_for(Upstreams({"s": server.url}), session)
            results = await asyncio.gather(*(verifier.verify(i, None) for i in items))
            (replica,) = verifier.balancer.replicas()
            verifier.metrics.watch(verifier.balancer, lambda: (0, 0), ReplyBudget(1 << 20))
            exported = generate_latest(verifier.metrics.registry).decode()
    assert all(r.reward == 1.0 for r in results), [r.error for r in results if r.error.code]
    assert replica.limit is not None and replica.limit.limit <= QUEUE_HIGH + 8, replica.limit.limit
    assert f'nemo_gym_grpc_upstream_limit{{upstream="{server.url}"}} {replica.limit.limit}' in (
        exported
    )
    assert f'nemo_gym_grpc_upstream_no_load_seconds{{upstream="{server.url}"}}' in exported
