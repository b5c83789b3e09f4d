"""``llmgw server init``: a new cluster's identity and a server.yaml that uses it.

Everything lands in the server's state directory (``--dir``, default ``/var/lib/llmgw``,
the default ``state_dir``), which only the server's user reads: the admin token is read
from there at every start, so keeping the CA beside it adds no new place to guard.

    <dir>/                 0700
      server.yaml          names everything below; state_dir is <dir>
      secrets/             0700
        admin-token        0600 (kept if there is one)
        ca.key             0600: signs node certificates
        server.key         0600
      tls/                 0700
        ca.pem             the cluster CA: every node trusts it, every node cert chains to it
        server.pem         the server's certificate, for the addresses it is reached at

Both listeners (``listen`` and ``tls.agent_listen``) go where the addresses say
(``listen_host``): on the one IP address given, else on every interface. ``--listen``
says where, whatever the addresses.

With ``--bundle``, an air-gapped control plane is set up from a bundle: the bundle is
imported into ``<dir>/mirror`` first (checked against ``--trusted-key`` and ``--sha256``;
nothing else is written when it is refused), and server.yaml trusts those keys, names the
bundle's engines at its versions, and declares each of its models with one replica
(``bundle.settings.offline_settings``).
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from llmgw import pki
from llmgw.config import (
    BundleSettings,
    Listen,
    ServerConfig,
    ServerTls,
    dump,
)
from llmgw.core.names import hostport, unbracket, url_host
from llmgw.files import write_atomically

if TYPE_CHECKING:
    from llmgw.bundle.manifest import Manifest

DEFAULT_DIR = ServerConfig().state_dir
# One part of a GGUF split in parts: llama.cpp loads the first, which finds the rest.


class InitError(Exception):
    """``server init`` cannot go on; the message says what to do."""


def _interface_ips() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    return [ipaddress.ip_address(address.address.split("%")[0])
            for addresses in psutil.net_if_addrs().values() for address in addresses
            if address.family in (socket.AF_INET, socket.AF_INET6)]


def default_addresses() -> list[str]:
    """The names and addresses this machine is reached at: its hostname, each
    non-loopback, non-link-local address, then loopback."""
    found = [socket.gethostname()]
    found += [str(ip) for ip in _interface_ips() if not (ip.is_loopback or ip.is_link_local)]
    found += ["127.0.0.1", "localhost"]
    return list(dict.fromkeys(found))


LOCALHOST = "localhost"
ANY_IPV4, ANY_IPV6 = "0.0.0.0", "::"


def listen_host(addresses: list[str]) -> str:
    """Where the server listens, given the addresses it is reached at. One IP address:
    that address (``localhost`` is served by a loopback address among them, else counts as
    127.0.0.1). Anything else needs every interface, since one socket listens on one
    address or on all, and a name may resolve to any of the machine's: ``::`` when every
    address is an IPv6 one (the listeners are IPv6-only there), else ``0.0.0.0`` (IPv4
    only)."""
    ips: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    named = False
    for address in addresses:
        if address == LOCALHOST:
            continue
        try:
            ips.add(ipaddress.ip_address(address))
        except ValueError:
            named = True
    if LOCALHOST in addresses and not any(ip.is_loopback for ip in ips):
        ips.add(ipaddress.IPv4Address("127.0.0.1"))
    if len(ips) == 1 and not named:
        return str(next(iter(ips)))
    if ips and not named and all(ip.version == 6 for ip in ips):
        return ANY_IPV6
    return ANY_IPV4


def check_listen(host: str) -> str:
    """``--listen``'s value as server.yaml takes it: an IP address, brackets or not."""
    try:
        return str(ipaddress.ip_address(unbracket(host)))
    except ValueError:
        raise InitError(f"--listen {host}: give an IP address of this machine, or "
                        f"{ANY_IPV4} (every IPv4 interface) or {ANY_IPV6} (every IPv6 one); "
                        "not a name") from None


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)


def check_fresh(directory: Path, force: bool) -> None:
    """Refuse a directory that holds a cluster already, unless ``force``."""
    directory = directory.expanduser().resolve()
    config_path = directory / "server.yaml"
    existing = [p for p in (directory / "secrets" / "ca.key", directory / "tls" / "ca.pem",
                            config_path) if p.exists()]
    if existing and not force:
        raise InitError(
            f"{existing[0]} exists already: this directory holds a cluster. A new CA would "
            "lock out every node that joined it. Pass --force to replace the CA, the server "
            "certificate and server.yaml (then join every node again), or give another --dir")


