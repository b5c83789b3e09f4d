"""One agent's session on the stream, whatever carries it.

The same protocol runs over two transports: the plain WebSocket route that Litestar serves
on the main listener (loopback and trusted networks: ``llmgw up``), and the mTLS listener
(``mtls.py``), where the node id is the certificate's. Both hand this module an
``AgentSocket``; only the mTLS one hands it an ``Identity``, and with it a Register must
name the certificate's node.

The first frame must be a Register; the server answers Welcome, then both sides talk
freely. A peer that sends garbage is disconnected with a logged reason, and nobody else
notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Protocol

from llmgw import wire
from llmgw.core.names import NameRuleError, check_element
from llmgw.server.agents.sessions import Close
from llmgw.server.mirror import welcome_mirror

if TYPE_CHECKING:
    from llmgw.server.controller import Controller

log = logging.getLogger(__name__)

# Close codes in the private range, so an agent can tell a refusal from a network drop.
CLOSE_PROTOCOL = 4400
CLOSE_UNAUTHORIZED = 4401  # revoked or expired while connected; also a plain route refusal
CLOSE_IDENTITY = 4403  # a Register naming another node than the certificate
CLOSE_REPLACED = 4409  # sessions.py closes with it
CLOSE_NOT_LEADER = 4421  # this server does not lead the cluster: dial another
CLOSE_VERSION = 4426
_REGISTER_TIMEOUT_S = 10.0


class StreamClosed(Exception):
    """The peer went away (or the stream was closed under us)."""


class AgentSocket(Protocol):
    """What the session needs of a WebSocket; one adapter per server stack."""

    peer: str

    async def receive_bytes(self) -> bytes:
        """The next binary frame; raises StreamClosed when the stream ends."""

    async def send_bytes(self, data: bytes) -> None: ...

    async def close(self, code: int, reason: str) -> None: ...


@dataclass(frozen=True)
class Identity:
    """Who the peer's certificate says it is, checked before the stream was accepted."""

    node: str
    serial: int
    not_after: datetime


# Signs a renewal for the stream's node: (identity, CSR PEM) -> the answer to send.
Renew = Callable[[Identity, bytes], Awaitable["wire.Certificate | wire.CertificateRefused"]]


async def serve_agent(socket: AgentSocket, controller: Controller,
                      identity: Identity | None = None, renew: Renew | None = None) -> None:
    """Run one agent's session until either side ends it. With ``identity`` (mTLS), the
    Register must name the certificate's node, and ``renew`` answers RenewCertificate."""
    peer = socket.peer
    try:
        first = await asyncio.wait_for(socket.receive_bytes(), _REGISTER_TIMEOUT_S)
        msg = wire.decode_up(first)
    except TimeoutError:
        return await refuse(socket, peer, CLOSE_PROTOCOL, "no Register within 10 s")
    except wire.WireError as err:
        return await refuse(socket, peer, CLOSE_PROTOCOL, str(err))
    except StreamClosed:
        return
    if not isinstance(msg, wire.Register):
        return await refuse(socket, peer, CLOSE_PROTOCOL, "the first message must be a Register")
    if not msg.protocol >= wire.MIN_PROTOCOL_VERSION:
        return await refuse(
            socket, peer, CLOSE_VERSION,
            f"agent speaks protocol {msg.protocol}; this server needs at least "
            f"{wire.MIN_PROTOCOL_VERSION}: upgrade the agent",
        )
    try:
        check_element(msg.node_id, "node id")
    except NameRuleError as err:
        return await refuse(socket, peer, CLOSE_PROTOCOL, str(err))
    if identity is not None and msg.node_id != identity.node:
        return await refuse(
            socket, peer, CLOSE_IDENTITY,
            f"its certificate (serial {identity.serial:x}) is node {identity.node!r} but it "
            f"registered as {msg.node_id!r}; a node speaks only for itself: set node_id in "
            f"agent.yaml to {identity.node!r}, or join as {msg.node_id!r}")

    if not controller.holds_lead:
        # Commands come from the leader only: the agent dials the next server it knows.
        # (A leader not sure of its lease, cut off from the store, still takes its nodes:
        # it sends nothing until it is sure again, and closes them if it was deposed.)
        return await refuse(socket, peer, CLOSE_NOT_LEADER, controller.not_leading())
    session, connection = await controller.node_registered(msg, time.time())
    outbox = session.outbox
    assert outbox is not None  # attach() gave this connection its own
    await socket.send_bytes(wire.encode(wire.Welcome(
        node_id=msg.node_id, heartbeat_interval_s=controller.heartbeat_interval_s,
        term=controller.term or 0, mirror=welcome_mirror(controller.settings))))
    controller.node_welcomed(msg.node_id, time.time())
    controller.upgrades.registered(msg, time.time())
    sender = asyncio.create_task(_send_loop(socket, outbox))
    who = f"{msg.node_id} ({peer})"
    try:
        while True:
            frame = await socket.receive_bytes()
            try:
                message = wire.decode_up(frame)
            except wire.WireError as err:
                await refuse(socket, who, CLOSE_PROTOCOL, str(err))
                break
            now = time.time()
            if isinstance(message, wire.Heartbeat):
                controller.sessions.heartbeat(msg.node_id, message, now)
            elif isinstance(message, wire.InventoryUpdate):
                await controller.inventory_changed(msg.node_id, message, now)
            elif isinstance(message, wire.ShardStatus):
                controller.sessions.seen(msg.node_id, now)
                controller.shard_status(msg.node_id, message, now)
            elif isinstance(message, wire.RenewCertificate):
                controller.sessions.seen(msg.node_id, now)
                outbox.put_nowait(await _renew(identity, renew, msg.node_id, message))
            elif isinstance(message, wire.ShardLog):
                controller.shard_logs.deliver(msg.node_id, message)
            elif isinstance(message, wire.UpgradeStatus):
                controller.sessions.seen(msg.node_id, now)
                controller.upgrades.reported(msg.node_id, message, now)
            elif isinstance(message, wire.Register):
                await refuse(socket, msg.node_id, CLOSE_PROTOCOL, "registered twice on one stream")
                break
            else:
                controller.sessions.seen(msg.node_id, now)
                log.info("%s sent a message type this server does not know; skipped", msg.node_id)
    except StreamClosed:
        pass
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender
        controller.node_disconnected(msg.node_id, connection)
        controller.shard_logs.node_gone(msg.node_id, connection)


async def _renew(identity: Identity | None, renew: Renew | None, node: str,
                 message: wire.RenewCertificate) -> wire.Certificate | wire.CertificateRefused:
    if identity is None or renew is None:
        log.warning("%s asked for a new certificate on the plain stream; refused", node)
        return wire.CertificateRefused(
            reason="this stream is plain WebSocket: certificates are renewed only on the "
                   "server's mTLS agent listener (tls.agent_listen)")
    return await renew(identity, message.csr.encode())


async def _send_loop(socket: AgentSocket, outbox: asyncio.Queue) -> None:
    while True:
        item = await outbox.get()
        if isinstance(item, Close):
            log.info("closing the stream of %s: %s", socket.peer, item.reason)
            with contextlib.suppress(Exception):
                await socket.close(item.code, item.reason)
            return
        await socket.send_bytes(wire.encode(item))


async def refuse(socket: AgentSocket, who: str, code: int, reason: str) -> None:
    """Log why, and close the stream with a code and reason the agent logs in turn."""
    log.warning("disconnecting agent %s: %s", who, reason)
    with contextlib.suppress(Exception):
        # A close reason must fit in a control frame (123 bytes).
        await socket.close(code, reason.encode()[:120].decode(errors="ignore"))
