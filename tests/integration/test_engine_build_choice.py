"""`llmgw ctl engine-build`: an operator's build choice for one node, kept by the control
plane and told to the node at once. A real server (SQLite store) and a real agent on
loopback.

What the node was told is read where the agent keeps it: the engine list it was last
sent (``<state_dir>/engines/wanted.json``, written as the message arrives), and what it
reports of the engine. server.yaml asks for llama.cpp from a mirror on a closed loopback
port, so nothing leaves the machine and nothing is installed.
"""

from __future__ import annotations

import contextlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmgw.cli.main import main
from tests.integration.cluster import AgentProc, Cluster, free_port, wait_for

NODE = "n1"
# What the node is asked for, within: a controller pass (0.5 s) or a reconnect (0.2-1 s),
# on a busy two-core machine.
TOLD_S = 15
VULKAN_ASKED = f"asked {NODE} for engines: llama.cpp b11434 (vulkan build)"


@dataclass
class Ran:
    code: int
    out: str
    err: str


@pytest.fixture
def cluster(tmp_path, request, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))  # no saved session
    for name in ("LLMGW_TOKEN", "LLMGW_SERVER", "LLMGW_CA_FILE"):
        monkeypatch.delenv(name, raising=False)
    made = Cluster(tmp_path / "cluster", [], {
        "engines": {"llama.cpp": {}},
        "engine_mirror": f"http://127.0.0.1:{free_port()}/"})
    made.root.mkdir()
    failed_before = request.session.testsfailed
    try:
        yield made
    finally:
        if request.session.testsfailed > failed_before:
            print(made.logs())
        made.stop()


def ctl(cluster: Cluster, *args: str) -> Ran:
    """``llmgw ctl ARGS`` through its real entry point, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["ctl", *args, "--server", cluster.base_url, "--token",
                     cluster.admin_token])
    return Ran(code, out.getvalue(), err.getvalue())


def asked(agent: AgentProc) -> dict[str, str] | None:
    """Engine -> build, as the node was last told (None before it was told anything)."""
    path = Path(agent.state_dir) / "engines" / "wanted.json"
    if not path.exists():
        return None
    # The list as the agent keeps it leaves out what is as by default: auto.
    return {e["name"]: e.get("build", "auto") for e in json.loads(path.read_text())}


def told(agent: AgentProc, wanted: dict[str, str], what: str) -> None:
    wait_for(lambda: asked(agent) == wanted, TOLD_S, what)


def reported(cluster: Cluster) -> dict:
    [node] = cluster.admin("GET", "/api/nodes").json()
    return node


def test_a_chosen_build_reaches_the_node_is_kept_and_can_be_undone(cluster):
    cluster.start_server()
    agent = cluster.add_agent(NODE, install_os_packages=False)
    told(agent, {"llama.cpp": "auto"}, "the node to be asked for llama.cpp, auto")

    chosen = ctl(cluster, "engine-build", NODE, "llama.cpp", "vulkan")
    assert (chosen.code, chosen.err) == (0, "")
    assert chosen.out == f"{NODE} llama.cpp: vulkan (chosen for this node); {NODE} was told now\n"
    told(agent, {"llama.cpp": "vulkan"}, "the node to be asked for the vulkan build")
    # It acts on it: this machine has no GPU for it (refused), or no mirror to fetch it from.
    wait_for(lambda: any(e["name"] == "llama.cpp" and "vulkan" in e["detail"]
                         for e in reported(cluster)["engines"]), TOLD_S,
             "the node to report what became of the vulkan build")
    assert reported(cluster)["engine_builds"]["llama.cpp"] == {
        "build": "vulkan", "source": "node",
        "choices": ["default", "auto", "none", "cuda-13.3", "cuda-12.8", "vulkan", "cpu"]}

    # Refused in words naming what would do, and nothing kept changes.
    wrong = ctl(cluster, "engine-build", NODE, "llama.cpp", "cu129")
    assert wrong.code == 1
    assert ("400 'cu129' is not a build of llama.cpp; use default, auto, none or one of "
            "cuda-13.3, cuda-12.8, vulkan, cpu") in wrong.err
    engine = ctl(cluster, "engine-build", NODE, "sim", "auto")
    assert engine.code == 1
    assert "llmgw installs no engine 'sim'; name one of llama.cpp, vllm" in engine.err
    nobody = ctl(cluster, "engine-build", "n9", "llama.cpp", "cpu")
    assert nobody.code == 1 and "404 no node 'n9' has registered" in nobody.err
    extra = cluster.admin("PUT", f"/api/nodes/{NODE}/engine-builds/llama.cpp",
                          json={"build": "cpu", "engine": "vllm"})
    assert extra.status_code == 400 and "`engine` cannot be set here" in extra.text
    builds = cluster.admin("GET", f"/api/nodes/{NODE}/engine-builds").json()
    assert {k: (v["build"], v["source"]) for k, v in builds.items()} == {
        "llama.cpp": ("vulkan", "node")}
    assert asked(agent) == {"llama.cpp": "vulkan"}

    # Kept by the control plane: the restarted server asks the node for it again.
    cluster.restart_server()
    wait_for(lambda: (cluster.root / "server.log").read_text().count(VULKAN_ASKED) >= 2,
             TOLD_S, "the restarted server to ask the node for the vulkan build")
    assert reported(cluster)["engine_builds"]["llama.cpp"]["build"] == "vulkan"

    # none: the engine is off the node; default: server.yaml's word (auto) again.
    gone = ctl(cluster, "engine-build", NODE, "llama.cpp", "none")
    assert gone.code == 0 and "none (chosen for this node)" in gone.out
    told(agent, {}, "the node to be asked for no engine")
    back = ctl(cluster, "engine-build", NODE, "llama.cpp", "default", "--json")
    assert back.code == 0
    assert json.loads(back.out)["build"]["source"] == "default"
    told(agent, {"llama.cpp": "auto"}, "the node to be asked for llama.cpp, auto, again")
    assert cluster.admin("GET", f"/api/nodes/{NODE}/engine-builds").json()[
        "llama.cpp"]["source"] == "default"
