"""An aiohttp client error in an operator's words, for every message of the agent.

aiohttp's own text for a failed connect carries the ``ssl=`` argument of the request:
"Cannot connect to host 10.0.0.5:8443 ssl:<ssl.SSLContext object at 0x7f…> [Connect call
failed ('10.0.0.5', 8443)]". Here it is "cannot connect to 10.0.0.5:8443: Connection
refused": the address and what the OS said, nothing else.
"""

from __future__ import annotations

import os
import socket
import ssl

import aiohttp

from llmgw.core.names import hostport, url_host


def describe(err: BaseException) -> str:
    """What went wrong with a request, without the exception's class or any object repr."""
    if isinstance(err, aiohttp.ClientConnectorError):
        where = url_host(err.host) if err.port is None else hostport(err.host, err.port)
        return f"cannot connect to {where}: {_os_reason(err)}"
    if isinstance(err, TimeoutError):  # aiohttp's own timeouts are TimeoutErrors too
        return "timed out"
    if isinstance(err, aiohttp.ClientPayloadError):
        return "the connection closed before the end"
    if isinstance(err, aiohttp.ServerDisconnectedError):
        return "the server closed the connection"
    return str(err) or type(err).__name__


def _os_reason(err: aiohttp.ClientConnectorError) -> str:
    if isinstance(err, aiohttp.ClientConnectorCertificateError):
        cause = err.certificate_error
        verify = getattr(cause, "verify_message", None)
        return f"its TLS certificate is refused: {verify or cause}"
    cause = err.os_error
    if isinstance(cause, ssl.SSLError):
        return f"TLS failed: {getattr(cause, 'reason', None) or cause}"
    if isinstance(cause, socket.gaierror):
        return f"the name does not resolve ({cause.strerror})"
    if cause.errno:
        # asyncio's strerror is "Connect call failed ('10.0.0.5', 8443)"; the errno says why.
        return os.strerror(cause.errno)
    return cause.strerror or str(cause) or type(cause).__name__
