"""What ``nixos-rebuild switch`` does to the llmgw server when its settings change.

switch-to-configuration compares each unit's file in the running system with the new one:
a unit whose only change is ``X-Reload-Triggers`` in ``[Unit]`` is reloaded, any other
change restarts it (nixpkgs' switch-to-configuration-ng, ``compare_units``;
``switch_action`` below is that rule). The server module reads /etc/llmgw/server.yaml,
names it in X-Reload-Triggers and the settings a reload does not apply in
X-Restart-Triggers.

Each case changes one key of server.yaml and asks llmgw itself
(``llmgw.core.config_change.compare`` over the two files the module wrote) whether a
reload applies it: the switch must then reload the server, and restart it otherwise. The
keys swept are every key of each section ``LIVE`` names, so the module's list of live keys
cannot drift from llmgw's either way.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from llmgw.config import ServerConfig, parse
from llmgw.core.config_change import LIVE, compare
from tests.nixos.conftest import Nix, Rendered, values
from tests.nixos.test_nixos_modules import SERVER, evaluate

SERVICE = "llmgw-server.service"
CONFIG = "llmgw/server.yaml"

# [Unit] keys switch-to-configuration does not restart a unit for (compare_units).
UNIT_SECTION_IGNORES = frozenset({
    "X-Reload-Triggers", "Description", "Documentation", "OnFailure", "OnSuccess",
    "OnFailureJobMode", "IgnoreOnIsolate", "StopWhenUnneeded", "RefuseManualStart",
    "RefuseManualStop", "AllowIsolate", "CollectMode", "SourcePath",
})

# Values of typed options (the module refuses others) and of keys outside the swept
# sections that must restart the server.
CHOSEN = {
    "models": [{"name": "sim-small", "profiles": [{"engine": "sim"}]}],
    "log_level": "debug",
    "listen.port": 9000,
    "store.url": "postgresql+asyncpg://llmgw@db.internal:5432/llmgw",
    "nodes.lost_after_s": 90.0,
    "name": "cp1",
}


def _sections(unit: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as switch-to-configuration reads it: [Install] left out, each key's
    values in order."""
    parsed: dict[str, dict[str, list[str]]] = {}
    current = None
    for line in unit.splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = None if line == "[Install]" else parsed.setdefault(line[1:-1], {})
        elif current is not None and "=" in line:
            key, value = line.split("=", 1)
            current.setdefault(key, []).append(value)
    return parsed


def switch_action(running: str, new: str) -> str:
    """``equal``, ``reload`` or ``restart``: what a switch does to a unit whose file
    changes from ``running`` to ``new``."""
    old_unit, new_unit = _sections(running), _sections(new)
    action = "equal"
    for name in old_unit.keys() | new_unit.keys():
        old_section, new_section = old_unit.get(name, {}), new_unit.get(name, {})
        for key in old_section.keys() | new_section.keys():
            if old_section.get(key) == new_section.get(key):
                continue
            if name == "Unit" and key == "X-Reload-Triggers":
                action = "reload"
            elif not (name == "Unit" and key in UNIT_SECTION_IGNORES):
                return "restart"
    return action


def test_switch_action_is_switch_to_configurations_rule():
    unit = "[Unit]\nDescription=a\nX-Reload-Triggers=/nix/store/a\n[Service]\nExecStart=x\n"
    assert switch_action(unit, unit) == "equal"
    assert switch_action(unit, unit.replace("store/a", "store/b")) == "reload"
    assert switch_action(unit, unit.replace("=a\n", "=b\n")) == "equal"
    assert switch_action(unit, unit.replace("=x", "=y")) == "restart"
    both = unit.replace("store/a", "store/b") + "[Unit]\nX-Restart-Triggers=/nix/store/c\n"
    assert switch_action(unit, both) == "restart"


def _default(key: str):
    top, _, field = key.partition(".")
    value = getattr(ServerConfig(), top)
    return getattr(value, field) if field else value


def _changed(key: str):
    """A value of ``key`` that llmgw reads as another than its default."""
    if key in CHOSEN:
        return CHOSEN[key]
    default = _default(key)
    if isinstance(default, bool):
        return not default
    if isinstance(default, int | float):
        return default + 1
    return f"/run/llmgw/{key}" if default is None else f"{default}-changed"


def _swept() -> list[str]:
    """Every key of each section LIVE names one key of, each top-level key LIVE names,
    and the keys of CHOSEN."""
    keys = set(CHOSEN)
    for live in LIVE:
        top, _, field = live.partition(".")
        section = _default(top)
        assert not field or isinstance(section, msgspec.Struct), live
        keys |= {f"{top}.{f}" for f in section.__struct_fields__} if field else {top}
    return sorted(keys)


