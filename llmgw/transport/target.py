"""An upstream named by a URL rather than by an engine's address: a server someone else
runs (a static endpoint, ``server.endpoints``).

Its requests carry what an engine's do not: the URL's path in front of each request's
(``/openai/v1/chat/completions`` for ``/v1/chat/completions`` under
``https://host/openai/v1``), its own Host, an ``Authorization`` header, TLS. All of that
is made into bytes once, when the Target is made: a request to it costs one join, as a
request to an engine does (``pool.request_bytes``), and a request to an engine pays
nothing for it. The key is in those bytes only; a Target's ``repr`` never shows it.
"""

from __future__ import annotations

import ssl

from llmgw.transport.pool import JSON_TYPE


class Target:
    """Where and how to send requests to one upstream server: ``host`` and ``port`` to
    connect to, over TLS with ``tls`` (None: plain), its ``base_path`` (``/v1``) in
    front of each request's path less its own ``/v1``, ``host_header`` as sent, and
    ``api_key`` sent as a bearer token (None: no Authorization header)."""

    __slots__ = (
        "_head",
        "_prefix",
        "address",
        "base_path",
        "host",
        "port",
        "server_hostname",
        "tls",
    )

    def __init__(self, host: str, port: int, base_path: str, host_header: str, *,
                 tls: ssl.SSLContext | None = None, api_key: str | None = None) -> None:
        self.host = host
        self.port = port
        self.base_path = base_path
        self.tls = tls
        # TLS checks the certificate against the URL's host (SNI too).
        self.server_hostname = host if tls is not None else None
        # What the pool keeps its idle connections under: never an engine's (host, port),
        # so a connection to an engine never carries this upstream's requests, nor one
        # made with one TLS context another's.
        self.address = (host, port, tls)
        self._prefix = base_path.encode("latin-1")
        head = b" HTTP/1.1\r\nhost: " + host_header.encode("idna")
        if api_key is not None:
            head += b"\r\nauthorization: Bearer " + api_key.encode("latin-1")
        self._head = head

    def path_of(self, path: str) -> bytes:
        """Where ``path`` of llmgw's ``/v1`` (``/v1/chat/completions``) is on this
        upstream: under its base path (``/v1`` of the URL, whatever it is)."""
        return self._prefix + path.removeprefix("/v1").encode("latin-1")

    def request(self, path: str, body: bytes, accept: bytes,
                content_type: bytes = JSON_TYPE) -> bytes:
        """A POST of ``body`` to ``path`` (llmgw's), head and body in one buffer."""
        return b"".join((b"POST ", self.path_of(path), self._head,
                         b"\r\ncontent-type: ", content_type, b"\r\naccept: ", accept,
                         b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n\r\n",
                         body))

    def get(self, path: str) -> bytes:
        """A GET of ``path`` (llmgw's: ``/v1/models``) on a connection it closes after."""
        return b"".join((b"GET ", self.path_of(path), self._head,
                         b"\r\naccept: ", JSON_TYPE, b"\r\nconnection: close\r\n\r\n"))

    def __repr__(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return f"Target({scheme}://{self.host}:{self.port}{self.base_path})"
