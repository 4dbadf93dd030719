"""A dataset row with its `responses_create_params`: what NeMo Gym's `/verify` body (with the
`response` after it) and an agent's `/run` body are made of."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from nemo_gym_grpc.v1 import verify_pb2


def build_row(
    prompt: Iterable[verify_pb2.Message],
    *,
    row: dict[str, Any] | None,
    params: dict[str, Any] | None,
) -> dict[str, Any]:
    """A dataset row with its `responses_create_params`: the body of an agent's `/run` and
    the part of `/verify`'s body before `response`.

    Args:
        prompt: the item's typed prompt, used only when neither `params` nor the row has
            `responses_create_params` (`{"input": [{"role", "content"}, ...]}`; role "" =
            "user").
        row, params: the item's `row_json` and `responses_create_params_json` as parsed
            JSON objects; None when the field is empty.

    Order of precedence is documented on `VerifyRequest` in verify.proto. Keys whose value is
    null are dropped from the row and from `responses_create_params`: a row from an Arrow
    table (axolotl's loader, `datasets`) or a saved rollout has null for every parameter that
    another row sets or the rollout left unset, and NeMo Gym's request models reject some of
    them (HTTP 422 for `"parallel_tool_calls": null`) where the absent key gets the default.
    """
    body: dict[str, Any] = {}
    if row is not None:
        body = {key: value for key, value in row.items() if value is not None}
    if params is not None:
        body["responses_create_params"] = params
    elif "responses_create_params" not in body:
        body["responses_create_params"] = {
            "input": [{"role": m.role or "user", "content": m.content} for m in prompt]
        }
    found = body["responses_create_params"]
    if isinstance(found, dict):
        body["responses_create_params"] = {k: v for k, v in found.items() if v is not None}
    return body
