"""Translation between a `VerifyRequest` and NeMo Gym's `POST /verify` JSON.

Request body (NeMo Gym `BaseVerifyRequest` plus the resources server's own row fields): the
dataset row's fields with None values dropped, `responses_create_params` and `response`.
Reply body (`BaseVerifyResponse`): the request echoed back plus `reward`, optional
`reward_components` and the server's own fields. Judge failures are marked in a 200 reply
(`_ng_failure_class`; newer releases `failure_kind` / `mask_sample`).
"""

from __future__ import annotations

import json
import math
from typing import Any

from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.v1 import verify_pb2

DEFAULT_MODEL = "nemo-gym-grpc"

# Reply keys that VerifyResponse carries as typed fields or that only echo the request.
_TYPED_OR_ECHOED = frozenset({"reward", "reward_components", "responses_create_params", "response"})


def _json_object(text: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise errors.invalid_item(f"{field} is not valid JSON: {exc}", field=field) from None
    if not isinstance(value, dict):
        raise errors.invalid_item(
            f"{field} must be a JSON object, got {type(value).__name__}", field=field
        )
    return value


def completion_response(text: str, model: str, response_id: str = "resp") -> dict[str, Any]:
    """An OpenAI Responses object for a plain completion.

    Shape: a completed response with one assistant `message` output item holding one
    `output_text` part whose text is `text` (what NeMo Gym's simple agent gets from a policy
    that answered in text).
    """
    return {
        "id": response_id,
        "object": "response",
        "created_at": 0,
        "model": model,
        "status": "completed",
        "output": [
            {
                "id": "msg_0",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": text, "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
    }


def build_verify_body(request: verify_pb2.VerifyRequest) -> dict[str, Any]:
    """The JSON body of NeMo Gym's `POST /verify` for one item.

    Order of precedence is documented on `VerifyRequest` in verify.proto. Keys whose value is
    null are dropped from the row and from `responses_create_params`: a row from an Arrow
    table (axolotl's loader, `datasets`) or a saved rollout has null for every parameter that
    another row sets or the rollout left unset, and NeMo Gym's request models reject some of
    them (HTTP 422 for `"parallel_tool_calls": null`) where the absent key gets the default.

    Raises:
        errors.ItemError: INVALID_ARGUMENT when a JSON field is not a JSON object.
    """
    body: dict[str, Any] = {}
    if request.row_json:
        row = _json_object(request.row_json, "row_json")
        body = {key: value for key, value in row.items() if value is not None}
    if request.responses_create_params_json:
        body["responses_create_params"] = _json_object(
            request.responses_create_params_json, "responses_create_params_json"
        )
    elif "responses_create_params" not in body:
        body["responses_create_params"] = {
            "input": [{"role": m.role or "user", "content": m.content} for m in request.prompt]
        }
    params = body["responses_create_params"]
    if isinstance(params, dict):
        body["responses_create_params"] = {k: v for k, v in params.items() if v is not None}
    if request.response_json:
        body["response"] = _json_object(request.response_json, "response_json")
    else:
        body["response"] = completion_response(
            request.completion, request.model or DEFAULT_MODEL, f"resp_{request.request_id}"
        )
    return body


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def read_verify_reply(
    raw: bytes, url: str, result: verify_pb2.VerifyResponse, include_reply: bool
) -> None:
    """Fill `result` (reward, reward_components, reply_json) from a 200 `/verify` body.

    Raises:
        errors.ItemError: the body is not a JSON object, has no finite numeric `reward`,
            has non-numeric `reward_components`, or marks a failure
            (`_ng_failure_class`, `failure_kind`, `mask_sample`).
    """

    def bad_reply(message: str) -> errors.ItemError:
        return errors.ItemError(
            code_pb2.INTERNAL, errors.UPSTREAM_BAD_REPLY, f"{url}: {message}", upstreamUrl=url
        )

    try:
        reply = json.loads(raw)
    except (ValueError, RecursionError):
        raise bad_reply(f"reply is not JSON: {raw[:200]!r}") from None
    if not isinstance(reply, dict):
        raise bad_reply(f"reply is not a JSON object: {raw[:200]!r}")

    failure_class = reply.get("_ng_failure_class")
    if failure_class:
        code = code_pb2.UNAVAILABLE if failure_class == "judge_failed" else code_pb2.INTERNAL
        reason = (
            errors.UPSTREAM_JUDGE_FAILED
            if failure_class == "judge_failed"
            else errors.UPSTREAM_REPORTED_FAILURE
        )
        detail = reply.get("_ng_failure_judge_error", "")
        raise errors.ItemError(
            code,
            reason,
            f"{url} reported {failure_class}: {str(detail)[:200]}",
            retryable=False,  # a retry would repeat the judge calls (the caller may resubmit)
            upstreamUrl=url,
            failureClass=failure_class,
        )
    if reply.get("failure_kind") or reply.get("mask_sample") is True:
        raise errors.ItemError(
            code_pb2.INTERNAL,
            errors.UPSTREAM_REPORTED_FAILURE,
            f"{url} reported failure {reply.get('failure_kind')!r}: "
            f"{str(reply.get('failure_reason') or '')[:200]}",
            upstreamUrl=url,
            failureKind=reply.get("failure_kind"),
        )

    reward = _number(reply.get("reward"))
    if reward is None:
        raise bad_reply(f"reply has no finite numeric reward (got {reply.get('reward')!r})")
    result.reward = reward

    components = reply.get("reward_components") or {}
    if not isinstance(components, dict):
        raise bad_reply("reward_components is not an object")
    for name, value in components.items():
        number = _number(value)
        if number is None:
            raise bad_reply(f"reward_components[{name!r}] is not a finite number")
        if errors.utf8_text(name) != name:
            raise bad_reply(f"reward_components key {name!r} is not valid Unicode text")
        result.reward_components[name] = number

    if include_reply:
        other = {k: v for k, v in reply.items() if k not in _TYPED_OR_ECHOED}
        result.reply_json = json.dumps(other)
