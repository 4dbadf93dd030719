"""An item, answered or failed, leaves no reference cycle in the bridge (bridge/errors.py: the
bridge runs Python's cycle collector rarely, so a cycle per item or per attempt would hold its
frames, bodies and connections until then). Items go through an in-process `Verifier` over
real HTTP on loopback to a port nothing listens on (refused, three attempts each), to a
stand-in that answers 500 and to one that answers 200 (a stand-in: the 500 on demand); after
warm-up items, the objects the collector finds unreachable stay far below one per item (a
refused attempt left about 37, frames included, before the fix)."""

from __future__ import annotations

import gc
import json

import aiohttp
import pytest
from aiohttp import web

from nemo_gym_grpc.bridge.flows.attempts import RetryPolicy
from nemo_gym_grpc.bridge.flows.upstreams import Upstreams
from nemo_gym_grpc.v1 import verify_pb2
from tests.support.procs import closed_port
from tests.support.verifiers import verifier_for
from tests.support.web_app import serve_app

ITEMS = 200


async def _stand_in(status: int) -> tuple[web.AppRunner, str]:
    async def verify(request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({**body, "reward": 1.0}, status=status)

    app = web.Application()
    app.add_routes([web.post("/verify", verify)])
    return await serve_app(app)


def _item(number: int) -> verify_pb2.VerifyRequest:
    row = {"responses_create_params": {"input": [{"role": "user", "content": "q"}]}}
    return verify_pb2.VerifyRequest(
        request_id=f"r{number}", resources_server="s", row_json=json.dumps(row), completion="a"
    )


async def _unreachable_after(url: str) -> tuple[int, set[str]]:
    """(objects found unreachable after ITEMS items to `url`, their outcomes: "reward" or the
    error's gRPC code)."""
    retry = RetryPolicy(attempts=3, budget=30.0, initial_backoff=0.0, max_backoff=0.0)
    async with aiohttp.ClientSession() as session:
        verifier = verifier_for(Upstreams({"s": url}), session, retry=retry)
        for number in range(5):  # warm-up: connections, capabilities, lazy imports
            await verifier.verify(_item(number), None)
        gc.collect()
        gc.disable()
        try:
            results = [await verifier.verify(_item(n), None) for n in range(ITEMS)]
            found = gc.collect()
        finally:
            gc.enable()
        await verifier.aclose()
    outcomes = {str(r.error.code) if r.HasField("error") else "reward" for r in results}
    return found, outcomes


@pytest.mark.parametrize(
    ("status", "outcome"),
    [(None, "14"), (500, "13"), (200, "reward")],  # UNAVAILABLE, INTERNAL
    ids=["refused", "http_500", "ok"],
)
async def test_items_leave_no_reference_cycles(status, outcome):
    if status is None:
        found, outcomes = await _unreachable_after(f"http://127.0.0.1:{closed_port()}")
    else:
        runner, url = await _stand_in(status)
        try:
            found, outcomes = await _unreachable_after(url)
        finally:
            await runner.cleanup()
    assert outcomes == {outcome}
    assert found < ITEMS, f"{found} objects in reference cycles after {ITEMS} items"
