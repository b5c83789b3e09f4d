"""Node onboarding and revocation over the admin API.

- ``POST /api/nodes/{name}/join-tokens`` (admin): a one-time join token for that node,
  and the one command to run on it.
- ``POST /api/join`` (the token is the only credential): a CSR in, the node's certificate,
  the CA and the agent-stream addresses out. The node's key never leaves the node.
- ``GET /api/ca`` (anyone): the CA certificate, which the node pins by its SHA-256.
- ``POST /api/nodes/{name}/revoke`` (admin): every unexpired certificate of the node is
  revoked; the callbacks in the app's ``on_revoked`` list are then awaited with
  ``(node, serials)``, so the agent listener can close the node's live streams at once.

Only the token's SHA-256 is stored. The token is used in the same transaction that records
the certificate (``Store.redeem_join_token``), so a token is good for one certificate even
when two joins race.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import msgspec
from litestar import Request, Response, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody, Parameter, SkipValidation

from llmgw import pki
from llmgw.config import ServerConfig, ServerTls
from llmgw.core.names import NameRuleError, check_element, hostport
from llmgw.server.admin.common import ADMIN, SERVICES, Input, OptionalBody, StrictBody
from llmgw.server.auth.sessions import Principal
from llmgw.server.dependencies import from_state
from llmgw.server.errors import ApiError, refusals
from llmgw.store import Store
from llmgw.store.pki import JoinTokenRecord, JoinTokenUnusable, NodeCertRecord, unusable

log = logging.getLogger(__name__)

TOKEN_PREFIX = "llmgwj_"
DEFAULT_TTL_S = 3600.0
MAX_TTL_S = 7 * 86400.0

# What the app's ``on_revoked`` list holds: awaited as ``callback(node, serials)`` after a
# revocation is committed; an exception is logged and does not undo the revocation.
RevokedCallback = Callable[[str, list[str]], Awaitable[object]]

DEPENDENCIES = {**SERVICES, "cluster_ca": from_state("cluster_ca"),
                "on_revoked": from_state("on_revoked")}
# A node's name, as ``_node`` checks it (for the OpenAPI document; ``_node`` words a
# refusal).
NodeName = Annotated[str, Parameter(schema_extra={
    "pattern": r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,63}$"})]


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class JoinTokenInput(Input, frozen=True):
    ttl_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_TTL_S)] = DEFAULT_TTL_S


# An empty body: a token for DEFAULT_TTL_S.
DEFAULT_TTL = JoinTokenInput()


class JoinInput(Input):
    token: Annotated[str, msgspec.Meta(max_length=256)]
    csr: Annotated[str, msgspec.Meta(max_length=64 * 1024)]


class JoinToken(msgspec.Struct):
    """A join token, shown once, and the command that uses it on the node."""

    node: str
    token: str
    expires_at: str
    ca_sha256: str
    command: str


class Joined(msgspec.Struct):
    """A joined node's certificate, the CA, and where its agent connects."""

    node: str
    cert: str
    ca: str
    servers: list[str]
    not_after: str


class NodeRevoked(msgspec.Struct):
    node: str
    revoked: list[str]


@dataclass(frozen=True)
class _Ca:
    key: pki.PrivateKey
    cert_pem: bytes
    fingerprint: str


def _tls(config: ServerConfig) -> ServerTls:
    if config.tls is None:
        raise ApiError(409, "this server has no cluster CA: run `llmgw server init`, or add a "
                       "tls block to server.yaml, and restart it", code="no_ca")
    return config.tls


class ClusterCa:
    """The cluster CA's key and certificate, read on first use and kept for the server's
    life."""

    def __init__(self, config: ServerConfig):
        self._config = config
        self._ca: _Ca | None = None

    def get(self) -> _Ca:
        if self._ca is not None:
            return self._ca
        tls = _tls(self._config)
        try:
            cert_pem = Path(tls.ca_file).read_bytes()
            self._ca = _Ca(pki.load_key(Path(tls.ca_key_file).read_bytes()), cert_pem,
                           pki.fingerprint(pki.load_cert(cert_pem)))
        except (OSError, pki.PkiError) as err:
            log.error("cannot use the cluster CA (tls.ca_file %s, tls.ca_key_file %s): %s",
                      tls.ca_file, tls.ca_key_file, err)
            raise ApiError(503, "the server cannot read its cluster CA; its log says why",
                           code="ca_unavailable") from None
        return self._ca


def _node(name: str) -> str:
    try:
        return check_element(name, "node id")
    except NameRuleError as err:
        raise ApiError(400, str(err), param="name", code="invalid_node_name") from None


def control_plane_urls(request: Request, config: ServerConfig) -> list[str]:
    """Where nodes reach this cluster's API: tls.public_urls, else this request's URL."""
    return list(_tls(config).public_urls) or [str(request.base_url).rstrip("/")]


