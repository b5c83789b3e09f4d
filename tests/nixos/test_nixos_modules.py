"""llmgw's NixOS modules, evaluated by nixpkgs' own module system.

Each system here is ``lib.evalModules`` with module checking on, over llmgw's modules and
the NixOS options they touch, declared with NixOS's types (tests/nix/nixos.nix); units are
rendered by NixOS's own code and the files by ``pkgs.formats.yaml``. What the modules write
is then read back as systemd and llmgw would read it: unit text, the start script and the
YAML, which llmgw's own config loader must accept.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from llmgw.config import AgentConfig, ServerConfig, load
from tests.nixos.conftest import Nix, Rendered, harness_expression, section, values

SERVER = "h.llmgw.nixosModules.server"
AGENT = "h.llmgw.nixosModules.agent"
AGENT_SETTINGS = ('{ services.llmgw.agent = { enable = true; '
                  'settings.servers = [ "http://127.0.0.1:8080" ]; }; }')
SERVER_ON = "{ services.llmgw.server.enable = true; }"


def evaluate(nix: Nix, systems: dict[str, str], read: str = "nixos") -> dict[str, dict]:
    """Each system, given as a Nix list of modules, evaluated in one Nix call; ``read`` is
    what of it: everything (tests/nix/llmgw.nix ``nixos``) or its ``assertions``."""
    body = "\n".join(f'  "{name}" = h.{read} ({modules});' for name, modules in systems.items())
    return nix.eval(f"let h = {harness_expression(nix)}; in {{\n{body}\n}}")


def failure(nix: Nix, modules: str) -> str:
    """The error a system fails to evaluate with (undeclared option, type, conflict)."""
    return nix.fails(f"let h = {harness_expression(nix)}; in h.nixos ({modules})")


def load_as_llmgw(data: dict, kind, tmp_path: Path, name: str):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return load(path, kind)


# --- each module alone, both, and the default ---------------------------------------------


@pytest.fixture(scope="module")
def systems(nix: Nix) -> dict[str, dict]:
    return evaluate(nix, {
        "server": f"[ {SERVER} {SERVER_ON} ]",
        "agent": f"[ {AGENT} {AGENT_SETTINGS} ]",
        "both": f"[ {SERVER} {AGENT} {SERVER_ON} {AGENT_SETTINGS} ]",
        "default": f"[ h.llmgw.nixosModules.default {SERVER_ON} {AGENT_SETTINGS} ]",
        # `default` beside a role imports that role once.
        "default-and-server": f"[ h.llmgw.nixosModules.default {SERVER} {SERVER_ON} ]",
        "server-off": f"[ {SERVER} ]",
        "agent-off": f"[ {AGENT} ]",
        "ipv6": f"""[ {SERVER} {{ services.llmgw.server = {{
            enable = true; settings.listen = {{ host = "::1"; port = 9000; }}; }}; }} ]""",
        "granian": f"""[ {SERVER} {{ services.llmgw.server = {{
            enable = true; settings.listen.server = "granian"; }}; }} ]""",
        "ipv6-any": f"""[ {SERVER} {{ services.llmgw.server = {{
            enable = true; openFirewall = true;
            settings.listen = {{ host = "::"; allow_plain_http = true; }}; }}; }} ]""",
    })


def test_each_module_alone_and_together_evaluates(systems):
    expected = {
        "server": {"llmgw-server.service", "llmgw-server.socket"},
        "agent": {"llmgw-agent.service"},
        "both": {"llmgw-server.service", "llmgw-server.socket", "llmgw-agent.service"},
        "default": {"llmgw-server.service", "llmgw-server.socket", "llmgw-agent.service"},
        "default-and-server": {"llmgw-server.service", "llmgw-server.socket"},
        "server-off": set(),
        "agent-off": set(),
    }
    for name, units in expected.items():
        assert systems[name]["failedAssertions"] == [], name
        assert set(systems[name]["units"]) == units, name


def test_the_package_defaults_to_the_flakes_own(nix, systems):
    """No wrapper sets `package`: the option's default is the flake's llmgw, whose
    program ExecStart runs and which is on the machine's PATH."""
    rendered = Rendered(nix, systems["both"])
    package = nix.eval(f"({harness_expression(nix)}).llmgw.packages.x86_64-linux.llmgw.outPath")
    script = rendered.script("llmgw-server.service")
    config = rendered.config_file(script)
    assert script.strip().endswith(f"exec {package}/bin/llmgw server --config {config}")
    agent = rendered.exec_start("llmgw-agent.service")
    assert agent.startswith(f"{package}/bin/llmgw agent --config ")
    assert package in systems["both"]["systemPackages"]
    assert systems["server-off"]["systemPackages"] == []


