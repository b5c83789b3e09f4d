"""Real llmgw processes on loopback (or in network namespaces), for integration tests.

A `Cluster` writes a server.yaml and agent.yaml into a temporary directory, starts
`python -m llmgw server` and `python -m llmgw agent` exactly as an operator would, and
stops everything it started by PID: the server and agents by process group, and the
engine shards an agent left behind by the PIDs in the agent's own shard records.

By default everything listens on 127.0.0.1. A cluster across network namespaces (see
``netns.py``) sets ``listen_host`` to the server's address on the test's bridge, and starts
each agent with a command prefix (``["ip", "netns", "exec", NS]``) and ``address=None``, so
that the agent finds its own address as the source of its route to the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx  # test-side only: a plain blocking client for polling; never on llmgw's path
import psutil
import pytest
import yaml

from llmgw import pki
from llmgw.agent.runtime import SystemdRuntime
from llmgw.server.auth import create_api_key
from llmgw.store import open_store, sqlite_url
from llmgw.store.pki import NodeCertRecord


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_block(size: int = 20) -> tuple[int, int]:
    """A block of ports below the kernel's ephemeral range, all free right now."""
    rng = random.Random()
    for _ in range(200):
        low = rng.randrange(21000, 32000 - size)
        try:
            for port in range(low, low + size):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return low, low + size - 1
    raise RuntimeError("no block of free ports found")


def cannot(reason: str) -> None:
    """Skip where the machine lacks what a test needs (root, network namespaces, a mount
    namespace); in CI (CI=true), which runs as root with iproute2 and util-linux, that is a
    broken runner, not a reason to skip: fail."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"needed in CI: {reason}")
    pytest.skip(reason)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1):
    """Poll ``predicate`` until it returns something truthy, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
        except Exception as err:  # the thing polled may not be up yet
            last_error = err
            value = None
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}"
                         + (f" (last error: {last_error!r})" if last_error else ""))


def _start(args: list[str], log: Path, prefix: Sequence[str] = ()) -> subprocess.Popen:
    """``python -m llmgw ARGS`` in a new session, after ``prefix`` (a command that execs the
    rest, such as ``ip netns exec NS``, so the Popen's pid is still llmgw's)."""
    out = open(log, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [*prefix, sys.executable, "-m", "llmgw", *args], stdout=out, stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL, start_new_session=True,
    )


def _stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 15) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
    except ProcessLookupError:
        proc.wait(5)


