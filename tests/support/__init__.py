"""Run real NVIDIA NeMo Gym resources servers (and our gRPC bridge) for tests, demos, benchmarks.

    ensure_venv()               -> Path of the cached venv with nemo-gym 0.7.0 (venv.py)
    ensure_venv(version="0.4.0")   # or env NEMO_GYM_VERSION=0.4.0 (versions.py)
    example_rows("mcqa")        -> the rows of that server's shipped data/example.jsonl
    with NemoGymServers(("mcqa",), version="0.4.0") as gym:   # NeMo Gym's `ng_run` (stack.py)
        gym.head_url, gym.server_urls["mcqa"], gym.version
    with AgentStack() as stack:  # agents.py: simple_agent + vllm_model over a scripted policy
        stack.agent_urls["simple_agent"], stack.environment_urls, stack.policy.knobs
    with start_bridge("--head-url", gym.head_url) as bridge:   # bridge.py
        bridge.target           -> "127.0.0.1:PORT" of `python -m nemo_gym_grpc.bridge serve`

Also here: ng_run.py (how stack.py launches ng_run), procs.py (processes, ports), items.py
(request builders shared by the tests), fault_proxy.py, prometheus_scrape.py, policy_model.py
(the scripted policy upstream), vllm_reply.py (its reply body) and toy_chat.py (its tokenizer
and chat template), grpo.py (GRPO advantages over the scored completions only: the axolotl
tests' reference). Command line: `python -m tests.support --help`.
Linux/POSIX only (process groups, fcntl, /proc).
"""

from tests.support.agents import AgentStack
from tests.support.bridge import BridgeProcess, start_bridge
from tests.support.errors import NemoGymError, NoSuitablePython
from tests.support.ng_run import offline_env
from tests.support.policy_model import CallRecord, Knobs, ScriptedPolicy
from tests.support.procs import ProcInfo, closed_port, free_ports, group_processes
from tests.support.stack import DEFAULT_SERVERS, NemoGymServers
from tests.support.venv import (
    NEMO_GYM_VERSION,
    ensure_venv,
    example_rows,
    find_python,
    resources_server_dir,
    venv_version,
)
from tests.support.versions import DEFAULT_VERSION, SPECS, selected_version

__all__ = [
    "AgentStack",
    "CallRecord",
    "DEFAULT_SERVERS",
    "DEFAULT_VERSION",
    "NEMO_GYM_VERSION",
    "BridgeProcess",
    "NemoGymError",
    "NemoGymServers",
    "Knobs",
    "NoSuitablePython",
    "SPECS",
    "ScriptedPolicy",
    "ProcInfo",
    "closed_port",
    "ensure_venv",
    "example_rows",
    "find_python",
    "free_ports",
    "group_processes",
    "offline_env",
    "resources_server_dir",
    "selected_version",
    "start_bridge",
    "venv_version",
]
