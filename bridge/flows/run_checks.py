"""The checks a rollout (`RunRequest`) passes before any upstream call, and its encoding to
the `/run` body of its server's protocol. Pure: no I/O, no state. A failed check is that
rollout's INVALID_ARGUMENT alone. Size and JSON rules are every item's (`checks`).
"""

from __future__ import annotations

from dataclasses import dataclass

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.flows.checks import check_envelope, encode, json_object
from nemo_gym_grpc.bridge.nemo_gym import codec, episodes
from nemo_gym_grpc.bridge.nemo_gym.correlation import rollout_id_problem
from nemo_gym_grpc.bridge.nemo_gym.head import ENVIRONMENT
from nemo_gym_grpc.bridge.nemo_gym.rows import build_row
from nemo_gym_grpc.v1 import rollout_pb2

# The RunRequest fields that carry JSON text.
JSON_FIELDS = ("row_json", "responses_create_params_json", "task_input_json")


@dataclass(frozen=True, slots=True)
class Checked:
    """A checked rollout, its JSON encoded once: `payload` is the agent `/run` body (the row
    with its `responses_create_params`) or, for an environment server, the episode's
    `task_input`; `taskset` and `task_id` name the episode's task ("" for an agent)."""

    payload: bytes
    taskset: str = ""
    task_id: str = ""

    def episode_body(self, rollout_id: str, attempt: int) -> bytes:
        """The environment server `/run` body of attempt `attempt` (0 = the first), as
        `episodes.episode_body` builds it, around the encoded `task_input`."""
        head = episodes.episode_body(rollout_id, attempt, self.taskset, self.task_id, {})
        head["task"]["task_input"] = None  # the last key: its text ends the body
        return codec.dumps(head)[: -len(b"null}}")] + self.payload + b"}}"


def check_run(request: rollout_pb2.RunRequest, *, max_item_bytes: int) -> None:
    """The checks that do not depend on the agent's protocol.

    Raises:
        errors.ItemError: INVALID_ARGUMENT / ITEM_TOO_LARGE for a rollout over
            `max_item_bytes` (`RunRequest.ByteSize()`); INVALID_ARGUMENT / INVALID_ITEM for
            an empty `request_id` or `agent`, or a negative or non-finite `timeout_seconds`.
    """
    check_envelope(request, "agent", max_item_bytes)


def check_body(request: rollout_pb2.RunRequest, protocol: str) -> Checked:
    """The rollout's body parts for its server's `protocol` (`head.AGENT` or `ENVIRONMENT`),
    built as rollout.proto's RunRequest says; each body is encoded once here, so an item
    that cannot be sent fails before any call.

    Raises:
        errors.ItemError: INVALID_ARGUMENT / INVALID_ITEM for JSON text that is invalid or
            not an object, that cannot be sent (`validation.encode`), or, for an
            environment server, a `request_id` that is no valid episode `rollout_id`.
    """
    row = json_object(request.row_json, "row_json") if request.row_json else None
    params = None
    if request.responses_create_params_json:
        params = json_object(request.responses_create_params_json, "responses_create_params_json")
    built = build_row(request.prompt, row=row, params=params)
    parsed = list(zip(JSON_FIELDS[:2], (row, params), strict=True))
    if protocol != ENVIRONMENT:
        return Checked(encode(built, parsed))
    problem = rollout_id_problem(request.request_id)
    if problem:
        raise errors.invalid_item(
            f"request_id {request.request_id[:100]!r} is the episode's rollout_id and {problem}",
            field="request_id",
        )
    if request.task_input_json:
        given = json_object(request.task_input_json, "task_input_json")
        payload = encode(given, [("task_input_json", given)])
    else:
        payload = encode(episodes.task_input(built), parsed)
    return Checked(
        payload,
        taskset=request.taskset or request.agent,
        task_id=request.task_id or request.request_id,
    )
