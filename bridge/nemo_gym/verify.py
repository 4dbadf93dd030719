"""`POST /verify` on a resources server: the body the bridge sends and what it reads back.

Request body (`BaseVerifyRequest` plus the server's own row fields): the dataset row's fields
with None values dropped, `responses_create_params` (`rows.build_row`) and `response`. Reply:
its score (`scores.score_reply`).
"""

from __future__ import annotations

from typing import Any

from nemo_gym_grpc.bridge.nemo_gym.rows import build_row
from nemo_gym_grpc.bridge.nemo_gym.scores import Scored, parse_reply, score_reply
from nemo_gym_grpc.v1 import verify_pb2

VERIFY_PATH = "/verify"
DEFAULT_MODEL = "nemo-gym-grpc"


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


def build_verify_body(
    request: verify_pb2.VerifyRequest,
    *,
    row: dict[str, Any] | None,
    params: dict[str, Any] | None,
    response: dict[str, Any] | None,
) -> dict[str, Any]:
    """The JSON body of `POST /verify` for one item: `build_row`, then `response`.

    Args:
        request: the item (its prompt, completion, model and request_id are used when the
            JSON fields below do not say otherwise).
        row, params, response: the item's `row_json`, `responses_create_params_json` and
            `response_json` as parsed JSON objects; None when the field is empty.
    """
    body = build_row(request.prompt, row=row, params=params)
    if response is not None:
        body["response"] = response
    else:
        body["response"] = completion_response(
            request.completion, request.model or DEFAULT_MODEL, f"resp_{request.request_id}"
        )
    return body


def read_verify_reply(raw: bytes, url: str, include_reply: bool) -> Scored:
    """The score in a 200 `/verify` body (`parse_reply`, then `score_reply`; raises as they
    do)."""
    return score_reply(parse_reply(raw, url), url, include_reply)
