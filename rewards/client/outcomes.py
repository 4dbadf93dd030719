"""What one item came to: a `VerifyResponse` (scoring) or a `RunResponse` (a rollout), or a
`Failure` saying why not.

Also the reasons (`google.rpc.ErrorInfo.reason`) of the failures only the client side decides
(a rollout without usable tokens, a bad `score` row); an item the client refuses for a cause the
bridge refuses too (not valid, over the message limit) gets the bridge's own reason
(`nemo_gym_grpc.shared.reasons`: `INVALID_ITEM`, `ITEM_TOO_LARGE`). And
`finite_number`, the one test of "a number worth reporting" for rows and reply fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import cast

import grpc
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from nemo_gym_grpc.v1 import rollout_pb2, verify_pb2

# A rollout without the tokens a trainer needs (decided by `stitch.py`): no model call returned
# token ids (the agent's policy model is not `vllm_model` with `return_token_id_information`)
# or nothing was generated; a turn's prompt does not continue the previous turn's prompt and
# generation; a turn's logprobs do not match its generated tokens.
NO_TOKENS = "NO_TOKENS"
TURNS_NOT_CONTIGUOUS = "TURNS_NOT_CONTIGUOUS"
LOGPROBS_MISMATCH = "LOGPROBS_MISMATCH"
# `score` input lines: not a JSON object with a `response` object; no route.
INVALID_ROW = "INVALID_ROW"
NO_RESOURCES_SERVER = "NO_RESOURCES_SERVER"

_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class ProtocolError(RuntimeError):
    """The bridge broke the VerifyStream / RunStream contract: a result with an unknown or
    duplicate `request_id`, or a stream that ended OK without a result for every item. Results are
    never zipped, broadcast or truncated onto the items, so this is raised instead."""


@dataclass(frozen=True)
class Failure:
    """Why one item has no reward.

    Attributes:
        code: canonical gRPC status code name, e.g. "NOT_FOUND", "UNAVAILABLE".
        reason: `google.rpc.ErrorInfo.reason` when the status carries one (e.g.
            "UNKNOWN_RESOURCES_SERVER", "UPSTREAM_UNAVAILABLE"), else None.
        message: human-readable detail (the bridge's or gRPC's message).
        whole_call: True when the item got no result of its own because the call failed as
            a whole (no connection, deadline, token refused, channel closed, bridge
            stopped): the item itself may be fine, and sending it again may score it.
        metadata: the `ErrorInfo` detail's metadata (rollouts: `failureKind`,
            `failureReason`, `stage`, `terminal`, when the bridge knows them); empty if none.
    """

    code: str
    reason: str | None
    message: str
    whole_call: bool = False
    metadata: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def cause(self) -> str:
        """Code and reason, e.g. "NOT_FOUND (UNKNOWN_RESOURCES_SERVER)" or "UNAVAILABLE"."""
        return f"{self.code} ({self.reason})" if self.reason else self.code

    @classmethod
    def from_status(cls, status: status_pb2.Status) -> Failure:
        """From a `google.rpc.Status` (a per-item `VerifyResponse.error`, or a call's rich
        status); the reason is taken from its first `ErrorInfo` detail."""
        reason = None
        metadata: dict[str, str] = {}
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason = info.reason or None
                metadata = dict(info.metadata)
                break
        code = _CODE_NAMES.get(status.code, f"CODE_{status.code}")
        return cls(code, reason, status.message, metadata=metadata)

    @classmethod
    def from_rpc_error(cls, error: grpc.RpcError) -> Failure:
        """From a failed call (the whole stream failed; a sync `grpc.Call` error or a
        `grpc.aio.AioRpcError`): its code, its rich status's ErrorInfo reason when the server
        sent one, and its details text. Not yet marked `whole_call`."""
        has_status = callable(getattr(error, "code", None))
        code = error.code() if has_status else None
        details = error.details() if has_status else None
        try:
            # a grpc.aio.AioRpcError is no grpc.Call but has the same three methods it reads
            status = rpc_status.from_call(cast(grpc.Call, error)) if has_status else None
        except ValueError:  # rich status inconsistent with the call's code/message
            status = None
        if status is not None:
            return cls.from_status(status)
        return cls(code.name if code is not None else "UNKNOWN", None, details or repr(error))


Outcome = verify_pb2.VerifyResponse | Failure
"""The outcome of one item: a successful `VerifyResponse` (`reward`, `reward_components`,
...), or a `Failure`."""

RunOutcome = rollout_pb2.RunResponse | Failure
"""The outcome of one rollout: a `RunResponse` whose `rollout` is set (reward, output, turns,
`latency_seconds`), or a `Failure`."""


def finite_number(value: object) -> float | None:
    """`value` as a float if it is an int or float (not a bool) and finite, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None