def _nested(key: str, value) -> dict:
    top, _, field = key.partition(".")
    return {top: {field: value}} if field else {top: value}


def _system(settings: dict, extra: str = "") -> str:
    # builtins.fromJSON: the settings as the test wrote them, floats included.
    return (f"[ {SERVER} {{ services.llmgw.server = {{ enable = true; {extra} "
            f"settings = builtins.fromJSON ''{json.dumps(settings)}''; }}; }} ]")


# A module-set key beside a live one in `auth`: only the live one may leave for a reload.
ADMIN_TOKEN = 'adminTokenFile = "/run/secrets/admin";'
PAIRS = {
    "live-and-restart": ({}, {"gateway": {"queue_max": 7}, "listen": {"port": 9000}}, ""),
    "auth-beside-module-key": ({}, {"auth": {"session_ttl_s": 60.0}}, ADMIN_TOKEN),
    "last-live-key-of-a-section": ({"gateway": {"queue_max": 7}}, {}, ""),
}


@pytest.fixture(scope="module")
def switched(nix: Nix) -> dict:
    """The base system and one system per swept key and pair, evaluated in one Nix
    call, with the server.yaml each writes."""
    systems = {"base": _system({})}
    systems |= {key: _system(_nested(key, _changed(key))) for key in _swept()}
    for name, (before, after, extra) in PAIRS.items():
        systems[f"{name}:before"] = _system(before, extra)
        systems[f"{name}:after"] = _system(after, extra)
    reports = evaluate(nix, systems)
    for name, report in reports.items():
        assert report["failedAssertions"] == [], name
    drvs = nix.derivations(*(report["etcDrvs"][CONFIG] for report in reports.values()))
    written = {name: json.loads(drvs[report["etc"][CONFIG]["source"]]["env"]["value"])
               for name, report in reports.items()}
    return {"reports": reports, "written": written}


def _llmgw_says(running: dict, new: dict) -> str:
    """What llmgw does with ``new`` on a reload while it runs ``running``: ``reload``
    when it applies every changed key, ``restart`` when any waits for one."""
    change = compare(parse(running, ServerConfig, "running"), parse(new, ServerConfig, "new"))
    assert not change.empty
    return "restart" if change.restart else "reload"


def _actions(reports: dict, running: str, new: str) -> dict[str, str]:
    old_units, new_units = reports[running]["units"], reports[new]["units"]
    assert old_units.keys() == new_units.keys()
    return {unit: switch_action(old_units[unit], new_units[unit]) for unit in old_units}


@pytest.mark.parametrize("key", _swept())
def test_a_switch_reloads_the_server_exactly_when_llmgw_applies_the_change_live(
        switched, key):
    reports, written = switched["reports"], switched["written"]
    assert written[key] != written["base"]
    expected = _llmgw_says(written["base"], written[key])
    actions = _actions(reports, "base", key)
    assert actions[SERVICE] == expected, (key, actions)
    if expected == "reload":
        # Nothing else of the system's units changes: the socket stays as it was.
        assert set(actions.values()) == {"equal", "reload"}, actions


def test_the_sweep_covers_both_outcomes(switched):
    """LIVE's keys reload; at least one key of the same sections, and the listen
    address and store, restart."""
    reports = switched["reports"]
    outcome = {key: _actions(reports, "base", key)[SERVICE] for key in _swept()}
    assert {k for k, action in outcome.items() if action == "reload"} == set(LIVE)
    assert outcome["listen.port"] == outcome["store.url"] == "restart"
    assert outcome["gateway.connect_timeout_s"] == "restart"


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_a_switch_with_more_than_one_change(switched, pair):
    """A live key and a restart key together restart; a live key in a section the module
    also writes to reloads; removing a section's last live key reloads."""
    reports, written = switched["reports"], switched["written"]
    before, after = f"{pair}:before", f"{pair}:after"
    expected = _llmgw_says(written[before], written[after])
    assert expected == ("restart" if pair == "live-and-restart" else "reload")
    assert _actions(reports, before, after)[SERVICE] == expected


def test_the_reload_reads_the_new_file_where_the_unit_looks(nix, switched):
    """The reloaded server reads /etc/llmgw/server.yaml, which the switch has pointed at
    the new file: the one X-Reload-Triggers names."""
    report = switched["reports"]["models"]
    rendered = Rendered(nix, report)
    script = rendered.script(SERVICE)
    assert rendered.config_file(script) == "/etc/llmgw/server.yaml"
    [trigger] = values(report["units"][SERVICE], "Unit", "X-Reload-Triggers")
    assert rendered.env(trigger)["text"] == report["etc"][CONFIG]["source"]
    assert rendered.yaml_of(script)["models"] == CHOSEN["models"]
