"""Log requests in flight: a shard's output on its way from its node's agent to an
operator (``GET /api/replicas/{replica}/logs``, ``llmgw ctl logs``).

The admin route opens a request, sends the ShardLogRequest down the node's stream and
reads the answer; the node's stream session delivers the ShardLog pieces to it. Each
request holds at most ``max_buffered`` pieces (64 KiB of output each) that its reader has
not taken: a client that reads more slowly than the node sends would otherwise make the
server hold the difference, without end while following. Past that the request ends,
the node is told to stop sending, and the reader is told why once it has read what was
held.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Callable

from llmgw import wire

# A whole tail (1 MiB, 16 pieces) and as much again of followed output.
MAX_BUFFERED = 32
# Requests open on this server at once, every node together.
MAX_OPEN = 64


class TooManyLogStreams(Exception):
    """``MAX_OPEN`` requests are open already."""


class PendingLog:
    """One request: the pieces received and not yet read, and how it ended."""

    def __init__(self, request: str, node: str, connection: int, max_buffered: int):
        self.request = request
        self.node = node
        self.connection = connection  # the node's stream it was sent on
        self._max = max_buffered
        self._pieces: deque[str] = deque()
        self._wake = asyncio.Event()
        # None while open; "" once ended cleanly; else why it ended.
        self.ended: str | None = None

    def put(self, data: str) -> bool:
        """Hold a piece for the reader; False (and the request ends) when ``max_buffered``
        are held already."""
        if self.ended is not None:
            return False
        if len(self._pieces) >= self._max:
            self.finish(f"stopped: this client read the log more slowly than the node sent "
                        f"it, and the server holds at most {self._max} pieces of 64 KiB for "
                        "it; ask again (with a smaller --tail)")
            return False
        self._pieces.append(data)
        self._wake.set()
        return True

    def finish(self, error: str = "") -> None:
        if self.ended is None:
            self.ended = error
            self._wake.set()

    @property
    def buffered(self) -> int:
        return len(self._pieces)

    async def next(self, timeout_s: float | None = None) -> str | None:
        """The next piece; None once the request has ended (``ended`` says why) and every
        piece held is read. TimeoutError when nothing came for ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while True:
                if self._pieces:
                    return self._pieces.popleft()
                if self.ended is not None:
                    return None
                self._wake.clear()
                await self._wake.wait()


class ShardLogs:
    """Every request open on this server. ``send(node, message)`` puts a message on the
    node's stream; False when it has none."""

    def __init__(self, send: Callable[[str, wire.Down], bool], *,
                 max_buffered: int = MAX_BUFFERED, max_open: int = MAX_OPEN):
        self._send = send
        self._max_buffered = max_buffered
        self._max_open = max_open
        self._open: dict[str, PendingLog] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, node: str, connection: int) -> PendingLog:
        """A new request to ``node``, on its stream number ``connection``."""
        if len(self._open) >= self._max_open:
            raise TooManyLogStreams(
                f"{self._max_open} log streams are open on this server already; end one "
                "(a --follow left running?) and ask again")
        pending = PendingLog(secrets.token_hex(8), node, connection, self._max_buffered)
        self._open[pending.request] = pending
        return pending

    def deliver(self, node: str, message: wire.ShardLog) -> None:
        """A piece from ``node``'s agent: to its reader, or, when nobody reads it any more,
        the node is told to stop."""
        pending = self._open.get(message.request)
        # Only the node asked answers (a node speaks only for itself).
        if pending is None or pending.node != node:
            if not message.done:
                self._send(node, wire.ShardLogCancel(request=message.request))
            return
        # An empty piece that does not end the request is its first answer: held too.
        if (message.data or not message.done) and not pending.put(message.data):
            del self._open[pending.request]
            if not message.done:
                self._send(node, wire.ShardLogCancel(request=message.request))
            return
        if message.done:
            del self._open[pending.request]
            pending.finish(message.error)

    def close(self, pending: PendingLog) -> None:
        """The reader is done, or gone: forget the request, and stop the node sending."""
        if self._open.pop(pending.request, None) is not None and pending.ended is None:
            self._send(pending.node, wire.ShardLogCancel(request=pending.request))
        pending.finish()

    def node_gone(self, node: str, connection: int) -> None:
        """``node``'s stream number ``connection`` closed: what was asked on it ends."""
        for pending in [p for p in self._open.values()
                        if p.node == node and p.connection == connection]:
            del self._open[pending.request]
            pending.finish(f"node {node}'s agent stream closed (the agent restarted, or the "
                           "network between them failed); ask again once it is back")
