"""`llmgw ctl` as a new operator meets it in the first hour (issue 39): a pipe closed early,
a wrong token, a replica on two nodes, and a revoked node's serials. A real server and two
agents on loopback (the sim engine), one replica of a model that spans both.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import httpx
import pytest

from llmgw.store import open_store, sqlite_url
from llmgw.store.pki import NodeCertRecord
from tests.integration.cluster import Cluster
from tests.integration.test_ctl import FAST_AUTH, ctl, run

TWO_NODES = {"name": "mn", "replicas": 1, "profiles": [{"engine": "sim", "nodes": 2}]}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, request):
    made = Cluster(tmp_path_factory.mktemp("first-hour"), [TWO_NODES], {"auth": FAST_AUTH})
    failed_before = request.session.testsfailed
    try:
        made.start_server()
        # A replica spans one fabric: its two nodes are in the same.
        made.add_agent("node-a", fabric="ib-a")
        made.add_agent("node-b", fabric="ib-a")
        made.wait_ready("mn", timeout_s=90)
    except BaseException:
        print(made.logs())
        made.stop()
        raise
    yield made
    if request.session.testsfailed > failed_before:
        print(made.logs())
    made.stop()


# ctl with its own session file and no credentials from the shell (conftest.py).
pytestmark = pytest.mark.usefixtures("ctl_environment")


@pytest.mark.parametrize("command", [["status", "--json"], ["nodes", "list"],
                                     ["models", "--json"]])
def test_a_reader_that_left_ends_ctl_quietly(cluster, command):
    """As ``llmgw ctl status --json | head -1`` once head has exited: the pipe's reading
    end is closed before ctl writes a byte, so every write ctl makes finds it closed."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "ctl", *command, "--server", cluster.base_url,
             "--token", cluster.admin_token],
            stdin=subprocess.DEVNULL, stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    _, err = proc.communicate(timeout=60)
    assert err.decode() == ""  # no BrokenPipeError traceback, nor "Exception ignored"
    assert proc.returncode == 141  # as a shell reports a command a closed pipe ended


def test_a_reader_that_left_ends_engine_check_quietly_too():
    # engine-check prints with rich outside ctl's commands: the same end, from main.
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "llmgw", "ctl", "engine-check", "sim"],
                                stdin=subprocess.DEVNULL, stdout=write_end,
                                stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    _, err = proc.communicate(timeout=60)
    assert err.decode() == ""
    assert proc.returncode == 141


def test_head_gets_the_first_line_and_ctl_says_nothing(cluster):
    """The pipeline itself; whether ctl writes before or after head exits is up to the
    scheduler, and both must end quietly."""
    ctl_proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "ctl", "status", "--json", "--server",
         cluster.base_url, "--token", cluster.admin_token],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    head = subprocess.Popen(["head", "-1"], stdin=ctl_proc.stdout, stdout=subprocess.PIPE)
    ctl_proc.stdout.close()  # head holds the reading end alone, as in a shell
    first, _ = head.communicate(timeout=60)
    err = ctl_proc.stderr.read().decode()
    assert ctl_proc.wait(timeout=60) in (0, 141), err
    assert (first, err) == (b"{\n", "")


def test_a_wrong_token_is_said_to_be_refused(cluster, monkeypatch):
    wrong = ctl(cluster, "status", token="not-a-token")
    assert wrong.code == 1
    assert ("GET /api/status: 401 the token given is not the admin token nor a live "
            "session; log in again") in wrong.err
    assert "(ctl sent the token from --token)" in wrong.err

    monkeypatch.setenv("LLMGW_TOKEN", "llmgws_ended-long-ago")
    ended = run("ctl", "nodes", "list", "--server", cluster.base_url)
    assert ended.code == 1
    assert "401 the session token given has ended" in ended.err
    assert "(ctl sent the token from $LLMGW_TOKEN)" in ended.err
    monkeypatch.delenv("LLMGW_TOKEN")

    # An API key is for /v1: said so, with the same stable code for scripts.
    refused = httpx.get(f"{cluster.base_url}/api/status", timeout=10,
                        headers={"authorization": f"Bearer {cluster.api_key}"})
    assert refused.status_code == 401
    error = refused.json()["error"]
    assert error["code"] == "login_required"
    assert error["message"].startswith("the token given is an API key, which is for /v1 only")
    # No token at all: the words as before.
    anonymous = httpx.get(f"{cluster.base_url}/api/status", timeout=10)
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["message"].startswith("log in first")


def test_status_names_a_two_node_replica_once_per_fabric(cluster):
    status = ctl(cluster, "status", "--json").json()
    [replica] = [r for r in status["replicas"] if r["model"] == "mn"]
    assert sorted(s["node"] for s in replica["shards"]) == ["node-a", "node-b"]
    table = ctl(cluster, "status")
    assert table.code == 0, table.err
    [row] = [line for line in table.out.splitlines() if line.startswith("│ ib-a ")]
    assert "node-a (ready)" in row and "node-b (ready)" in row
    assert row.count(replica["id"]) == 1, row
    [model_row] = [line for line in table.out.splitlines() if line.startswith("│ mn ")]
    assert model_row.count("node-a") == model_row.count("node-b") == 1, model_row


async def _issued(db, node: str, serial: int) -> None:
    """A certificate the cluster issued ``node``, as a join records it."""
    store = await open_store(sqlite_url(db))
    now = datetime.now(UTC)
    try:
        await store.add_node_cert(NodeCertRecord(serial=str(serial), node=node,
                                                 not_before=now,
                                                 not_after=now + timedelta(days=1)))
    finally:
        await store.close()


def test_revoke_prints_serials_in_hex_as_the_logs_do(cluster):
    serial = 0x5D3A_91C4_7B20_E6F1_08AA
    asyncio.run(_issued(cluster.server_state / "llmgw.db", "node-gone", serial))
    revoked = ctl(cluster, "nodes", "revoke", "node-gone")
    assert revoked.code == 0, revoked.err
    assert f"revoked node-gone: certificate serial(s) {serial:x};" in revoked.out
    assert str(serial) not in revoked.out
    line = cluster.server_log_line("revoked node node-gone: certificate serial(s)")
    assert f"{serial:x}" in line and str(serial) not in line
    nothing = ctl(cluster, "nodes", "revoke", "node-gone")
    assert "node-gone has no unexpired certificate: nothing to revoke" in nothing.out

    # The API's answer is as it was: decimal strings, for scripts.
    asyncio.run(_issued(cluster.server_state / "llmgw.db", "node-gone-2", serial + 1))
    answer = ctl(cluster, "nodes", "revoke", "node-gone-2", "--json").json()
    assert answer == {"node": "node-gone-2", "revoked": [str(serial + 1)]}