def init(directory: Path, addresses: list[str], key_type: str = "ecdsa", *,
         force: bool = False, port: int = 8080, agent_port: int = 8443,
         node_cert_days: float = 7.0, listen: str | None = None,
         settings: dict[str, Any] | None = None) -> tuple[Path, str]:
    """Make the CA, the server certificate, the admin token and server.yaml in
    ``directory``; returns (server.yaml's path, the CA's SHA-256 fingerprint). Both
    listeners go on ``listen``, or where ``listen_host`` puts them for ``addresses``.
    ``settings``: more of server.yaml's keys (``bundle.settings.offline_settings``)."""
    directory = directory.expanduser().resolve()
    secrets, tls = directory / "secrets", directory / "tls"
    config_path = directory / "server.yaml"
    check_fresh(directory, force)
    if not addresses:
        raise InitError("give at least one --address the server is reached at")
    host = check_listen(listen) if listen is not None else listen_host(addresses)
    ca_key, ca_pem = pki.create_ca(kind=key_type)
    server_key, server_pem = pki.issue_server_cert(ca_key, ca_pem, addresses, kind=key_type)
    _private_dir(directory)
    _private_dir(secrets)
    _private_dir(tls)
    # Imported here: the server's modules load the store, which `llmgw agent` never needs.
    from llmgw.server.auth import SecretsFileError, load_or_create_admin_token

    try:
        load_or_create_admin_token(directory)
    except SecretsFileError as err:
        raise InitError(str(err)) from None
    write_atomically(secrets / "ca.key", pki.key_pem(ca_key), 0o600)
    write_atomically(secrets / "server.key", server_key, 0o600)
    write_atomically(tls / "ca.pem", ca_pem, 0o644)
    write_atomically(tls / "server.pem", server_pem, 0o644)
    public = [f"https://{hostport(a, port)}" for a in addresses if a != "localhost"]
    config = ServerConfig(
        listen=Listen(host=host, port=port), state_dir=str(directory),
        tls=ServerTls(ca_file=str(tls / "ca.pem"), ca_key_file=str(secrets / "ca.key"),
                      cert_file=str(tls / "server.pem"), key_file=str(secrets / "server.key"),
                      node_cert_days=node_cert_days,
                      agent_listen=Listen(host=host, port=agent_port),
                      public_urls=public),
        **(settings or {}))
    header = ("# Written by `llmgw server init`; see docs/configuration.md for every key.\n"
              "# Add models under `models:`.\n")
    write_atomically(config_path, (header + dump(config)).encode(), 0o600)
    return config_path, pki.fingerprint(pki.load_cert(ca_pem))


def import_into(directory: Path, bundle: Path, trusted_keys: list[str],
                sha256: str | None) -> Manifest:
    """Import ``bundle`` into ``<directory>/mirror`` (the default bundle.mirror_dir) and
    return its manifest; InitError naming what was wrong when it is refused."""
    # Imported here: only a command that imports a bundle loads the bundle code.
    from llmgw.bundle.manifest import BundleError
    from llmgw.bundle.mirror import import_bundle

    if not trusted_keys:
        raise InitError("--bundle needs --trusted-key LINE: the public key of whoever made "
                        "the bundle (llmgw-bundle-ed25519:…, as `llmgw bundle keygen` "
                        "printed it); its signature is checked against that key")
    directory = directory.expanduser().resolve()
    _private_dir(directory)
    mirror = directory / "mirror"
    try:
        return import_bundle(bundle, mirror, trusted_keys, sha256=sha256).manifest
    except BundleError as err:
        raise InitError(f"the bundle {bundle} was not imported: {err}") from None


def _where(host: str, port: int, agent_port: int, chosen: bool) -> str:
    shown = url_host(host)
    where = f"it listens on {shown}:{port} (API) and {shown}:{agent_port} (agent stream)"
    if host in (ANY_IPV4, ANY_IPV6) and not chosen:
        return (f"{where}: every {'IPv6' if host == ANY_IPV6 else 'IPv4'} interface, since "
                "the addresses are not one IP address; --listen IP chooses one")
    return where


