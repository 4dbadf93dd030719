"""`serve --workers 2`: two processes share one port and both take connections."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import grpc

from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc
from tests.support import example_rows


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def _established_server_sockets(pid: int, port: int) -> int:
    """Established TCP connections to local `port` owned by process `pid` (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            if local_port == port and fields[3] == "01" and fields[9] in inodes:
                count += 1
    return count


def test_two_workers_share_the_port_and_both_serve(start_bridge, nemo_gym):
    bridge = start_bridge("--head-url", nemo_gym.head_url, "--workers", "2")
    workers = _children(bridge.pid)
    assert len(workers) == 2
    port = int(bridge.target.rsplit(":", 1)[1])
    row = example_rows("mcqa")[0]
    request = verify_pb2.VerifyRequest(
        request_id="w",
        resources_server="mcqa",
        row_json=json.dumps(row),
        completion=f"\\boxed{{{row['expected_answer']}}}",
    )
    # A local subchannel pool per channel = one TCP connection per channel.
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [grpc.insecure_channel(bridge.target, options=options) for _ in range(16)]
    try:
        for channel in channels:  # each new channel is a new connection
            assert (
                verify_pb2_grpc.VerifyServiceStub(channel).Verify(request, timeout=30).reward == 1.0
            )
        per_worker = [_established_server_sockets(pid, port) for pid in workers]
    finally:
        for channel in channels:
            channel.close()
    assert sum(per_worker) == 16
    assert all(count > 0 for count in per_worker), per_worker
    os.kill(bridge.pid, signal.SIGTERM)
    assert bridge.proc.wait(timeout=30) == 0
