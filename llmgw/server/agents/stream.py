"""The plain agent stream: ``/agent/v1/stream`` on the main listener, one WebSocket per node.

It carries no identity: any peer may register as any node. So it serves only a server
without a ``tls`` block (``llmgw up``, a trusted network), and only loopback peers unless
``listen.allow_plain_http`` says the operator chose plain HTTP on purpose. With ``tls`` set,
agents dial the mTLS listener (``mtls.py``) instead, and this route says so.
"""

from __future__ import annotations

import logging

from litestar import WebSocket, websocket
from litestar.di import NamedDependency
from litestar.exceptions import WebSocketDisconnect

from llmgw.config import ServerConfig
from llmgw.core.names import hostport, is_loopback_host
from llmgw.server.agents.protocol import (
    CLOSE_UNAUTHORIZED,
    StreamClosed,
    refuse,
    serve_agent,
)
from llmgw.server.controller import Controller
from llmgw.server.dependencies import from_states

log = logging.getLogger(__name__)


class LitestarSocket:
    """``AgentSocket`` over Litestar's WebSocket."""

    def __init__(self, socket: WebSocket):
        self._socket = socket
        self.peer = socket.client.host if socket.client else "?"

    async def receive_bytes(self) -> bytes:
        try:
            return await self._socket.receive_bytes()
        except (WebSocketDisconnect, RuntimeError) as err:
            raise StreamClosed(str(err)) from None

    async def send_bytes(self, data: bytes) -> None:
        await self._socket.send_bytes(data)

    async def close(self, code: int, reason: str) -> None:
        await self._socket.close(code, reason)


def plain_refusal(config: ServerConfig, peer: str) -> str | None:
    """Why this server takes no agent on the plain route from ``peer``; None when it does."""
    tls = config.tls
    if tls is not None:
        shown = hostport(tls.agent_listen.host, tls.agent_listen.port)
        return (f"this server takes agents only on its mTLS listener, "
                f"wss://{shown}; point servers: in agent.yaml at "
                "https://ADDRESS:PORT and set tls")
    if not config.listen.allow_plain_http and not is_loopback_host(peer):
        return ("plain agent streams are taken from loopback only; give the server a tls "
                "block (llmgw server init), or set listen.allow_plain_http on a trusted network")
    return None


@websocket("/agent/v1/stream", dependencies=from_states("config", "controller"))
async def agent_stream(socket: WebSocket, config: NamedDependency[ServerConfig],
                       controller: NamedDependency[Controller]) -> None:
    adapter = LitestarSocket(socket)
    await socket.accept()
    why_not = plain_refusal(config, adapter.peer)
    if why_not is not None:
        return await refuse(adapter, adapter.peer, CLOSE_UNAUTHORIZED, why_not)
    await serve_agent(adapter, controller)
