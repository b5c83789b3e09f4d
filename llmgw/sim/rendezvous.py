"""Multi-node rendezvous: how the ranks of one sim replica find each other.

A real multi-node engine (vLLM over Ray, SGLang with `--dist-init-addr`) cannot serve
until every rank has joined, and dies when one rank goes. The sim reproduces that
contract so the launch sequence can be tested without GPUs:

- rank 0, the leader, listens on a plain TCP port and keeps a `Group` of members;
- each worker dials it (retrying forever, since start order is not guaranteed), sends
  one JSON line `{"rank", "world_size", "model"}` and gets one JSON line back
  (`{"ok": true}` or `{"ok": false, "reason": ...}`), then holds the connection open;
- the connection *is* the membership: when it closes, the leader marks the rank
  missing and the worker exits non-zero, the way a rank dies when its group breaks.

The decision (`refusal`) is a pure function; the sockets are a thin shell around it.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import msgspec

from llmgw.core.names import unbracket

log = logging.getLogger("llmgw.sim.rendezvous")

HELLO_TIMEOUT_S = 5.0
RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.5, 1.0)  # then 1.0 forever


class Hello(msgspec.Struct):
    """What a worker says when it joins. Unknown fields are ignored (newer peers)."""

    rank: int
    world_size: int
    model: str


class Reply(msgspec.Struct):
    """The leader's answer to a hello; a refusal carries its reason."""

    ok: bool
    reason: str = ""


class RendezvousError(Exception):
    """The worker's membership ended; the message says why."""


class Refused(RendezvousError):
    """The leader refused this worker's hello."""


class LeaderLost(RendezvousError):
    """The connection to the leader dropped after this worker had joined."""


def parse_address(text: str) -> tuple[str, int]:
    """Split `HOST:PORT` (or `[v6]:PORT`); ValueError with a readable message."""
    host, sep, port = text.rpartition(":")
    host = unbracket(host)
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def refusal(hello: Hello, *, world_size: int, model: str, joined: set[int]) -> str | None:
    """Why the leader must refuse this hello, or None to accept it."""
    if hello.world_size != world_size:
        return f"world size {hello.world_size} disagrees with the leader's {world_size}"
    if hello.model != model:
        return f"model {hello.model!r} disagrees with the leader's {model!r}"
    if not 1 <= hello.rank < world_size:
        return f"rank {hello.rank} is out of range 1..{world_size - 1}"
    if hello.rank in joined:
        return f"rank {hello.rank} has already joined"
    return None


def _keepalive(writer: asyncio.StreamWriter) -> None:
    """Notice a peer that vanished without closing (host down) within ~10 s."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 4), ("TCP_KEEPINTVL", 2), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


async def _until_eof(reader: asyncio.StreamReader) -> None:
    while await reader.read(4096):
        pass


class Group:
    """The leader's view of its replica: which worker ranks are connected right now."""

    def __init__(self, world_size: int, model: str) -> None:
        self.world_size = world_size
        self.model = model
        self._members: dict[int, asyncio.StreamWriter] = {}
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}

    @property
    def ready(self) -> bool:
        return len(self._members) == self.world_size - 1

    @property
    def joined(self) -> int:
        """Ranks present, the leader included (so `joined == world_size` when ready)."""
        return 1 + len(self._members)

    def missing_ranks(self) -> list[int]:
        return sorted(set(range(1, self.world_size)) - self._members.keys())

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        """Start accepting workers; returns the bound address (port 0 picks one)."""
        self._server = await asyncio.start_server(self._serve_one, host, port)
        return self._server.sockets[0].getsockname()[:2]

    async def close(self) -> None:
        """Stop accepting and drop every worker (they exit: their group is gone)."""
        if self._server is not None:
            self._server.close()
        for writer in self._connections.values():
            writer.close()  # the handler sees EOF and unwinds by itself
        if self._connections:
            await asyncio.wait(list(self._connections), timeout=1.0)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections[task] = writer
        peer = writer.get_extra_info("peername")
        rank: int | None = None
        try:
            line = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
            try:
                hello = msgspec.json.decode(line, type=Hello)
            except msgspec.DecodeError as exc:
                reason = f"unreadable hello: {exc}"
            else:
                reason = refusal(
                    hello, world_size=self.world_size, model=self.model,
                    joined=set(self._members),
                )
            if reason is not None:
                log.warning("refused worker %s: %s", peer, reason)
                writer.write(msgspec.json.encode(Reply(ok=False, reason=reason)) + b"\n")
                await writer.drain()
                return
            rank = hello.rank
            self._members[rank] = writer
            _keepalive(writer)
            writer.write(msgspec.json.encode(Reply(ok=True)) + b"\n")
            await writer.drain()
            log.info("rank %d joined from %s (%d of %d)", rank, peer, self.joined, self.world_size)
            await _until_eof(reader)
        except (OSError, TimeoutError) as exc:
            log.warning("worker connection %s failed: %s", peer, exc)
        finally:
            if rank is not None and self._members.get(rank) is writer:
                del self._members[rank]
                log.warning("rank %d left; missing ranks %s", rank, self.missing_ranks())
            writer.close()
            self._connections.pop(task, None)


async def _connect(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Dial the leader until it answers; the leader may well start after its workers."""
    attempt = 0
    while True:
        try:
            return await asyncio.open_connection(host, port)
        except OSError as exc:
            if attempt % 20 == 0:
                log.info("leader %s:%d not answering yet (%s); retrying", host, port, exc)
            await asyncio.sleep(RETRY_DELAYS_S[min(attempt, len(RETRY_DELAYS_S) - 1)])
            attempt += 1


async def join_group(host: str, port: int, hello: Hello, on_joined: Callable[[], None]) -> None:
    """Join the leader and hold the membership; returns only by raising.

    Raises Refused when the leader says no, LeaderLost when the connection drops after
    joining. A connection that drops before the leader answers is retried.
    """
    while True:
        reader, writer = await _connect(host, port)
        try:
            writer.write(msgspec.json.encode(hello) + b"\n")
            await writer.drain()
            line = await reader.readline()
            if not line:
                log.info("leader %s:%d closed before answering; retrying", host, port)
                await asyncio.sleep(RETRY_DELAYS_S[-1])
                continue
            reply = msgspec.json.decode(line, type=Reply)
            if not reply.ok:
                raise Refused(f"leader {host}:{port} refused rank {hello.rank}: {reply.reason}")
            _keepalive(writer)
            on_joined()
            try:
                await _until_eof(reader)
            except OSError as exc:
                raise LeaderLost(f"lost the leader {host}:{port}: {exc}") from exc
            raise LeaderLost(f"lost the leader {host}:{port}: connection closed")
        except msgspec.DecodeError as exc:
            raise Refused(f"leader {host}:{port} sent an unreadable reply: {exc}") from exc
        except ConnectionError as exc:
            log.info("leader %s:%d dropped the hello (%s); retrying", host, port, exc)
            await asyncio.sleep(RETRY_DELAYS_S[-1])
        finally:
            writer.close()
