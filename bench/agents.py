"""How many agents one server carries: N simulated agents speaking the real wire protocol.

Each simulated agent opens the plain agent stream on loopback (``/agent/v1/stream``),
registers with 8 fake GPUs, waits for its Welcome and sends a heartbeat every
``--heartbeat-s`` (phases spread evenly), reconnecting with jitter if its stream closes.
Against one ``llmgw server`` on SQLite with no models, for each N it measures:

- cold start: the time until all N were welcomed;
- steady state over ``--steady-s``: the server's CPU (% of one core, from /proc) and RSS
  per agent (over the server's RSS with no agent), and the event loop's stalls, seen as
  the latency of ``/healthz`` polled every 50 ms by a process of its own (max and p99: a
  request waits behind a pass as a heartbeat does);
- nodes the server called unreachable although every agent kept sending (``/api/status``
  at the end of the steady state);
- a server restart (SIGTERM, the same store): the time until all N were welcomed again,
  and how many nodes were unreachable once the restart had settled.

It prints a table and exits 0 whatever it measured; nothing is asserted. Every process it
starts is stopped by PID; every loop is bounded in count and time.

    .venv/bin/python -m bench.agents --agents 100,1000
    .venv/bin/python -m bench.agents --agents 5000 --steady-s 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml
from rich.console import Console
from rich.table import Table

from bench.gateway import cpu_ns, free_port, spawn, stop
from llmgw import wire
from llmgw.agent.agent import SERVER_SILENCE_S
from llmgw.server.auth import load_or_create_admin_token

console = Console(width=140)
GPUS = [wire.Gpu(index=i, name="NVIDIA H100 80GB HBM3", memory_total_mib=81_559,
                 memory_free_mib=81_000, uuid=f"GPU-{i:08d}", pci_bus_id=f"0000:{i + 16:02x}:00.0")
        for i in range(8)]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Agents:
    """N simulated agents: their streams, and when each was last welcomed."""

    def __init__(self, url: str, count: int, heartbeat_s: float) -> None:
        self.url = url
        self.count = count
        self.heartbeat_s = heartbeat_s
        self.welcomed: dict[str, float] = {}
        self.tasks: list[asyncio.Task] = []
        self.http: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self.http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True))
        self.tasks = [asyncio.create_task(self._agent(i)) for i in range(self.count)]

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.close()

    async def all_welcomed_since(self, since: float, timeout_s: float) -> float | None:
        """Seconds from ``since`` until every agent was welcomed after it; None on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if len(self.welcomed) == self.count and min(self.welcomed.values()) >= since:
                return max(self.welcomed.values()) - since
            await asyncio.sleep(0.1)
        return None

    async def _agent(self, i: int) -> None:
        node_id = f"sim-{i:05d}"
        register = wire.Register(
            node_id=node_id, address="127.0.0.1",
            inventory=wire.Inventory(hostname=node_id, os="ubuntu 24.04", arch="x86_64",
                                     cpu_count=64, ram_total_mib=1_048_576, gpus=GPUS,
                                     cpu_flags=["avx2", "avx512f"]))
        rng = random.Random(i)
        phase = self.heartbeat_s * i / self.count
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                # Pinging a silent server as the real agent does.
                async with self.http.ws_connect(self.url, heartbeat=SERVER_SILENCE_S) as ws:
                    await ws.send_bytes(wire.encode(register))
                    welcome = await ws.receive(timeout=120)
                    if welcome.type is aiohttp.WSMsgType.BINARY:
                        self.welcomed[node_id] = time.monotonic()
                        await self._beat(ws, phase)
            await asyncio.sleep(rng.uniform(0.1, 1.0))  # reconnect, with jitter

    async def _beat(self, ws: aiohttp.ClientWebSocketResponse, phase: float) -> None:
        beat = wire.encode(wire.Heartbeat(gpu_memory_free_mib=[81_000] * 8))
        await asyncio.sleep(phase)
        while not ws.closed:
            await ws.send_bytes(beat)
            with contextlib.suppress(asyncio.TimeoutError):
                message = await ws.receive(timeout=self.heartbeat_s)
                if message.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED,
                                    aiohttp.WSMsgType.ERROR):
                    return


async def healthz_waits(base: str, seconds: float) -> list[float]:
    """Latency of /healthz polled every 50 ms for ``seconds``, in ms, by a process of its
    own (bench/healthz_poll.py): not behind this busy one's loop."""
    poller = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.healthz_poll", base, str(seconds),
        stdout=asyncio.subprocess.PIPE)
    out, _ = await poller.communicate()
    return json.loads(out)


