"""``llmgw agent join URL[,URL...] TOKEN``: give this node its identity, then run the agent.

The node makes its key here and keeps it (0600, never sent); it sends a certificate
request with the one-time token, checks that the certificate it gets back is for its key
and issued by the CA it was given, and writes them beside an agent.yaml that names every
control-plane address and only the overrides given on the command line.

Trust before the node has the CA: ``--ca-sha256`` (the command ``llmgw ctl nodes add``
prints carries it) pins the cluster CA. The CA is fetched from ``GET /api/ca`` over a
connection not yet verified, refused unless its SHA-256 is the pinned one, and only then
is the token sent, over a connection verified against that CA. Without a pin the system's
trust store must vouch for the server; plain http is taken on loopback only.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import socket
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import yaml

from llmgw import pki
from llmgw.config import AgentConfig, AgentTls, ConfigError, EnginePath, parse
from llmgw.core.names import NameRuleError, check_element, is_loopback_host
from llmgw.files import write_atomically

DEFAULT_DIR = AgentConfig(servers=["-"]).state_dir
_TIMEOUT_S = 30.0


class JoinError(Exception):
    """The join cannot go on; the message says what to do."""


class _Refused(JoinError):
    """The server answered with a refusal: trying another address would not help."""


def _request(url: str, context: ssl.SSLContext | None, payload: dict | None = None) -> bytes:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, method="POST" if data else "GET",
                                     headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S, context=context) as resp:
            return resp.read()
    except urllib.error.HTTPError as err:
        try:
            message = json.loads(err.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = err.reason
        raise _Refused(f"{url}: {err.code} {message}") from None
    except (urllib.error.URLError, OSError) as err:
        raise JoinError(f"cannot reach {url}: {getattr(err, 'reason', err)}") from None


def _context(base: str, ca_sha256: str | None) -> ssl.SSLContext | None:
    """How to trust ``base``: None for loopback http, else a verifying TLS context."""
    parts = urlsplit(base)
    if parts.scheme == "http":
        if not is_loopback_host(parts.hostname or ""):
            raise JoinError(f"{base}: the token and certificate would cross the network in "
                            "the clear; use the https:// address the join command names")
        return None
    if parts.scheme != "https":
        raise JoinError(f"{base}: not an http(s) URL; copy the command `llmgw ctl nodes add` "
                        "printed")
    if not ca_sha256:
        return ssl.create_default_context()
    # The CA itself is public: fetch it unverified, then trust it only by its pin.
    unverified = ssl.create_default_context()
    unverified.check_hostname = False
    unverified.verify_mode = ssl.CERT_NONE
    ca_pem = _request(f"{base}/api/ca", unverified)
    try:
        got = pki.fingerprint(pki.load_cert(ca_pem))
    except pki.PkiError as err:
        raise JoinError(f"{base}/api/ca did not answer with a certificate: {err}") from None
    if not hmac.compare_digest(got, ca_sha256.lower()):
        raise _Refused(f"{base} presents the CA {got}, not the pinned {ca_sha256}: this is not "
                       "the cluster the token came from (or someone is in between); check "
                       "the address, and the command `llmgw ctl nodes add` printed")
    return ssl.create_default_context(cadata=ca_pem.decode())


def _csr_name() -> str:
    """What the CSR asks to be called; the server names the certificate after the token's
    node whatever this says."""
    try:
        return check_element(socket.gethostname(), "node id")
    except NameRuleError:
        return "node"


def request_certificate(urls: list[str], token: str, key: pki.PrivateKey,
                        ca_sha256: str | None) -> dict:
    """POST the CSR to the first control plane that answers; a refusal is final."""
    csr = pki.make_csr(key, _csr_name()).decode()
    failures = []
    for url in urls:
        base = url.rstrip("/")
        try:
            context = _context(base, ca_sha256)
            reply = json.loads(_request(f"{base}/api/join", context,
                                        {"token": token, "csr": csr}))
        except _Refused:
            raise
        except JoinError as err:
            failures.append(str(err))
            continue
        if ca_sha256 and not hmac.compare_digest(
                pki.fingerprint(pki.load_cert(reply["ca"].encode())), ca_sha256.lower()):
            raise JoinError(f"{base} answered with a CA other than the pinned one")
        return reply
    raise JoinError("no control plane answered: " + "; ".join(failures))


def _pairs(values: list[str], what: str) -> dict[str, str]:
    found = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name or not rest:
            raise JoinError(f"{what} {value!r}: write it as NAME=VALUE")
        found[name] = rest
    return found


def overrides(args: argparse.Namespace) -> dict:
    """What the command line sets in agent.yaml; checked before the token is spent."""
    return {"labels": _pairs(args.label or [], "--label"), "fabric": args.fabric,
            "engines": {name: EnginePath(binary=path)
                        for name, path in _pairs(args.engine or [], "--engine").items()},
            "disable_engines": args.disable_engine or []}


def agent_config(servers: list[str], node: str, directory: Path, tls: AgentTls,
                 given: dict) -> AgentConfig:
    """agent.yaml: every control-plane address, the TLS files, and only what was given."""
    config = AgentConfig(
        servers=servers, tls=tls, state_dir=str(directory),
        # The agent's id defaults to the hostname; the certificate's node must win.
        node_id=None if node == socket.gethostname() else node, **given)
    # What is written must load as the agent will load it.
    return parse(msgspec.to_builtins(config), AgentConfig, "agent.yaml")


def _set_keys(config: AgentConfig) -> dict:
    """The keys whose value is not the default: agent.yaml says only what was given, so a
    default changed in a later release reaches every node."""
    defaults = msgspec.to_builtins(AgentConfig(servers=config.servers))
    return {key: value for key, value in msgspec.to_builtins(config).items()
            if key == "servers" or value != defaults.get(key)}


def join(args: argparse.Namespace) -> Path:
    """Join, write the files; returns agent.yaml's path."""
    urls = [u.strip() for u in args.urls.split(",") if u.strip()]
    if not urls:
        raise JoinError("give at least one control-plane URL")
    given = overrides(args)
    directory = Path(args.dir).expanduser().resolve()
    tls_dir = directory / "tls"
    config_path = (Path(args.join_config).expanduser().resolve() if args.join_config
                   else directory / "agent.yaml")
    # The key never leaves this machine: only its CSR is sent. It is written once the
    # certificate checks out, so a refused join leaves a node's earlier identity intact.
    key = pki.new_key(args.key_type)
    reply = request_certificate(urls, args.token, key, args.ca_sha256)
    cert_pem, ca_pem = reply["cert"].encode(), reply["ca"].encode()
    try:
        node = pki.verify_node_cert(cert_pem, ca_pem, key)
    except pki.PkiError as err:
        raise JoinError(f"the server's answer cannot be used: {err}") from None
    if node != reply["node"]:
        raise JoinError(f"the certificate names {node!r}, the server said {reply['node']!r}")
    for path in (directory, tls_dir):
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.chmod(0o700)
    tls = AgentTls(ca_file=str(tls_dir / "ca.pem"), cert_file=str(tls_dir / "node.pem"),
                   key_file=str(tls_dir / "node.key"))
    write_atomically(Path(tls.key_file), pki.key_pem(key), 0o600)
    write_atomically(Path(tls.ca_file), ca_pem, 0o644)
    write_atomically(Path(tls.cert_file), cert_pem, 0o644)
    config = agent_config(reply["servers"], node, directory, tls, given)
    config_path.parent.mkdir(parents=True, exist_ok=True)
    header = "# Written by `llmgw agent join`; see docs/configuration.md.\n"
    write_atomically(config_path, (header + yaml.safe_dump(_set_keys(config), sort_keys=False)
                             ).encode(), 0o600)
    print(f"joined as {node}; certificate valid until {reply['not_after']}; "
          f"wrote {config_path}", file=sys.stderr)
    return config_path


