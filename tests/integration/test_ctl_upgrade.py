"""`llmgw ctl upgrade`: three agents on loopback replace their own llmgw with the release
a signed bundle holds, one node at a time, under a bounded load, and their engines keep
serving (adopted: the same processes).

Offline and real: the bundle is made as `llmgw bundle create --llmgw-lock` makes it, from
wheels made in the test (this checkout's llmgw at a later version, and its dependencies
repacked from this venv: tests/integration/wheels.py) served by a package index on
127.0.0.1 and resolved as this checkout's uv.lock pins them, imported into the server's
mirror, and
each agent downloads them from the server, installs them with uv (`--no-index
--require-hashes`) into a new environment in its state directory, and execs into it.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import sys
from pathlib import Path

import psutil
import pytest

import llmgw
from llmgw.bundle import signing
from llmgw.bundle.mirror import import_bundle
from tests.hub import hub_in_thread
from tests.integration.cluster import free_port, wait_for
from tests.integration.load import ChatLoad
from tests.integration.test_ctl import ctl, run
from tests.integration.wheels import ROOT, release_wheels
from tests.pyindex import Index

MODEL = "sim-upgrade"


def _later(version: str) -> str:
    major, minor, patch = [*version.split("+")[0].split("."), "0", "0"][:3]
    return f"{major}.{minor}.{int(patch) + 1}"


NEW = _later(llmgw.__version__)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tuple[Path, str]:
    """A signed bundle holding llmgw NEW's wheel and its dependencies' as this checkout's
    uv.lock pins them, resolved for this machine from a package index on 127.0.0.1 that
    serves them (`bundle create --llmgw-lock`), and the public key line it is signed
    with."""
    root = tmp_path_factory.mktemp("upgrade-bundle")
    wheels = release_wheels(root / "wheels", NEW)
    [ours] = wheels.glob(f"llmgw-{NEW}-*.whl")
    served = {re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower(): w
              for w in wheels.glob("*.whl") if w != ours}
    line = signing.keygen(root / "bundle.key")
    _, glibc = platform.libc_ver()
    with hub_in_thread(served, Index) as index:
        made = run("bundle", "create", str(root / "bundle"), "--key", str(root / "bundle.key"),
                   "--llmgw-lock", str(ROOT), "--llmgw-wheel", str(ours),
                   "--llmgw-version", NEW, "--index-url", index.url,
                   "--llmgw-python", f"3.{sys.version_info.minor}", "--llmgw-platform",
                   f"{platform.machine()}-manylinux_{glibc.replace('.', '_')}")
    assert made.code == 0, made.err
    # Every dependency was fetched from the index, once.
    assert sorted(r for r in index.requests if r.endswith(".whl")) == sorted(
        f"/files/{w.name}" for w in served.values())
    return root / "bundle", line


def _versions(cluster) -> dict[str, str]:
    return {n["id"]: n["llmgw_version"] for n in cluster.admin("GET", "/api/nodes").json()}


def _agent_python(agent) -> str:
    return psutil.Process(agent.proc.pid).cmdline()[0]


def test_ctl_upgrade_rolls_three_agents_forward_under_load_with_engines_adopted(
        make_cluster, bundle, tmp_path):
    made, key_line = bundle
    mirror = tmp_path / "mirror"
    import_bundle(made, mirror, [key_line])
    cluster = make_cluster(models=[{"name": MODEL, "profiles": [{"engine": "sim"}],
                                    "replicas": 3}],
                           bundle={"trusted_keys": [key_line], "mirror_dir": str(mirror)})
    cluster.start_server()
    # One port per node: a replica on each, so each node's upgrade has an engine to adopt.
    agents = [cluster.add_agent(f"up-{n}", port_range=[port, port])
              for n, port in ((n, free_port()) for n in (1, 2, 3))]
    cluster.wait_ready(MODEL, count=3, timeout_s=60)
    old = llmgw.__version__
    assert _versions(cluster) == {a.node_id: old for a in agents}
    engines = {a.node_id: a.engine_pids() for a in agents}
    assert [len(pids) for pids in engines.values()] == [1, 1, 1]
    agent_pids = {a.node_id: a.proc.pid for a in agents}

    plan = ctl(cluster, "upgrade", "--dry-run", "--json").json()["plan"]
    assert plan["version"] == NEW and plan["kind"] == "wheels"
    assert {n["node"]: n["action"] for n in plan["nodes"]} == {
        a.node_id: "upgrade" for a in agents}

    # A wheel changed in the mirror after the import: the first node refuses it, and the
    # rollout stops there with every node as it was.
    [wheel] = (mirror / "current" / "files" / "llmgw" / NEW).glob(f"llmgw-{NEW}-*.whl")
    good = wheel.read_bytes()
    wheel.write_bytes(good[:100] + bytes([good[100] ^ 1]) + good[101:])
    stopped = ctl(cluster, "upgrade")
    assert stopped.code == 1, stopped.out + stopped.err
    assert "stopped at up-1" in stopped.err and "sha256" in stopped.err
    assert "not tried: up-2, up-3" in stopped.err
    assert "run `llmgw ctl upgrade` again" in stopped.err
    assert _versions(cluster) == {a.node_id: old for a in agents}
    assert not (agents[0].state_dir / "llmgw" / "current").exists()
    wheel.write_bytes(good)

    load = ChatLoad(cluster.base_url, cluster.api_key, MODEL, {"plain": 2, "stream": 1},
                    max_requests=3000, max_s=240)
    load.start()
    try:
        rolled = ctl(cluster, "upgrade")
    finally:
        load.finish()
    assert rolled.code == 0, rolled.out + rolled.err
    assert f"upgraded 3 node(s) to llmgw {NEW}: up-1, up-2, up-3" in rolled.out
    for agent in agents:
        assert f"{agent.node_id}: done: llmgw {NEW} runs; 1 replica(s) adopted and ready" \
            in rolled.out

    assert load.failures() == []
    assert len(load.done) > 20
    assert _versions(cluster) == {a.node_id: NEW for a in agents}
    for agent in agents:
        # The same agent process, now running the new installation; the same engines.
        assert agent.proc.pid == agent_pids[agent.node_id] and agent.proc.poll() is None
        current = agent.state_dir / "llmgw" / "current"
        assert current.resolve() == (agent.state_dir / "llmgw" / "versions" / NEW).resolve()
        assert Path(_agent_python(agent)).parent.parent == current.resolve()
        assert agent.engine_pids() == engines[agent.node_id]
    assert ctl(cluster, "upgrade", "--json").json()["upgraded"] == []

    # A restart from the llmgw first installed hands over to the upgraded one.
    first = agents[0]
    os.kill(first.proc.pid, signal.SIGTERM)
    first.proc.wait(30)
    first.start()
    wait_for(lambda: _versions(cluster)[first.node_id] == NEW
             and cluster.node_state(first.node_id) == "ready"
             and first.proc.pid in {p.pid for p in psutil.process_iter()}
             and Path(_agent_python(first)).parent.parent == current_of(first),
             30, "the restarted agent to hand over to the upgraded llmgw")
    assert sys.executable not in _agent_python(first)
    assert first.engine_pids() == engines[first.node_id]

    # Going back: with no managed installation before it, to the llmgw it is started with.
    back = run("agent", "rollback", "--config", str(first.config_path))
    assert back.code == 0, back.err
    assert f"not llmgw {NEW}, from its next start" in back.out
    assert not (first.state_dir / "llmgw" / "current").exists()


def current_of(agent) -> Path:
    return (agent.state_dir / "llmgw" / "current").resolve()
