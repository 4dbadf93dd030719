"""A step-wise server's `/step` reply (NeMo Gym 0.7's `EnvStepResponse`: `observation`,
`reward`, `terminated`, `truncated`, `info`) read into a `StepResult`. A sample that is no valid
measurement is failed as in a `/verify` reply (`scores.masked`)."""

from __future__ import annotations

import json

from nemo_gym_grpc.bridge.nemo_gym import scores
from nemo_gym_grpc.v1 import session_pb2


def read_step_reply(raw: bytes, url: str) -> session_pb2.StepResult:
    """The StepResult of a 200 `/step` body.

    Raises:
        errors.ItemError: INTERNAL / UPSTREAM_BAD_REPLY (not a JSON object, no finite numeric
            `reward`, `terminated` / `truncated` not booleans, `observation` not text or null,
            `info` not an object); a masked sample as `scores.masked_error`.
    """
    reply = scores.parse_reply(raw, url)
    if scores.masked(reply):
        raise scores.masked_error(reply, url)
    reward = scores.number(reply.get("reward"))
    if reward is None:
        raise scores.bad_reply(url, f"step reply has no finite numeric reward: {raw[:200]!r}")
    flags = (reply.get("terminated", False), reply.get("truncated", False))
    if not all(isinstance(flag, bool) for flag in flags):
        raise scores.bad_reply(url, f"terminated / truncated are not booleans: {raw[:200]!r}")
    observation, info = reply.get("observation"), reply.get("info", {})
    if not (observation is None or isinstance(observation, str)) or not isinstance(info, dict):
        raise scores.bad_reply(url, f"observation / info have the wrong type: {raw[:200]!r}")
    result = session_pb2.StepResult(
        reward=reward, terminated=flags[0], truncated=flags[1], info_json=json.dumps(info)
    )
    if observation is not None:
        result.observation = observation
    return result
