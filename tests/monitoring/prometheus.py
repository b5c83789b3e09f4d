"""Debian's real Prometheus tools for the monitoring tests: ``promtool``, and a
``prometheus`` process on loopback with its own data directory, stopped by its process
group.

Both come from Debian's ``prometheus`` package (.ci/run installs it). Without them a test
skips on a developer's machine and fails under CI=true.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.integration.cluster import cannot, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / "deploy" / "monitoring"


def tool(name: str) -> str:
    """The path of ``name`` (``promtool``, ``prometheus``), or skip (fail under CI=true)."""
    found = shutil.which(name)
    if found is None:
        cannot(f"{name} is not installed (Debian: apt-get install prometheus)")
    return found  # type: ignore[return-value]


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([tool("promtool"), *args], capture_output=True, text=True,
                          cwd=cwd, timeout=120, check=False)


@dataclass
class Prometheus:
    """One ``prometheus`` on 127.0.0.1, started with ``config`` in ``root``."""

    root: Path
    config: dict
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        config_file = self.root / "prometheus.yml"
        config_file.write_text(yaml.safe_dump(self.config))
        log = open(self.root / "prometheus.log", "ab")  # noqa: SIM115 - the child owns it
        self.proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={config_file}",
             f"--storage.tsdb.path={self.root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        wait_for(self._ready, 30, "Prometheus to answer /-/ready")

    def _ready(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n"
                                 + self.log())
        return httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200

    def api(self, path: str, **params: Any) -> Any:
        """The ``data`` of a successful answer of Prometheus' HTTP API."""
        answer = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        answer.raise_for_status()
        body = answer.json()
        assert body["status"] == "success", body
        return body["data"]

    def value(self, query: str) -> float | None:
        """An instant query's single value, None while it has no series."""
        result = self.api("query", query=query)["result"]
        if not result:
            return None
        assert len(result) == 1, result
        return float(result[0]["value"][1])

    def log(self) -> str:
        path = self.root / "prometheus.log"
        return path.read_text(errors="replace")[-6000:] if path.exists() else ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def eventually(query: Prometheus, expression: str, expected: float,
               timeout_s: float = 30) -> None:
    """Wait until ``expression`` evaluates to ``expected`` in Prometheus."""
    last: list[float | None] = [None]

    def settled() -> bool:
        last[0] = query.value(expression)
        return last[0] == expected

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if settled():
            return
        time.sleep(0.5)
    raise AssertionError(f"{expression} is {last[0]}, not {expected}, after {timeout_s:g} s; "
                         f"Prometheus' log:\n{query.log()}")