def run(args: argparse.Namespace) -> int:
    try:
        config_path = join(args)
    except (JoinError, pki.PkiError, ConfigError, OSError) as err:
        print(f"llmgw agent join: {err}", file=sys.stderr)
        return 1 if isinstance(err, _Refused) else 2
    if args.no_start:
        print(f"start it with: llmgw agent --config {config_path}", file=sys.stderr)
        return 0
    # Become the agent: the same process, as `llmgw agent --config` would run it.
    os.execv(sys.executable, [sys.executable, "-m", "llmgw", "agent", "--config",
                              str(config_path)])
    return 0  # not reached


def add_parser(agent_commands) -> None:
    p = agent_commands.add_parser(
        "join", help="join this node to a cluster with a one-time token, then run the agent",
        description="Make this node's key (kept here), get its certificate with a one-time "
        "token from `llmgw ctl nodes add`, write agent.yaml and start the agent.")
    p.add_argument("urls", metavar="URL[,URL...]",
                   help="the control plane's addresses, comma separated")
    p.add_argument("token", help="the one-time join token")
    p.add_argument("--ca-sha256", metavar="HEX",
                   help="the cluster CA's SHA-256 fingerprint, pinned (the printed command "
                   "carries it)")
    p.add_argument("--label", action="append", metavar="KEY=VALUE",
                   help="a label for placement (repeat it)")
    p.add_argument("--fabric", help="the fabric (InfiniBand/RoCE island) this node is on")
    p.add_argument("--disable-engine", action="append", metavar="ENGINE",
                   help="an engine this node must never run (repeat it)")
    p.add_argument("--engine", action="append", metavar="NAME=PATH",
                   help="an engine binary to use instead of installing one (repeat it)")
    p.add_argument("--dir", default=DEFAULT_DIR,
                   help=f"the agent's state directory; its TLS files go in DIR/tls "
                   f"(default {DEFAULT_DIR})")
    p.add_argument("--config", dest="join_config", metavar="PATH",
                   help="where to write agent.yaml (default DIR/agent.yaml)")
    p.add_argument("--key-type", choices=pki.KEY_KINDS, default="ecdsa",
                   help="the node key's type (default ecdsa, P-256)")
    p.add_argument("--no-start", action="store_true",
                   help="write the files and stop; do not start the agent")
    p.set_defaults(func=run)
