"""The modules' monitoring and tracing options, evaluated by nixpkgs' own module system
(as in test_nixos_modules.py), over NixOS's Prometheus options declared with their NixOS
types (tests/nix/prometheus.nix).

Read back: the Prometheus configuration NixOS would write (the scrape jobs, the rules file,
the Alertmanager on loopback), the credentials Prometheus gets, and the `tracing` and
`logging` blocks of server.yaml and agent.yaml, which llmgw's own loader must accept. The
Prometheus configuration is also rendered as NixOS renders it and checked by the real
``promtool``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from llmgw.config import AgentConfig, ServerConfig
from tests.monitoring.prometheus import KIT, promtool
from tests.nixos.conftest import Nix, Rendered, harness_expression, values
from tests.nixos.test_nixos_modules import AGENT, SERVER, load_as_llmgw

CREDENTIALS = "/run/credentials/prometheus.service"
TLS = ('tls = { caFile = "/etc/llmgw/tls/ca.pem"; caKeyFile = "/run/secrets/ca-key"; '
       'certFile = "/etc/llmgw/tls/server.pem"; keyFile = "/run/secrets/server-key"; };')
TRACING = ('tracing = { endpoint = "http://127.0.0.1:4318/v1/traces"; '
           'headersFile = "/run/secrets/otlp-headers"; sampleRatio = 0.25; };')


def evaluate(nix: Nix, systems: dict[str, str]) -> dict[str, dict]:
    """Each system (a Nix list of modules) as tests/nix/llmgw.nix reports it, with what
    NixOS's Prometheus modules were given."""
    body = "\n".join(f'  "{name}" = read ({modules});' for name, modules in systems.items())
    return nix.eval(f"""
      let
        h = {harness_expression(nix)};
        read = modules:
          let
            system = h.nixpkgs.lib.nixosSystem {{ inherit modules; }};
            p = system.config.services.prometheus;
          in h.report system // {{ prometheus = {{
            inherit (p) enable listenAddress globalConfig ruleFiles scrapeConfigs checkConfig
              alertmanagers;
            alertmanager = {{ inherit (p.alertmanager) enable listenAddress port extraFlags
              configuration openFirewall; }};
            node = {{ inherit (p.exporters.node) enable port listenAddress openFirewall; }};
          }}; }};
      in {{
      {body}
      }}""")


def failure(nix: Nix, modules: str) -> str:
    return nix.fails(f"let h = {harness_expression(nix)}; in h.nixos ({modules})")


def without_nulls(value):
    """As NixOS's Prometheus module writes prometheus.yml (filterValidPrometheus)."""
    if isinstance(value, dict):
        return {k: without_nulls(v) for k, v in value.items() if v is not None and k != "_module"}
    if isinstance(value, list):
        return [without_nulls(v) for v in value]
    return value


def in_store(nix: Nix, path: str) -> Path:
    """Where a path of the private store is on disk."""
    return nix.scratch / "root" / path.lstrip("/")


@pytest.fixture(scope="module")
def systems(nix: Nix) -> dict[str, dict]:
    return evaluate(nix, {
        # A server with TLS on every interface and a metrics token; a node with its
        # exporter; both tracing.
        "cluster": f"""[ {SERVER} {AGENT} {{
            services.llmgw.server = {{
              enable = true; {TLS} {TRACING}
              metricsTokenFile = "/run/secrets/metrics";
              monitoring = {{ enable = true; scrapeInterval = "30s";
                             tlsServerName = "cp1.example.org"; }};
              settings.listen.host = "0.0.0.0";
              settings.logging.access = "json";
            }};
            services.llmgw.agent = {{
              enable = true; {TRACING}
              tracing.serviceName = "gpu-01";
              settings.servers = [ "http://127.0.0.1:8080" ];
              monitoring.nodeExporter = {{ enable = true; openFirewall = true; }};
            }};
          }} ]""",
        # The defaults: a server on loopback, no TLS, no token.
        "plain": f"""[ {SERVER} {{ services.llmgw.server = {{
            enable = true; monitoring.enable = true; }}; }} ]""",
        # One address off loopback: a token for /metrics, and no node discovery.
        "one-address": f"""[ {SERVER} {{ services.llmgw.server = {{
            enable = true; {TLS}
            metricsTokenFile = "/run/secrets/metrics";
            settings.listen.host = "10.0.0.1";
            monitoring = {{ enable = true; nodeExporterPort = null; alertmanager.enable = false; }};
          }}; }} ]""",
        "off": f"[ {SERVER} {AGENT} {{ services.llmgw.server.enable = true; "
               'services.llmgw.agent = { enable = true; '
               'settings.servers = [ "http://127.0.0.1:8080" ]; }; } ]',
    })


