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
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
import sys
from pathlib import Path

import psutil

from llmgw import pki
from llmgw.config import Listen, ServerConfig, ServerTls, dump
from llmgw.files import write_atomically

DEFAULT_DIR = ServerConfig().state_dir


class InitError(Exception):
    """``server init`` cannot go on; the message says what to do."""


def default_addresses() -> list[str]:
    """The names and addresses this machine is reached at: its hostname, each
    non-loopback, non-link-local address, then loopback."""
    found = [socket.gethostname()]
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = ipaddress.ip_address(address.address.split("%")[0])
            if not (ip.is_loopback or ip.is_link_local):
                found.append(str(ip))
    found += ["127.0.0.1", "localhost"]
    return list(dict.fromkeys(found))


def _private_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def init(directory: Path, addresses: list[str], key_type: str = "ecdsa", *,
         force: bool = False, port: int = 8080, agent_port: int = 8443,
         node_cert_days: float = 7.0) -> tuple[Path, str]:
    """Make the CA, the server certificate, the admin token and server.yaml in
    ``directory``; returns (server.yaml's path, the CA's SHA-256 fingerprint)."""
    directory = directory.expanduser().resolve()
    secrets, tls = directory / "secrets", directory / "tls"
    config_path = directory / "server.yaml"
    existing = [p for p in (secrets / "ca.key", tls / "ca.pem", config_path) if p.exists()]
    if existing and not force:
        raise InitError(
            f"{existing[0]} exists already: this directory holds a cluster. A new CA would "
            "lock out every node that joined it. Pass --force to replace the CA, the server "
            "certificate and server.yaml (then join every node again), or give another --dir")
    if not addresses:
        raise InitError("give at least one --address the server is reached at")
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
    public = [f"https://{_url_host(a)}:{port}" for a in addresses if a != "localhost"]
    config = ServerConfig(
        listen=Listen(host="0.0.0.0", port=port), state_dir=str(directory),
        tls=ServerTls(ca_file=str(tls / "ca.pem"), ca_key_file=str(secrets / "ca.key"),
                      cert_file=str(tls / "server.pem"), key_file=str(secrets / "server.key"),
                      node_cert_days=node_cert_days,
                      agent_listen=Listen(host="0.0.0.0", port=agent_port),
                      public_urls=public))
    header = ("# Written by `llmgw server init`; see docs/configuration.md for every key.\n"
              "# Add models under `models:`.\n")
    write_atomically(config_path, (header + dump(config)).encode(), 0o600)
    return config_path, pki.fingerprint(pki.load_cert(ca_pem))


def run(args: argparse.Namespace) -> int:
    addresses = args.address or default_addresses()
    try:
        config_path, fingerprint = init(Path(args.dir), addresses, args.key_type,
                                        force=args.force, port=args.port,
                                        agent_port=args.agent_port)
    except (InitError, pki.PkiError, OSError) as err:
        print(f"llmgw server init: {err}", file=sys.stderr)
        return 2
    print(f"wrote {config_path} and the cluster CA (SHA-256 {fingerprint})")
    print(f"the server certificate names: {', '.join(addresses)}")
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
    p.add_argument("--key-type", choices=pki.KEY_KINDS, default="ecdsa",
                   help="the CA's and server's key type (default ecdsa, P-256)")
    p.add_argument("--port", type=int, default=8080,
                   help="the API and gateway port (default 8080)")
    p.add_argument("--agent-port", type=int, default=8443,
                   help="the agent stream's mTLS port (default 8443)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing CA and server.yaml (every node must join again)")
    p.set_defaults(func=run)