def test_the_server_unit(nix, systems, tmp_path):
    rendered = Rendered(nix, systems["server"])
    service = rendered.units["llmgw-server.service"]
    hardening = dict(section(service, "Service"))
    for key, value in {
        "Type": "exec", "DynamicUser": "true", "PrivateUsers": "true", "ProcSubset": "pid",
        "ProtectProc": "invisible", "ProtectSystem": "strict", "NoNewPrivileges": "true",
        "CapabilityBoundingSet": "", "DevicePolicy": "closed", "PrivateDevices": "true",
        "SystemCallErrorNumber": "EPERM", "SystemCallArchitectures": "native",
        "RestrictNamespaces": "true", "UMask": "0077", "StateDirectory": "llmgw",
        "StateDirectoryMode": "0700", "Restart": "on-failure",
    }.items():
        assert hardening.get(key) == value, key
    # `systemctl reload`: SIGHUP to the server, which reads server.yaml again.
    [reload] = values(service, "Service", "ExecReload")
    assert reload.endswith("/bin/kill -HUP $MAINPID"), reload
    assert values(service, "Service", "SystemCallFilter") == ["@system-service", "~@privileged"]
    assert values(service, "Service", "RestrictAddressFamilies") == [
        "AF_INET", "AF_INET6", "AF_UNIX"]
    # A switch restarts the server in one step; the socket holds the listener meanwhile.
    assert ("X-StopIfChanged", "false") in section(service, "Service")
    # server.yaml at a path the unit names for good; what a switch changes of it reaches
    # the unit through the triggers (tests/nixos/test_server_switch.py).
    [restart_triggers] = values(service, "Unit", "X-Restart-Triggers")
    [reload_triggers] = values(service, "Unit", "X-Reload-Triggers")
    assert rendered.env(reload_triggers)["text"] == rendered.store_path("/etc/llmgw/server.yaml")
    assert json.loads(rendered.env(restart_triggers)["text"]) == {
        "listen": {"host": "127.0.0.1", "port": 8080, "allow_plain_http": False},
        "state_dir": "/var/lib/llmgw"}
    assert systems["server"]["etc"] == {"llmgw/server.yaml": {
        "source": rendered.store_path("/etc/llmgw/server.yaml"), "mode": "symlink"}}
    unit = dict(section(service, "Unit"))
    assert unit["Requires"] == "llmgw-server.socket"
    assert "llmgw-server.socket" in unit["After"].split()
    assert values(service, "Service", "LoadCredential") == []

    socket = rendered.units["llmgw-server.socket"]
    assert dict(section(socket, "Socket")) == {
        "Accept": "false", "Backlog": "4096", "FreeBind": "true", "ListenStream": "127.0.0.1:8080"}
    assert values(socket, "Install", "WantedBy") == ["sockets.target"]

    script = rendered.script("llmgw-server.service")
    assert "PGPASSWORD" not in script
    assert rendered.config_file(script) == "/etc/llmgw/server.yaml"
    server = rendered.yaml_of(script)
    assert server == {"listen": {"host": "127.0.0.1", "port": 8080, "allow_plain_http": False},
                      "state_dir": "/var/lib/llmgw"}
    load_as_llmgw(server, ServerConfig, tmp_path, "server.yaml")