@dataclass
class AgentProc:
    node_id: str
    config_path: Path
    state_dir: Path
    log: Path
    proc: subprocess.Popen | None = None
    prefix: tuple[str, ...] = ()
    systemd_bus: str | None = None  # its shards are units on this (test) manager

    def start(self) -> None:
        self.proc = _start(["agent", "--config", str(self.config_path)], self.log, self.prefix)

    def kill(self, group: bool = False) -> None:
        """SIGKILL, as a crash would: the agent gets no chance to clean up. With ``group``,
        its whole process group (the agent and any helper it forked; not its shards, which
        run in their own sessions)."""
        assert self.proc is not None
        if group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        else:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)

    def pause(self) -> None:
        """SIGSTOP the agent process only (not its shards): it goes silent, as behind a
        partition, with its stream left open."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def engine_pids(self) -> dict[str, tuple[int, float]]:
        """Per shard unit, the engine's (pid, start time) from this agent's records."""
        return {r["unit"]: (r["pid"], r["started_at"]) for r in self.shard_records()
                if "unit" in r and "pid" in r}

    def shard_records(self) -> list[dict]:
        records = []
        for path in sorted((self.state_dir / "shards").glob("*.json")):
            try:
                records.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return records

    def stop(self) -> None:
        if self.proc is not None:
            _stop_group(self.proc)
        if self.systemd_bus:
            # Units outlive their agent by design; the manager is this test session's own.
            asyncio.run(_stop_units(self.systemd_bus, self.state_dir))
        # Shards run in their own sessions so that they outlive a crashed agent; stop the
        # ones this agent's records name, checking each PID is still the same process.
        for record in self.shard_records():
            try:
                proc = psutil.Process(record["pid"])
                if abs(proc.create_time() - record["started_at"]) < 0.5:
                    os.killpg(record["pid"], signal.SIGKILL)
            except (psutil.Error, ProcessLookupError, KeyError):
                continue


async def _stop_units(bus: str, state_dir: Path) -> None:
    runtime = SystemdRuntime(bus, state_dir)
    try:
        for record in await runtime.running():
            await runtime.stop(record.unit)
    finally:
        await runtime.close()


@dataclass
class Cluster:
    root: Path
    models: list[dict]
    server_overrides: dict = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    server: subprocess.Popen | None = None
    agents: dict[str, AgentProc] = field(default_factory=dict)
    api_key: str = ""
    admin_token: str = ""
    # The server's listen address; a non-loopback one keeps auth.require_api_key on.
    listen_host: str = "127.0.0.1"
    # listen.server: the HTTP server it runs on.
    http_server: str = "uvicorn"

    @property
    def base_url(self) -> str:
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        return f"{'https' if 'tls' in self.server_overrides else 'http'}://{host}:{self.port}"

    @property
    def server_state(self) -> Path:
        return self.root / "server"

    @property
    def plain_off_loopback(self) -> bool:
        """Plain HTTP on a bridge address (the netns tests): both sides must allow it."""
        return self.listen_host not in ("127.0.0.1", "::1", "localhost")

    def write_server_config(self) -> Path:
        config = {
            "listen": {"host": self.listen_host, "port": self.port, "server": self.http_server,
                       **({"allow_plain_http": True} if self.plain_off_loopback else {})},
            "state_dir": str(self.server_state),
            "nodes": {"heartbeat_interval_s": 0.5, "unreachable_after_s": 3,
                      "lost_after_s": 8},
            "controller": {"interval_s": 0.5, "restart_backoff_initial_s": 0.5,
                           "restart_backoff_max_s": 2, "adoption_grace_s": 5},
            "models": self.models,
            # No engine installs unless a test asks: tests stay on loopback.
            "engines": {},
            "log_level": "debug",
            **self.server_overrides,
        }
        path = self.root / "server.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start_server(self) -> None:
        path = self.write_server_config()
        if not self.api_key:
            self.server_state.mkdir(parents=True, exist_ok=True)
            self.api_key = self.make_key()
        self.server = _start(["server", "--config", str(path)], self.root / "server.log")
        wait_for(lambda: httpx.get(f"{self.base_url}/healthz").status_code == 200, 30,
                 "the server to answer /healthz")
        self.admin_token = (self.server_state / "secrets" / "admin-token").read_text().strip()

    def make_key(self) -> str:
        """An API key made in the server's SQLite store, before the server runs."""
        return asyncio.run(self._make_key())

    async def _make_key(self) -> str:
        store = await open_store(sqlite_url(self.server_state / "llmgw.db"))
        try:
            key, _ = await create_api_key(store, "tests")
        finally:
            await store.close()
        return key

    def add_agent(self, node_id: str, *, prefix: Sequence[str] = (), **overrides) -> AgentProc:
        """Write agent-NODE.yaml and start the agent, after ``prefix`` when given. An
        override of None leaves the key out (``address=None``: the agent finds its own)."""
        state = self.root / f"agent-{node_id}"
        config = {
            "servers": [self.base_url],
            "node_id": node_id,
            "address": "127.0.0.1",
            "state_dir": str(state),
            "port_range": list(free_port_block()),
            "reconnect": {"initial_s": 0.2, "max_s": 1.0},
            # Never the machine's own systemd manager: a test that wants systemd passes
            # the bus of the manager it started.
            "runtime": "process",
            "weights": {"directories": [{"path": str(state / "weights")}]},
            "log_level": "debug",
            **({"allow_plain_http": True} if self.plain_off_loopback else {}),
            **overrides,
        }
        config = {key: value for key, value in config.items() if value is not None}
        path = self.root / f"agent-{node_id}.yaml"
        path.write_text(yaml.safe_dump(config))
        agent = AgentProc(node_id, path, state, self.root / f"agent-{node_id}.log",
                          prefix=tuple(prefix),
                          systemd_bus=config.get("systemd_bus")
                          if config.get("runtime") == "systemd" else None)
        agent.start()
        self.agents[node_id] = agent
        return agent

    def stop_server(self) -> int | None:
        """SIGTERM the server's process group and wait for it to exit (SIGKILL after 15 s);
        returns its exit status: 0 when it stopped on SIGTERM, -9 when it had to be killed."""
        assert self.server is not None
        _stop_group(self.server)
        return self.server.returncode

    def restart_server(self) -> float:
        """Stop the server and start it again on the same port, state directory, store and
        API key; returns how long it was down, in seconds (until /healthz answered)."""
        began = time.monotonic()
        self.stop_server()
        self.start_server()
        return time.monotonic() - began

    def admin(self, method: str, path: str, **kwargs) -> httpx.Response:
        """One admin API call with the admin token."""
        return httpx.request(method, f"{self.base_url}{path}", timeout=10,
                             headers={"authorization": f"Bearer {self.admin_token}"}, **kwargs)

    def replicas(self, model: str) -> list[dict]:
        return [r for r in self.status()["replicas"] if r["model"] == model]

    def status(self) -> dict:
        resp = httpx.get(f"{self.base_url}/api/status",
                         headers={"authorization": f"Bearer {self.admin_token}"}, timeout=5)
        resp.raise_for_status()
        return resp.json()

    def node_state(self, node_id: str) -> str | None:
        return next((n["state"] for n in self.status()["nodes"] if n["id"] == node_id), None)

    def ready_replicas(self, model: str) -> list[dict]:
        return [r for r in self.status()["replicas"]
                if r["model"] == model and r["state"] == "ready"]

    def wait_ready(self, model: str, count: int = 1, timeout_s: float = 30) -> list[dict]:
        return wait_for(lambda: len(self.ready_replicas(model)) >= count
                        and self.ready_replicas(model), timeout_s,
                        f"{count} ready replica(s) of {model}")

    def server_log_line(self, *words: str, timeout_s: float = 30) -> str:
        """Wait for the first line of the server's log holding every one of ``words``."""
        log = self.root / "server.log"
        return wait_for(lambda: next((line for line in log.read_text().splitlines()
                                      if all(w in line for w in words)), None),
                        timeout_s, f"a server log line with {words}")

    def logs(self) -> str:
        parts = []
        for path in sorted(self.root.glob("*.log")):
            parts.append(f"===== {path.name}\n{path.read_text(errors='replace')[-6000:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        for agent in self.agents.values():
            agent.stop()
        if self.server is not None:
            _stop_group(self.server)


def process_alive(pid: int, started_at: float) -> bool:
    """Whether the process that a shard record names still runs (not a recycled PID, not
    a zombie)."""
    try:
        proc = psutil.Process(pid)
        return (abs(proc.create_time() - started_at) < 0.5
                and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


@dataclass
class ClusterCa:
    """A cluster CA made in ``root``, as ``llmgw server init`` makes one: the server's
    certificate for 127.0.0.1, and node certificates as ``llmgw agent join`` gets them.
    A cluster whose server_overrides hold ``server_tls()`` serves https (base_url); its
    test process trusts ``ca_file`` when SSL_CERT_FILE names it (httpx reads it)."""

    root: Path
    key: pki.PrivateKey
    pem: bytes

    @classmethod
    def make(cls, root: Path) -> ClusterCa:
        root.mkdir(parents=True)
        key, pem = pki.create_ca()
        ca = cls(root, key, pem)
        ca.ca_file.write_bytes(pem)
        (root / "ca.key").write_bytes(pki.key_pem(key))
        (root / "ca.key").chmod(0o600)
        return ca

    @property
    def ca_file(self) -> Path:
        return self.root / "ca.pem"

    def server_tls(self, agent_port: int) -> dict:
        """server.yaml's tls block: the API over https, the agents' mTLS on agent_port."""
        key_pem, cert_pem = pki.issue_server_cert(self.key, self.pem, ["127.0.0.1"])
        (self.root / "server.key").write_bytes(key_pem)
        (self.root / "server.key").chmod(0o600)
        (self.root / "server.pem").write_bytes(cert_pem)
        return {"ca_file": str(self.ca_file), "ca_key_file": str(self.root / "ca.key"),
                "cert_file": str(self.root / "server.pem"),
                "key_file": str(self.root / "server.key"),
                "agent_listen": {"host": "127.0.0.1", "port": agent_port}}

    def node_tls(self, node: str, store_db: Path) -> dict:
        """agent.yaml's tls block for ``node``: a certificate issued and recorded in the
        server's store (``store_db``), as a join would."""
        key = pki.new_key()
        issued = pki.sign_node_csr(self.key, self.pem, pki.make_csr(key, node), node,
                                   timedelta(days=1))
        (self.root / f"{node}.key").write_bytes(pki.key_pem(key))
        (self.root / f"{node}.key").chmod(0o600)
        (self.root / f"{node}.pem").write_bytes(issued.cert_pem)
        asyncio.run(_record_node_cert(store_db, NodeCertRecord(
            serial=str(issued.serial), node=node, not_before=issued.not_before,
            not_after=issued.not_after)))
        return {"ca_file": str(self.ca_file), "cert_file": str(self.root / f"{node}.pem"),
                "key_file": str(self.root / f"{node}.key")}


async def _record_node_cert(store_db: Path, record: NodeCertRecord) -> None:
    store = await open_store(sqlite_url(store_db))
    try:
        await store.add_node_cert(record)
    finally:
        await store.close()
