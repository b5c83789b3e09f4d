"""deploy/monitoring/: the alert rules and the example configuration, checked by Debian's
real ``promtool``.

``promtool test rules`` runs llmgw-alerts.test.yml, whose series make each alert fire and
later clear; the tests here also hold that file to cover every alert both ways, and show
that it catches a rule that no longer fires.
"""

from __future__ import annotations

import re
import shutil

import pytest
import yaml

from tests.monitoring.prometheus import KIT, promtool

RULES = KIT / "llmgw-alerts.yml"
RULE_TESTS = KIT / "llmgw-alerts.test.yml"
ALERTS = {"LlmgwServerDown", "LlmgwNodeLost", "LlmgwReplicaFailing",
          "LlmgwEngineInstallFailed", "LlmgwQueueGrowing", "LlmgwStoreUnreachable",
          "LlmgwCertificateExpiring"}


def _rules() -> list[dict]:
    (group,) = yaml.safe_load(RULES.read_text())["groups"]
    return group["rules"]


def test_promtool_accepts_the_rules():
    checked = promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 7 rules found" in checked.stdout


def test_every_alert_says_how_bad_and_what_to_do():
    rules = _rules()
    assert {r["alert"] for r in rules} == ALERTS
    for rule in rules:
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert set(rule["annotations"]) == {"summary", "description"}, rule["alert"]
        # Each description points somewhere to look or something to run.
        assert "`" in rule["annotations"]["description"], rule["alert"]


def test_the_unit_tests_pass():
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=KIT)
    assert tested.returncode == 0, tested.stdout + tested.stderr
    assert "SUCCESS" in tested.stdout


def test_each_alert_is_tested_firing_and_cleared():
    """For each alert: a time at which it fires, and a later one at which it has cleared."""
    fired: dict[str, list[str]] = {}
    cleared: dict[str, list[str]] = {}
    for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            into = fired if check["exp_alerts"] else cleared
            into.setdefault(check["alertname"], []).append(check["eval_time"])
    assert set(fired) == ALERTS
    for alert in ALERTS:
        first_fired = min(_seconds(t) for t in fired[alert])
        assert any(_seconds(t) > first_fired for t in cleared.get(alert, [])), alert


def _seconds(duration: str) -> int:
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(int(n) * units[u] for n, u in re.findall(r"(\d+)([smhd])", duration))


@pytest.mark.parametrize("alert", sorted(ALERTS))
def test_the_unit_tests_catch_an_alert_that_never_fires(tmp_path, alert):
    """The same tests against rules where one alert's condition can never hold: promtool
    fails them, naming that alert."""
    rules = yaml.safe_load(RULES.read_text())
    for rule in rules["groups"][0]["rules"]:
        if rule["alert"] == alert:
            rule["expr"] = "vector(1) == 0"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(rules))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert tested.returncode != 0
    failed = set(re.findall(r"alertname: (\w+),", tested.stdout + tested.stderr))
    assert failed == {alert}, tested.stdout + tested.stderr


def test_the_example_configuration(tmp_path):
    """prometheus.yml as an operator copies it: valid, with the rules beside it, once the
    token and CA files it names are there."""
    config = (KIT / "prometheus.yml").read_text()
    token, ca = tmp_path / "llmgw-metrics-token", tmp_path / "ca.pem"
    token.write_text("scrape-me\n")
    ca.write_text("")
    config = (config.replace("/etc/prometheus/llmgw-metrics-token", str(token))
              .replace("/etc/llmgw/tls/ca.pem", str(ca)))
    (tmp_path / "prometheus.yml").write_text(config)
    shutil.copy(RULES, tmp_path / RULES.name)
    # The full check: the files it names are read, and the rules beside it checked.
    checked = promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 7 rules found" in checked.stdout
    jobs = {job["job_name"]: job for job in yaml.safe_load(config)["scrape_configs"]}
    assert set(jobs) == {"llmgw-server", "llmgw-nodes"}
    (discovery,) = jobs["llmgw-nodes"]["http_sd_configs"]
    assert discovery["url"].endswith("/api/metrics/targets?port=9100")