def test_prometheus_scrapes_the_server_and_finds_the_nodes_through_it(systems, nix):
    cluster = systems["cluster"]
    assert cluster["failedAssertions"] == []
    prometheus = cluster["prometheus"]
    assert prometheus["enable"] is True
    assert prometheus["listenAddress"] == "127.0.0.1"  # its API has no login
    assert prometheus["globalConfig"]["scrape_interval"] == "30s"
    assert prometheus["globalConfig"]["evaluation_interval"] == "30s"
    jobs = {job["job_name"]: without_nulls(job) for job in prometheus["scrapeConfigs"]}
    tls = {"ca_file": f"{CREDENTIALS}/llmgw-ca", "server_name": "cp1.example.org"}
    assert jobs["llmgw-server"] == {
        "job_name": "llmgw-server",
        "scheme": "https",
        # Every interface: over loopback, where llmgw lets Prometheus in.
        "static_configs": [{"targets": ["127.0.0.1:8080"], "labels": {}}],
        "tls_config": tls,
        "authorization": {"type": "Bearer",
                          "credentials_file": f"{CREDENTIALS}/llmgw-metrics-token"},
    }
    assert jobs["llmgw-nodes"] == {
        "job_name": "llmgw-nodes",
        "http_sd_configs": [{"url": "https://127.0.0.1:8080/api/metrics/targets?port=9100",
                             "tls_config": tls}],
    }
    # The files it names reach Prometheus as its own credentials; promtool, which runs
    # where the system is built, checks the syntax only.
    rendered = Rendered(nix, cluster)
    assert values(rendered.units["prometheus.service"], "Service", "LoadCredential") == [
        "llmgw-ca:/etc/llmgw/tls/ca.pem", "llmgw-metrics-token:/run/secrets/metrics"]
    assert prometheus["checkConfig"] == "syntax-only"


def test_the_rules_are_the_repositorys_file(systems, nix):
    (rules,) = systems["cluster"]["prometheus"]["ruleFiles"]
    assert rules.startswith("/nix/store/") and rules.endswith("-llmgw-alerts.yml")
    assert in_store(nix, rules).read_text() == (KIT / "llmgw-alerts.yml").read_text()


def test_alertmanager_listens_on_loopback_alone(systems):
    prometheus = systems["cluster"]["prometheus"]
    alertmanager = prometheus["alertmanager"]
    assert alertmanager["enable"] is True
    assert (alertmanager["listenAddress"], alertmanager["port"]) == ("127.0.0.1", 9093)
    assert alertmanager["openFirewall"] is False
    # No gossip listener, which would otherwise take 0.0.0.0:9094.
    assert "--cluster.listen-address=" in alertmanager["extraFlags"]
    # NixOS refuses an Alertmanager without a configuration: one that notifies no one
    # until the operator routes it.
    assert alertmanager["configuration"] == {"route": {"receiver": "nobody"},
                                             "receivers": [{"name": "nobody"}]}
    assert prometheus["alertmanagers"] == [{"static_configs": [{"targets": ["127.0.0.1:9093"]}]}]


def test_the_nodes_exporter(systems):
    node = systems["cluster"]["prometheus"]["node"]
    assert node == {"enable": True, "port": 9100, "listenAddress": "0.0.0.0",
                    "openFirewall": True}
    assert systems["off"]["prometheus"]["node"]["enable"] is False


def test_the_defaults_on_loopback(systems, nix):
    plain = systems["plain"]
    assert plain["failedAssertions"] == []
    jobs = {job["job_name"]: without_nulls(job) for job in plain["prometheus"]["scrapeConfigs"]}
    assert jobs["llmgw-server"] == {"job_name": "llmgw-server", "scheme": "http",
                                    "static_configs": [{"targets": ["127.0.0.1:8080"],
                                                        "labels": {}}]}
    assert jobs["llmgw-nodes"]["http_sd_configs"] == [
        {"url": "http://127.0.0.1:8080/api/metrics/targets?port=9100"}]
    # Nothing to hand Prometheus, so NixOS's full check of its file stays on.
    assert "prometheus.service" not in plain["units"]
    assert plain["prometheus"]["checkConfig"] is True
    assert plain["prometheus"]["globalConfig"]["scrape_interval"] == "15s"


def test_one_address_off_loopback(systems):
    """Scraped at its own address with the token; no node discovery, which NixOS's
    Prometheus could not authenticate; no Alertmanager when asked for none."""
    one = systems["one-address"]
    assert one["failedAssertions"] == []
    (job,) = [without_nulls(j) for j in one["prometheus"]["scrapeConfigs"]]
    assert job["static_configs"] == [{"targets": ["10.0.0.1:8080"], "labels": {}}]
    assert job["authorization"]["credentials_file"] == f"{CREDENTIALS}/llmgw-metrics-token"
    assert one["prometheus"]["alertmanager"]["enable"] is False
    assert one["prometheus"]["alertmanagers"] == []


def test_nothing_of_it_unless_asked(systems):
    off = systems["off"]
    assert off["failedAssertions"] == []
    assert off["prometheus"]["enable"] is False
    assert off["prometheus"]["alertmanager"]["enable"] is False
    assert set(off["units"]) == {"llmgw-server.service", "llmgw-server.socket",
                                 "llmgw-agent.service"}


