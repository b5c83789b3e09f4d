"""The agent stream's own mTLS listener, on aiohttp in the server's event loop.

The main listener (``/v1``, the admin API) takes no client certificates: the OpenAI
clients have none. So the agent stream has a listener of its own, where the handler sees
the peer's certificate (docs/security.md). A connection is admitted in this
order, and refused at the first failure with a log line that says why:

1. the TLS handshake (``ssl``): the certificate chains to the cluster CA, the only CA
   trusted for clients, and is within its dates. A failed handshake is logged by
   ``_LoggedHandshake``, since asyncio drops it silently.
2. a certificate at all: the context asks for one without requiring it, so an agent that
   has none gets an HTTP 401 that says how to get one instead of a bare handshake alert.
3. ``pki.verify_node_cert``: issued by the CA, within its dates, ``clientAuth``, a node id.
4. the store: the serial is one the cluster issued, for that node, and is not revoked.
   Asked at every handshake, never cached, so a revocation bites at the next one.

The same admission opens the control plane's mirror (``/mirror/...``, server/mirror.py)
to a node. Then the session runs as on the plain route (``protocol.serve_agent``) with the
certificate's node as its identity. Live streams are kept by node and serial in
``live.LiveStreams``: revoking a node closes them at once on this server, and a watcher
polls the store's revocations, so a revocation made on another server sharing the store
closes them within ``live.WATCH_S`` too, as does a certificate that expires while
connected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import WSMsgType, web
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from llmgw import pki, wire
from llmgw.config import ConfigError
from llmgw.core.names import hostport
from llmgw.server import mirror
from llmgw.server.agents.live import LiveStreams
from llmgw.server.agents.protocol import Identity, StreamClosed, serve_agent
from llmgw.store import StoreError
from llmgw.store.pki import NodeCertRecord

if TYPE_CHECKING:
    from llmgw.server.controller import Controller
    from llmgw.store import Store

log = logging.getLogger(__name__)

STREAM_PATH = "/agent/v1/stream"
_RENEW_EVERY_S = 60.0  # at most one renewal per node this often: a loop cannot flood the store
_MAX_FRAME = 16 * 2**20  # a Register carries the whole inventory

_HANDSHAKE_HINTS = {
    "unable to get local issuer certificate":
        "the certificate is not signed by this cluster's CA; join the node to this cluster",
    "certificate has expired":
        "the node's certificate expired before it was renewed; join it again "
        "(llmgw ctl nodes add NAME, then llmgw agent join on the node)",
    "certificate is not yet valid": "check the node's clock (NTP)",
    "unsuitable certificate purpose":
        "that is not a node certificate (no clientAuth); use the one llmgw agent join wrote",
}


class TlsSetupError(ConfigError):
    """The server's TLS files cannot be used; the message names the file and what to do."""


class _LoggedHandshake(ssl.SSLObject):
    """asyncio logs a failed TLS handshake only in debug mode; an operator needs to see
    why a node was turned away, so the refusal is logged here, where it happens."""

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLCertVerificationError as err:
            hint = _HANDSHAKE_HINTS.get(err.verify_message, "")
            log.warning("agent stream: TLS handshake refused: the client certificate failed "
                        "verification: %s%s", err.verify_message, f"; {hint}" if hint else "")
            raise
        except ssl.SSLError as err:
            log.warning("agent stream: TLS handshake refused: %s", err.reason or err)
            raise


def server_context(ca_file: str, cert_file: str, key_file: str) -> ssl.SSLContext:
    """The listener's TLS: the server's certificate, the cluster CA as the only trust for
    clients, a client certificate asked for (its absence answered with a 401)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    try:
        context.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as err:
        raise TlsSetupError(f"tls.cert_file {cert_file} / tls.key_file {key_file}: cannot use "
                            f"them: {_words(err)}; they must be the PEM certificate and key "
                            "`llmgw server init` wrote") from None
    try:
        context.load_verify_locations(cafile=ca_file)
    except (OSError, ssl.SSLError) as err:
        raise TlsSetupError(f"tls.ca_file {ca_file}: cannot use it: {_words(err)}") from None
    context.verify_mode = ssl.CERT_OPTIONAL
    context.sslobject_class = _LoggedHandshake
    return context


def _words(err: Exception) -> str:
    return getattr(err, "strerror", None) or getattr(err, "reason", None) or str(err)


def _read(path: str, key: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as err:
        raise TlsSetupError(f"{key} {path}: cannot read: {err.strerror}") from None


class AiohttpSocket:
    """``AgentSocket`` over aiohttp's server WebSocket."""

    def __init__(self, ws: web.WebSocketResponse, peer: str):
        self._ws = ws
        self.peer = peer
        self._closing: asyncio.Future | None = None

    async def receive_bytes(self) -> bytes:
        msg = await self._ws.receive()
        if msg.type == WSMsgType.BINARY:
            return msg.data
        if msg.type == WSMsgType.TEXT:
            return msg.data.encode()  # not msgpack: refused by the decoder with a reason
        raise StreamClosed(msg.type.name)

    async def send_bytes(self, data: bytes) -> None:
        await self._ws.send_bytes(data)

    async def close(self, code: int, reason: str) -> None:
        # Shielded: the task asking (a revocation, a replaced stream's sender) may be
        # cancelled, and a close cut short never tells the agent why.
        if self._closing is None:
            self._closing = asyncio.ensure_future(self._ws.close(code=code,
                                                                 message=reason.encode()))
        await asyncio.shield(self._closing)

    async def wait_closed(self) -> None:
        """Let a close begun by another task finish before the handler returns: returning
        drops the connection, and with the agent's frames still unread that is a reset,
        which can lose the close frame and its reason on the way."""
        if self._closing is not None:
            with contextlib.suppress(Exception):
                await self._closing