def test_the_agent_unit(nix, systems, tmp_path):
    rendered = Rendered(nix, systems["agent"])
    service = rendered.units["llmgw-agent.service"]
    options = dict(section(service, "Service"))
    for key, value in {"Type": "exec", "User": "root", "KillMode": "process",
                       "DevicePolicy": "closed", "ProtectSystem": "strict",
                       "StateDirectory": "llmgw-agent", "Restart": "always"}.items():
        assert options.get(key) == value, key
    # Every group name a current or older NVIDIA driver registers for GPUs, nvidiactl, UVM.
    assert {"char-nvidia", "char-nvidia-frontend", "char-nvidia-uvm", "char-nvidia-caps"} <= set(
        values(service, "Service", "DeviceAllow"))
    assert "PrivateDevices" not in options
    # Nothing the agent's environment holds for itself reaches the engines it starts.
    environment = values(service, "Service", "Environment")
    assert not [e for e in environment if "LD_LIBRARY_PATH" in e], environment
    assert values(service, "Service", "ReadWritePaths") == ["-/var/lib/llmgw-weights"]
    assert systems["agent"]["tmpfiles"] == ["d /var/lib/llmgw-weights 0755 root root -"]
    assert systems["agent"]["firewall"] == {"allowedTCPPorts": [], "allowedTCPPortRanges": []}

    agent = rendered.yaml_of(rendered.exec_start("llmgw-agent.service"))
    assert agent["weights"] == {
        "directories": [{"path": "/var/lib/llmgw-weights", "shared": False}]}
    assert agent["nvml_library"] == "/run/opengl-driver/lib/libnvidia-ml.so.1"
    config = load_as_llmgw(agent, AgentConfig, tmp_path, "agent.yaml")
    assert config.runtime == "systemd"
    assert config.install_os_packages is False


def test_an_ipv6_listen_address(nix, systems, tmp_path):
    assert systems["ipv6"]["failedAssertions"] == []
    rendered = Rendered(nix, systems["ipv6"])
    socket = rendered.units["llmgw-server.socket"]
    assert values(socket, "Socket", "ListenStream") == ["[::1]:9000"]
    server = load_as_llmgw(rendered.yaml_of(rendered.script("llmgw-server.service")),
                           ServerConfig, tmp_path, "server.yaml")
    assert (server.listen.host, server.listen.port) == ("::1", 9000)

    anywhere = Rendered(nix, systems["ipv6-any"])
    assert values(anywhere.units["llmgw-server.socket"], "Socket", "ListenStream") == ["[::]:8080"]
    assert systems["ipv6-any"]["firewall"]["allowedTCPPorts"] == [8080]


def test_the_http_server_choice_reaches_server_yaml(nix, systems, tmp_path):
    rendered = Rendered(nix, systems["granian"])
    server = load_as_llmgw(rendered.yaml_of(rendered.script("llmgw-server.service")),
                           ServerConfig, tmp_path, "server.yaml")
    assert server.listen.server == "granian"
    # On the socket the unit passes, as with uvicorn.
    assert values(rendered.units["llmgw-server.socket"], "Socket", "ListenStream") == [
        "127.0.0.1:8080"]
    refused = failure(nix, f"""[ {SERVER} {{ services.llmgw.server = {{
        enable = true; settings.listen.server = "gunicorn"; }}; }} ]""")
    assert "is not of type" in refused and "granian" in refused, refused


