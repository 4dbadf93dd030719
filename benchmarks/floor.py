"""A no-op `VerifyService` on grpc.aio and uvloop, as the bridge runs them: `Verify` answers
reward 1.0 at once, `VerifyStream` answers each message's items as it reads them. Scenario 5
times the same clients against it as against the bridge: what gRPC's own round trip in Python
costs on this machine (the floor under the bridge's added latency).

    python benchmarks/floor.py --ready-file "$(mktemp -u)"
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import AsyncIterable, AsyncIterator
from pathlib import Path

import grpc

from nemo_gym_grpc.shared.child import write_ready_file
from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc


class NoopVerifier(verify_pb2_grpc.VerifyServiceServicer):
    """Scores every item 1.0 without any work."""

    async def Verify(
        self, request: verify_pb2.VerifyRequest, context: grpc.aio.ServicerContext
    ) -> verify_pb2.VerifyResponse:
        return verify_pb2.VerifyResponse(request_id=request.request_id, reward=1.0)

    async def VerifyStream(
        self,
        request_iterator: AsyncIterable[verify_pb2.VerifyStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[verify_pb2.VerifyStreamResponse]:
        async for message in request_iterator:
            yield verify_pb2.VerifyStreamResponse(
                results=[
                    verify_pb2.VerifyResponse(request_id=item.request_id, reward=1.0)
                    for item in message.items
                ]
            )


async def serve(host: str, ready_file: Path) -> None:
    """Serve on a free port of `host` until SIGTERM/SIGINT; write "host:port" to `ready_file`
    once listening."""
    server = grpc.aio.server()
    verify_pb2_grpc.add_VerifyServiceServicer_to_server(NoopVerifier(), server)
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    write_ready_file(ready_file, f"{host}:{port}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


def main() -> None:
    """Command line: --host, --ready-file PATH."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--ready-file", type=Path, required=True)
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(args.host, args.ready_file))
    else:
        uvloop.run(serve(args.host, args.ready_file))


if __name__ == "__main__":
    main()
