"""`POST /run` on an agent server (e.g. simple_agent): the body the bridge sends and what it
reads back.

Request body (`BaseRunRequest` plus the row's own fields): the dataset row with its
`responses_create_params` (`rows.build_row`). Reply: the resources server's `/verify` reply
the agent got (`BaseVerifyResponse`): the row echoed back, `response` (the Responses object of
the whole rollout: `response.output` holds every output item, in order), `reward`, optional
`reward_components`, 0.7's `mask_sample` / `failure_kind` / `failure_reason`, and
`verification_skipped: true` when the agent's `skip_verification` is set (the reward is then
its `skip_verification_reward`). With `vllm_model` and `return_token_id_information: true`,
the last output item of each model call carries `prompt_token_ids`, `generation_token_ids` and
`generation_log_probs` (NeMo Gym's `TokenIDLogProbMixin`; `responses_converter.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym.scores import Scored, bad_reply, score_reply

RUN_PATH = "/run"

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


@dataclass(frozen=True, slots=True)
class TokenTurn:
    """The tokens of one model call (`Turn` in rollout.proto): the prompt's token ids, the
    generated token ids, and one natural-log probability per generated token."""

    prompt_token_ids: list[int]
    generation_token_ids: list[int]
    generation_log_probs: list[float]


@dataclass(frozen=True, slots=True)
class Ran:
    """What a finished rollout says: its score (`Scored`: reward, components, diagnostics,
    reply_json), `response.output` as JSON text ("[]" when absent), the token turns in order,
    and whether the agent skipped `/verify`."""

    scored: Scored
    output_json: str
    turns: list[TokenTurn] = field(default_factory=list)
    verification_skipped: bool = False


def _int_list(value: Any) -> list[int] | None:
    if not isinstance(value, list):
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return None
    return value


def _float_list(value: Any) -> list[float] | None:
    if not isinstance(value, list):
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return None
    return [float(v) for v in value]


def token_turns(output: list[Any], url: str) -> list[TokenTurn]:
    """One TokenTurn per output item that carries token information, in order.

    Raises:
        errors.ItemError: INTERNAL / UPSTREAM_BAD_REPLY for an item with only some of the
            three fields, with values that are not lists of integers / numbers, or with a
            different count of generated token ids and log probabilities.
    """
    turns = []
    for index, item in enumerate(output):
        if not isinstance(item, dict):
            continue
        present = [name for name in TOKEN_FIELDS if item.get(name) is not None]
        if not present:
            continue
        if len(present) != len(TOKEN_FIELDS):
            missing = sorted(set(TOKEN_FIELDS) - set(present))
            raise bad_reply(url, f"response.output[{index}] lacks {', '.join(missing)}")
        prompt = _int_list(item["prompt_token_ids"])
        generated = _int_list(item["generation_token_ids"])
        log_probs = _float_list(item["generation_log_probs"])
        if prompt is None or generated is None or log_probs is None:
            raise bad_reply(url, f"response.output[{index}] has token fields of the wrong type")
        if len(generated) != len(log_probs):
            raise bad_reply(
                url,
                f"response.output[{index}] has {len(generated)} generation_token_ids and "
                f"{len(log_probs)} generation_log_probs",
            )
        turns.append(TokenTurn(prompt, generated, log_probs))
    return turns


def read_rollout(reply: dict[str, Any], url: str, include_reply: bool) -> Ran:
    """The rollout in an agent's `/run` reply object (or an environment server's `result`,
    which has the same shape): `score_reply`'s rules for the reward and the mask, then
    `response.output` and its token turns.

    Raises:
        errors.ItemError: as `score_reply` (masked, a judge failure included: UNKNOWN /
            UPSTREAM_MASKED_SAMPLE, never retried, as rerunning means a new rollout; no
            numeric reward: INTERNAL / UPSTREAM_BAD_REPLY); INTERNAL / UPSTREAM_BAD_REPLY
            when `response.output` is there but not a list, or its token fields are
            malformed (`token_turns`).
    """
    scored = score_reply(reply, url, include_reply, judge_unavailable=False)
    response = reply.get("response")
    output: Any = response.get("output") if isinstance(response, dict) else None
    if output is None:
        output = []
    if not isinstance(output, list):
        raise bad_reply(url, "response.output is not a list")
    try:
        output_json = json.dumps(output, ensure_ascii=False)
    except ValueError as exc:  # (cannot happen for parsed JSON; kept for other callers)
        raise bad_reply(url, f"response.output cannot be encoded: {exc}") from None
    return Ran(
        scored,
        errors.utf8_text(output_json),
        token_turns(output, url),
        reply.get("verification_skipped") is True,
    )
