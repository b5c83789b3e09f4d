"""Scale to zero: how long a request to a sleeping model waits for its first token, against
llama-server started by hand.

A real ``llmgw server`` and ``llmgw agent`` (engines as plain processes) serve SmolLM2 on
the real llama.cpp, declared with ``idle_unload_s`` so that it sleeps between rounds. Each
round, in turn:

- bare: llama-server is spawned by this process with the same arguments the agent gives
  it, ``/health`` is polled every 20 ms, and one streamed chat completion is sent: spawn to
  first token, the least a cold start can take;
- wake: once llmgw has unloaded the model (its status says asleep, no replica), one
  streamed chat completion through llmgw's ``/v1``: request to first token, while the
  control plane places a replica, the agent starts llama-server and llmgw sees it ready;
- warm: the same request again at once, to the awake model.

The wake is split into phases from the server's log (the replica placed, ready). Figures
are medians over the rounds, and the ratio of each round's wake to its bare start.
llama.cpp and SmolLM2 must be in llmgw's cache (``llmgw up`` puts them there; the tests'
``llama_cpp`` fixture too). Nothing is asserted; it prints a table and exits 0.

    .venv/bin/python -m bench.wake               # 5 rounds
    .venv/bin/python -m bench.wake --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from bench.gateway import api_key, free_port, llama_files, spawn, stop
from llmgw import config as cfg
from llmgw.server.auth import load_or_create_admin_token

console = Console(width=110) if not sys.stdout.isatty() else Console()
MODEL = "smol"
IDLE_S = 2.0
ARGS = ["--threads", "1"]
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8, "stream": True}


def write_configs(tmp: Path, port: int, llama: tuple[Path, Path]) -> tuple[Path, Path]:
    server = cfg.ServerConfig(
        listen=cfg.Listen(host="127.0.0.1", port=port), state_dir=str(tmp / "server"),
        controller=cfg.Controller(interval_s=0.5),
        models=[cfg.Model(name=MODEL, idle_unload_s=IDLE_S, wake_timeout_s=120,
                          profiles=[cfg.Profile(engine="llama.cpp", weights=str(llama[1]),
                                                startup_timeout_s=120, args=ARGS)])],
        engines={}, log_level="info")
    agent = cfg.AgentConfig(
        servers=[f"http://127.0.0.1:{port}"], node_id="bench", address="127.0.0.1",
        state_dir=str(tmp / "agent"), runtime="process", stop_shards_on_exit=True,
        engines={"llama.cpp": cfg.EnginePath(binary=str(llama[0]))},
        weights=cfg.Weights(directories=[cfg.WeightsDirectory(path=str(tmp / "weights"))]),
        log_level="info")
    paths = tmp / "server.yaml", tmp / "agent.yaml"
    paths[0].write_text(cfg.dump(server))
    paths[1].write_text(cfg.dump(agent))
    return paths


async def first_token(http: aiohttp.ClientSession, url: str, headers: dict[str, str],
                      began: float) -> float:
    """Seconds from ``began`` to the first streamed event with content."""
    async with http.post(url, json=BODY, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url} answered {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if line.startswith(b"data: {"):
                event = json.loads(line[6:])
                if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                    took = time.monotonic() - began
                    async for _ in resp.content:  # read it to the end
                        pass
                    return took
    raise RuntimeError(f"{url} streamed no content")


async def bare_start(http: aiohttp.ClientSession, llama: tuple[Path, Path], tmp: Path) -> float:
    port = free_port()
    began = time.monotonic()
    proc = spawn([str(llama[0]), "--model", str(llama[1]), "--host", "127.0.0.1",
                  "--port", str(port), *ARGS], tmp / "bare.log")
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode}; see "
                                   f"{tmp / 'bare.log'}")
            try:
                async with http.get(f"http://127.0.0.1:{port}/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() - began > 120:
                raise TimeoutError("llama-server was not healthy within 120 s")
            await asyncio.sleep(0.02)
        return await first_token(http, f"http://127.0.0.1:{port}/v1/chat/completions", {},
                                 began)
    finally:
        stop(proc.pid)


async def status(http: aiohttp.ClientSession, base: str, token: str) -> dict:
    async with http.get(f"{base}/api/status",
                        headers={"authorization": f"Bearer {token}"}) as resp:
        return await resp.json()


async def until_asleep(http: aiohttp.ClientSession, base: str, token: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        body = await status(http, base, token)
        model = next(m for m in body["models"] if m["name"] == MODEL)
        if model["asleep"] and not [r for r in body["replicas"] if r["model"] == MODEL]:
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{MODEL} was not unloaded within 60 s")


def log_times(log: Path, pattern: str, after: datetime) -> datetime | None:
    for line in log.read_text(errors="replace").splitlines():
        stamp = LOG_TIME.match(line)
        if stamp and re.search(pattern, line):
            when = datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f")
            if when >= after:
                return when
    return None


async def main(rounds: int) -> None:
    llama = llama_files()
    if llama is None:
        console.print("llama.cpp and SmolLM2 are not in llmgw's cache; run `llmgw up` once "
                      "(or the tests' llama_cpp fixture), then this again")
        return
    rows: dict[str, list[float]] = {k: [] for k in
                                    ("bare", "wake", "warm", "placed", "ready", "ratio")}
    with tempfile.TemporaryDirectory(prefix="llmgw-wake-") as name:
        tmp = Path(name)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        server_yaml, agent_yaml = write_configs(tmp, port, llama)
        llmgw = [sys.executable, "-m", "llmgw"]
        (tmp / "server").mkdir(mode=0o700)
        token, _ = load_or_create_admin_token(tmp / "server")
        server = spawn([*llmgw, "server", "--config", str(server_yaml)], tmp / "server.log")
        agent = None
        try:
            timeout = aiohttp.ClientTimeout(total=180)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                deadline = time.monotonic() + 60
                while True:
                    if server.poll() is not None:
                        raise RuntimeError(f"llmgw server exited with {server.returncode}; "
                                           f"see {tmp / 'server.log'}:\n"
                                           + (tmp / "server.log").read_text()[-3000:])
                    try:
                        await status(http, base, token)
                        break
                    except aiohttp.ClientError:
                        if time.monotonic() > deadline:
                            raise
                        await asyncio.sleep(0.1)
                agent = spawn([*llmgw, "agent", "--config", str(agent_yaml)],
                              tmp / "agent.log")
                headers = {"authorization": f"Bearer {await api_key(base, token)}"}
                url = f"{base}/v1/chat/completions"
                for i in range(rounds):
                    bare = await bare_start(http, llama, tmp)
                    await until_asleep(http, base, token)
                    at = datetime.now()
                    began = time.monotonic()
                    wake = await first_token(http, url, headers, began)
                    warm = await first_token(http, url, headers, time.monotonic())
                    placed = log_times(tmp / "server.log", rf"replica {MODEL}-\S+ of {MODEL}: "
                                       r"placed on", at)
                    ready = log_times(tmp / "server.log", rf"{MODEL}-\S+ .*-> ready", at)
                    rows["bare"].append(bare)
                    rows["wake"].append(wake)
                    rows["warm"].append(warm)
                    rows["ratio"].append(wake / bare)
                    if placed and ready:
                        rows["placed"].append((placed - at).total_seconds())
                        rows["ready"].append((ready - placed).total_seconds())
                    console.print(f"round {i + 1}: bare {bare:.2f} s, wake {wake:.2f} s, "
                                  f"warm {warm * 1000:.0f} ms")
        finally:
            for proc in (agent, server):
                if proc is not None:
                    stop(proc.pid)
    table = Table(title=f"wake to first token, SmolLM2 on llama.cpp ({rounds} rounds)")
    for column in ("", "median", "min", "max"):
        table.add_column(column, justify="right" if column else "left")
    words = {"bare": "bare llama-server: spawn to first token (s)",
             "wake": "llmgw, asleep: request to first token (s)",
             "warm": "llmgw, awake: request to first token (s)",
             "placed": "  of which: to the replica placed (s)",
             "ready": "  of which: placed to ready (s)",
             "ratio": "wake / bare (each round's)"}
    for key, label in words.items():
        values = rows[key]
        if values:
            table.add_row(label, f"{statistics.median(values):.3f}", f"{min(values):.3f}",
                          f"{max(values):.3f}")
    console.print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    asyncio.run(main(parser.parse_args().rounds))
