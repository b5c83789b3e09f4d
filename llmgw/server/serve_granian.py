"""granian as the HTTP server (``listen.server: granian``), for operators who run granian
elsewhere. uvicorn (``llmgw.transport.server``) is the default; docs/gateway.md ("The HTTP
server") says why and what differs.

granian does its socket I/O on its own Rust threads and hands each request, body and chunk
to the event loop across threads. It offers no BodyWriter and serves nothing from
callbacks, so the gateway takes its plain ASGI path (``send`` for each chunk, a task that
watches for the client leaving): the same answers for more CPU per request.

It runs embedded (``granian.server.embed``) in the server's own event loop, on the socket
``listen.listening_socket`` gave, bound there or passed by systemd, so that under socket
activation a restart refuses no connection here either. granian's embedded server binds a
socket of its own; ``_OnSocket`` hands it ours instead, as granian itself does where its
workers share one socket (a ``SocketHolder`` in place of a ``ListenerSpec``). That
overrides one private method of granian 2.8 (pinned in pyproject.toml;
tests/integration/test_socket_activation.py serves on it): check it when granian moves. A
granian without that method is refused at start, with what to do.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
from pathlib import Path
from typing import Any

import granian
from granian.constants import HTTPModes, Interfaces, SSLProtocols
from granian.errors import FatalError
from granian.http import HTTP1Settings
from granian.log import LogLevels
from granian.net import SocketHolder
from granian.server.embed import Server as Granian

from llmgw.config import ConfigError
from llmgw.server.listen import BACKLOG
from llmgw.transport.server import GRACEFUL_STOP_S, HEAD_TIMEOUT_S, MAX_HEAD_BYTES

log = logging.getLogger(__name__)

# granian's own logger; its Rust side logs under it too.
_GRANIAN_LOGGER = "_granian"
# Applied over granian's logging config, which is otherwise a new one with its own
# handlers: ``incremental`` only sets levels, so granian's lines go to llmgw's log.
_LOGGING = {"version": 1, "incremental": True, "handlers": {},
            "loggers": {_GRANIAN_LOGGER: {"propagate": True}}}


class GranianStopped(RuntimeError):
    """granian stopped serving without being asked; its log lines say why."""


class _QuietEmbedWarning(logging.Filter):
    """granian warns at every start that its embedded server is experimental."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Embedded server is experimental" not in record.getMessage()


class _OnSocket(Granian):
    """granian's embedded server on a socket already listening (see the module docstring)."""

    def __init__(self, target: Any, sock: socket.socket, **options: Any):
        if not callable(getattr(Granian, "_init_shared_socket", None)):
            raise ConfigError(
                f"granian {granian.__version__} no longer takes the listening socket the way "
                "llmgw hands it over (granian 2.8's _init_shared_socket); install the granian "
                "pinned in llmgw's pyproject.toml, or set listen.server: uvicorn")
        host, port = sock.getsockname()[:2]
        super().__init__(target, address=host, port=port, **options)
        self._listener = sock

    def _init_shared_socket(self) -> None:
        # What granian's AbstractServer does where workers share a socket. granian owns
        # the descriptor from here on and closes it when it stops.
        self._ssp = None
        self._shd = SocketHolder(self._listener.detach(), False, self.backlog)
        self._sfd = self._shd.get_fd()


class GranianServer:
    """``app`` served by granian on ``sock``: ``serve()`` until ``stop()``, which lets
    requests in flight finish for up to GRACEFUL_STOP_S; a second ``stop()`` ends them at
    once (uvicorn's Server behaves the same)."""

    def __init__(self, app: Any, sock: socket.socket, tls: tuple[Path, Path] | None = None):
        debug = logging.getLogger().level <= logging.DEBUG
        granian_log = logging.getLogger(_GRANIAN_LOGGER)
        if not any(isinstance(f, _QuietEmbedWarning) for f in granian_log.filters):
            granian_log.addFilter(_QuietEmbedWarning())
        # Each connection holds one of granian's permits; uvicorn has no cap of its own, so
        # neither does this one below what the process may open.
        connections = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self._granian = _OnSocket(
            app, sock, interface=Interfaces.ASGI, http=HTTPModes.http1, websockets=True,
            backlog=BACKLOG,
            backpressure=connections if connections != resource.RLIM_INFINITY else 1 << 20,
            # A request's head bounded in size and in time, as on uvicorn.
            http1_settings=HTTP1Settings(header_read_timeout=int(HEAD_TIMEOUT_S * 1000),
                                         max_buffer_size=MAX_HEAD_BYTES),
            log_level=LogLevels.info if debug else LogLevels.warning,
            log_dictconfig=_LOGGING, log_access=False,
            # /v1 and the admin API over TLS 1.3 with the server's certificate; granian
            # would pass the app no client certificate, so none is asked for.
            ssl_cert=tls[0] if tls else None, ssl_key=tls[1] if tls else None,
            ssl_protocol_min=SSLProtocols.tls13,
        )
        self._serving: asyncio.Task | None = None
        self._stopping = False
        self._forced = False
        self._deadline: asyncio.TimerHandle | None = None

    async def serve(self) -> None:
        """Serve until ``stop()``; raises GranianStopped if granian ends on its own (its
        worker failed: the ASGI app's startup, say)."""
        self._serving = asyncio.ensure_future(self._granian.serve())
        try:
            await self._serving
        except asyncio.CancelledError:
            if not self._forced:
                raise
        except FatalError as err:  # its worker's, re-raised as granian stops
            raise GranianStopped(f"granian stopped serving: {err} failed; the lines of "
                                 "_granian in the log above say why") from None
        finally:
            if self._deadline is not None:
                self._deadline.cancel()
        if not self._stopping:
            raise GranianStopped("granian stopped serving without being asked to; the lines "
                                 "of _granian in the log above say why")

    def stop(self) -> None:
        if self._stopping:
            self._force()
            return
        self._stopping = True
        self._granian.stop()
        self._deadline = asyncio.get_running_loop().call_later(GRACEFUL_STOP_S, self._force)

    def _force(self) -> None:
        if self._serving is not None and not self._serving.done():
            log.warning("ending the requests still in flight")
            self._forced = True
            self._serving.cancel()
