"""The score in a NeMo Gym reply: the resources server's `/verify` reply (`BaseVerifyResponse`:
the request echoed back plus `reward`, optional `reward_components` and the server's own
fields), read alone or inside an agent's `/run` reply. A sample that is no valid measurement is
marked in a 200 reply (`mask_sample`; 0.7's `failure_kind` / `failure_reason` say why;
`_ng_failure_class` for a judge failure).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from google.rpc import code_pb2

from nemo_gym_grpc.bridge import errors
from nemo_gym_grpc.bridge.nemo_gym import codec
from nemo_gym_grpc.shared import reasons

# Reply keys that VerifyResponse carries as typed fields or that only echo the request.
_TYPED_OR_ECHOED = frozenset({"reward", "reward_components", "responses_create_params", "response"})


@dataclass(frozen=True, slots=True)
class Scored:
    """What a 200 `/verify` reply says: the reward, its named components, the reply's other
    fields as JSON text ("" unless asked for), and NeMo Gym >= 0.7's diagnostics of a valid
    but degraded measurement (`failure_kind`, `failure_reason`; "" when the reply has none)."""

    reward: float
    components: dict[str, float]
    reply_json: str
    failure_kind: str = ""
    failure_reason: str = ""


# Longest failure_kind / failure_reason passed on, characters (NeMo Gym's kinds are short
# names; a reason can hold a whole traceback).
MAX_FAILURE_KIND = 200
MAX_FAILURE_REASON = 1000
JUDGE_FAILED = "judge_failed"


def number(value: Any) -> float | None:
    """`value` as a finite float, or None (booleans, text, NaN, infinities, huge integers)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        as_float = float(value)
    except OverflowError:  # an integer beyond float range: no finite reward
        return None
    return as_float if math.isfinite(as_float) else None


def diagnostic_text(value: Any, limit: int) -> str:
    """A reply's diagnostic value as text of at most `limit` characters ("" for null/"")."""
    if value is None:
        return ""
    return errors.utf8_text(value if isinstance(value, str) else json.dumps(value))[:limit]


def masked(reply: dict[str, Any]) -> bool:
    """True when a `/verify` reply says its reward is no valid measurement: `mask_sample`
    true at the top level (NeMo Gym >= 0.7) or in `instance_config` (what NeMo RL reads), or
    the legacy `_ng_failure_class` (0.4-0.7 judge failsafe) set."""
    config = reply.get("instance_config")
    return (
        reply.get("mask_sample") is True
        or (isinstance(config, dict) and config.get("mask_sample") is True)
        or bool(reply.get("_ng_failure_class"))
    )


def masked_error(
    reply: dict[str, Any], url: str, judge_unavailable: bool = True
) -> errors.ItemError:
    """The per-item error of a masked reply (see `masked`); never retried (a retry would
    repeat the scoring and its judge calls; the caller may resubmit).

    UNAVAILABLE / UPSTREAM_JUDGE_FAILED when `failure_kind` or `_ng_failure_class` is
    "judge_failed" (a judge model that failed is usually back a moment later). Else UNKNOWN /
    UPSTREAM_MASKED_SAMPLE: the verdict comes from NeMo Gym's failure kinds, an error space
    that does not say whether the cause is transient (gRPC's guide: UNKNOWN for "a status from
    an error space not known here" and for errors "that do not return enough error
    information"); not UNAVAILABLE, which tells clients to retry, nor INTERNAL, which is for
    broken invariants. Metadata: `upstreamUrl`, `failureKind`, `failureReason`,
    `failureClass` (those the reply has). With `judge_unavailable` False (rollouts: a retry
    would run the whole rollout again) a judge failure is UNKNOWN / UPSTREAM_MASKED_SAMPLE too.
    """
    kind = diagnostic_text(reply.get("failure_kind"), MAX_FAILURE_KIND)
    failure_class = diagnostic_text(reply.get("_ng_failure_class"), MAX_FAILURE_KIND)
    why = diagnostic_text(
        reply.get("failure_reason") or reply.get("_ng_failure_judge_error"), MAX_FAILURE_REASON
    )
    judge = judge_unavailable and JUDGE_FAILED in (kind, failure_class)
    name = kind or failure_class
    message = f"{url} reported {name}" if name else f"{url} masked the sample (mask_sample)"
    if why:
        message += f": {why[:200]}"
    return errors.ItemError(
        code_pb2.UNAVAILABLE if judge else code_pb2.UNKNOWN,
        reasons.UPSTREAM_JUDGE_FAILED if judge else reasons.UPSTREAM_MASKED_SAMPLE,
        message,
        retryable=False,
        upstreamUrl=url,
        failureKind=kind or None,
        failureReason=why or None,
        failureClass=failure_class or None,
    )


def bad_reply(url: str, message: str) -> errors.ItemError:
    """INTERNAL / UPSTREAM_BAD_REPLY: a 200 reply from `url` that says no usable result."""
    return errors.ItemError(
        code_pb2.INTERNAL, reasons.UPSTREAM_BAD_REPLY, f"{url}: {message}", upstreamUrl=url
    )


def parse_reply(raw: bytes, url: str) -> dict[str, Any]:
    """A 200 reply body as a JSON object.

    Raises:
        errors.ItemError: INTERNAL / UPSTREAM_BAD_REPLY when it is not JSON or not an object.
    """
    try:
        reply = codec.loads(raw)
    except (ValueError, RecursionError):
        raise bad_reply(url, f"reply is not JSON: {raw[:200]!r}") from None
    if not isinstance(reply, dict):
        raise bad_reply(url, f"reply is not a JSON object: {raw[:200]!r}")
    return reply


def score_reply(
    reply: dict[str, Any], url: str, include_reply: bool, judge_unavailable: bool = True
) -> Scored:
    """The score in a `/verify` reply object (also an agent's `/run` reply and an environment
    server's `result`: the same shape); `include_reply` keeps the reply's other fields.

    A reply with `failure_kind` / `failure_reason` but not masked (NeMo Gym >= 0.7: the two
    are orthogonal) is a valid measurement: its reward is returned, with the two in
    `Scored.failure_kind` / `failure_reason`.

    Raises:
        errors.ItemError: no finite numeric `reward`, or non-numeric `reward_components`
            (INTERNAL / UPSTREAM_BAD_REPLY); or it is masked (`masked`; see
            `masked_error`, which gets `judge_unavailable`). None is retryable: a retry
            would repeat the same scoring (and, for judge failures, its judge calls).
    """
    if masked(reply):
        raise masked_error(reply, url, judge_unavailable)
    reward = number(reply.get("reward"))
    if reward is None:
        got = f"{reply.get('reward')!r:.100}"
        raise bad_reply(url, f"reply has no finite numeric reward (got {got})")
    found = reply.get("reward_components") or {}
    if not isinstance(found, dict):
        raise bad_reply(url, "reward_components is not an object")
    components: dict[str, float] = {}
    for name, value in found.items():
        component = number(value)
        if component is None:
            raise bad_reply(url, f"reward_components[{name!r}] is not a finite number")
        if errors.has_lone_surrogate(name):
            raise bad_reply(url, f"reward_components key {name!r} is not valid Unicode text")
        components[name] = component
    other = ""
    if include_reply:
        other = json.dumps({k: v for k, v in reply.items() if k not in _TYPED_OR_ECHOED})
    return Scored(
        reward,
        components,
        other,
        diagnostic_text(reply.get("failure_kind"), MAX_FAILURE_KIND),
        diagnostic_text(reply.get("failure_reason"), MAX_FAILURE_REASON),
    )