def test_secrets_reach_the_server_as_credentials(nix, tmp_path):
    (report,) = evaluate(nix, {"secrets": f"""[ {SERVER} {{ services.llmgw.server = {{
        enable = true; openFirewall = true;
        storePasswordFile = "/run/secrets/db";
        adminTokenFile = "/run/secrets/admin";
        metricsTokenFile = "/run/secrets/metrics";
        tls = {{ caFile = "/etc/llmgw/ca.pem"; caKeyFile = "/run/secrets/ca-key";
                certFile = "/etc/llmgw/server.pem"; keyFile = "/run/secrets/key"; }};
        settings.listen.host = "0.0.0.0";
        settings.store.url = "postgresql+asyncpg://llmgw@db:5432/llmgw";
    }}; }} ]"""}).values()
    assert report["failedAssertions"] == []
    rendered = Rendered(nix, report)
    service = rendered.units["llmgw-server.service"]
    assert sorted(values(service, "Service", "LoadCredential")) == sorted([
        "store-password:/run/secrets/db", "admin-token:/run/secrets/admin",
        "metrics-token:/run/secrets/metrics", "tls-ca:/etc/llmgw/ca.pem",
        "tls-ca-key:/run/secrets/ca-key", "tls-cert:/etc/llmgw/server.pem",
        "tls-key:/run/secrets/key"])
    script = rendered.script("llmgw-server.service")
    assert 'PGPASSWORD="$(< "$CREDENTIALS_DIRECTORY/store-password")"' in script
    server = rendered.yaml_of(script)
    credentials = "/run/credentials/llmgw-server.service"
    assert server["tls"] == {
        "ca_file": f"{credentials}/tls-ca", "ca_key_file": f"{credentials}/tls-ca-key",
        "cert_file": f"{credentials}/tls-cert", "key_file": f"{credentials}/tls-key",
        "agent_listen": {"host": "0.0.0.0", "port": 8443}}
    assert server["auth"] == {"admin_token_file": f"{credentials}/admin-token"}
    assert server["metrics"] == {"token_file": f"{credentials}/metrics-token"}
    # No secret's path or content is in the file or the unit beyond LoadCredential.
    assert "/run/secrets" not in json.dumps(server)
    config = load_as_llmgw(server, ServerConfig, tmp_path, "server.yaml")
    assert config.auth.admin_token_file == f"{credentials}/admin-token"
    assert report["firewall"]["allowedTCPPorts"] == [8080, 8443]


def test_engines_pinned_from_nixpkgs(nix, tmp_path):
    (report,) = evaluate(nix, {"engines": f"""[ {AGENT} ({{ pkgs, ... }}: {{
        services.llmgw.agent = {{
          enable = true;
          settings.servers = [ "http://127.0.0.1:8080" ];
          settings.engines_dir = "/srv/engines";
          engines."llama.cpp".package = pkgs.llama-cpp.override {{ cudaSupport = true; }};
          engines.vllm = {{ binary = "/opt/vllm/bin/vllm"; version = "0.11.0"; }};
          engines.custom = {{ package = pkgs.jq; program = "bin/jq"; }};
        }}; }}) ]"""}).values()
    assert report["failedAssertions"] == []
    rendered = Rendered(nix, report)
    agent = rendered.yaml_of(rendered.exec_start("llmgw-agent.service"))
    pkgs = f"({harness_expression(nix)}).nixpkgs.legacyPackages.x86_64-linux"
    cuda = nix.eval(f"({pkgs}.llama-cpp.override {{ cudaSupport = true; }}).outPath")
    plain = nix.eval(f"{pkgs}.llama-cpp.outPath")
    assert cuda != plain
    assert agent["engines"]["llama.cpp"] == {
        "binary": f"{cuda}/bin/llama-server", "version": "6981"}
    assert agent["engines"]["vllm"] == {"binary": "/opt/vllm/bin/vllm", "version": "0.11.0"}
    assert agent["engines"]["custom"]["binary"].endswith("-jq-1.8.1/bin/jq")
    # The engine's package is in the agent's closure: nixos-rebuild builds it, nix copy
    # carries it.
    assert cuda in rendered.drvs
    assert values(rendered.units["llmgw-agent.service"], "Service", "ReadWritePaths") == [
        "-/var/lib/llmgw-weights", "-/srv/engines"]
    config = load_as_llmgw(agent, AgentConfig, tmp_path, "agent.yaml")
    assert config.engines["llama.cpp"].binary == f"{cuda}/bin/llama-server"


def test_a_certificate_given_as_a_nix_path_travels_in_the_store(nix, tmp_path):
    """A public file may be a Nix path: it is copied into the store with the system, so the
    node reads it there, not at the path it had on the machine that evaluated it."""
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    (report,) = evaluate(nix, {"agent": f"""[ {AGENT} {{ services.llmgw.agent = {{
        enable = true; settings.servers = [ "https://10.0.0.1:8443" ];
        tls = {{ caFile = {ca}; certFile = "/var/lib/llmgw-agent/tls/node.pem";
                keyFile = "/var/lib/llmgw-agent/tls/node-key.pem"; }}; }}; }} ]"""}).values()
    assert report["failedAssertions"] == []
    rendered = Rendered(nix, report)
    tls = rendered.yaml_of(rendered.exec_start("llmgw-agent.service"))["tls"]
    assert re.fullmatch(r"/nix/store/[0-9a-z]{32}-ca\.pem", tls["ca_file"]), tls
    assert tls["key_file"] == "/var/lib/llmgw-agent/tls/node-key.pem"


