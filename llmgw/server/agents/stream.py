"""The agent stream endpoint: ``/agent/v1/stream``, one WebSocket per node.

The first frame must be a Register; the server answers Welcome, then both sides talk
freely. A peer that sends garbage is disconnected with a logged reason, and nobody else
notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from litestar import WebSocket, websocket
from litestar.exceptions import WebSocketDisconnect

from llmgw import wire
from llmgw.core.names import NameRuleError, check_element
from llmgw.server.agents.sessions import is_close

log = logging.getLogger(__name__)

# Close codes in the private range, so an agent can tell a refusal from a network drop.
CLOSE_PROTOCOL = 4400
CLOSE_VERSION = 4426
CLOSE_REPLACED = 4409
_REGISTER_TIMEOUT_S = 10.0


@websocket("/agent/v1/stream")
async def agent_stream(socket: WebSocket) -> None:
    controller = socket.app.state.controller
    peer = socket.client.host if socket.client else "?"
    await socket.accept()
    try:
        first = await asyncio.wait_for(socket.receive_bytes(), _REGISTER_TIMEOUT_S)
        msg = wire.decode_up(first)
    except TimeoutError:
        return await _refuse(socket, peer, CLOSE_PROTOCOL, "no Register within 10 s")
    except wire.WireError as err:
        return await _refuse(socket, peer, CLOSE_PROTOCOL, str(err))
    except (WebSocketDisconnect, RuntimeError):
        return
    if not isinstance(msg, wire.Register):
        return await _refuse(socket, peer, CLOSE_PROTOCOL, "the first message must be a Register")
    if not msg.protocol >= wire.MIN_PROTOCOL_VERSION:
        return await _refuse(
            socket, peer, CLOSE_VERSION,
            f"agent speaks protocol {msg.protocol}; this server needs at least "
            f"{wire.MIN_PROTOCOL_VERSION}: upgrade the agent",
        )
    try:
        check_element(msg.node_id, "node id")
    except NameRuleError as err:
        return await _refuse(socket, peer, CLOSE_PROTOCOL, str(err))

    session, connection = await controller.node_registered(msg, time.time())
    await socket.send_bytes(wire.encode(wire.Welcome(
        node_id=msg.node_id, heartbeat_interval_s=controller.heartbeat_interval_s)))
    sender = asyncio.create_task(_send_loop(socket, session.outbox))
    try:
        while True:
            frame = await socket.receive_bytes()
            try:
                message = wire.decode_up(frame)
            except wire.WireError as err:
                await _refuse(socket, f"{msg.node_id} ({peer})", CLOSE_PROTOCOL, str(err))
                break
            now = time.time()
            if isinstance(message, wire.Heartbeat):
                controller.sessions.heartbeat(msg.node_id, message, now)
            elif isinstance(message, wire.InventoryUpdate):
                await controller.inventory_changed(msg.node_id, message, now)
            elif isinstance(message, wire.ShardStatus):
                controller.sessions.seen(msg.node_id, now)
                controller.shard_status(msg.node_id, message, now)
            elif isinstance(message, wire.Register):
                await _refuse(socket, msg.node_id, CLOSE_PROTOCOL, "registered twice on one stream")
                break
            else:
                controller.sessions.seen(msg.node_id, now)
                log.info("%s sent a message type this server does not know; skipped", msg.node_id)
    except (WebSocketDisconnect, RuntimeError):
        pass
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await sender
        controller.node_disconnected(msg.node_id, connection)


async def _send_loop(socket: WebSocket, outbox: asyncio.Queue) -> None:
    while True:
        item = await outbox.get()
        if is_close(item):
            with contextlib.suppress(Exception):
                await socket.close(CLOSE_REPLACED, "replaced by a newer connection")
            return
        await socket.send_bytes(wire.encode(item))


async def _refuse(socket: WebSocket, who: str, code: int, reason: str) -> None:
    log.warning("disconnecting agent %s: %s", who, reason)
    with contextlib.suppress(Exception):
        # A close reason must fit in a control frame (123 bytes).
        await socket.close(code, reason.encode()[:120].decode(errors="ignore"))
