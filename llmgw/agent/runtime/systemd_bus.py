"""Talking to a systemd manager over D-Bus with dbus-fast: connecting (to a bus, or
peer-to-peer to a manager's own socket), calling its methods, and its object paths.

Nothing here knows about shards; :mod:`llmgw.agent.runtime.systemd` builds on it.
"""

from __future__ import annotations

import asyncio
import re
from contextlib import ExitStack
from typing import Any

from dbus_fast import DBusError, Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.aio.message_bus import _MessageWriter
from dbus_fast.aio.message_reader import build_message_reader
from dbus_fast.errors import DBusFastError

DEFAULT_ADDRESS = "unix:path=/run/systemd/private"

DEST = "org.freedesktop.systemd1"
ROOT = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
SERVICE = "org.freedesktop.systemd1.Service"
PROPS = "org.freedesktop.DBus.Properties"

_CONNECT_TIMEOUT_S = 5.0
_CALL_TIMEOUT_S = 15.0

# A connection that cannot reach the manager. DBusError (the manager said no) is a
# DBusFastError too: catch it first wherever both are caught.
TRANSPORT = (OSError, EOFError, TimeoutError, DBusFastError)


def unit_path(name: str) -> str:
    """The manager's object path for a unit, escaped as systemd escapes bus labels."""
    label = "".join(
        c if c.isascii() and (c.isalpha() or (c.isdigit() and i > 0)) else f"_{ord(c):02x}"
        for i, c in enumerate(name)
    )
    return f"{ROOT}/unit/{label or '_'}"


def unit_name(path: str) -> str:
    """The unit name in an object path made by :func:`unit_path`."""
    label = path.rsplit("/", 1)[-1]
    return re.sub(r"_([0-9a-f]{2})", lambda m: chr(int(m.group(1), 16)), label)


def is_peer(address: str) -> bool:
    """A manager's own socket (``.../systemd/private``) is peer-to-peer: no bus daemon,
    no ``Hello``. Any other address is a bus (the system bus on a real node)."""
    return address.rstrip("/").endswith("/systemd/private")


class _PeerBus(MessageBus):
    """A dbus-fast connection to a peer rather than a bus: authenticated, without ``Hello``
    (a manager's private socket answers it with UnknownObject). dbus-fast 5.2 has no such
    mode, so this is its ``connect`` less the ``Hello``; the version is pinned."""

    async def connect(self) -> _PeerBus:
        transport, options = self._bus_address[0]
        with ExitStack() as stack:
            sock, stream, address = self._create_socket_for_transport(transport, options)
            stack.callback(sock.close)
            stack.callback(stream.close)
            sock.setblocking(False)
            await self._loop.sock_connect(sock, address)
            stack.pop_all()
        self._sock, self._stream, self._fd = sock, stream, sock.fileno()
        self._writer = _MessageWriter(self)
        try:
            await self._authenticate()
            self._loop.add_reader(self._fd, build_message_reader(
                self._sock, self._process_message, self._finalize, self._negotiate_unix_fd))
        except BaseException:
            self._loop.remove_reader(self._fd)
            stream.close()
            sock.close()
            self._sock = self._stream = self._fd = self._writer = None
            raise
        self.unique_name = ":peer"  # dbus-fast writes nothing until it has one
        # systemd (252) leaves a message that arrived together with the end of the
        # handshake unread until more data comes: nudge with pings until one is answered.
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _CONNECT_TIMEOUT_S
        pings: set[asyncio.Task] = set()
        interval = 0.05
        try:
            while loop.time() < deadline:
                pings.add(asyncio.ensure_future(self.call(Message(
                    destination=DEST, path=ROOT, interface="org.freedesktop.DBus.Peer",
                    member="Ping"))))
                done, pings = await asyncio.wait(pings, timeout=interval,
                                                 return_when=asyncio.FIRST_COMPLETED)
                if done:
                    done.pop().result()
                    return self
                interval = min(interval * 2, 0.5)
        finally:
            for ping in pings:
                ping.cancel()
        self.disconnect()
        raise TimeoutError("the manager accepted the connection but answers nothing")


async def connect(address: str) -> MessageBus:
    """A connection to the manager at ``address``: peer-to-peer to its own socket, else
    through the bus there. Raises one of :data:`TRANSPORT` (or ValueError for an address
    dbus-fast cannot parse)."""
    bus = (_PeerBus if is_peer(address) else MessageBus)(
        bus_address=address, auth_timeout=_CONNECT_TIMEOUT_S)
    try:
        await asyncio.wait_for(bus.connect(), _CONNECT_TIMEOUT_S)
    except BaseException:
        bus.disconnect()
        raise
    return bus


async def call(bus: MessageBus, member: str, signature: str = "", body: Any = (),
               path: str = ROOT, interface: str = MANAGER, destination: str = DEST) -> list:
    """The body of the reply to one method call (the manager's by default); DBusError
    when the call is refused, one of :data:`TRANSPORT` when no answer comes."""
    message = Message(destination=destination, path=path, interface=interface, member=member,
                      signature=signature, body=list(body))
    reply = await asyncio.wait_for(bus.call(message), _CALL_TIMEOUT_S)
    if reply is None:
        raise EOFError("the connection to the manager closed")
    if reply.message_type == MessageType.ERROR:
        raise DBusError(reply.error_name or "unknown", reply.body[0] if reply.body else "")
    return reply.body


def why(err: BaseException) -> str:
    """A connection or call error, in words for a message."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    if isinstance(err, TimeoutError):
        return "no answer in time"
    return str(err) or type(err).__name__


async def available(address: str = DEFAULT_ADDRESS) -> str | None:
    """None when a systemd manager answers at ``address``; else why not, in words."""
    try:
        bus = await connect(address)
    except (*TRANSPORT, ValueError) as err:
        return f"cannot reach the systemd manager at {address}: {why(err)}"
    try:
        await call(bus, "Get", "ss", [MANAGER, "Version"], interface=PROPS)
    except (*TRANSPORT, DBusError) as err:
        return f"{address} does not answer as a systemd manager: {why(err)}"
    finally:
        bus.disconnect()
    return None
