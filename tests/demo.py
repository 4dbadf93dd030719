"""`make demo` (`python -m tests.demo`): score NeMo Gym example rows through the bridge with
`reward_nemo_gym_verify`.

Starts real NeMo Gym resources servers (mcqa, equivalence_rule, reasoning_gym; on 0.4.0 also
example_single_tool_call) of the version env NEMO_GYM_VERSION selects (default 0.7.0) with
NeMo Gym's own `ng_run`, lets the reward function start its
embedded bridge (discovering the servers from the head server), scores each server's example
rows with a right and a wrong completion, prints a table and the items/s of one large batch,
then stops everything. Exits 1 if a reward is not the expected one.
"""

from __future__ import annotations

import os
import sys
import time

from tests.support import NemoGymServers, example_rows, selected_version

ROWS_PER_SERVER = 3
BATCH_ITEMS = 1024
# Why the first latency of each server is about a second (measured here: mcqa 1.7 s,
# equivalence_rule 1.2 s, reasoning_gym 0.9 s; the next ones a few ms).
FIRST_ITEMS = (
    "(The first item of each server waits for the bridge to learn what that server supports,\n"
    " once: GET /openapi.json, which a NeMo Gym server builds on its first request. The very\n"
    " first item also waits for the embedded bridge to start.)"
)


def _prompt(row: dict) -> str:
    """The first user message of the row, as axolotl's NeMo Gym dataset loader takes it."""
    for message in row["responses_create_params"]["input"]:
        if message.get("role") == "user":
            return message["content"]
    return ""


def _other_letter(letter: str) -> str:
    return "A" if letter != "A" else "C"


# server -> (expected-answer text, right completion, wrong completion, reward for wrong)
CASES = {
    "mcqa": lambda r: (
        r["expected_answer"],
        f"The answer is \\boxed{{{r['expected_answer']}}}",
        f"The answer is \\boxed{{{_other_letter(r['expected_answer'])}}}",
        0.0,
    ),
    "equivalence_rule": lambda r: (
        r["expected_answer"],
        r["expected_answer"],
        "I do not know.",
        0.0,
    ),
    "reasoning_gym": lambda r: (
        r["answer"],
        f"<answer>{r['answer']}</answer>",
        "<answer>no idea</answer>",
        0.0,
    ),
}
if selected_version() == "0.4.0":  # 0.7.0's rewards only a tool call, which text cannot hold
    # NeMo Gym 0.4.0's example_single_tool_call scores every response 1.0 by design.
    CASES["example_single_tool_call"] = lambda r: ("(any: always 1.0)", "It is sunny.", "", 1.0)


def main() -> int:
    os.environ.pop("NEMO_GYM_GRPC_TARGET", None)  # use the embedded bridge
    print("starting NeMo Gym resources servers (ng_run) ...", flush=True)
    with NemoGymServers(servers=tuple(CASES)) as gym:
        os.environ["NEMO_GYM_HEAD_URL"] = gym.head_url
        from nemo_gym_grpc.rewards import reward_nemo_gym_verify

        print(f"head server {gym.head_url}; servers {gym.server_urls}\n", flush=True)
        header = f"{'server':<26}{'row':>4}  {'expected':<30}{'completion':<11}{'reward':>7}"
        print(header + f"{'latency ms':>12}")
        print("-" * (len(header) + 12))
        mismatches = 0
        batch: list[tuple[str, dict, str, float]] = []
        for server, case in CASES.items():
            for index, row in enumerate(example_rows(server)[:ROWS_PER_SERVER]):
                expected, right, wrong, wrong_reward = case(row)
                for kind, text, want in (("right", right, 1.0), ("wrong", wrong, wrong_reward)):
                    started = time.perf_counter()
                    (reward,) = reward_nemo_gym_verify(
                        completions=[[{"role": "assistant", "content": text}]],
                        prompts=[[{"role": "user", "content": _prompt(row)}]],
                        resources_server_ref=[{"name": server}],
                        verify_extra=[row],
                    )
                    latency_ms = (time.perf_counter() - started) * 1000
                    mark = "" if reward == want else f"   <-- expected {want}"
                    mismatches += reward != want
                    shown = expected if len(expected) <= 28 else expected[:25] + "..."
                    print(
                        f"{server:<26}{index:>4}  {shown:<30}{kind:<11}{reward!s:>7}"
                        f"{latency_ms:>12.1f}{mark}"
                    )
                    batch.append((server, row, text, want))

        print(FIRST_ITEMS)
        items = [batch[i % len(batch)] for i in range(BATCH_ITEMS)]
        started = time.perf_counter()
        rewards = reward_nemo_gym_verify(
            completions=[[{"role": "assistant", "content": text}] for _, _, text, _ in items],
            prompts=[[{"role": "user", "content": _prompt(row)}] for _, row, _, _ in items],
            resources_server_ref=[{"name": server} for server, _, _, _ in items],
            verify_extra=[row for _, row, _, _ in items],
        )
        elapsed = time.perf_counter() - started
        wrong_in_batch = sum(r != want for r, (*_, want) in zip(rewards, items, strict=True))
        mismatches += wrong_in_batch
        print(
            f"\none batch of {len(items)} items over one VerifyStream: {elapsed:.2f} s, "
            f"{len(items) / elapsed:.0f} items/s, {wrong_in_batch} unexpected rewards"
        )
    print("stopped NeMo Gym servers and the bridge")
    if mismatches:
        print(f"FAILED: {mismatches} rewards differ from the expected ones", file=sys.stderr)
        return 1
    print("OK: correct completions scored 1.0, wrong ones 0.0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
