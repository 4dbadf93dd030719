"""`POST /run` on a NeMo Gym 0.7 environment server (`base_environment_server.py`,
`episode_types.py`): one episode.

Request (`BaseEpisodeRequest`, extra=forbid): `{"episode_id": {"rollout_id", "attempt"},
"task": {"task_id": {"taskset", "task_id"}, "task_input": ...}}`; `episode_id` is NeMo Gym's
`EpisodeId` (`correlation.py`: a valid rollout id, `attempt` counted from 0).
single_agent_turn's `task_input` is `{"responses_create_params", "task_data"}`. Reply
(`BaseEpisodeResponse`): `{episode_id, task_id, result | failure}`: `result` is the episode's
result (single_agent_turn: the resources server's `/verify` reply plus
`ng_agent_observations`); `failure` is `{failure_reason, terminal, failure_kind?, stage?}`
with stage one of admission, seed, agent, verification, cleanup. Admission control
(`max_concurrent_episodes`, `queue_timeout_seconds`) refuses an episode with stage
"admission" and terminal false: it never started.
"""

from __future__ import annotations

from typing import Any

from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym import reports
from nemo_gym_grpc.bridge.nemo_gym.correlation import episode_id
from nemo_gym_grpc.bridge.nemo_gym.run import Ran, read_rollout
from nemo_gym_grpc.bridge.nemo_gym.scores import (
    MAX_FAILURE_KIND,
    MAX_FAILURE_REASON,
    bad_reply,
    diagnostic_text,
    parse_reply,
)
from nemo_gym_grpc.shared import reasons

ADMISSION = "admission"


def task_input(row: dict[str, Any]) -> dict[str, Any]:
    """single_agent_turn's `task_input` from a row with its `responses_create_params`
    (`rows.build_row`): `{"responses_create_params": ..., "task_data": <the other
    fields>}`."""
    data = {k: v for k, v in row.items() if k != "responses_create_params"}
    return {"responses_create_params": row["responses_create_params"], "task_data": data}


def episode_body(
    rollout_id: str, attempt: int, taskset: str, task_id: str, task_input: dict[str, Any]
) -> dict[str, Any]:
    """The `/run` body of attempt `attempt` (0 = the first) of episode `rollout_id`."""
    return {
        "episode_id": episode_id(rollout_id, attempt),
        "task": {"task_id": {"taskset": taskset, "task_id": task_id}, "task_input": task_input},
    }


def episode_error(failure: dict[str, Any], url: str) -> errors.ItemError:
    """The per-rollout error of an episode `failure`.

    UNAVAILABLE / UPSTREAM_EPISODE_FAILED, retryable, for stage "admission" with terminal
    false (the environment server refused the episode before it started); else INTERNAL /
    UPSTREAM_EPISODE_FAILED, final. Metadata: `upstreamUrl`, `stage`, `terminal` ("true" /
    "false"), `failureKind`, `failureReason`, `failureReport` (`reports.py`; those the
    failure has).
    """
    stage = diagnostic_text(failure.get("stage"), MAX_FAILURE_KIND)
    kind = diagnostic_text(failure.get("failure_kind"), MAX_FAILURE_KIND)
    why = diagnostic_text(failure.get("failure_reason"), MAX_FAILURE_REASON)
    terminal = failure.get("terminal") is True
    admission = stage == ADMISSION and not terminal
    message = f"{url}: episode failed"
    if stage:
        message += f" at {stage}"
    if kind:
        message += f" ({kind})"
    if why:
        message += f": {why[:200]}"
    return errors.ItemError(
        code_pb2.UNAVAILABLE if admission else code_pb2.INTERNAL,
        reasons.UPSTREAM_EPISODE_FAILED,
        message,
        retryable=admission,
        upstreamUrl=url,
        stage=stage or None,
        terminal="true" if terminal else "false",
        failureKind=kind or None,
        failureReason=why or None,
        failureReport=reports.bounded(failure.get(reports.EPISODE_FIELD)) or None,
    )


def read_episode_reply(raw: bytes, url: str, include_reply: bool) -> Ran:
    """The rollout in a 200 episode `/run` reply: its `result` read as an agent's `/run`
    reply (`read_rollout`; `reply_json` then holds the result's other fields).

    Raises:
        errors.ItemError: `episode_error` for a `failure`; INTERNAL / UPSTREAM_BAD_REPLY
            when the body is not a JSON object or has neither (or both) of `result` and
            `failure`; what `read_rollout` raises for the result.
    """
    reply = parse_reply(raw, url)
    result, failure = reply.get("result"), reply.get("failure")
    if isinstance(failure, dict) and result is None:
        raise episode_error(failure, url)
    if not isinstance(result, dict) or failure is not None:
        raise bad_reply(url, f"episode reply has no result object: {raw[:200]!r}")
    return read_rollout(result, url, include_reply)
