"""A failure report from upstream reaches the failed item's or rollout's error metadata
(`failureReport`, bridge/nemo_gym/reports.py): the `X-NG-Failure-Report` header of a `/verify`
or `/run` reply, an episode failure's `failure_report` field (which wins over the header), at
most 2 KiB, a cut one marked.

The upstream is scripted (tests/support/fault_proxy.py with no upstream behind it) because no
released NeMo Gym sends a failure report: 0.7.0, the newest, has neither the header nor the
field. What 0.7.0 does send (`failure_kind`, `failure_reason`) is tested on a real 0.7 judge
failure in tests/test_judge_failure.py. Real bridge process, real gRPC, real HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from nemo_gym_grpc.bridge.nemo_gym import reports
from nemo_gym_grpc.rewards import run_rollouts
from nemo_gym_grpc.rewards.client.outcomes import Failure
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import BridgeProcess, start_bridge
from tests.support.fault_proxy import Fault, FaultProxy
from tests.support.items import error_info

REPORT = "judge_model: HTTP 503 <- openai_model judge_503: overloaded"
FAILURE = {"failure_reason": "agent raised", "terminal": True, "stage": "agent"}


@pytest.fixture(scope="module")
def scripted() -> Iterator[FaultProxy]:
    with FaultProxy(None) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def bridge(scripted) -> Iterator[BridgeProcess]:
    with start_bridge(
        "--server",
        f"judged={scripted.url}",
        "--agent",
        f"agent={scripted.url}",
        "--environment-server",
        f"environment={scripted.url}",
        "--retry-attempts",
        "1",
    ) as process:
        yield process


def row(marker: str) -> dict[str, Any]:
    return {"responses_create_params": {"input": [{"role": "user", "content": marker}]}}


def rollout_failure(bridge: BridgeProcess, agent: str, marker: str) -> Failure:
    (outcome,) = run_rollouts([row(marker)], agent=agent, target=bridge.target)
    assert isinstance(outcome, Failure), outcome
    return outcome


def test_a_verify_replys_header_joins_what_the_masked_reply_says(bridge, scripted):
    masked = {
        "reward": 0.0,
        "mask_sample": True,
        "failure_kind": "judge_failed",
        "failure_reason": "judge answered 503",
    }
    scripted.set_faults(
        Fault("status", body=json.dumps(masked).encode(), headers={reports.HEADER: REPORT})
    )
    item = verify_pb2.VerifyRequest(
        request_id="masked", resources_server="judged", completion="31", row_json="{}"
    )
    with grpc.insecure_channel(bridge.target) as channel:
        result = verify_pb2_grpc.VerifyServiceStub(channel).Verify(item, timeout=60)
    metadata = error_info(result).metadata
    assert metadata["failureKind"] == "judge_failed"
    assert metadata["failureReason"] == "judge answered 503"
    assert metadata[reports.REPORT_KEY] == REPORT


def test_a_run_replys_header_reaches_the_rollouts_error(bridge, scripted):
    scripted.set_faults(
        Fault("status", status=500, body=b'{"detail": "boom"}', headers={reports.HEADER: REPORT})
    )
    failure = rollout_failure(bridge, "agent", "http-500")
    assert failure.reason == "UPSTREAM_HTTP_ERROR"
    assert failure.metadata[reports.REPORT_KEY] == REPORT


def test_an_episodes_own_report_wins_over_the_header_and_is_kept_as_json(bridge, scripted):
    chain = [{"server": "agent", "error": "raised"}, {"server": "policy", "error": "timeout"}]
    reply = {"episode_id": {}, "task_id": {}, "failure": {**FAILURE, "failure_report": chain}}
    scripted.set_faults(
        Fault("status", body=json.dumps(reply).encode(), headers={reports.HEADER: REPORT})
    )
    failure = rollout_failure(bridge, "environment", "episode")
    assert failure.reason == "UPSTREAM_EPISODE_FAILED"
    assert failure.metadata["failureReason"] == "agent raised"
    assert json.loads(failure.metadata[reports.REPORT_KEY]) == chain


def test_a_long_report_is_cut_to_2_kib_and_marked(bridge, scripted):
    long = "é" * 1500  # 3,000 bytes of UTF-8: the cut must not split a character
    reply = {"episode_id": {}, "task_id": {}, "failure": {**FAILURE, "failure_report": long}}
    scripted.set_faults(Fault("status", body=json.dumps(reply).encode()))
    report = rollout_failure(bridge, "environment", "long").metadata[reports.REPORT_KEY]
    assert report.endswith(reports.TRUNCATED) and report.startswith("é" * 100)
    assert len(report.encode()) <= reports.MAX_REPORT_BYTES
    assert len(report.encode()) > reports.MAX_REPORT_BYTES - 2 - len(reports.TRUNCATED)


def test_no_report_no_key(bridge, scripted):
    scripted.set_faults(Fault("status", status=500, body=b'{"detail": "boom"}'))
    assert reports.REPORT_KEY not in rollout_failure(bridge, "agent", "plain").metadata
