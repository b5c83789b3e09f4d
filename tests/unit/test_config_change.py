"""What a reloaded server.yaml changes: which keys apply at once, which wait for a restart,
and the config the server runs on afterwards."""

from __future__ import annotations

import pytest
import yaml

from llmgw.config import ConfigError, ServerConfig, parse
from llmgw.core.config_change import compare, effective
from llmgw.server.reload import _checked

SIM = {"name": "sim-a", "profiles": [{"engine": "sim"}]}


def _config(**data) -> ServerConfig:
    return parse(data, ServerConfig)


def test_keys_are_judged_one_by_one_inside_a_section():
    running = _config(models=[SIM])
    new = _config(models=[SIM, {**SIM, "name": "sim-b"}], listen={"port": 9090},
                  gateway={"queue_max": 3, "connect_timeout_s": 1},
                  auth={"require_api_key": False, "login_attempts": 3},
                  store={"url": "postgresql+asyncpg://db/llmgw"}, log_level="debug")
    change = compare(running, new)
    assert change.live == ("gateway.queue_max", "auth.require_api_key", "models",
                           "log_level")
    assert change.restart == ("listen.port", "gateway.connect_timeout_s", "store.url",
                              "auth.login_attempts")


def test_a_section_added_or_a_list_changed_is_named_whole():
    tls = {"ca_file": "ca.pem", "ca_key_file": "ca.key", "cert_file": "s.pem",
           "key_file": "s.key"}
    change = compare(_config(), _config(tls=tls, engine_overrides=[{"nodes": ["a"]}]))
    assert change.live == ()
    assert change.restart == ("tls", "engine_overrides")


def test_the_server_runs_on_the_new_live_keys_and_the_old_restart_ones():
    running = _config(listen={"port": 8080}, gateway={"connect_timeout_s": 5})
    new = _config(listen={"port": 9090}, gateway={"connect_timeout_s": 1, "queue_max": 3},
                  models=[SIM])
    merged = effective(running, new, compare(running, new))
    assert merged.listen.port == 8080
    assert merged.gateway.connect_timeout_s == 5
    assert merged.gateway.queue_max == 3
    assert [m.name for m in merged.models] == ["sim-a"]
    assert compare(running, running).empty


def test_a_kept_key_must_still_fit_the_new_ones(tmp_path):
    """auth.require_api_key: false is fine in a file that listens on loopback, but not
    while the server still listens where it did (restart needed for listen.host)."""
    running = _config(listen={"host": "0.0.0.0", "allow_plain_http": True})
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"listen": {"host": "127.0.0.1"},
                                    "auth": {"require_api_key": False}}))
    with pytest.raises(ConfigError, match=r"auth\.require_api_key: false is allowed only"):
        _checked(path, running)


def test_a_model_that_cannot_be_served_is_refused_naming_it(tmp_path):
    path = tmp_path / "server.yaml"
    path.write_text(yaml.safe_dump({"models": [SIM, {**SIM, "name": "b",
                                                     "aliases": ["sim-a"]}]}))
    with pytest.raises(ConfigError, match=r"models\[1\]"):
        _checked(path, _config())