def run(args: argparse.Namespace) -> int:
    addresses = args.address or default_addresses()
    manifest, notes = None, []
    try:
        host = check_listen(args.listen) if args.listen is not None else listen_host(addresses)
        settings: dict[str, Any] = {}
        if args.bundle is not None:
            # The bundle first: a refused one leaves no half-made cluster behind.
            check_fresh(Path(args.dir), args.force)
            manifest = import_into(Path(args.dir), args.bundle, args.trusted_key or [],
                                   args.sha256)
            from llmgw.bundle.settings import offline_settings

            settings, notes = offline_settings(manifest, args.trusted_key or [])
        elif args.trusted_key:
            settings = {"bundle": BundleSettings(trusted_keys=args.trusted_key)}
        config_path, fingerprint = init(Path(args.dir), addresses, args.key_type,
                                        force=args.force, port=args.port,
                                        agent_port=args.agent_port, listen=host,
                                        settings=settings)
    except (InitError, pki.PkiError, OSError) as err:
        print(f"llmgw server init: {err}", file=sys.stderr)
        return 2
    print(f"wrote {config_path} and the cluster CA (SHA-256 {fingerprint})")
    if manifest is not None:
        engines = ", ".join(f"{e.name} {e.version}" for e in manifest.engines) or "none"
        models = ", ".join(f"{m.name} ({m.repo}@{m.revision})" for m in manifest.models)
        print(f"imported the bundle made {manifest.created_at:%Y-%m-%d %H:%M} UTC into "
              f"{Path(args.dir).expanduser().resolve() / 'mirror'}: engines {engines}; "
              f"models {models or 'none'}; server.yaml names them")
        for note in notes:
            print(f"llmgw server init: note: {note}", file=sys.stderr)
    print(f"the server certificate names: {', '.join(addresses)}")
    print(_where(host, args.port, args.agent_port, args.listen is not None))
    ip = ipaddress.ip_address(host.split("%")[0])
    if not (ip.is_unspecified or ip.is_loopback or ip in _interface_ips()):
        print(f"llmgw server init: warning: {host} is not an address of this machine, so a "
              "server started here cannot listen on it; if the machine is reached at it "
              "through NAT, set listen.host and tls.agent_listen.host in server.yaml to one "
              f"of its own addresses, or {ANY_IPV4} for every interface", file=sys.stderr)
    print(f"start it with: llmgw server --config {config_path}")
    print("then add a node with: llmgw ctl nodes add NAME")
    return 0


def add_parser(server_commands) -> None:
    p = server_commands.add_parser(
        "init", help="make the cluster CA, the server certificate and server.yaml",
        description="Make a new cluster's CA, the server's certificate (named by the "
        "addresses it is reached at), the admin token and a server.yaml using them. "
        f"Everything goes in --dir (default {DEFAULT_DIR}); keys are mode 0600.")
    p.add_argument("--dir", default=DEFAULT_DIR,
                   help=f"the server's state directory (default {DEFAULT_DIR})")
    p.add_argument("--address", action="append", metavar="HOST",
                   help="a name or IP address the server is reached at (repeat it); default: "
                   "this machine's hostname and addresses, 127.0.0.1 and localhost")
    p.add_argument("--listen", metavar="IP",
                   help="the address both listeners (API and agent stream) bind, 0.0.0.0 or "
                   ":: for every interface; default: the --address when it is one IP "
                   "address (localhost counts as 127.0.0.1), else 0.0.0.0 (:: when every "
                   "address is IPv6)")
    p.add_argument("--key-type", choices=pki.KEY_KINDS, default="ecdsa",
                   help="the CA's and server's key type (default ecdsa, P-256)")
    p.add_argument("--port", type=int, default=8080,
                   help="the API and gateway port (default 8080)")
    p.add_argument("--agent-port", type=int, default=8443,
                   help="the agent stream's mTLS port (default 8443)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing CA and server.yaml (every node must join again)")
    p.add_argument("--bundle", type=Path, metavar="BUNDLE",
                   help="an air-gapped control plane: import this bundle (a directory or "
                   "a .tar from `llmgw bundle create`) into DIR/mirror, and write its "
                   "engines and models into server.yaml (docs/offline.md)")
    p.add_argument("--trusted-key", action="append", metavar="LINE",
                   help="a public key (llmgw-bundle-ed25519:…) whose bundles this control "
                   "plane imports (repeat it); written to bundle.trusted_keys")
    p.add_argument("--sha256", metavar="HEX",
                   help="the bundle manifest's sha256, as carried apart from the bundle")
    p.set_defaults(func=run)
