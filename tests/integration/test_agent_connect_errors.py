"""The agent's words for a control plane or a download that does not answer: the address
and what the OS said, never aiohttp's ``ssl:<ssl.SSLContext object at 0x…>``.

A port nobody listens on (bound, never listened on, so no other test takes it meanwhile)
refuses every connection; the agent dials it over TLS with its real node certificate, as
a node whose control plane is down does.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import aiohttp
import pytest

from llmgw import pki
from llmgw.agent.client_errors import describe
from llmgw.agent.control_plane import client_context
from llmgw.agent.install.download import download
from llmgw.agent.install.pypi import InstallError
from llmgw.config import AgentConfig, AgentTls, dump
from tests.integration.cluster import wait_for


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port that refuses connections for as long as the test runs."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
        yield held.getsockname()[1]


def node_tls(root: Path, node: str = "n1") -> AgentTls:
    ca_key, ca_pem = pki.create_ca()
    key = pki.new_key()
    issued = pki.sign_node_csr(ca_key, ca_pem, pki.make_csr(key, node), node,
                               timedelta(days=1))
    (root / "ca.pem").write_bytes(ca_pem)
    (root / "node.pem").write_bytes(issued.cert_pem)
    (root / "node.key").write_bytes(pki.key_pem(key))
    os.chmod(root / "node.key", 0o600)
    return AgentTls(ca_file=str(root / "ca.pem"), cert_file=str(root / "node.pem"),
                    key_file=str(root / "node.key"))


async def _connect_error(url: str, ssl_arg) -> aiohttp.ClientConnectorError:
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectorError) as caught:
            await http.get(url, ssl=ssl_arg)
    return caught.value


async def test_a_refused_connect_names_the_address_and_the_reason(tmp_path, refused_port):
    tls = node_tls(tmp_path)
    for scheme, ssl_arg in (("https", client_context(tls)), ("http", True)):
        err = await _connect_error(f"{scheme}://127.0.0.1:{refused_port}/", ssl_arg)
        if scheme == "https":
            assert "SSLContext object" in str(err)  # what aiohttp itself says
        assert describe(err) == f"cannot connect to 127.0.0.1:{refused_port}: Connection refused"


async def test_an_engine_download_that_cannot_connect_says_where(tmp_path, refused_port):
    url = f"http://127.0.0.1:{refused_port}/llama.cpp/b1/llama-b1-bin.zip"
    async with aiohttp.ClientSession() as http:
        with pytest.raises(InstallError) as caught:
            await download(http, url, tmp_path / "a.zip", sha256="0" * 64, max_bytes=2**20)
    assert str(caught.value) == (f"GET {url}: cannot connect to 127.0.0.1:{refused_port}: "
                                 "Connection refused")


def test_the_agent_says_which_control_plane_refused_and_why(tmp_path, refused_port):
    server = f"https://127.0.0.1:{refused_port}"
    config = AgentConfig(servers=[server], node_id="n1", address="127.0.0.1",
                         state_dir=str(tmp_path / "state"), runtime="process",
                         tls=node_tls(tmp_path))
    (tmp_path / "agent.yaml").write_text(dump(config))
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "agent", "--config", str(tmp_path / "agent.yaml")],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
    try:
        line = wait_for(lambda: next((x for x in log.read_text().splitlines()
                                      if "reconnecting in" in x), None), 30,
                        "the agent's warning that the stream could not be opened")
    except AssertionError:
        print(log.read_text(errors="replace"))
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(agent.pid, signal.SIGKILL)
        agent.wait(10)
    assert (f"stream to {server} ended (cannot connect to 127.0.0.1:{refused_port}: "
            "Connection refused)") in line
    assert "ssl:" not in line and "object at 0x" not in line
    # agent.yaml names no weights directories: the agent made its own under state_dir.
    assert (tmp_path / "state" / "weights").is_dir()
