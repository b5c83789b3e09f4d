"""The control plane the agent is connected to, as a place to download from.

A server that holds an imported bundle serves it as a mirror (server/mirror.py): engine
archives at URLs relative to the server (``wire.MIRROR_SCHEME``), and a Hugging Face-style
hub of the bundle's models (``Welcome.mirror``). The server cannot know which address each
node reaches it at, so the agent resolves them against the one it dialled, and reads them
with the stream's own TLS: the cluster CA as the only trust, the node's certificate
presented (the mTLS listener admits a node to the mirror as to the stream).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass

from llmgw import wire
from llmgw.config import AgentTls


class TlsFilesUnusable(Exception):
    """tls.* files that cannot make a TLS client; retried, since join may be writing them."""


def client_context(tls: AgentTls) -> ssl.SSLContext:
    """TLS to the control plane: only the cluster CA is trusted, and the node certificate
    is presented. Read afresh for every connection, so a renewed certificate is used at
    the next one."""
    try:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=tls.ca_file)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as err:
        words = getattr(err, "strerror", None) or getattr(err, "reason", None) or str(err)
        raise TlsFilesUnusable(f"tls files {tls.ca_file}, {tls.cert_file}, {tls.key_file}: "
                               f"{words}; `llmgw doctor` checks them") from None
    return context


def http_base(server: str) -> str:
    """A control-plane address of agent.yaml's ``servers`` as an HTTP base URL."""
    server = server.rstrip("/")
    for stream, web in (("wss://", "https://"), ("ws://", "http://")):
        if server.startswith(stream):
            return web + server[len(stream):]
    return server


@dataclass(frozen=True)
class ControlPlane:
    """The server of the agent's current (or last) stream: ``url`` as dialled, and the
    node's TLS when that is https."""

    url: str
    tls: AgentTls | None = None
    # Welcome.mirror: the path of its hub of the bundle's models; "" when it serves none.
    hub_path: str = ""

    @property
    def base(self) -> str:
        return http_base(self.url)

    def resolve(self, url: str) -> str:
        """``url``, with a MIRROR_SCHEME one made absolute on this server."""
        if url.startswith(wire.MIRROR_SCHEME):
            return self.base + url[len(wire.MIRROR_SCHEME):]
        return url

    @property
    def hub(self) -> str:
        """Its hub's URL, or "" when it serves none."""
        return self.base + self.hub_path if self.hub_path else ""

    def ssl_context(self) -> ssl.SSLContext | bool:
        """What aiohttp's ``ssl=`` takes for a request to it: the node's TLS for https
        (TlsFilesUnusable when its files cannot be used), else the default."""
        if self.tls is not None and self.base.startswith("https://"):
            return client_context(self.tls)
        return True


def is_mirrored(url: str) -> bool:
    """Whether ``url`` is on the control plane's mirror (relative to the server)."""
    return url.startswith(wire.MIRROR_SCHEME)