# --- admission -----------------------------------------------------------------------------


class Refused(Exception):
    """A connection turned away before its WebSocket was accepted."""

    def __init__(self, status: int, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


_NO_CERTIFICATE = (
    "no client certificate: this listener takes agents with a node certificate from the "
    "cluster CA; join the node (llmgw ctl nodes add NAME, then llmgw agent join URL TOKEN "
    "on it), or set tls: {ca_file, cert_file, key_file} in agent.yaml")


async def admit(der: bytes | None, ca_pem: bytes, store: Store,
                now: datetime | None = None) -> tuple[str, x509.Certificate]:
    """Steps 2 to 4 of the module's order: the node id of an acceptable peer certificate
    (DER, as the ssl layer gives it) and the certificate; Refused otherwise."""
    if not der:
        raise Refused(401, _NO_CERTIFICATE)
    cert = x509.load_der_x509_certificate(der)
    serial = cert.serial_number
    try:
        node = pki.verify_node_cert(cert.public_bytes(serialization.Encoding.PEM), ca_pem,
                                    now=now)
    except pki.PkiError as err:
        raise Refused(403, f"certificate serial {serial:x}: {err}") from None
    try:
        record = await store.get_node_cert(str(serial))
    except StoreError as err:
        # Fail closed: a revocation that cannot be checked is not known to be absent.
        raise Refused(503, f"cannot check certificate serial {serial:x} of node {node!r} "
                      f"against the store's revocations: {err}") from None
    if record is None:
        raise Refused(403, f"certificate serial {serial:x} of node {node!r} is not one this "
                      "cluster issued (it is not in the store); join the node again")
    if record.node != node:
        raise Refused(403, f"certificate serial {serial:x} names node {node!r} but the store "
                      f"issued it to {record.node!r}; join the node again")
    if record.revoked_at is not None:
        raise Refused(403, f"certificate serial {serial:x} of node {node!r} was revoked at "
                      f"{record.revoked_at:%Y-%m-%d %H:%M:%S} UTC; to let the node back, "
                      "join it again with a new token (llmgw ctl nodes add NAME)")
    return node, cert


# --- renewal -------------------------------------------------------------------------------


class Renewer:
    """Signs a connected node's renewal, for that node only, and records it in the store."""

    def __init__(self, store: Store, ca_key: pki.PrivateKey, ca_pem: bytes, lifetime: timedelta):
        self.store = store
        self.ca_key = ca_key
        self.ca_pem = ca_pem
        self.lifetime = lifetime
        self._last: dict[str, float] = {}

    async def __call__(self, identity: Identity, csr_pem: bytes
                       ) -> wire.Certificate | wire.CertificateRefused:
        node = identity.node
        last = self._last.get(node)
        if last is not None and time.monotonic() - last < _RENEW_EVERY_S:
            return self._refuse(node, f"renewed less than {_RENEW_EVERY_S:g} s ago; ask again "
                                "later")
        if await self._revoked(identity):
            return self._refuse(node, "this stream's certificate was revoked")
        try:
            issued = pki.sign_node_csr(self.ca_key, self.ca_pem, csr_pem, node, self.lifetime)
        except pki.PkiError as err:
            return self._refuse(node, str(err))
        try:
            await self.store.add_node_cert(NodeCertRecord(
                serial=str(issued.serial), node=node, not_before=issued.not_before,
                not_after=issued.not_after))
        except StoreError as err:
            return self._refuse(node, f"the store could not record it: {err}; ask again later")
        # A revocation that landed while we signed must reach the new certificate too:
        # revoking again revokes every unexpired certificate of the node, this one included.
        if await self._revoked(identity):
            with contextlib.suppress(StoreError):
                await self.store.revoke_node_certs(node, datetime.now(UTC))
            return self._refuse(node, "this stream's certificate was revoked")
        self._last[node] = time.monotonic()
        log.info("renewed the certificate of node %s: serial %x replaces %x, valid until "
                 "%s UTC", node, issued.serial, identity.serial,
                 f"{issued.not_after:%Y-%m-%d %H:%M:%S}")
        return wire.Certificate(cert=issued.cert_pem.decode(), ca=self.ca_pem.decode())

    async def _revoked(self, identity: Identity) -> bool:
        try:
            record = await self.store.get_node_cert(str(identity.serial))
        except StoreError:
            return True  # fail closed: the agent asks again later
        return record is None or record.revoked_at is not None

    @staticmethod
    def _refuse(node: str, reason: str) -> wire.CertificateRefused:
        log.warning("not renewing the certificate of node %s: %s", node, reason)
        return wire.CertificateRefused(reason=reason)


# --- the listener --------------------------------------------------------------------------


class AgentListener:
    """The mTLS agent stream: ``await start()``, then ``await stop()``."""

    def __init__(self, tls, controller: Controller, store: Store, live: LiveStreams):
        self.tls = tls
        self.controller = controller
        self.store = store
        self.live = live
        self.context = server_context(tls.ca_file, tls.cert_file, tls.key_file)
        self.ca_pem = _read(tls.ca_file, "tls.ca_file")
        try:
            ca_key = pki.load_key(_read(tls.ca_key_file, "tls.ca_key_file"))
            pki.load_cert(self.ca_pem)
        except pki.PkiError as err:
            raise TlsSetupError(f"tls.ca_key_file {tls.ca_key_file} / tls.ca_file "
                                f"{tls.ca_file}: {err}") from None
        self.renewer = Renewer(store, ca_key, self.ca_pem,
                               timedelta(days=tls.node_cert_days))
        self._runner: web.AppRunner | None = None
        self._watcher: asyncio.Task | None = None

    @property
    def url(self) -> str:
        listen = self.tls.agent_listen
        return f"wss://{hostport(listen.host, listen.port)}{STREAM_PATH}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(STREAM_PATH, self._handle)
        app.router.add_get(mirror.AIOHTTP_ROUTE, self._mirror)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        listen = self.tls.agent_listen
        site = web.TCPSite(self._runner, listen.host, listen.port, ssl_context=self.context,
                           shutdown_timeout=2.0)
        try:
            await site.start()
        except OSError as err:
            await self._runner.cleanup()
            raise TlsSetupError(f"tls.agent_listen {listen.host}:{listen.port}: cannot listen "
                                f"there: {err.strerror}; pick another port or address") from None
        self._watcher = asyncio.create_task(self.live.watch(self.store), name="revocations")
        log.info("agent stream (mTLS) on %s", self.url)

    async def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        await self.live.close_all("the server is stopping")
        if self._runner is not None:
            await self._runner.cleanup()

    async def _mirror(self, request: web.Request) -> web.StreamResponse:
        """The control plane's mirror, for the nodes this listener admits to the stream."""
        peer = request.remote or "?"
        ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        try:
            await admit(der, self.ca_pem, self.store)
        except Refused as refusal:
            log.warning("mirror request from %s refused: %s", peer, refusal.reason)
            return web.Response(status=refusal.status, text=refusal.reason + "\n")
        return await mirror.aiohttp_response(self.controller.settings, request, peer)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        peer = request.remote or "?"
        ssl_object = request.transport.get_extra_info("ssl_object") if request.transport else None
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        try:
            node, cert = await admit(der, self.ca_pem, self.store)
        except Refused as refusal:
            log.warning("agent stream from %s refused: %s", peer, refusal.reason)
            return web.Response(status=refusal.status, text=refusal.reason + "\n")
        identity = Identity(node=node, serial=cert.serial_number,
                            not_after=cert.not_valid_after_utc)
        log.info("agent stream from %s: node %s, certificate serial %x, valid until %s UTC",
                 peer, node, identity.serial, f"{identity.not_after:%Y-%m-%d %H:%M:%S}")
        ws = web.WebSocketResponse(heartbeat=None, max_msg_size=_MAX_FRAME)
        await ws.prepare(request)
        socket = AiohttpSocket(ws, peer)
        entry = self.live.add(identity, socket)
        try:
            await serve_agent(socket, self.controller, identity, renew=self.renewer)
        finally:
            self.live.discard(entry)
            await socket.wait_closed()
            with contextlib.suppress(Exception):
                await ws.close()
        return ws
