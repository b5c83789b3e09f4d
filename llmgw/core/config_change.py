"""What a reloaded server.yaml changes, compared with the running one: a pure decision.

Keys are compared one level into each section (``listen.port``, ``gateway.queue_max``), so
that a section of which some keys apply at once and others do not is judged key by key.
A key applies live only when it is named in ``LIVE``: the server really reads it anew
after a reload (the catalog is synced again; the gateway, the auth checks and the admin
API read the config object that a reload replaces). Every other key keeps its running
value until the server restarts, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from llmgw.config import ServerConfig

# Dotted keys (or whole top-level keys) a reload applies at once. Each is read per request
# or per pass from the replaced config, or handed to the part that holds it.
LIVE = frozenset({
    "models",
    "log_level",
    "gateway.first_byte_timeout_s",
    "gateway.idle_timeout_s",
    "gateway.queue_max",
    "gateway.queue_wait_s",
    "gateway.affinity",
    "gateway.affinity_epsilon",
    "auth.require_api_key",
    "auth.session_ttl_s",
})


@dataclass(frozen=True)
class ConfigChange:
    """The keys that differ, in server.yaml's order: those a reload applies, and those
    that keep their running value until a restart."""

    live: tuple[str, ...] = ()
    restart: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.live and not self.restart


def changed_keys(running: ServerConfig, new: ServerConfig) -> list[str]:
    """Each key that differs: ``section.key`` inside a section present in both, the
    top-level key otherwise (a list, a mapping, a section added or removed)."""
    keys = []
    for top in running.__struct_fields__:
        old_value, new_value = getattr(running, top), getattr(new, top)
        if old_value == new_value:
            continue
        if isinstance(old_value, msgspec.Struct) and type(old_value) is type(new_value):
            keys.extend(f"{top}.{field}" for field in old_value.__struct_fields__
                        if getattr(old_value, field) != getattr(new_value, field))
        else:
            keys.append(top)
    return keys


def is_live(key: str) -> bool:
    return key in LIVE or key.split(".", 1)[0] in LIVE


def compare(running: ServerConfig, new: ServerConfig) -> ConfigChange:
    keys = changed_keys(running, new)
    return ConfigChange(tuple(k for k in keys if is_live(k)),
                        tuple(k for k in keys if not is_live(k)))


def effective(running: ServerConfig, new: ServerConfig, change: ConfigChange) -> ServerConfig:
    """``new`` with each key that needs a restart put back to its running value: the
    config the server runs on after the reload."""
    result = new
    for key in change.restart:
        top, _, field = key.partition(".")
        if field:
            section = msgspec.structs.replace(getattr(result, top),
                                              **{field: getattr(getattr(running, top), field)})
            result = msgspec.structs.replace(result, **{top: section})
        else:
            result = msgspec.structs.replace(result, **{top: getattr(running, top)})
    return result
