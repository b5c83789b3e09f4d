"""Network namespaces for multi-node integration tests: one "node" per namespace.

A `Lab` makes a bridge in the root namespace and, per node, a namespace joined to the bridge
by a veth pair: the bridge is 10.R.0.1/24 (the server listens there), the nodes are
10.R.0.2, 10.R.0.3, ... (R picked at random among subnets no interface or route of this
machine uses). Every name carries a random suffix, and `destroy` removes exactly the
namespaces and links this lab made, by name, whatever happened in between.

All of it is done with the `ip` command, as an operator would; it needs root.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.integration.cluster import cannot

_SUBNET_LOCK = Path("/tmp/llmgw-netns.lock")  # two labs never pick one subnet at once
_THIRD_OCTETS = range(200, 251)


class LabError(Exception):
    """A namespace or link could not be made; the message has `ip`'s own words."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and done.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20)
    if done.returncode != 0:
        return f"`ip netns` does not work here: {done.stderr.strip()}"
    return None


@dataclass(frozen=True)
class Node:
    index: int  # 1-based
    namespace: str
    address: str
    veth: str  # the root namespace's end, on the bridge; the node's end is eth0

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        """Prefix a command with this to run it in the node (ip netns exec execs it)."""
        return ("ip", "netns", "exec", self.namespace)


@dataclass
class Lab:
    count: int
    suffix: str = field(default_factory=lambda: secrets.token_hex(3))
    subnet: ipaddress.IPv4Network | None = None
    nodes: list[Node] = field(default_factory=list)
    # What this lab made, so that destroy removes exactly that.
    _namespaces: list[str] = field(default_factory=list)
    _links: list[str] = field(default_factory=list)

    @property
    def bridge(self) -> str:
        return f"lgb{self.suffix}"  # 9 characters: interface names stop at 15

    @property
    def server_address(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 1)

    def create(self) -> Lab:
        try:
            self._create()
        except BaseException:
            self.destroy()
            raise
        return self

    def _create(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self._links.append(self.bridge)
        with open(_SUBNET_LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.subnet = _free_subnet()
            prefix = self.subnet.prefixlen
            ip("addr", "add", f"{self.server_address}/{prefix}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for index in range(1, self.count + 1):
            namespace = f"llmgw-{self.suffix}-n{index}"
            veth = f"lgv{self.suffix}n{index}"
            address = str(self.subnet.network_address + 1 + index)
            ip("netns", "add", namespace)
            self._namespaces.append(namespace)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
            self._links.append(veth)
            ip("link", "set", veth, "master", self.bridge, "up")
            ip("-n", namespace, "link", "set", "lo", "up")
            ip("-n", namespace, "addr", "add", f"{address}/{prefix}", "dev", "eth0")
            ip("-n", namespace, "link", "set", "eth0", "up")
            self.nodes.append(Node(index, namespace, address, veth))

    def unplug(self, node: Node) -> None:
        """Take the node's link down: nothing reaches it and nothing leaves it."""
        ip("link", "set", node.veth, "down")

    def pids(self, node: Node) -> list[int]:
        """Every process in the node's namespace."""
        done = ip("netns", "pids", node.namespace, check=False)
        return [int(word) for word in done.stdout.split() if word.isdigit()]

    def listening(self, node: Node) -> set[tuple[str, int]]:
        """The TCP sockets listening in the node's namespace, as (address, port)."""
        done = subprocess.run([*node.exec_prefix, "cat", "/proc/net/tcp", "/proc/net/tcp6"],
                              capture_output=True, text=True, timeout=20, check=True)
        return set(parse_listening(done.stdout))

    def destroy(self) -> None:
        """Remove what this lab made, by name: any process left in its namespaces (they
        are this test's), the namespaces (and their veth ends with them), the links."""
        for namespace in self._namespaces:
            done = ip("netns", "pids", namespace, check=False)
            for word in done.stdout.split():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(word), signal.SIGKILL)
        for namespace in self._namespaces:
            ip("netns", "del", namespace, check=False)
        for link in reversed(self._links):
            if ip("link", "show", link, check=False).returncode == 0:
                ip("link", "del", link, check=False)
        self._namespaces.clear()
        self._links.clear()


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.R.0.0/24 that no address or route of the root namespace overlaps."""
    used = []
    for line in ip("-o", "-4", "addr", "show").stdout.splitlines():
        words = line.split()
        if "inet" in words:
            used.append(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    for line in ip("-4", "route", "show", "table", "all").stdout.splitlines():
        words = line.split()
        if words and words[0] in ("broadcast", "local", "unicast", "anycast", "multicast",
                                   "unreachable", "blackhole", "prohibit", "throw"):
            words = words[1:]
        if words and words[0] != "default":
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(words[0], strict=False))
    candidates = [ipaddress.ip_network(f"10.{r}.0.0/24") for r in _THIRD_OCTETS]
    free = [net for net in candidates if not any(net.overlaps(u) for u in used)]
    if not free:
        raise LabError("every 10.R.0.0/24 with R in 200-250 is in use on this machine")
    return free[secrets.randbelow(len(free))]


def parse_listening(text: str) -> Iterator[tuple[str, int]]:
    """(address, port) of every LISTEN row of /proc/net/tcp and /proc/net/tcp6 text."""
    for line in text.splitlines():
        words = line.split()
        if len(words) < 4 or words[3] != "0A" or ":" not in words[1]:
            continue
        raw, port = words[1].split(":")
        if len(raw) == 8:  # IPv4, little-endian
            address = str(ipaddress.IPv4Address(bytes.fromhex(raw)[::-1]))
        else:  # IPv6: four little-endian 32-bit words
            chunks = [bytes.fromhex(raw[i:i + 8])[::-1] for i in range(0, 32, 8)]
            address = str(ipaddress.IPv6Address(b"".join(chunks)))
        yield address, int(port, 16)


@contextlib.contextmanager
def lab_for_test(nodes: int) -> Iterator[Lab]:
    """A lab of ``nodes`` namespaces for one test, removed after it; where namespaces
    cannot be made, the test is skipped (failed in CI: see cluster.cannot)."""
    reason = unavailable()
    if reason:
        cannot(reason)
    try:
        made = Lab(nodes).create()
    except LabError as err:
        cannot(f"cannot make network namespaces: {err}")
    try:
        yield made
    finally:
        made.destroy()
