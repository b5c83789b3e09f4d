"""Static endpoints: OpenAI-compatible servers someone else runs, named by URL in a model's
``endpoints`` (server.yaml, ``POST /api/models``), and served beside (or instead of) the
replicas llmgw runs. Their declaration as the catalog keeps it, the checks of what an
operator wrote, and the name each one goes by wherever a replica's name shows. Pure: the
key files are read, and the endpoints checked, by the server (``server.endpoints``).
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass

from llmgw import config
from llmgw.core.names import url_host

# The ports a URL leaves out.
_DEFAULT_PORTS = {"http": 80, "https": 443}
# What a URL's host and path may hold as written in a request's head: RFC 3986's
# characters (a host name, an IPv4 or IPv6 address; a path's segments, %-escapes).
_HOST = re.compile(r"[A-Za-z0-9.\-:]+")
_PATH = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,;=:@%/]+")


class EndpointError(ValueError):
    """A static endpoint that cannot be used as written; the message says what to change."""


@dataclass(frozen=True, slots=True)
class Address:
    """Where a static endpoint's URL points: what to connect to, and the path its
    requests' go under (``/v1`` of ``http://10.0.0.5:8000/v1``; no trailing slash)."""

    scheme: str  # http or https
    host: str  # an IPv6 address without brackets
    port: int
    path: str

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def host_header(self) -> str:
        """The Host header its requests carry: the URL's host, and its port unless the
        scheme's own."""
        host = url_host(self.host)
        return host if _DEFAULT_PORTS[self.scheme] == self.port else f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class StaticEndpoint:
    """One entry of a model's ``endpoints``, checked."""

    url: str  # as written, but a trailing slash: what pages and refusals show
    address: Address
    # A file holding the API key, sent as ``Authorization: Bearer``; None sends none.
    api_key_file: str | None = None
    # The upstream's name for the model, set as the request body's ``model``; None: the
    # catalog's name (or the alias's model's), as for a replica.
    model: str | None = None
    # Requests it takes at once (the router's slots); None: the router's default.
    slots: int | None = None
    # CA certificates an https endpoint's certificate is checked against instead of the
    # system's.
    ca_file: str | None = None


def endpoint_name(model: str, index: int) -> str:
    """What the ``index``-th endpoint of ``model`` goes by where a replica's name shows
    (routing, refusals, the trail, in-flight counts). No replica's id holds an ``@``
    (``core.names.replica_id``), so the two never clash."""
    return f"{model}@endpoint-{index}"


def model_of_endpoint(name: str) -> str | None:
    """The model of the endpoint called ``name`` (``endpoint_name``); None for any other
    name (a replica's id). A model's name holds no ``@`` (``core.names``)."""
    model, at, index = name.rpartition("@endpoint-")
    return model if at and index.isdigit() else None


def parse_url(url: str) -> Address:
    """Check a static endpoint's ``url``: http or https, a host, a base path, nothing
    else. EndpointError saying what to write otherwise."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise EndpointError(f"{url!r} is not a URL ({err}); write it as an OpenAI client's "
                            "base_url, such as http://10.0.0.5:8000/v1") from None
    if parts.scheme not in _DEFAULT_PORTS:
        raise EndpointError(f"{url!r} is not an http:// or https:// URL; write it as an "
                            "OpenAI client's base_url, such as http://10.0.0.5:8000/v1")
    if not parts.hostname:
        raise EndpointError(f"{url!r} names no host; write it as an OpenAI client's "
                            "base_url, such as http://10.0.0.5:8000/v1")
    # urlsplit drops tabs and line breaks without a word: a URL holding one is refused.
    if not _HOST.fullmatch(parts.hostname) or any(c in url for c in "\t\r\n "):
        raise EndpointError(f"{url!r} holds a space, a line break or a character no host "
                            "name has; write it as an OpenAI client's base_url, such as "
                            "http://10.0.0.5:8000/v1")
    if parts.username is not None or parts.password is not None:
        raise EndpointError("the URL holds a user or password: drop it, and put the API "
                            "key in a file named by api_key_file")
    if parts.query or parts.fragment:
        raise EndpointError(f"{url!r} has a query or fragment; an endpoint's URL is its "
                            "base URL only, such as http://10.0.0.5:8000/v1")
    path = parts.path.rstrip("/")
    if path and not _PATH.fullmatch(path):
        raise EndpointError(f"{url!r} has a path with characters a URL must %-escape; "
                            "escape them, as an OpenAI client's base_url would be")
    if not path:
        raise EndpointError(f"{url!r} has no path: requests to it would go to /chat/"
                            "completions; write the base URL an OpenAI client would use, "
                            f"usually ending in /v1 ({url.rstrip('/')}/v1)")
    return Address(parts.scheme, parts.hostname, port or _DEFAULT_PORTS[parts.scheme], path)


def static_endpoint(raw: config.Endpoint, where: str) -> StaticEndpoint:
    """One ``endpoints`` entry of server.yaml checked; ``where`` is its key path
    (``models[0].endpoints[1]``), which a CatalogError's words start with."""
    try:
        address = parse_url(raw.url)
    except EndpointError as err:
        raise EndpointError(f"{where}.url: {err}") from None
    if raw.ca_file is not None and not address.tls:
        raise EndpointError(f"{where}.ca_file is set but the URL is http://, which checks "
                            "no certificate; write https://, or drop ca_file")
    for key in ("api_key_file", "ca_file", "model"):
        if getattr(raw, key) is not None and not getattr(raw, key).strip():
            raise EndpointError(f"{where}.{key} is empty; name one, or leave the key out")
    return StaticEndpoint(url=raw.url.rstrip("/"), address=address,
                          api_key_file=raw.api_key_file, model=raw.model, slots=raw.slots,
                          ca_file=raw.ca_file)


def static_endpoints(raws: list[config.Endpoint], where: str) -> tuple[StaticEndpoint, ...]:
    """A model's ``endpoints`` checked (``where``: the model's key path); the same URL
    twice is refused."""
    found: list[StaticEndpoint] = []
    for k, raw in enumerate(raws):
        endpoint = static_endpoint(raw, f"{where}.endpoints[{k}]")
        if any(e.url == endpoint.url for e in found):
            raise EndpointError(f"{where}.endpoints[{k}].url: {endpoint.url} is listed "
                                "twice in this model; drop one (slots says how many "
                                "requests one endpoint takes at once)")
        found.append(endpoint)
    return tuple(found)
