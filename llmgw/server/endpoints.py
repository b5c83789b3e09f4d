"""Static endpoints as this server routes to them: OpenAI-compatible servers someone else
runs, named by URL in a model's ``endpoints`` (``core.endpoints``).

They are routes of their model in the router's pool, as its replicas are
(``Controller.ready_endpoints`` adds ``routes``): leases, slots, the queue, affinity, key
limits and usage all apply alike. Each server checks each endpoint itself (``run``:
``GET {url}/models`` with its key, every few seconds, under a bounded timeout); one that
fails is out of routing until it answers again, and ``why_not`` says why in the 503 of
a model left with nothing to serve it. An endpoint not checked yet is routed to, as a
replica its node reports ready is. A request that finds no connection to an endpoint, or
whose key it refuses, has every endpoint checked at once (``recheck``), not a few seconds
later.

Keys: read from their files at start and at each reload (``read_secrets``: a file that
cannot be read is a config error naming its key path), for a model added over the API
when it is added, and by a server that did not read one yet (a follower, say) when it
first needs it. A key lives in its endpoint's ``transport.target.Target`` only, as the
bytes of the Authorization header: it is never in an answer, a page, a log line, a metric
or the store (which keeps the file's path).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from llmgw import config
from llmgw.core.endpoints import StaticEndpoint, endpoint_name
from llmgw.transport.check import ask_status
from llmgw.transport.target import Target

if TYPE_CHECKING:
    from llmgw.core.catalog import Catalog, Model

log = logging.getLogger(__name__)
T = TypeVar("T")

# How often each endpoint is checked, and how long a check may take.
CHECK_INTERVAL_S = 2.0
CHECK_TIMEOUT_S = 2.0
# The least time between two checks of an endpoint, however often requests ask for one.
_RECHECK_GAP_S = 0.25
_CONCURRENCY = 64
# What a check asks for: the model list, which every OpenAI-compatible server answers.
HEALTH_PATH = "/v1/models"


class SecretError(ValueError):
    """A key or CA file that cannot be used; the message says why and what to do."""


@dataclass
class Secrets:
    """The keys read (by file path) and the TLS contexts made (by CA file; None: the
    system's CAs)."""

    keys: dict[str, str] = field(default_factory=dict)
    contexts: dict[str | None, ssl.SSLContext] = field(default_factory=dict)

    def __repr__(self) -> str:  # never the keys
        return f"Secrets({len(self.keys)} key(s), {len(self.contexts)} TLS context(s))"


def read_key(path: str) -> str:
    """The API key in the file at ``path``: its one line, trimmed."""
    try:
        key = Path(path).read_text(encoding="utf-8").strip()
    except OSError as err:
        raise SecretError(f"cannot read {path}: {err.strerror or err}; write the endpoint's "
                          "API key there, or drop api_key_file") from None
    except UnicodeDecodeError:
        raise SecretError(f"{path} is not text (UTF-8); write the endpoint's API key there "
                          "as one line") from None
    if not key:
        raise SecretError(f"{path} is empty; write the endpoint's API key there, or drop "
                          "api_key_file")
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        # Sent as a header: a line break in it would start another header.
        raise SecretError(f"{path} holds more than one word (spaces, line breaks or "
                          "characters a header cannot carry); write only the API key there")
    return key


def tls_context(ca_file: str | None) -> ssl.SSLContext:
    """A client context checking certificates against ``ca_file``, or the system's CAs."""
    try:
        return ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as err:
        raise SecretError(f"cannot read CA certificates from {ca_file}: "
                          f"{getattr(err, 'strerror', None) or err}; name a PEM file, or "
                          "drop ca_file for the system's CAs") from None


def read_secrets(models: Iterable[tuple[str, config.Model]], source: str = "") -> Secrets:
    """The keys and CA files of ``models`` (each with its key path, ``models[0]``), read
    now; a ConfigError naming the key path (after ``source``, the file) of the first that
    cannot be used."""
    secrets = Secrets()
    for where, model in models:
        for k, endpoint in enumerate(model.endpoints):
            at = f"{where}.endpoints[{k}]"
            try:
                if endpoint.api_key_file and endpoint.api_key_file not in secrets.keys:
                    at = f"{where}.endpoints[{k}].api_key_file"
                    secrets.keys[endpoint.api_key_file] = read_key(endpoint.api_key_file)
                if endpoint.url.lower().startswith("https:") and endpoint.ca_file not in \
                        secrets.contexts:
                    at = f"{where}.endpoints[{k}].ca_file"
                    secrets.contexts[endpoint.ca_file] = tls_context(endpoint.ca_file)
            except SecretError as err:
                raise config.ConfigError(f"{source}: {at}: {err}" if source
                                         else f"{at}: {err}") from None
    return secrets


def config_secrets(models: list[config.Model], source: str = "") -> Secrets:
    """``read_secrets`` of server.yaml's ``models``."""
    return read_secrets(((f"models[{i}]", m) for i, m in enumerate(models)), source)


def key_refused(endpoint: StaticEndpoint, status: int) -> str:
    """Why an endpoint answered 401 or 403 (``status``): the key llmgw sent, or the lack
    of one, in words saying what to do."""
    if endpoint.api_key_file is None:
        return (f"it answered {status}: it wants an API key; name a file holding one in "
                "api_key_file")
    return (f"it answered {status}: it refused the key in {endpoint.api_key_file}; check "
            "that file, then reload the server (systemctl reload llmgw-server)")


class Remote:
    """A static endpoint as the router holds it (``router.Endpoint.remote``): its
    declaration and the Target its requests go to."""

    __slots__ = ("endpoint", "target")

    def __init__(self, endpoint: StaticEndpoint, target: Target) -> None:
        self.endpoint = endpoint
        self.target = target

    @property
    def model(self) -> str | None:
        """The upstream's name for the model, when it has its own."""
        return self.endpoint.model

    def __repr__(self) -> str:
        return f"Remote({self.endpoint.url})"


@dataclass(frozen=True, slots=True)
class Health:
    """An endpoint's last check: up, or why not, and since when (Unix time)."""

    endpoint: StaticEndpoint
    up: bool
    reason: str
    since: float


@dataclass(frozen=True, slots=True)
class EndpointState:
    """One endpoint of a model as the views show it."""

    name: str
    url: str
    model: str | None
    slots: int | None
    # "up", "down", or "unchecked" (routed to until a check fails).
    health: str
    reason: str | None
    since: float | None


class StaticEndpoints:
    """Every static endpoint of the catalog as this server sees it: its Target (key read,
    TLS context made), and its last health check."""

    def __init__(self, interval_s: float = CHECK_INTERVAL_S,
                 timeout_s: float = CHECK_TIMEOUT_S) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._secrets = Secrets()
        # Files that could not be read, and why: asked again by the next check only.
        self._problems: dict[str, str] = {}
        self._remotes: dict[str, Remote] = {}
        self._health: dict[str, Health] = {}
        self._checked: frozenset[tuple[str, StaticEndpoint]] = frozenset()
        self._limit = asyncio.Semaphore(_CONCURRENCY)
        self._recheck = asyncio.Event()

    def use(self, secrets: Secrets) -> None:
        """Keys and CA files read anew (at start, at a reload): every Target is made again
        with them, a file that could not be read is tried again, and every endpoint is
        checked again with them."""
        self._secrets = secrets
        self._problems.clear()
        self._remotes.clear()
        self.recheck()

    def recheck(self) -> None:
        """Check every endpoint now rather than at the next interval: a request found no
        connection to one, or its key was refused."""
        self._recheck.set()

    # --- what the controller and the views read ----------------------------------------------

    def routes(self, catalog: Catalog, servers: int = 1
               ) -> dict[str, list[tuple[str, str, int, int | None, Remote]]]:
        """Per model, ``(name, host, port, slots, remote)`` of each endpoint to route to:
        all but those whose last check failed, or whose key cannot be read. ``slots`` is
        this server's share of the endpoint's, as a replica's is."""
        found: dict[str, list[tuple[str, str, int, int | None, Remote]]] = {}
        for model in catalog.models:
            for i, endpoint in enumerate(model.endpoints):
                name = endpoint_name(model.name, i)
                health = self._health.get(name)
                if health is not None and health.endpoint == endpoint and not health.up:
                    continue
                remote = self._remote(name, endpoint)
                if isinstance(remote, str):
                    continue
                slots = endpoint.slots
                if slots is not None:
                    slots = -(-slots // max(servers, 1))
                found.setdefault(model.name, []).append(
                    (name, endpoint.address.host, endpoint.address.port, slots, remote))
        return found

    def why_not(self, model: Model) -> str:
        """Why none of ``model``'s endpoints is routed to, in words an operator can act
        on: each one's failed check, or the file it cannot read."""
        words = []
        for i, endpoint in enumerate(model.endpoints):
            name = endpoint_name(model.name, i)
            remote = self._remote(name, endpoint)
            if isinstance(remote, str):  # a key or CA file it cannot read
                words.append(f"endpoint {endpoint.url} cannot be used: {remote}")
                continue
            state = self._state(name, endpoint)
            if state.health == "down":
                words.append(f"endpoint {endpoint.url} did not answer its health check: "
                             f"{state.reason}")
        if words:
            return "; ".join(words)
        return "every endpoint of it answers its health check but none took the request"

    def states(self, model: Model) -> list[EndpointState]:
        """``model``'s endpoints, each with its health, for the views."""
        return [self._state(endpoint_name(model.name, i), e)
                for i, e in enumerate(model.endpoints)]

    def _state(self, name: str, endpoint: StaticEndpoint) -> EndpointState:
        remote = self._remote(name, endpoint)
        health = self._health.get(name)
        if health is not None and health.endpoint != endpoint:
            health = None
        if health is not None and not health.up:
            shown, reason = "down", health.reason
        elif isinstance(remote, str):
            shown, reason = "down", remote
        else:
            shown, reason = ("unchecked", None) if health is None else ("up", None)
        return EndpointState(name, endpoint.url, endpoint.model, endpoint.slots, shown,
                             reason, None if health is None else health.since)

    def _remote(self, name: str, endpoint: StaticEndpoint, retry: bool = False
                ) -> Remote | str:
        """The endpoint's Remote, made once; or why it cannot be (a file not readable,
        tried again only when ``retry``)."""
        remote = self._remotes.get(name)
        if remote is not None and remote.endpoint == endpoint:
            return remote
        try:
            key = None if endpoint.api_key_file is None else \
                self._file(endpoint.api_key_file, retry, read_key, self._secrets.keys)
            tls = None if not endpoint.address.tls else \
                self._file(endpoint.ca_file, retry, tls_context, self._secrets.contexts)
        except SecretError as err:
            return str(err)
        address = endpoint.address
        remote = self._remotes[name] = Remote(endpoint, Target(
            address.host, address.port, address.path, address.host_header, tls=tls,
            api_key=key))
        return remote

    def _file(self, path: Any, retry: bool, read: Callable[[Any], T],
              read_before: dict[Any, T]) -> T:
        """What ``read`` made of the file at ``path`` (a key, a TLS context; None: the
        system's CAs), read once; a SecretError saying why not."""
        if path in read_before:
            return read_before[path]
        if path in self._problems and not retry:
            raise SecretError(self._problems[path])
        try:
            made = read_before[path] = read(path)
        except SecretError as err:
            if self._problems.get(path) != str(err):
                log.warning("static endpoint: %s", err)
            self._problems[path] = str(err)
            raise
        self._problems.pop(path, None)
        return made

    # --- the checks --------------------------------------------------------------------------

    async def run(self, catalog_of: Callable[[], Catalog], changed: Callable[[], None]
                  ) -> None:
        """Check every endpoint of the catalog (``catalog_of()``) every ``interval_s``;
        call ``changed()`` when what is routed to changes; sooner when asked to
        (``recheck``)."""
        while True:
            self._recheck.clear()
            try:
                if await self.check_once(catalog_of()):
                    changed()
            except Exception:
                log.exception("checking the static endpoints failed; trying again")
            await asyncio.sleep(_RECHECK_GAP_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.interval_s - _RECHECK_GAP_S):
                    await self._recheck.wait()

    async def check_once(self, catalog: Catalog) -> bool:
        """Check each endpoint of ``catalog`` once; whether routing changes with it (one
        went down or came back, or the endpoints declared changed)."""
        todo = [(endpoint_name(m.name, i), e)
                for m in catalog.models for i, e in enumerate(m.endpoints)]
        results = await asyncio.gather(*(self._check(n, e) for n, e in todo))
        checked = frozenset(todo)
        changed = checked != self._checked
        now = time.time()
        health: dict[str, Health] = {}
        for (name, endpoint), result in zip(todo, results, strict=True):
            up = result is True
            reason = "" if up else str(result)
            old = self._health.get(name)
            if old is not None and old.endpoint != endpoint:
                old = None
            if old is not None and old.up == up:
                health[name] = old if old.reason == reason else Health(
                    endpoint, up, reason, old.since)
                continue
            health[name] = Health(endpoint, up, reason, now)
            if not up:
                changed = True
                log.warning("endpoint %s (%s) did not answer this server's health check: "
                            "%s; not routed to until it does", endpoint.url, name, reason)
            elif old is not None:
                changed = True
                log.info("endpoint %s (%s) answers this server's health check again",
                         endpoint.url, name)
        self._health = health
        self._checked = checked
        self._remotes = {n: r for n, r in self._remotes.items() if n in health}
        return changed

    async def _check(self, name: str, endpoint: StaticEndpoint) -> bool | str:
        """True when the endpoint answers 200 to ``GET {url}/models``; else why not."""
        remote = self._remote(name, endpoint, retry=True)
        if isinstance(remote, str):
            return remote
        target = remote.target
        async with self._limit:
            answer = await ask_status(target.host, target.port, target.get(HEALTH_PATH),
                                      self.timeout_s, tls=target.tls,
                                      server_hostname=target.server_hostname)
        if answer == 200:
            return True
        if isinstance(answer, str):
            return answer
        if answer in (401, 403):
            return key_refused(endpoint, answer)
        return f"it answered {answer} to GET {endpoint.url}/models"
