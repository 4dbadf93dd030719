"""The bytes of stream items and results the whole bridge holds, bounded (`--max-held-mb`).

Each VerifyStream and RunStream counts the items it read and the results it has not yet sent,
in serialized bytes, against its own limit (`--max-stream-mb`, `kinds.Kind.max_stream_bytes`)
and against the bridge's `Budget`. A stream over either stops reading before its next message,
so gRPC flow control slows its sender (backpressure) until results go out; a unary call counts
while it runs and waits to start while the budget is full; nothing is refused for it.
"""

from __future__ import annotations

import asyncio


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
