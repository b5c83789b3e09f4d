"""Name rules, defined once and used by the API, the CLI, the controller and the agent."""

from __future__ import annotations

import ipaddress
import re

# Model names are what clients send as `model`: allow the usual "org/name:tag" shapes.
_MODEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,127}")
# Profile names and anything that ends up in a unit name or a path: one safe element.
_ELEMENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,63}")
_UNSAFE_RE = re.compile(r"[^A-Za-z0-9_.-]+")


class NameRuleError(ValueError):
    """A name that breaks a rule; the message says which rule."""


def check_model_name(name: str) -> str:
    if not _MODEL_RE.fullmatch(name) or ".." in name:
        raise NameRuleError(
            f"model name {name!r} is not allowed: use 1-128 letters, digits and ._:/+- "
            "starting with a letter or digit, without '..'"
        )
    return name


def check_element(name: str, what: str) -> str:
    """A name that becomes one path element or part of a unit name."""
    if not _ELEMENT_RE.fullmatch(name):
        raise NameRuleError(
            f"{what} {name!r} is not allowed: use 1-64 letters, digits and ._+- "
            "starting with a letter or digit"
        )
    return name


_USERNAME_RE = re.compile(r"[a-z0-9][a-z0-9._-]{1,63}")


def check_username(name: str) -> str:
    if not _USERNAME_RE.fullmatch(name):
        raise NameRuleError(
            f"username {name!r} is not allowed: use 2-64 lowercase letters, digits and ._- "
            "starting with a letter or digit"
        )
    return name


def replica_id(model: str, epoch: int) -> str:
    """A replica's id: the model name made unit-safe, and the placement epoch that made it
    (epochs only grow, so the id is unique for the life of the store)."""
    slug = _UNSAFE_RE.sub("-", model).strip("-.").lower()[:48] or "model"
    return f"{slug}-e{epoch}"


def shard_unit(replica: str, rank: int) -> str:
    return f"llmgw-shard-{replica}-{rank}"


def is_loopback_host(host: str | None) -> bool:
    """Whether ``host`` is a loopback address (an IPv4-mapped one and ``localhost``
    included). Names other than ``localhost`` are not resolved: they are not loopback."""
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(unbracket(host).split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def url_host(host: str) -> str:
    """``host`` as a URL or ``host:port`` writes it: an IPv6 address (a zone id kept as
    is) in brackets, an IPv4 address or a name unchanged, brackets already there kept."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def hostport(host: str, port: int) -> str:
    return f"{url_host(host)}:{port}"


def unbracket(host: str) -> str:
    """``host`` without the brackets a URL puts round an IPv6 address."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host