async def unreachable(base: str, token: str) -> int:
    async with aiohttp.ClientSession() as http, http.get(
            base + "/api/status", headers={"authorization": f"Bearer {token}"}) as resp:
        nodes = (await resp.json())["nodes"]
    return sum(1 for n in nodes if n["state"] != "ready")


def write_server(tmp: Path, port: int, heartbeat_s: float) -> Path:
    config = {
        "listen": {"host": "127.0.0.1", "port": port},
        "state_dir": str(tmp / "server"),
        "nodes": {"heartbeat_interval_s": heartbeat_s, "unreachable_after_s": 3 * heartbeat_s,
                  "lost_after_s": 10 * heartbeat_s},
        "models": [],
        "engines": {},
        "log_level": "warning",
    }
    path = tmp / "server.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def wait_healthz(base: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(base + "/healthz") as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise TimeoutError("the server did not answer /healthz within 60 s")


async def measure(count: int, args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-agents-"))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    (tmp / "server").mkdir(mode=0o700)
    token, _ = load_or_create_admin_token(tmp / "server")
    server_yaml = write_server(tmp, port, args.heartbeat_s)
    argv = [sys.executable, "-m", "llmgw", "server", "-c", str(server_yaml)]
    server = spawn(argv, tmp / "server.log")
    agents = Agents(f"ws://127.0.0.1:{port}/agent/v1/stream", count, args.heartbeat_s)
    figures: dict = {"agents": count}
    try:
        await wait_healthz(base)
        await asyncio.sleep(1)  # what a server holds before its first agent
        rss_empty = rss_kib(server.pid)
        began = time.monotonic()
        await agents.start()
        figures["cold_s"] = await agents.all_welcomed_since(began, args.register_timeout_s)
        cpu_before, wall_before = cpu_ns([server.pid]), time.monotonic()
        waits = await healthz_waits(base, args.steady_s)
        cpu_s = (cpu_ns([server.pid]) - cpu_before) / 1e9
        figures["cpu_pct"] = 100 * cpu_s / (time.monotonic() - wall_before)
        figures["kib_per_agent"] = (rss_kib(server.pid) - rss_empty) / count
        figures["stall_max_ms"] = max(waits)
        figures["stall_p99_ms"] = statistics.quantiles(waits, n=100)[98]
        figures["unreachable"] = await unreachable(base, token)

        stop(server.pid)
        restarted = time.monotonic()
        server = spawn(argv, tmp / "server.log")
        await wait_healthz(base)
        figures["restart_s"] = await agents.all_welcomed_since(restarted,
                                                               args.register_timeout_s)
        await asyncio.sleep(args.heartbeat_s * 4)  # past unreachable_after_s, settled
        figures["unreachable_after_restart"] = await unreachable(base, token)
    finally:
        await agents.stop()
        stop(server.pid)
        if args.keep:
            console.print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return figures


def _fmt(value, digits: int = 1) -> str:
    return "timeout" if value is None else f"{value:.{digits}f}"


async def main(args: argparse.Namespace) -> None:
    rows = [await measure(n, args) for n in args.agents]
    table = Table(title=f"one server on SQLite, heartbeat every {args.heartbeat_s:g} s, "
                        f"steady state {args.steady_s:g} s")
    for column in ("agents", "cold start s", "server CPU %", "KiB / agent",
                   "stall max ms", "stall p99 ms", "unreachable", "restart s",
                   "unreachable after restart"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["agents"]), _fmt(r["cold_s"]), _fmt(r["cpu_pct"]),
                      _fmt(r["kib_per_agent"]), _fmt(r["stall_max_ms"]),
                      _fmt(r["stall_p99_ms"]), str(r["unreachable"]), _fmt(r["restart_s"]),
                      str(r["unreachable_after_restart"]))
    console.print(table)
    console.print("targets (informational): 10,000 agents under 50 % of one core; no stall "
                  "over 50 ms at 5,000; 5,000 registered within 30 s cold or after a "
                  "restart, 0 falsely unreachable")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="100,1000",
                        type=lambda s: [int(x) for x in s.split(",")],
                        help="agent counts, comma-separated (default 100,1000)")
    parser.add_argument("--heartbeat-s", type=float, default=3.0)
    parser.add_argument("--steady-s", type=float, default=10.0)
    parser.add_argument("--register-timeout-s", type=float, default=120.0)
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse()))
