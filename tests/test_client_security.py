"""The reward functions' client with TLS, mTLS and a bearer token from the environment, against
real bridges started with --tls-cert/--tls-key[/--tls-client-ca] and --token-file, in front of
the real NeMo Gym mcqa server. Certificates are throwaway ones from trustme.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import trustme

from nemo_gym_grpc.rewards import ScoringError, reward_nemo_gym_verify, reward_nemo_gym_verify_async
from nemo_gym_grpc.rewards.client import embedded, settings
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import example_rows
from tests.support import start_bridge as run_bridge

TOKEN = "tr41ner-t0ken"
TLS_ENVS = (settings.CA_ENV, settings.CLIENT_CERT_ENV, settings.CLIENT_KEY_ENV)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """PEM files: a CA, a server certificate for 127.0.0.1 it signed, a client certificate
    it signed, another CA, and a token file."""
    folder = tmp_path_factory.mktemp("client_pki")
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("trainer@example.org")
    blobs = {
        "ca": ca.cert_pem,
        "other_ca": other.cert_pem,
        "server_cert": server.cert_chain_pems[0],
        "server_key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0],
        "client_key": client.private_key_pem,
    }
    paths = {name: folder / f"{name}.pem" for name in blobs}
    for name, blob in blobs.items():
        blob.write_to_path(str(paths[name]))
    paths["token"] = folder / "token"
    paths["token"].write_text(TOKEN + "\n")
    return paths


@pytest.fixture(scope="module")
def tls_token_bridge(nemo_gym, pki):
    """A bridge serving TLS (server certificate from `ca`) and requiring the token."""
    tls = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    args = ["--head-url", nemo_gym.head_url, *tls, "--token-file", str(pki["token"])]
    with run_bridge(*args) as bridge:
        yield bridge


@pytest.fixture(scope="module")
def mtls_bridge(nemo_gym, pki):
    """A bridge requiring client certificates signed by `ca` (mTLS), no token."""
    tls = ["--tls-cert", str(pki["server_cert"]), "--tls-key", str(pki["server_key"])]
    args = ["--head-url", nemo_gym.head_url, *tls, "--tls-client-ca", str(pki["ca"])]
    with run_bridge(*args) as bridge:
        yield bridge


@pytest.fixture
def env(monkeypatch):
    """Set the client's env vars: env(target=..., ca=..., cert=..., key=..., token=...)."""
    for name in (*TLS_ENVS, settings.TOKEN_ENV, settings.TARGET_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(settings.CONNECT_TIMEOUT_ENV, "5")
    names = {
        "target": settings.TARGET_ENV,
        "ca": settings.CA_ENV,
        "cert": settings.CLIENT_CERT_ENV,
        "key": settings.CLIENT_KEY_ENV,
        "token": settings.TOKEN_ENV,
        "max_failure_fraction": settings.MAX_FAILURE_FRACTION_ENV,
    }

    def set_env(**values: str | Path) -> None:
        for key, value in values.items():
            monkeypatch.setenv(names[key], str(value))

    return set_env


def mcqa_args(count: int = 4) -> tuple[dict, list[float]]:
    """reward-function arguments for `count` mcqa rows (odd ones answered right) and the
    rewards they should get."""
    rows = [example_rows("mcqa")[i % 5] for i in range(count)]
    answers, expected = [], []
    for i, row in enumerate(rows):
        right = i % 2 == 1
        letter = (
            row["expected_answer"] if right else ("A" if row["expected_answer"] != "A" else "C")
        )
        answers.append([{"role": "assistant", "content": f"\\boxed{{{letter}}}"}])
        expected.append(float(right))
    args = {
        "completions": answers,
        "resources_server_ref": [{"name": "mcqa"}] * count,
        "verify_extra": rows,
    }
    return args, expected


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_rewards_through_tls_with_the_token(tls_token_bridge, pki, env, asynchronous):
    env(target=tls_token_bridge.target, ca=pki["ca"], token=TOKEN)
    args, expected = mcqa_args()
    if asynchronous:
        assert asyncio.run(reward_nemo_gym_verify_async(**args)) == expected
    else:
        assert reward_nemo_gym_verify(**args) == expected


@pytest.mark.parametrize("token", ["wrong-token", None], ids=["wrong", "missing"])
def test_a_refused_token_fails_the_items_unauthenticated(tls_token_bridge, pki, env, token, caplog):
    env(target=tls_token_bridge.target, ca=pki["ca"], **({"token": token} if token else {}))
    args, _ = mcqa_args()
    with pytest.raises(ScoringError) as raised:  # every item failed: the guard raises
        reward_nemo_gym_verify(**args)
    assert raised.value.causes == {"UNAUTHENTICATED": 4}
    assert {f.message for f in raised.value.failures.values()} == {
        "missing or invalid bearer token"
    }

    env(max_failure_fraction=1)  # guard off: the items are None, never 0.0
    with caplog.at_level(logging.WARNING, logger="nemo_gym_grpc.rewards"):
        assert asyncio.run(reward_nemo_gym_verify_async(**args)) == [None] * 4
    assert "UNAUTHENTICATED x4" in caplog.text


def test_a_ca_that_did_not_sign_the_bridge_certificate_fails_the_items(tls_token_bridge, pki, env):
    env(target=tls_token_bridge.target, ca=pki["other_ca"], token=TOKEN, max_failure_fraction=1)
    args, _ = mcqa_args(2)
    assert reward_nemo_gym_verify(**args) == [None, None]


def test_mtls_scores_with_a_client_certificate_and_fails_without(
    mtls_bridge, pki, env, monkeypatch
):
    env(target=mtls_bridge.target, ca=pki["ca"], cert=pki["client_cert"], key=pki["client_key"])
    args, expected = mcqa_args()
    assert reward_nemo_gym_verify(**args) == expected
    assert asyncio.run(reward_nemo_gym_verify_async(**args)) == expected

    monkeypatch.delenv(settings.CLIENT_CERT_ENV)
    monkeypatch.delenv(settings.CLIENT_KEY_ENV)
    with pytest.raises(ScoringError) as raised:
        reward_nemo_gym_verify(**args)
    assert raised.value.causes == {"UNAVAILABLE": 4}  # the handshake is refused


def test_an_embedded_bridge_inherits_the_token_and_is_plaintext(nemo_gym, pki, env, monkeypatch):
    monkeypatch.setenv(settings.HEAD_URL_ENV, nemo_gym.head_url)
    env(token=TOKEN, ca=pki["ca"])  # the CA is for configured targets, not the embedded one
    args, expected = mcqa_args(2)
    try:
        assert reward_nemo_gym_verify(**args) == expected
        (bridge,) = embedded.running_bridges().values()
        with grpc.insecure_channel(bridge.target) as channel:
            stub = verify_pb2_grpc.VerifyServiceStub(channel)
            item = verify_pb2.VerifyRequest(request_id="1", resources_server="mcqa")
            with pytest.raises(grpc.RpcError) as refused:
                stub.Verify(item, timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        embedded.stop_all()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"ca": "/nonexistent/ca.pem"}, "NEMO_GYM_GRPC_CA='/nonexistent/ca.pem': cannot read"),
        ({"ca": "token"}, "is not a PEM file"),
        ({"ca": "ca", "cert": "client_cert"}, "NEMO_GYM_GRPC_CLIENT_KEY go together"),
        ({"cert": "client_cert", "key": "client_key"}, "needs NEMO_GYM_GRPC_CA"),
        ({"token": "line\nbreak"}, "NEMO_GYM_GRPC_TOKEN must be printable ASCII"),
    ],
)
def test_bad_security_settings_raise_naming_the_variable(pki, env, values, message):
    env(**{k: pki.get(v, v) for k, v in values.items()})
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        settings.security()


def test_score_command_stops_on_a_refused_token_without_writing_rows(
    tls_token_bridge, pki, tmp_path
):
    rows = []
    for row in example_rows("mcqa")[:3]:
        answer = {"role": "assistant", "content": [{"type": "output_text", "text": "\\boxed{A}"}]}
        response = {"id": "r", "object": "response", "output": [{"type": "message", **answer}]}
        rows.append({**row, "resources_server_ref": {"name": "mcqa"}, "response": response})
    rows_path = tmp_path / "rows.jsonl"
    rows_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    child_env = {**os.environ, settings.CA_ENV: str(pki["ca"]), settings.TOKEN_ENV: "wrong"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nemo_gym_grpc.cli",
            "score",
            str(rows_path),
            "-o",
            str(out),
        ]
        + ["--target", tls_token_bridge.target, "--no-progress"],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env,
    )
    assert done.returncode == 1  # and it exited: the channel is released before exit
    assert "failed as a whole (1 attempt): UNAUTHENTICATED" in done.stderr
    assert "Traceback" not in done.stderr and "Channel closed" not in done.stderr
    assert out.read_bytes() == b""  # a refused call is not a result: a rerun scores the rows
