"""The body of a vLLM chat completion reply, as the scripted policy (policy_model.py) sends it:
the generated message with its finish_reason, per-token logprobs when asked, usage, and
vLLM's inline token ids when asked; ids and logprobs from tests/support/toy_chat.py."""

from __future__ import annotations

import time
from typing import Any

from tests.support import toy_chat


def chat_completion(
    body: dict[str, Any], message: dict[str, Any], reply_id: str, model: str
) -> dict[str, Any]:
    """The reply to the Chat Completions request `body` whose generated assistant message is
    `message` (`model`: the name when `body` has none)."""
    messages = list(body.get("messages") or [])
    tools = list(body.get("tools") or [])
    prompt = toy_chat.prompt_token_ids(messages, tools)
    generated = toy_chat.generation_token_ids(message)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": "tool_calls" if message.get("tool_calls") else "stop",
    }
    if body.get("logprobs"):
        ids_as_tokens = bool(body.get("return_tokens_as_token_ids"))
        choice["logprobs"] = {
            "content": [
                {
                    "token": f"token_id:{t}" if ids_as_tokens else str(t),
                    "logprob": lp,
                    "bytes": None,
                    "top_logprobs": [],
                }
                for t, lp in zip(generated, toy_chat.log_probs(generated), strict=True)
            ]
        }
    reply: dict[str, Any] = {
        "id": reply_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model", model),
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(generated),
            "total_tokens": len(prompt) + len(generated),
        },
    }
    if body.get("return_token_ids"):
        reply["prompt_token_ids"] = prompt
        choice["token_ids"] = generated
    return reply
