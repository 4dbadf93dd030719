"""The bytes of stream items and results the whole bridge holds, bounded (`--max-held-mb`).

Each VerifyStream and RunStream counts the items it read (`item_bytes`) and the results it has
not yet sent (serialized bytes) against its own limit (`--max-stream-mb`,
`kinds.Kind.max_stream_bytes`) and against the bridge's `Budget`. A stream over either stops
reading before its next message, so gRPC flow control slows its sender (backpressure) until
results go out; a unary call counts while it runs and waits to start while the budget is full;
nothing is refused for it.
"""

from __future__ import annotations

import asyncio

from google.protobuf.message import Message

# An item in flight counts this many times its serialized size against the byte limits: its
# message, and the upstream body built from it (about as large: the row and the response).
IN_FLIGHT_COPIES = 2
# And this many bytes whatever its size: its task and coroutines, its wait for a slot, the
# body's own fields. Measured: 4.9 KB per item of 16 serialized bytes waiting for a slot
# (16,384 at once, bridge RSS 60 -> 137 MiB; 5.4 KB before waits shared their timers), and
# 10.7 KB per item of 3 KB (before).
ITEM_STATE_BYTES = 6 << 10


def item_bytes(request: Message) -> int:
    """What one request in flight counts against the byte limits (`--max-stream-mb`,
    `--max-held-mb`): IN_FLIGHT_COPIES times its serialized size plus ITEM_STATE_BYTES."""
    return IN_FLIGHT_COPIES * request.ByteSize() + ITEM_STATE_BYTES


class Budget:
    """Bytes held by all streams together, at most about `limit`.

    Streams `take` bytes as items arrive and results grow, and `give` them back once results
    are sent or the stream ends; a reader awaits `room()` before each message it reads.

    Args:
        limit: bytes (> 0).

    Attributes:
        limit: that limit.
        held: bytes held now.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._freed = asyncio.Event()

    def take(self, size: int) -> None:
        """Count `size` more bytes held (negative: fewer)."""
        self.held += size

    def give(self, size: int) -> None:
        """Count `size` bytes no longer held, and wake the readers waiting for room."""
        self.held -= size
        if self.held < self.limit:
            self._freed.set()

    async def room(self) -> None:
        """Return once fewer than `limit` bytes are held."""
        while self.held >= self.limit:
            self._freed.clear()
            await self._freed.wait()
