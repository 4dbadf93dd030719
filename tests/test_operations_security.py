"""Operating the bridge (test_operations.py): TLS/mTLS, bearer tokens, a non-loopback listen
address, and the stream and message limits."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import grpc
import pytest
import trustme

from nemo_gym_grpc.bridge.process.checks import check_exposure
from nemo_gym_grpc.bridge.process.config import BridgeConfig
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.test_operations import SERVING, health_status, mcqa_request

# --- TLS, mTLS and tokens --------------------------------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A throwaway CA with a server certificate for 127.0.0.1 and a client certificate."""
    folder = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("trainer@example.org")
    files = {
        "ca": ca.cert_pem,
        "server_cert": server.cert_chain_pems[0],
        "server_key": server.private_key_pem,
        "client_cert": client.cert_chain_pems[0],
        "client_key": client.private_key_pem,
    }
    paths = {}
    for name, blob in files.items():
        paths[name] = folder / f"{name}.pem"
        blob.write_to_path(str(paths[name]))
    other = trustme.CA()
    paths["other_ca"] = folder / "other_ca.pem"
    other.cert_pem.write_to_path(str(paths["other_ca"]))
    return paths


def _secure_channel(target: str, pki: dict[str, Path], ca: str = "ca", client_cert: bool = False):
    credentials = grpc.ssl_channel_credentials(
        root_certificates=pki[ca].read_bytes(),
        private_key=pki["client_key"].read_bytes() if client_cert else None,
        certificate_chain=pki["client_cert"].read_bytes() if client_cert else None,
    )
    return grpc.secure_channel(target, credentials)


def _verify(channel: grpc.Channel, metadata=None) -> verify_pb2.VerifyResponse:
    stub = verify_pb2_grpc.VerifyServiceStub(channel)
    return stub.Verify(mcqa_request(), timeout=10, metadata=metadata)


def test_tls_handshake_succeeds_with_the_right_ca_and_fails_with_another(
    start_bridge, pki, nemo_gym
):
    bridge = start_bridge(
        "--head-url",
        nemo_gym.head_url,
        "--tls-cert",
        str(pki["server_cert"]),
        "--tls-key",
        str(pki["server_key"]),
    )
    with _secure_channel(bridge.target, pki) as channel:
        assert _verify(channel).reward == 1.0
    with _secure_channel(bridge.target, pki, ca="other_ca") as channel:
        with pytest.raises(grpc.RpcError) as failed:
            _verify(channel)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(bridge.target) as channel:
        with pytest.raises(grpc.RpcError):
            _verify(channel)


def test_mtls_requires_a_client_certificate(start_bridge, pki, nemo_gym):
    bridge = start_bridge(
        "--head-url",
        nemo_gym.head_url,
        "--tls-cert",
        str(pki["server_cert"]),
        "--tls-key",
        str(pki["server_key"]),
        "--tls-client-ca",
        str(pki["ca"]),
    )
    with _secure_channel(bridge.target, pki, client_cert=True) as channel:
        assert _verify(channel).reward == 1.0
    with _secure_channel(bridge.target, pki, client_cert=False) as channel:
        with pytest.raises(grpc.RpcError) as failed:
            _verify(channel)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE


def test_bearer_token_is_required_and_refusals_leak_nothing(start_bridge, nemo_gym, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    bridge = start_bridge("--head-url", nemo_gym.head_url, "--token-file", str(token_file))
    with grpc.insecure_channel(bridge.target) as channel:
        assert _verify(channel, [("authorization", "Bearer s3cret-token")]).reward == 1.0
        for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", "s3c")]):
            with pytest.raises(grpc.RpcError) as refused:
                _verify(channel, metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert refused.value.details() == "missing or invalid bearer token"
        assert health_status(channel, "") == SERVING  # probes need no token


def test_token_from_environment(start_bridge, nemo_gym):
    bridge = start_bridge("--head-url", nemo_gym.head_url, env={"NEMO_GYM_GRPC_TOKEN": "t0k"})
    with grpc.insecure_channel(bridge.target) as channel:
        assert _verify(channel, [("authorization", "Bearer t0k")]).reward == 1.0
        with pytest.raises(grpc.RpcError) as refused:
            _verify(channel)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _refused_stream_codes(target: str, metadata=None, calls: int = 100) -> set[str]:
    """Codes a grpc.aio client gets from `calls` VerifyStream calls of 64 items each."""
    batch = verify_pb2.VerifyStreamRequest(items=[mcqa_request(str(i)) for i in range(64)])

    async def codes() -> set[str]:
        seen = set()
        async with grpc.aio.insecure_channel(target) as channel:
            stub = verify_pb2_grpc.VerifyServiceStub(channel)
            for _ in range(calls):
                call = stub.VerifyStream(iter([batch]), metadata=metadata, timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    async for _ in call:
                        pass
                seen.add(refused.value.code().name)
        return seen

    return asyncio.run(codes())


def test_refused_streams_keep_their_code_while_the_client_writes(start_bridge, nemo_gym):
    # grpc.aio reports INTERNAL "Internal error from Core" when a write races a server that
    # ended the call unread (grpc#36066: about 1 in 10 calls here); refusals read first.
    bridge = start_bridge("--head-url", nemo_gym.head_url, env={"NEMO_GYM_GRPC_TOKEN": "t0k"})
    assert _refused_stream_codes(bridge.target) == {"UNAUTHENTICATED"}
    assert _refused_stream_codes(bridge.target, [("authorization", "Bearer no")]) == {
        "UNAUTHENTICATED"
    }


@pytest.mark.parametrize(
    ("listen", "extra", "allowed"),
    [
        ("127.0.0.1:0", {}, True),
        ("[::1]:0", {}, True),
        ("localhost:0", {}, True),
        ("0.0.0.0:50051", {}, False),
        ("192.0.2.10:50051", {}, False),
        ("0.0.0.0:50051", {"token": "x"}, True),
        ("0.0.0.0:50051", {"tls_cert": Path("c"), "tls_key": Path("k")}, True),
        ("0.0.0.0:50051", {"insecure": True}, True),
    ],
)
def test_non_loopback_listen_needs_tls_a_token_or_insecure(listen, extra, allowed):
    config = BridgeConfig(listen=listen, **extra)
    if allowed:
        check_exposure(config)
    else:
        with pytest.raises(ValueError, match="--insecure"):
            check_exposure(config)


def test_cli_refuses_a_non_loopback_listen_address_before_binding():
    done = subprocess.run(
        [sys.executable, "-m", "nemo_gym_grpc.bridge", "serve", "--listen", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert "refusing to listen on non-loopback 0.0.0.0:0" in done.stderr


# --- limits ------------------------------------------------------------------------------


def _held_open(first_item: str, release: threading.Event):
    """A VerifyStream's messages: one item, then an empty message every 0.1 s (so the stream
    is never idle) until `release`."""
    yield verify_pb2.VerifyStreamRequest(items=[mcqa_request(first_item)])
    while not release.wait(0.1):
        yield verify_pb2.VerifyStreamRequest()


def test_stream_over_the_limit_waits_for_a_place(start_bridge, nemo_gym):
    bridge = start_bridge("--head-url", nemo_gym.head_url, "--max-streams", "1")
    release = threading.Event()
    answered: list[tuple[str, bool]] = []  # (request_id, whether `release` was set by then)

    def second_stream(stub):
        for response in stub.VerifyStream(iter([verify_pb2.VerifyStreamRequest(
            items=[mcqa_request("waited")]
        )]), timeout=60):  # fmt: skip
            answered.extend((r.request_id, release.is_set()) for r in response.results)

    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        first = stub.VerifyStream(_held_open("held", release), timeout=60)
        assert next(first).results[0].request_id == "held"  # the first stream holds the place
        waiting = threading.Thread(target=second_stream, args=(stub,))
        waiting.start()
        # the second stream is not read while it waits: its item is not scored yet
        assert not release.wait(1.0) and answered == []
        release.set()
        assert list(first) == []
        waiting.join(30)
    assert answered == [("waited", True)]


def test_stream_that_waited_too_long_is_resource_exhausted_naming_the_flag(start_bridge, nemo_gym):
    bridge = start_bridge(
        "--head-url", nemo_gym.head_url, "--max-streams", "1", "--stream-idle-timeout", "1"
    )
    release = threading.Event()
    with grpc.insecure_channel(bridge.target) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        first = stub.VerifyStream(_held_open("held", release), timeout=60)
        assert next(first).results[0].request_id == "held"  # the first stream is open
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.VerifyStream(iter([verify_pb2.VerifyStreamRequest()]), timeout=10))
        assert _refused_stream_codes(bridge.target, calls=3) == {"RESOURCE_EXHAUSTED"}
        release.set()
        assert list(first) == []
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "waited 1 s" in refused.value.details()
    assert "--max-streams" in refused.value.details()


def test_message_over_the_size_limit_is_resource_exhausted(start_bridge, nemo_gym):
    bridge = start_bridge("--head-url", nemo_gym.head_url, "--max-message-mb", "1")
    request = mcqa_request()
    request.completion = "x" * (2 * 1024 * 1024)
    with grpc.insecure_channel(bridge.target) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            verify_pb2_grpc.VerifyServiceStub(channel).Verify(request, timeout=10)
        assert _verify(channel).reward == 1.0  # the bridge still serves
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