# --- refusals -------------------------------------------------------------------------------

PATH_LITERAL = "a Nix path is copied into /nix/store, which every user can read"

REFUSED = {
    "hostname-listen": (SERVER, 'enable = true; settings.listen = { host = "cp1.internal"; '
                                'allow_plain_http = true; };',
                        'settings.listen.host = "cp1.internal": give an IP address or localhost'),
    "plain-http-off-loopback": (SERVER, 'enable = true; settings.listen.host = "0.0.0.0";',
                                "is not loopback and there is no `tls`"),
    "store-password-literal": (
        SERVER, 'enable = true; storePasswordFile = /etc/llmgw/db-password; '
                'settings.store.url = "postgresql+asyncpg://llmgw@db/llmgw";',
        f"services.llmgw.server.storePasswordFile = /etc/llmgw/db-password: {PATH_LITERAL}"),
    "tls-key-literal": (
        SERVER, 'enable = true; tls = { caFile = "/etc/ca.pem"; caKeyFile = "/run/ca-key"; '
                'certFile = "/etc/cert.pem"; keyFile = /etc/llmgw/server-key.pem; };',
        f"services.llmgw.server.tls.keyFile = /etc/llmgw/server-key.pem: {PATH_LITERAL}"),
    "admin-token-in-store": (
        SERVER, 'enable = true; adminTokenFile = "/nix/store/00000000000000000000000000000000-t";',
        "services.llmgw.server.adminTokenFile = /nix/store/00000000000000000000000000000000-t: "
        + PATH_LITERAL),
    "relative-secret": (SERVER, 'enable = true; metricsTokenFile = "secrets/metrics";',
                        "services.llmgw.server.metricsTokenFile = secrets/metrics: "
                        "give an absolute path"),
    "tls-settings-without-files": (
        SERVER, 'enable = true; settings.tls.public_urls = [ "https://cp1:8080" ];',
        "services.llmgw.server.settings.tls is set but services.llmgw.server.tls is not"),
    "password-in-store-url": (
        SERVER, 'enable = true; settings.store.url = "postgresql+asyncpg://llmgw:hunter2@db/llmgw";',
        "settings.store.url holds a password, which would be written into the world-readable "
        "Nix store"),
    "password-without-postgresql": (SERVER, 'enable = true; storePasswordFile = "/run/secrets/db";',
                                    "storePasswordFile is for PostgreSQL"),
    "port-range-order": (AGENT, 'enable = true; settings.servers = [ "http://127.0.0.1:8080" ]; '
                                "settings.port_range = [ 21000 20000 ];",
                         "settings.port_range = [ 21000 20000 ]: write the lower port first"),
    "https-without-tls": (AGENT, 'enable = true; settings.servers = [ "https://10.0.0.1:8443" ];',
                          "has https:// addresses but services.llmgw.agent.tls is not set"),
    "plain-http-server-off-loopback": (
        AGENT, 'enable = true; settings.servers = [ "http://10.0.0.1:8080" ];',
        "has a plain http:// address off loopback"),
    "server-without-scheme": (AGENT, 'enable = true; settings.servers = [ "10.0.0.1:8443" ];',
                              "each address starts with https://"),
    "engine-without-package": (AGENT, 'enable = true; settings.servers = [ "http://127.0.0.1:1" ]; '
                                      "engines.vllm = { };",
                               'engines."vllm": set exactly one of package (from nixpkgs) '
                               "or binary"),
    "engine-without-program": (
        AGENT, 'enable = true; settings.servers = [ "http://127.0.0.1:1" ]; '
               "engines.sglang.package = pkgs.jq;",
        'engines."sglang": set program, the path of its program inside the package'),
    "hub-token-literal": (AGENT, 'enable = true; settings.servers = [ "http://127.0.0.1:1" ]; '
                                 "hubTokenFile = /etc/llmgw/hub-token;",
                          "services.llmgw.agent.hubTokenFile = /etc/llmgw/hub-token: "
                          + PATH_LITERAL),
}


