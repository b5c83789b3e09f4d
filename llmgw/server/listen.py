"""The server's listening socket: bound here, or inherited from systemd.

Under systemd socket activation (``llmgw-server.socket``, from the NixOS module) systemd
owns the listening socket and hands it to each ``llmgw server`` it starts, as fd 3 with
``LISTEN_FDS=1`` and ``LISTEN_PID`` set to the server's pid (sd_listen_fds(3)). The socket
outlives every server process, so while one stops and the next starts, the kernel keeps
accepting connections into its queue and the next server answers them: a restart or an
upgrade refuses no connection.

granian's embedded server always binds its own socket; ``_InheritedSocketServer`` gives it
the inherited one instead, the way granian itself does on platforms where it shares one
socket between workers (a ``SocketHolder`` in place of a ``ListenerSpec``). That overrides
one private method of granian 2.8 (pinned in pyproject.toml): check it when granian moves.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from collections.abc import MutableMapping
from typing import Any

from granian.net import SocketHolder
from granian.server.embed import Server as Granian

from llmgw.config import ConfigError, Listen

SD_LISTEN_FDS_START = 3  # sd_listen_fds(3): passed sockets start at this fd
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
        shown = f"[{host}]" if ":" in host else host
        raise ListenError(
            f"the socket systemd passed listens on {shown}:{port}, but server.yaml says "
            f"listen: {{host: {listen.host}, port: {listen.port}}}; make "
            "llmgw-server.socket's ListenStream= and listen agree")


class _InheritedSocketServer(Granian):
    def __init__(self, target: Any, sock: socket.socket, **options: Any):
        host, port = sock.getsockname()[:2]
        super().__init__(target, address=host, port=port, **options)
        self._inherited = sock

    def _init_shared_socket(self) -> None:
        # What granian's AbstractServer does off Linux: workers serve a shared socket.
        self._ssp = None
        self._shd = SocketHolder(self._inherited.detach(), False, self.backlog)
        self._sfd = self._shd.get_fd()


def make_server(target: Any, listen: Listen, **options: Any) -> tuple[Granian, str]:
    """granian's embedded server for ``target``, on the socket systemd passed if it passed
    one, else bound to ``listen``; and the URL it serves on, for the log."""
    sock = inherited_listener()
    if sock is None:
        server = Granian(target, address=listen.host, port=listen.port, **options)
        return server, f"http://{_url_host(listen.host)}:{listen.port}"
    try:
        check_matches(sock, listen)
    except ListenError:
        sock.detach()
        raise
    host, port = sock.getsockname()[:2]
    server = _InheritedSocketServer(target, sock, **options)
    return server, f"http://{_url_host(host)}:{port} (socket passed by systemd)"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
