"""`ScriptedBridge`: the in-process VerifyService that plays a bridge breaking the
VerifyStream contract in tests/test_rewards_client.py (why scripted: that module's docstring).
"""

from __future__ import annotations

import threading

from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from nemo_gym_grpc.v1 import verify_pb2, verify_pb2_grpc

ITEM_FAILURES = {
    "unroutable": (code_pb2.NOT_FOUND, "UNKNOWN_RESOURCES_SERVER"),
    "headless": (code_pb2.UNAVAILABLE, "HEAD_SERVER_UNAVAILABLE"),
}


class ScriptedBridge(verify_pb2_grpc.VerifyServiceServicer):
    """Answers each VerifyStream according to the `resources_server` of its first item.

    echo: reward = the number in the completion, results in reverse order; unknown: one
    result for an id never sent; duplicate: the first item answered twice; short: all but one
    answered, then OK; abort: half answered, then UNAVAILABLE with an ErrorInfo reason;
    stall: half answered, then nothing until the client gives up (counted in `stalls_ended`);
    unroutable / headless: every item fails alone, NOT_FOUND (UNKNOWN_RESOURCES_SERVER) /
    UNAVAILABLE (HEAD_SERVER_UNAVAILABLE), as the bridge answers items it has no route for.
    Streams are counted by mode (`streams`).
    """

    def __init__(self) -> None:
        self.message_sizes: list[int] = []
        self.stalls_ended: list[str] = []
        self.in_flight = self.most_in_flight = 0
        self.streams: dict[str, int] = {}
        self.lock = threading.Lock()

    def VerifyStream(self, request_iterator, context):
        with self.lock:
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            yield from self._answer(request_iterator, context)
        finally:
            with self.lock:
                self.in_flight -= 1

    def _answer(self, request_iterator, context):
        items = []
        for message in request_iterator:
            self.message_sizes.append(len(message.items))
            items.extend(message.items)
        if not items:
            return
        mode = items[0].resources_server
        self.streams[mode] = self.streams.get(mode, 0) + 1
        results = [
            verify_pb2.VerifyResponse(request_id=r.request_id, reward=float(r.completion or 0))
            for r in items
        ]
        half = len(results) // 2
        if mode == "echo":
            yield verify_pb2.VerifyStreamResponse(results=results[::-1])
        elif mode == "unknown":
            yield verify_pb2.VerifyStreamResponse(
                results=[verify_pb2.VerifyResponse(request_id="never-sent")]
            )
        elif mode == "duplicate":
            yield verify_pb2.VerifyStreamResponse(results=[results[0], *results])
        elif mode == "short":
            yield verify_pb2.VerifyStreamResponse(results=results[:-1])
        elif mode == "abort":
            yield verify_pb2.VerifyStreamResponse(results=results[:half])
            info = any_pb2.Any()
            info.Pack(error_details_pb2.ErrorInfo(reason="BRIDGE_DRAINING", domain="test"))
            context.abort_with_status(
                rpc_status.to_status(
                    status_pb2.Status(
                        code=code_pb2.UNAVAILABLE, message="shutting down", details=[info]
                    )
                )
            )
        elif mode in ITEM_FAILURES:
            code, reason = ITEM_FAILURES[mode]
            info = any_pb2.Any()
            info.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="nemo-gym-grpc"))
            failed = status_pb2.Status(code=code, message=f"scripted {reason}", details=[info])
            yield verify_pb2.VerifyStreamResponse(
                results=[
                    verify_pb2.VerifyResponse(request_id=r.request_id, error=failed) for r in items
                ]
            )
        elif mode == "stall":
            yield verify_pb2.VerifyStreamResponse(results=results[:half])
            stopped = threading.Event()
            context.add_callback(stopped.set)
            stopped.wait(60)
            self.stalls_ended.append(items[0].request_id)
