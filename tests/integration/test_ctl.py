"""`llmgw ctl` against a real server and agent on loopback (the sim engine): every command,
its `--json` parsed and checked against what the server holds, its tables, and its exit
codes. One server for the module: starting one costs seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import ssl
import sys
from dataclasses import dataclass

import httpx
import pytest
import yaml

from llmgw import config
from llmgw.cli.main import main
from llmgw.server.catalog import sync_declared
from llmgw.store import open_store, sqlite_url
from tests.integration.cluster import Cluster, _start, _stop_group, free_port, wait_for
from tests.integration.conftest import SIM_SMALL

FAST_AUTH = {"argon2_memory_kib": 19 * 1024, "argon2_time_cost": 2,
             "argon2_parallelism": 1, "hash_slots": 2}


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def json(self):
        assert self.code == 0, self.err
        return json.loads(self.out)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    made = Cluster(tmp_path_factory.mktemp("ctl"), [SIM_SMALL], {"auth": FAST_AUTH})
    failed_before = request.session.testsfailed
    try:
        made.start_server()
        made.add_agent("node-a")
        made.wait_ready("sim-small")
        yield made
    finally:
        if request.session.testsfailed > failed_before:
            print(made.logs())
        made.stop()


# ctl with its own session file and no credentials from the shell (conftest.py).
pytestmark = pytest.mark.usefixtures("ctl_environment")


def run(*args: str, stdin: str = "") -> Ran:
    """``llmgw ARGS`` through its real entry point, in this process: a fresh interpreter
    per command costs seconds of imports on a loaded machine."""
    out, err = io.StringIO(), io.StringIO()
    saved_stdin, sys.stdin = sys.stdin, io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit_:  # argparse's usage errors
                code = exit_.code
    finally:
        sys.stdin = saved_stdin
    return Ran(code, out.getvalue(), err.getvalue())


def ctl(cluster: Cluster, *args: str, token: str | None = None, stdin: str = "") -> Ran:
    return run("ctl", *args, "--server", cluster.base_url, "--token",
               token or cluster.admin_token, stdin=stdin)


def models(cluster: Cluster) -> dict[str, dict]:
    return {m["name"]: m for m in ctl(cluster, "models", "list", "--json").json()}


def test_nodes_list_drain_and_undrain(cluster):
    [node] = ctl(cluster, "nodes", "list", "--json").json()
    real = cluster.admin("GET", "/api/nodes").json()[0]
    assert (node["id"], node["state"], node["address"]) == ("node-a", "ready", "127.0.0.1")
    assert node["engines"] == real["engines"] and node["gpus"] == []
    assert node["replicas"] == real["replicas"] and node["replicas"]
    table = ctl(cluster, "nodes", "list")
    assert table.code == 0 and "node-a" in table.out and "ready" in table.out
    for column in ("address", "fabric", "gpus", "engines", "warnings"):
        assert column in table.out
    bare = ctl(cluster, "nodes")  # alone, the group lists
    assert bare.code == 0 and bare.out == table.out

    drained = ctl(cluster, "nodes", "drain", "node-a", "--json").json()
    assert drained["state"] == "draining" == cluster.node_state("node-a")
    # The only node: the replica stays until another could serve in its place.
    assert cluster.ready_replicas("sim-small")
    back = ctl(cluster, "nodes", "undrain", "node-a")
    assert back.code == 0 and "node-a takes replicas again" in back.out
    assert cluster.node_state("node-a") == "ready"

    unknown = ctl(cluster, "nodes", "drain", "node-zz")
    assert unknown.code == 1 and "no node 'node-zz' has registered" in unknown.err


def test_status_shows_models_replicas_fabrics_and_servers(cluster):
    status = ctl(cluster, "status", "--json").json()
    real = cluster.status()
    assert [m["name"] for m in status["models"]] == [m["name"] for m in real["models"]]
    [replica] = [r for r in status["replicas"] if r["model"] == "sim-small"]
    assert replica["state"] == "ready" and replica["shards"][0]["node"] == "node-a"
    table = ctl(cluster, "status")
    assert table.code == 0
    for title in ("models", "replicas", "fabrics", "servers"):
        assert title in table.out
    assert replica["id"] in table.out and "no fabric" in table.out
    # The one server leads, and says it answered.
    assert status["leader"]["name"] == status["answered_by"]
    assert f"leads (term {status['leader']['term']}), answered this" in table.out


def test_models_add_scale_and_remove(cluster):
    added = ctl(cluster, "models", "add", "sim-api", "--engine", "sim", "--json").json()
    assert (added["source"], added["replicas"], added["replicas_in_config"]) == ("api", 1, None)
    assert added["spec"] == {"name": "sim-api", "profiles": [{"engine": "sim"}]}
    cluster.wait_ready("sim-api")

    scaled = ctl(cluster, "models", "scale", "sim-api", "2", "--json").json()
    assert scaled["replicas"] == 2 and not scaled["overridden"]
    two = cluster.wait_ready("sim-api", 2)
    assert len({r["id"] for r in two}) == 2
    listed = models(cluster)["sim-api"]
    assert (listed["replicas"], listed["source"]) == (2, "api")
    wait_for(lambda: models(cluster)["sim-api"]["replicas_ready"] == 2, 10,
             "models list to count two ready replicas")
    table = ctl(cluster, "models", "list")
    assert table.code == 0 and "sim-api" in table.out and "default: sim" in table.out
    assert ctl(cluster, "models").out == table.out

    removed = ctl(cluster, "models", "remove", "sim-api", "--json").json()
    assert removed == {"removed": "sim-api"}
    assert "sim-api" not in models(cluster)
    wait_for(lambda: not cluster.replicas("sim-api"), 15, "sim-api's replicas to stop")
    gone = ctl(cluster, "models", "remove", "sim-api")
    assert gone.code == 1 and "no model 'sim-api'" in gone.err


def test_a_model_file_is_checked_with_server_yaml_rules(cluster, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: sim-bad\nprofiles:\n  - engine: sim\n    gpus: two\n")
    refused = ctl(cluster, "models", "add", "--file", str(bad))
    assert refused.code == 1
    assert "model.profiles[0].gpus: expected int, got str" in refused.err
    bad.write_text("name: sim-bad\nprofiles: [{engine: sim, gpu: 1}]\n")
    assert "unknown field" in ctl(cluster, "models", "add", "-f", str(bad)).err
    bad.write_text("name: sim-bad\nprofiles: [{engine: simm}]\n")
    assert "model.profiles[0].engine: unknown engine 'simm'" in ctl(
        cluster, "models", "add", "-f", str(bad)).err
    assert "sim-bad" not in models(cluster)

    whole = tmp_path / "server.yaml"
    whole.write_text("models: [{name: x, profiles: [{engine: sim}]}]\n")
    usage = ctl(cluster, "models", "add", "-f", str(whole))
    assert usage.code == 2 and "looks like a whole server.yaml" in usage.err
    missing = ctl(cluster, "models", "add", "-f", str(tmp_path / "nope.yaml"))
    assert missing.code == 2 and "cannot read" in missing.err
    neither = ctl(cluster, "models", "add", "sim-x")
    assert neither.code == 2 and "--engine" in neither.err
    twice = ctl(cluster, "models", "add", "sim-small", "--engine", "sim")
    assert twice.code == 1 and "server.yaml declares it" in twice.err


def test_a_server_yaml_model_is_not_removed_but_can_be_scaled(cluster):
    refused = ctl(cluster, "models", "remove", "sim-small")
    assert refused.code == 1
    assert "declared in server.yaml: remove it there and reload the server" in refused.err
    assert "sim-small" in models(cluster)
    no_count = ctl(cluster, "models", "scale", "sim-small")
    assert no_count.code == 2 and "--reset" in no_count.err


def test_keys_commands(cluster, monkeypatch):
    made = ctl(cluster, "keys", "create", "ci", "--model", "sim-small", "--rpm", "100",
               "--json").json()
    prefix, key = made["prefix"], made["key"]
    real = {k["prefix"]: k for k in cluster.admin("GET", "/api/keys").json()}
    assert real[prefix]["models"] == ["sim-small"] and real[prefix]["limits"]["rpm"] == 100
    listed = {k["prefix"]: k for k in ctl(cluster, "keys", "list", "--json").json()}
    assert listed[prefix] == real[prefix]
    # On a terminal 80 columns wide, the prefix the other key commands take is shown
    # whole, to be copied, and the rest folded, not cut.
    monkeypatch.setenv("COLUMNS", "80")
    table = ctl(cluster, "keys", "list")
    assert prefix in table.out and "100 rpm" in table.out
    assert "…" not in table.out

    limits = ctl(cluster, "keys", "limits", prefix, "--tpm", "5000", "--rpm", "none",
                 "--json").json()
    assert limits["limits"]["tpm"] == 5000 and limits["limits"]["rpm"] is None
    shown = {row["limit"]: row for row in ctl(cluster, "keys", "limits", prefix,
                                              "--json").json()}
    assert shown["tpm"]["value"] == 5000

    chat = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=20,
                      headers={"authorization": f"Bearer {key}"},
                      json={"model": "sim-small", "max_tokens": 3,
                            "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200, chat.text
    usage = wait_for(lambda: (u := ctl(cluster, "keys", "usage", prefix, "--json").json())
                     ["models"] and u, 10, "the request to be recorded")
    assert usage["models"][0]["model"] == "sim-small"
    assert usage["models"][0]["requests"] == 1

    revoked = ctl(cluster, "keys", "revoke", prefix, "--json").json()
    assert revoked == {"revoked": prefix}
    real = {k["prefix"]: k for k in cluster.admin("GET", "/api/keys").json()}
    assert real[prefix]["revoked_at"]
    again = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=20,
                       headers={"authorization": f"Bearer {key}"},
                       json={"model": "sim-small", "messages": []})
    assert again.status_code == 401


def test_users_invites_signup_and_a_session(cluster):
    password = "carol's long secret"
    added = ctl(cluster, "users", "add", "carol", "--password-stdin", "--json",
                stdin=password + "\n").json()
    assert (added["username"], added["role"]) == ("carol", "user")
    listed = {u["username"]: u for u in ctl(cluster, "users", "list", "--json").json()}
    real = {u["username"]: u for u in cluster.admin("GET", "/api/users").json()}
    assert listed["carol"] == real["carol"]
    changed = ctl(cluster, "users", "set", "carol", "--role", "admin", "--json").json()
    assert changed["role"] == "admin"
    changed = ctl(cluster, "users", "set", "carol", "--role", "user", "--json").json()
    assert changed["role"] == "user"
    assert ctl(cluster, "users", "set", "carol").code == 2

    invite = ctl(cluster, "invites", "create", "--hours", "1", "--json").json()
    assert invite["invite"]
    assert ctl(cluster, "signup", "invite", "--json").json() == {"signup": "invite"}
    assert cluster.admin("GET", "/api/settings").json() == {"signup": "invite"}
    assert ctl(cluster, "signup", "closed", "--json").json() == {"signup": "closed"}

    # A user's session: models are readable, changing them needs an admin.
    logged = run("ctl", "login", "carol", "--password-stdin", "--server", cluster.base_url,
                 "--json", stdin=password + "\n").json()
    assert (logged["username"], logged["role"]) == ("carol", "user")
    assert "token" not in logged
    seen = run("ctl", "models", "list", "--json").json()
    assert {m["name"] for m in seen} >= {"sim-small"} and "spec" not in seen[0]
    refused = run("ctl", "models", "scale", "sim-small", "3")
    assert refused.code == 1 and "this needs an admin" in refused.err
    assert run("ctl", "logout", "--json").json() == {"logged_out": True, "session_ended": True}


def test_exit_codes_when_nothing_answers_or_nobody_logged_in(cluster):
    nobody = run("ctl", "status", "--server", f"http://127.0.0.1:{free_port()}", "--token", "x")
    assert nobody.code == 3 and "is the server running" in nobody.err
    anonymous = run("ctl", "models", "list", "--server", cluster.base_url)
    assert anonymous.code == 2 and "no credentials" in anonymous.err
    wrong = ctl(cluster, "status", token="not-a-token")
    assert wrong.code == 1 and "401" in wrong.err
    assert run("ctl", "models", "scale").code == 2  # argparse: NAME is required


def test_restart_keeps_api_models_and_scale_overrides(cluster, tmp_path):
    spec = tmp_path / "kept.json"
    spec.write_text(json.dumps({"name": "sim-kept", "replicas": 0,
                                "description": "kept across restarts",
                                "aliases": ["kept-alias"], "fallbacks": ["sim-small"],
                                "profiles": [{"engine": "sim", "args": ["--x"]}]}))
    assert ctl(cluster, "models", "add", "-f", str(spec), "--json").json()["replicas"] == 0
    scaled = ctl(cluster, "models", "scale", "sim-small", "2", "--json").json()
    assert (scaled["replicas"], scaled["replicas_in_config"], scaled["overridden"]) == (
        2, 1, True)
    cluster.wait_ready("sim-small", 2)
    table = ctl(cluster, "models", "list")
    assert "2 (server.yaml: 1)" in table.out
    assert "aliases" in table.out and "fallbacks" in table.out
    [kept_row] = [line for line in table.out.splitlines() if "sim-kept" in line]
    assert "kept-alias" in kept_row and "sim-small" in kept_row

    cluster.restart_server()
    after = models(cluster)
    assert after["sim-kept"]["source"] == "api"
    assert (after["sim-kept"]["aliases"], after["sim-kept"]["fallbacks"]) == (
        ["kept-alias"], ["sim-small"])
    assert after["sim-kept"]["spec"]["profiles"] == [{"engine": "sim", "args": ["--x"]}]
    small = after["sim-small"]
    assert (small["source"], small["replicas"], small["replicas_in_config"]) == ("config", 2, 1)
    cluster.wait_ready("sim-small", 2)

    reset = ctl(cluster, "models", "scale", "sim-small", "--reset", "--json").json()
    assert (reset["replicas"], reset["overridden"]) == (1, False)
    wait_for(lambda: len(cluster.replicas("sim-small")) == 1, 15,
             "sim-small back to server.yaml's one replica")
    assert ctl(cluster, "models", "remove", "sim-kept").code == 0
    refused = ctl(cluster, "models", "scale", "sim-api-none", "1")
    assert refused.code == 1 and "no model 'sim-api-none'" in refused.err


def test_a_store_from_before_model_sources_reads_as_server_yaml(tmp_path):
    """Rows written when the store only mirrored server.yaml hold a bare model: the one
    still declared keeps serving, the one no longer declared goes."""
    settings = config.parse({"models": [SIM_SMALL]}, config.ServerConfig)

    async def check():
        store = await open_store(sqlite_url(tmp_path / "llmgw.db"))
        try:
            await store.put_model("sim-small", {**SIM_SMALL, "replicas": 5})
            await store.put_model("sim-gone", {"name": "sim-gone",
                                               "profiles": [{"engine": "sim"}]})
            catalog = await sync_declared(store, settings)
            assert [(m.name, m.replicas) for m in catalog.models] == [("sim-small", 1)]
            assert [m.name for m in await store.list_models()] == ["sim-small"]
            assert (await store.get_model("sim-small")).spec["source"] == "config"
        finally:
            await store.close()

    asyncio.run(check())


def test_ca_file_lets_ctl_trust_a_tls_server(tmp_path, monkeypatch):
    """The same ctl over https, with the certificate `llmgw server init` made: refused
    without the cluster CA, served with it (--ca-file or $LLMGW_CA_FILE)."""
    directory, port = tmp_path / "tls-server", free_port()
    done = run("server", "init", "--dir", str(directory), "--address", "127.0.0.1",
               "--port", str(port), "--agent-port", str(free_port()))
    assert done.code == 0, done.err
    path = directory / "server.yaml"
    config = yaml.safe_load(path.read_text())
    config["listen"]["host"] = config["tls"]["agent_listen"]["host"] = "127.0.0.1"
    path.write_text(yaml.safe_dump(config))
    token = (directory / "secrets" / "admin-token").read_text().strip()
    ca, url = config["tls"]["ca_file"], f"https://127.0.0.1:{port}"
    proc = _start(["server", "--config", str(path)], tmp_path / "server.log")
    try:
        trust = ssl.create_default_context(cafile=ca)
        wait_for(lambda: httpx.get(url + "/healthz", verify=trust).status_code == 200, 30,
                 "the https server to answer")
        untrusted = run("ctl", "users", "list", "--server", url, "--token", token)
        assert untrusted.code == 3 and "--ca-file" in untrusted.err
        trusted = run("ctl", "users", "list", "--server", url, "--token", token,
                      "--ca-file", ca, "--json")
        assert trusted.json() == []
        monkeypatch.setenv("LLMGW_CA_FILE", ca)
        assert run("ctl", "models", "list", "--server", url, "--token", token,
                   "--json").json() == []
        bad = run("ctl", "status", "--server", url, "--token", token,
                  "--ca-file", str(tmp_path / "none.pem"))
        assert bad.code == 2 and "cannot use" in bad.err
    finally:
        _stop_group(proc)