@pytest.fixture(scope="module")
def refused(nix: Nix) -> dict[str, dict]:
    role = {SERVER: "server", AGENT: "agent"}
    return evaluate(nix, {
        name: f"[ {module} ({{ pkgs, ... }}: {{ services.llmgw.{role[module]} = {{ {body} }}; }}) ]"
        for name, (module, body, _) in REFUSED.items()}, read="assertions")


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_bad_combinations_fail_with_the_modules_own_words(refused, case):
    """Each bad combination fails with one assertion, the module's own message."""
    expected = REFUSED[case][2]
    failed = refused[case]["failedAssertions"]
    assert len(failed) == 1 and expected in failed[0], failed


def test_a_typed_setting_cannot_be_overridden_silently(nix):
    """settings are typed where the module reads them: a second value for one of them is a
    conflict, not a silent override, and a value of the wrong type names the option."""
    twice = failure(nix, f"""[ {SERVER} {SERVER_ON}
        {{ services.llmgw.server.settings.listen.port = 9000; }}
        {{ services.llmgw.server.settings.listen.port = 9001; }} ]""")
    assert "services.llmgw.server.settings.listen.port' has conflicting definition values" in twice
    wrong = failure(nix, f"""[ {SERVER} {SERVER_ON}
        {{ services.llmgw.server.settings.listen.port = "8080"; }} ]""")
    assert "services.llmgw.server.settings.listen.port' is not of type `16 bit unsigned" in wrong
    fixed = failure(nix, f"""[ {AGENT} {AGENT_SETTINGS}
        {{ services.llmgw.agent.settings.state_dir = "/srv/llmgw"; }} ]""")
    assert "services.llmgw.agent.settings.state_dir' is read-only" in fixed


def test_an_option_nobody_declared_fails_as_in_nixos(nix):
    error = failure(nix, f"""[ {SERVER} {{ services.llmgw.server = {{ enable = true;
        listenPort = 9000; }}; }} ]""")
    assert "The option `services.llmgw.server.listenPort' does not exist" in error


def test_the_earlier_options_still_apply_with_a_warning(nix, tmp_path):
    """An operator's configuration of the earlier modules keeps working: each renamed
    option warns, naming its new place, and its value lands there."""
    systems = evaluate(nix, {
        "server": f"""[ {SERVER} {{ services.llmgw.server = {{ enable = true;
            listen = {{ host = "::1"; port = 9000; }}; logLevel = "debug";
            engines = {{ }};
            models = [ {{ name = "sim-small"; profiles = [ {{ engine = "sim"; }} ]; }} ];
        }}; }} ]""",
        "agent": f"""[ {AGENT} {{ services.llmgw.agent = {{ enable = true;
            servers = [ "http://127.0.0.1:8080" ]; fabric = "ib-a"; portRange = [ 21000 21999 ];
            weights.directories = [ {{ path = "/srv/weights"; }} ];
        }}; }} ]""",
    })
    server, agent = systems["server"], systems["agent"]
    assert any("services.llmgw.server.listen.port" in w and "has been renamed to" in w
               and "services.llmgw.server.settings.listen.port" in w
               for w in server["warnings"]), server["warnings"]
    assert len(server["warnings"]) == 5 and len(agent["warnings"]) == 4
    rendered = Rendered(nix, server)
    written = rendered.yaml_of(rendered.script("llmgw-server.service"))
    assert written["listen"]["port"] == 9000 and written["log_level"] == "debug"
    assert written["engines"] == {} and written["models"][0]["name"] == "sim-small"
    load_as_llmgw(written, ServerConfig, tmp_path, "server.yaml")
    rendered = Rendered(nix, agent)
    written = rendered.yaml_of(rendered.exec_start("llmgw-agent.service"))
    assert (written["fabric"], written["port_range"]) == ("ib-a", [21000, 21999])
    assert written["weights"]["directories"] == [{"path": "/srv/weights", "shared": False}]
    load_as_llmgw(written, AgentConfig, tmp_path, "agent.yaml")