def agent_stream_urls(request: Request, config: ServerConfig) -> list[str]:
    """The agent-stream addresses for a node's agent.yaml: every control-plane host, on
    the mTLS listener's port."""
    port = _tls(config).agent_listen.port
    urls = []
    for url in control_plane_urls(request, config):
        urls.append(f"https://{hostport(urlsplit(url).hostname or '', port)}")
    return list(dict.fromkeys(urls))


_ADMIN = {**ADMIN, "dependencies": DEPENDENCIES}


@post("/api/nodes/{name:str}/join-tokens", status_code=201, **_ADMIN, dto=StrictBody,
      operation_class=OptionalBody,
      responses=refusals(400, 401, 403, 409, 415, 503))
async def create_join_token(request: Request, name: NodeName, principal: NamedDependency[Principal],
                            store: NamedDependency[Store], config: NamedDependency[ServerConfig],
                            cluster_ca: NamedDependency[ClusterCa],
                            data: JSONBody[JoinTokenInput] = DEFAULT_TTL) -> JoinToken:
    node = _node(name)
    ca = cluster_ca.get()
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    now = datetime.now(UTC)
    record = await store.add_join_token(JoinTokenRecord(
        token_hash=hash_token(token), node=node, created_at=now,
        expires_at=now + timedelta(seconds=data.ttl_s), created_by=principal.username))
    urls = ",".join(control_plane_urls(request, config))
    log.info("%s made a join token for node %s, valid until %s", principal.username, node,
             f"{record.expires_at:%Y-%m-%d %H:%M:%S} UTC")
    return JoinToken(node=node, token=token, expires_at=record.expires_at.isoformat(),
                     ca_sha256=ca.fingerprint,
                     command=f"llmgw agent join {urls} {token} --ca-sha256 {ca.fingerprint}")


@get("/api/ca", media_type="application/x-pem-file", dependencies=DEPENDENCIES,
     responses=refusals(409, 503))
async def cluster_ca_cert(cluster_ca: NamedDependency[ClusterCa]) -> Response[str]:
    """The cluster CA's certificate (public): a joining node fetches it over a connection
    it cannot verify yet, and trusts it only if its SHA-256 is the one it was given."""
    return Response(cluster_ca.get().cert_pem, media_type="application/x-pem-file")


@post("/api/join", status_code=200, dependencies=DEPENDENCIES, dto=StrictBody,
      responses=refusals(400, 403, 409, 503))
async def join(request: Request, data: JSONBody[JoinInput], store: NamedDependency[Store],
               config: NamedDependency[ServerConfig],
               cluster_ca: NamedDependency[ClusterCa]) -> Joined:
    tls = _tls(config)
    ca = cluster_ca.get()
    token_hash = hash_token(data.token)
    now = datetime.now(UTC)
    token = await store.find_join_token(token_hash)
    refusal = unusable(token, now)
    if token is None or refusal is not None:
        log.warning("join from %s refused: %s", request.client.host if request.client else "?",
                    refusal)
        raise ApiError(403, str(refusal), param="token", code=f"join_token_{refusal.reason}")
    try:
        issued = pki.sign_node_csr(ca.key, ca.cert_pem, data.csr.encode(), token.node,
                                   timedelta(days=tls.node_cert_days), now=now)
    except pki.PkiError as err:
        raise ApiError(400, str(err), param="csr", code="invalid_csr") from None
    try:
        await store.redeem_join_token(token_hash, NodeCertRecord(
            serial=str(issued.serial), node=token.node, not_before=issued.not_before,
            not_after=issued.not_after), now)
    except JoinTokenUnusable as err:  # another join used it in between
        raise ApiError(403, str(err), param="token", code=f"join_token_{err.reason}") from None
    log.info("node %s joined: certificate serial %x, valid until %s", token.node, issued.serial,
             f"{issued.not_after:%Y-%m-%d %H:%M:%S} UTC")
    return Joined(node=token.node, cert=issued.cert_pem.decode(), ca=ca.cert_pem.decode(),
                  servers=agent_stream_urls(request, config),
                  not_after=issued.not_after.isoformat())


@post("/api/nodes/{name:str}/revoke", status_code=200, **_ADMIN,
      responses=refusals(400, 401, 403, 415))
async def revoke(name: NodeName, principal: NamedDependency[Principal],
                 store: NamedDependency[Store],
                 on_revoked: NamedDependency[SkipValidation[list[RevokedCallback]]]) -> NodeRevoked:
    node = _node(name)
    serials = await store.revoke_node_certs(node, datetime.now(UTC))
    log.warning("%s revoked node %s: certificate serial(s) %s", principal.username, node,
                ", ".join(f"{int(s):x}" for s in serials) or "none unexpired")
    for callback in list(on_revoked):
        try:
            await callback(node, serials)
        except Exception:
            log.exception("after revoking node %s, a revocation callback failed", node)
    return NodeRevoked(node, serials)


ROUTES = [cluster_ca_cert, create_join_token, join, revoke]
