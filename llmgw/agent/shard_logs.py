"""A shard's output, sent up the agent stream for ``llmgw ctl logs``.

The engine writes its output to a file on this node (the runtime's ``log_path``). A
ShardLogRequest is answered from that file: its last ``tail_bytes``, then, when
following, what the engine writes next, read every ``POLL_S``. Everything is bounded, so
that a chatty engine or a forgotten request cannot flood the stream: a tail of at most
1 MiB, pieces of at most 64 KiB of the file, at most ``FOLLOW_READ_BYTES`` read a poll
(more is skipped, and said so in the output), at most ``MAX_OPEN`` requests at once. A
request ends when the server cancels it, when the shard stops (or is started again), or
when the stream closes: ``run`` ends with it, and every request with ``run``.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
import os
from collections.abc import Callable
from typing import BinaryIO

from llmgw import wire
from llmgw.agent.runtime import Runtime
from llmgw.core.names import shard_unit

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024
TAIL_MAX_BYTES = 1024 * 1024
# At one read every POLL_S: at most 1 MiB/s of one shard's output per request.
FOLLOW_READ_BYTES = 256 * 1024
POLL_S = 0.25
MAX_OPEN = 16


class ShardLogs:
    """The log requests of one agent stream. ``running``: the shards this node runs (or
    prepares); ``send``: puts a message on the stream."""

    def __init__(self, runtime: Runtime, running: Callable[[], list[wire.RunningShard]],
                 send: Callable[[wire.Up], None]):
        self._runtime = runtime
        self._running = running
        self._send = send
        self._tasks: dict[str, asyncio.Task] = {}

    def handle(self, message: wire.ShardLogRequest | wire.ShardLogCancel) -> None:
        if isinstance(message, wire.ShardLogCancel):
            task = self._tasks.pop(message.request, None)
            if task is not None:
                task.cancel()
            return
        if message.request in self._tasks:
            return  # the same request twice: it is being answered
        if len(self._tasks) >= MAX_OPEN:
            self._end(message, f"{MAX_OPEN} log streams are open on this node already; "
                      "end one and ask again")
            return
        task = asyncio.create_task(self._serve(message), name=f"shard-log-{message.request}")
        self._tasks[message.request] = task
        task.add_done_callback(lambda done: self._forget(message.request, done))

    def _forget(self, request: str, task: asyncio.Task) -> None:
        if self._tasks.get(request) is task:
            del self._tasks[request]

    async def run(self) -> None:
        """Wait until cancelled (the stream closed), then end every request of the stream:
        nobody is left to read them."""
        try:
            await asyncio.Event().wait()
        finally:
            tasks = list(self._tasks.values())
            self._tasks.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _shard(self, req: wire.ShardLogRequest) -> wire.RunningShard | None:
        return next((s for s in self._running()
                     if s.replica == req.replica and s.rank == req.rank), None)

    async def _serve(self, req: wire.ShardLogRequest) -> None:
        what = f"replica {req.replica} rank {req.rank}"
        log.debug("sending the output of %s (request %s%s)", what, req.request,
                  ", following" if req.follow else "")
        try:
            await self._answer(req, what)
        except OSError as err:
            self._end(req, f"cannot read the output of {what}: {err.strerror or err}")
        except Exception:
            log.exception("sending the output of %s failed", what)
            self._end(req, f"the agent failed reading the output of {what}; its log says why")
        finally:
            log.debug("done with the output of %s (request %s)", what, req.request)

    async def _answer(self, req: wire.ShardLogRequest, what: str) -> None:
        # Only a shard this agent knows: the file name comes from the request.
        shard = self._shard(req)
        if shard is None:
            self._end(req, f"this node runs no {what}")
            return
        path = self._runtime.log_path(shard_unit(req.replica, req.rank))
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below, once followed
        except FileNotFoundError:
            self._end(req, f"{what} is {shard.state} on this node, and its engine has not "
                      "started yet: there is no output")
            return
        with f:
            decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            offset = self._send_tail(req, f, decoder)
            if req.follow:
                await self._follow(req, f, offset, shard, decoder, what)
            else:
                self._end(req)

    def _send_tail(self, req: wire.ShardLogRequest, f: BinaryIO, decoder) -> int:
        """Send the file's last ``tail_bytes`` (at most TAIL_MAX_BYTES), from the first
        whole line in them; returns the offset after what was read."""
        size = f.seek(0, os.SEEK_END)
        start = max(0, size - max(0, min(req.tail_bytes, TAIL_MAX_BYTES)))
        f.seek(start)
        data = f.read(size - start)
        if start > 0:
            newline = data.find(b"\n")
            if 0 <= newline < len(data) - 1:
                data = data[newline + 1:]
            else:  # one long line: at least start on a character
                data = data.lstrip(bytes(range(0x80, 0xC0)))
        if not self._send_data(req, data, decoder):
            # An empty piece all the same: the server waits for a first answer.
            self._send(wire.ShardLog(request=req.request))
        return size

    async def _follow(self, req: wire.ShardLogRequest, f: BinaryIO, offset: int,
                      shard: wire.RunningShard, decoder, what: str) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            size = os.fstat(f.fileno()).st_size
            if size < offset:  # truncated: what is there now is new
                offset = 0
            if size - offset > FOLLOW_READ_BYTES:
                skipped = size - FOLLOW_READ_BYTES - offset
                self._send(wire.ShardLog(
                    request=req.request,
                    data=f"\n-- llmgw: skipped {skipped} bytes: the engine writes faster "
                         "than its output is sent --\n"))
                offset = size - FOLLOW_READ_BYTES
                decoder.reset()
            if size > offset:
                f.seek(offset)
                data = f.read(size - offset)
                offset += len(data)
                self._send_data(req, data, decoder)
            # After the last read: what it wrote before it stopped has been sent.
            now = self._shard(req)
            if now is None or now.epoch != shard.epoch:
                self._end(req, f"{what} stopped: its output ends here")
                return

    def _send_data(self, req: wire.ShardLogRequest, data: bytes, decoder) -> bool:
        """Send ``data`` in pieces; whether any was sent."""
        sent = False
        for at in range(0, len(data), CHUNK_BYTES):
            text = decoder.decode(data[at:at + CHUNK_BYTES])
            if text:
                self._send(wire.ShardLog(request=req.request, data=text))
                sent = True
        return sent

    def _end(self, req: wire.ShardLogRequest, error: str = "") -> None:
        self._send(wire.ShardLog(request=req.request, done=True, error=error))
