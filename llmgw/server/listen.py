"""The server's listening socket: bound here, or inherited from systemd.

Under systemd socket activation (``llmgw-server.socket``, from the NixOS module) systemd
owns the listening socket and hands it to each ``llmgw server`` it starts, as fd 3 with
``LISTEN_FDS=1`` and ``LISTEN_PID`` set to the server's pid (sd_listen_fds(3)). The socket
outlives every server process, so while one stops and the next starts, the kernel keeps
accepting connections into its queue and the next server answers them: a restart or an
upgrade refuses no connection.

Either way the server is handed a listening socket (``listening_socket``), and serves the
socket it is given: uvicorn as it is, granian through ``serve_granian``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from collections.abc import MutableMapping

from llmgw.config import ConfigError, Listen
from llmgw.core.names import hostport

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): passed sockets start at this fd
# Connections the kernel queues while the server is busy (capped by net.core.somaxconn).
BACKLOG = 2048
# TCP_DEFER_ACCEPT under granian: a connection is handed to it only once its first bytes
# are in (or after this many seconds). Stopping, granian closes the connections that have
# sent nothing yet as idle: one accepted just before a restart, its request not yet sent,
# was closed unanswered instead of waiting in the queue for the next server (under load:
# 4 failed restarts in 14 without it, none in 14 with it). llmgw's own server (uvicorn)
# answers such a connection's request as it stops (transport/server.py), so it needs none.
DEFER_ACCEPT_S = 5
_ENV = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")


class ListenError(ConfigError):
    """The socket systemd passed cannot be used; the message says what to change."""


def _int_var(environ: MutableMapping[str, str], name: str) -> int:
    value = environ[name]
    try:
        return int(value)
    except ValueError:
        raise ListenError(f"{name}={value!r} is not a number; it is set by systemd for socket "
                          "activation and should not be set by hand") from None


def inherited_listener(
    environ: MutableMapping[str, str] | None = None,
    pid: int | None = None,
    fd_start: int = SD_LISTEN_FDS_START,
) -> socket.socket | None:
    """The listening TCP socket systemd passed to this process, or None when it passed none
    (no ``LISTEN_PID``). Raises ListenError for anything else than exactly one TCP listener
    meant for this process. The variables are removed from ``environ`` (``os.environ`` by
    default) so that no child process takes them for its own."""
    environ = os.environ if environ is None else environ
    pid = os.getpid() if pid is None else pid
    if "LISTEN_PID" not in environ:
        if "LISTEN_FDS" in environ:
            raise ListenError("LISTEN_FDS is set without LISTEN_PID; start llmgw server from "
                              "a systemd socket unit, or unset LISTEN_FDS")
        return None
    listen_pid = _int_var(environ, "LISTEN_PID")
    count = _int_var(environ, "LISTEN_FDS") if "LISTEN_FDS" in environ else 0
    for name in _ENV:
        environ.pop(name, None)
    if listen_pid != pid:
        raise ListenError(
            f"LISTEN_PID={listen_pid} names another process, not this one ({pid}): a wrapper "
            "between systemd and llmgw server must exec it, not start it as a child")
    if count != 1:
        raise ListenError(
            f"LISTEN_FDS={count}: llmgw server takes exactly one listening socket; give "
            "llmgw-server.socket one ListenStream= (host:port, as listen in server.yaml)")
    return _check_listener(fd_start)


def _check_listener(fd: int) -> socket.socket:
    try:
        mode = os.fstat(fd).st_mode
    except OSError as err:
        raise ListenError(f"fd {fd}, passed by systemd (LISTEN_FDS=1), is not open: "
                          f"{err.strerror}") from None
    if not stat.S_ISSOCK(mode):
        raise ListenError(f"fd {fd}, passed by systemd (LISTEN_FDS=1), is not a socket; "
                          "llmgw-server.socket must use ListenStream=")
    sock = socket.socket(fileno=fd)
    try:
        if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
            raise ListenError(f"the socket systemd passed is {sock.family.name}/{sock.type.name}, "
                              "not TCP; llmgw-server.socket must use ListenStream=HOST:PORT")
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            raise ListenError("the socket systemd passed is not listening; llmgw-server.socket "
                              "must use ListenStream= with Accept=no")
    except ListenError:
        sock.detach()  # not ours to close: systemd holds it
        raise
    sock.set_inheritable(False)
    return sock


def _same_host(configured: str, bound: str) -> bool:
    if configured == "localhost":
        return ipaddress.ip_address(bound).is_loopback
    try:
        return ipaddress.ip_address(configured) == ipaddress.ip_address(bound)
    except ValueError:
        return False


def check_matches(sock: socket.socket, listen: Listen) -> None:
    """The inherited socket must be the one server.yaml describes: the config's checks
    (an API key may be off only on loopback) read ``listen``, not the socket."""
    host, port = sock.getsockname()[:2]
    if port != listen.port or not _same_host(listen.host, host):
        raise ListenError(
            f"the socket systemd passed listens on {hostport(host, port)}, but server.yaml says "
            f"listen: {{host: {listen.host}, port: {listen.port}}}; make "
            "llmgw-server.socket's ListenStream= and listen agree")


def _defer_accept(sock: socket.socket, listen: Listen) -> None:
    """TCP_DEFER_ACCEPT for granian, where the kernel has it (Linux)."""
    option = getattr(socket, "TCP_DEFER_ACCEPT", None)
    if listen.server == "granian" and option is not None:
        sock.setsockopt(socket.IPPROTO_TCP, option, DEFER_ACCEPT_S)


def listening_socket(listen: Listen) -> tuple[socket.socket, str]:
    """The socket systemd passed, if it passed one, else a new one bound to ``listen``; and
    where it listens, for the log. Under granian, either way with TCP_DEFER_ACCEPT."""
    sock = inherited_listener()
    if sock is not None:
        try:
            check_matches(sock, listen)
        except ListenError:
            sock.detach()
            raise
        _defer_accept(sock, listen)
        host, port = sock.getsockname()[:2]
        return sock, f"{hostport(host, port)} (socket passed by systemd)"
    host = listen.host
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, listen.port), family=family, backlog=BACKLOG)
    except OSError as err:
        raise ListenError(f"cannot listen on {hostport(host, listen.port)}: "
                          f"{err.strerror or err}; change listen in server.yaml or stop what "
                          "holds that port") from None
    sock.set_inheritable(False)
    _defer_accept(sock, listen)
    return sock, hostport(host, listen.port)
