"""Drive OpenRLHF 0.11.2's own reward caller, `SingleTurnAgentExecutor` (run in build/verl-venv,
with build/openrlhf-pkg, openrlhf installed without its dependencies, on sys.path).

`python tests/openrlhf_run.py SPEC.json` prints one JSON object. SPEC: {"remote_rm_url": a
`.py` file defining `reward_func` or an http URL (what `--remote_rm_url` takes), "items":
[{"prompt": text, "completion": text, "label": text}, ...]}. Every item goes through
`SingleTurnAgentExecutor.execute` at once, as OpenRLHF's rollout does: it tokenizes the
prompt, asks the engine for a continuation, decodes prompt + continuation as the query and
fetches the reward for that one sample from the file's `reward_func` (in a thread) or over
HTTP. Output: {"outputs": [{"reward", "scores", "extra_logs"} per item, tensors as lists]}.

Stand-ins, because they cannot run here: the vLLM engine (`ScriptedEngine` returns the item's
completion as its tokens; no LLM) and the tokenizer (tests/verl_run.py's byte-level one, so
the decoded query is exactly prompt + completion and no model is downloaded).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1] / "build" / "openrlhf-pkg"))

from openrlhf.utils.agent import SingleTurnAgentExecutor  # noqa: E402
from verl_run import byte_tokenizer  # noqa: E402  (tests/ is this script's sys.path[0])


class ScriptedEngine:
    """vLLM's `generate` for one item: its completion's tokens, finish_reason "stop"."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    async def generate(self, prompt_token_ids: list[int], params: Any, **kwargs: Any) -> Any:
        output = SimpleNamespace(token_ids=self.token_ids, finish_reason="stop", logprobs=None)
        return SimpleNamespace(outputs=[output])


def plain(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


async def run(spec: dict[str, Any], tokenizer_dir: str) -> dict[str, Any]:
    tokenizer = byte_tokenizer(tokenizer_dir)
    executor = SingleTurnAgentExecutor(remote_rm_url=spec["remote_rm_url"])
    params = SimpleNamespace(max_tokens=4096, logprobs=None)

    async def one(item: dict[str, Any]) -> dict[str, Any]:
        engine = ScriptedEngine(tokenizer.encode(item["completion"]))
        out = await executor.execute(item["prompt"], item["label"], params, 8192, tokenizer, engine)
        return {k: plain(out[k]) for k in ("reward", "scores", "extra_logs")}

    return {"outputs": list(await asyncio.gather(*(one(i) for i in spec["items"])))}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        print(json.dumps(asyncio.run(run(spec, tokenizer_dir))))


if __name__ == "__main__":
    main()
