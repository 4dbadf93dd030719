"""A new session client connects by itself: it does not inherit the reconnect backoff of the
process's other channels to the same address (gRPC's global subchannel pool shares connections
between channels whose options differ in the service config alone, as the reward functions'
cached `round_robin` channel and a session client's `pick_first` one did). In a CI run a
session client's first call to a bridge that listened failed UNAVAILABLE, "Connection refused":
a bridge stopped earlier had had that port.

The server is a bare in-process gRPC server, not a bridge: the test needs a refused connection
and a server on the same port within one reconnect backoff (at least 0.8 s), and a bridge
process takes longer to start. A call it answers UNIMPLEMENTED reached it; UNAVAILABLE did not.
"""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest

from nemo_gym_grpc.rewards.client import channels
from nemo_gym_grpc.rewards.client.sessions import SessionClient, SessionError
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import closed_port


def test_a_new_session_client_does_not_inherit_another_channels_backoff():
    target = f"127.0.0.1:{closed_port()}"
    with grpc.insecure_channel(target, options=channels.CHANNEL_OPTIONS) as cached:
        stub = verify_pb2_grpc.VerifyServiceStub(cached)
        with pytest.raises(grpc.RpcError) as refused:
            stub.ListResourcesServers(verify_pb2.ListResourcesServersRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # now in its backoff
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        server.add_insecure_port(target)
        server.start()
        try:
            with SessionClient(target) as client, pytest.raises(SessionError) as reached:
                client.open("mcqa", {"responses_create_params": {"input": "hi"}}, timeout=5)
        finally:
            server.stop(0)
    assert reached.value.failure.code == "UNIMPLEMENTED", reached.value