def test_promtool_accepts_the_configuration_nixos_writes(systems, nix, tmp_path):
    """prometheus.yml as NixOS's module builds it from these options (nulls left out),
    with the rules file from the store: what `promtool check config` says of it."""
    for name, flags in (("plain", ()), ("cluster", ("--syntax-only",))):
        prometheus = systems[name]["prometheus"]
        config = without_nulls({
            "global": prometheus["globalConfig"],
            "scrape_configs": prometheus["scrapeConfigs"],
            "rule_files": [str(in_store(nix, f)) for f in prometheus["ruleFiles"]],
            "alerting": {"alertmanagers": prometheus["alertmanagers"]},
        })
        path = tmp_path / f"{name}.yml"
        path.write_text(yaml.safe_dump(config))
        checked = promtool("check", "config", *flags, str(path))
        assert checked.returncode == 0, checked.stdout + checked.stderr
        if not flags:
            assert "SUCCESS: 7 rules found" in checked.stdout


def test_tracing_and_access_logs_reach_server_yaml(systems, nix, tmp_path):
    rendered = Rendered(nix, systems["cluster"])
    server = rendered.yaml_of(rendered.script("llmgw-server.service"))
    credentials = "/run/credentials/llmgw-server.service"
    assert server["tracing"] == {"endpoint": "http://127.0.0.1:4318/v1/traces",
                                 "headers_file": f"{credentials}/tracing-headers",
                                 "sample_ratio": 0.25}
    assert server["logging"] == {"access": "json"}
    assert "tracing-headers:/run/secrets/otlp-headers" in values(
        rendered.units["llmgw-server.service"], "Service", "LoadCredential")
    assert "/run/secrets" not in json.dumps(server)
    config = load_as_llmgw(server, ServerConfig, tmp_path, "server.yaml")
    assert (config.tracing.sample_ratio, config.logging.access) == (0.25, "json")
    # Unset: no block, llmgw's defaults.
    plain = Rendered(nix, systems["plain"])
    written = plain.yaml_of(plain.script("llmgw-server.service"))
    assert "tracing" not in written and "logging" not in written


def test_tracing_reaches_agent_yaml(systems, nix, tmp_path):
    rendered = Rendered(nix, systems["cluster"])
    agent = rendered.yaml_of(rendered.exec_start("llmgw-agent.service"))
    # The agent runs as root and reads the file where it is.
    assert agent["tracing"] == {"endpoint": "http://127.0.0.1:4318/v1/traces",
                                "headers_file": "/run/secrets/otlp-headers",
                                "sample_ratio": 0.25, "service_name": "gpu-01"}
    config = load_as_llmgw(agent, AgentConfig, tmp_path, "agent.yaml")
    assert config.tracing.service_name == "gpu-01"


REFUSED = {
    "token-off-loopback": (
        'enable = true; ' + TLS + ' settings.listen.host = "10.0.0.1"; '
        'monitoring = { enable = true; nodeExporterPort = null; };',
        "Prometheus scrapes the server at 10.0.0.1:8080, which llmgw lets in without a token "
        "only over loopback (settings.metrics.allow_loopback): set "
        "services.llmgw.server.metricsTokenFile"),
    "nodes-off-loopback": (
        'enable = true; ' + TLS + ' settings.listen.host = "10.0.0.1"; '
        'metricsTokenFile = "/run/secrets/metrics"; monitoring.enable = true;',
        "finds the nodes at 10.0.0.1:8080/api/metrics/targets, which NixOS's Prometheus asks "
        "without a token"),
    "loopback-turned-off": (
        'enable = true; metricsTokenFile = "/run/secrets/metrics"; monitoring.enable = true; '
        "settings.metrics.allow_loopback = false;",
        "or set monitoring.nodeExporterPort = null to scrape the server alone"),
    "metrics-off": (
        "enable = true; monitoring.enable = true; settings.metrics.enabled = false;",
        "services.llmgw.server.monitoring needs the server's /metrics: remove "
        "settings.metrics.enabled = false"),
    "headers-literal": (
        "enable = true; tracing.headersFile = /etc/llmgw/otlp-headers;",
        "services.llmgw.server.tracing.headersFile = /etc/llmgw/otlp-headers: a Nix path is "
        "copied into /nix/store"),
}


@pytest.fixture(scope="module")
def refused(nix: Nix) -> dict[str, dict]:
    body = "\n".join(
        f'  "{name}" = h.assertions [ {SERVER} {{ services.llmgw.server = {{ {options} }}; }} ];'
        for name, (options, _) in REFUSED.items())
    return nix.eval(f"let h = {harness_expression(nix)}; in {{\n{body}\n}}")


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_cannot_be_monitored_fails_with_the_modules_words(refused, case):
    failed = refused[case]["failedAssertions"]
    assert len(failed) == 1 and REFUSED[case][1] in failed[0], failed


def test_typed_values(nix):
    ratio = failure(nix, f"""[ {SERVER} {{ services.llmgw.server = {{ enable = true;
        tracing.sampleRatio = 1.5; }}; }} ]""")
    assert "services.llmgw.server.tracing.sampleRatio' is not of type" in ratio
    access = failure(nix, f"""[ {SERVER} {{ services.llmgw.server = {{ enable = true;
        settings.logging.access = "text"; }}; }} ]""")
    assert "services.llmgw.server.settings.logging.access' is not of type" in access
