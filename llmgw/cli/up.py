"""``llmgw up``: a whole cluster of one on this machine, for a first look.

It writes a server.yaml and an agent.yaml into the state directory, makes an API key,
starts ``llmgw server`` and ``llmgw agent`` as child processes exactly as a real
deployment runs them, waits for the model to be ready and says how to call it. Ctrl-C
stops the agent first (which stops its engines), then the server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from rich.console import Console

from llmgw import config as cfg
from llmgw.server.auth import create_api_key, key_id, load_or_create_admin_token
from llmgw.server.run import store_url
from llmgw.store import open_store

DEMO_MODEL = "sim-small"
console = Console(stderr=True, highlight=False)


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "llmgw"


def write_configs(state: Path, port: int, engine: str) -> tuple[Path, Path]:
    server = cfg.ServerConfig(
        listen=cfg.Listen(host="127.0.0.1", port=port),
        state_dir=str(state / "server"),
        models=[cfg.Model(name=DEMO_MODEL, description="a deterministic demo model",
                          profiles=[cfg.Profile(engine=engine)])],
    )
    agent = cfg.AgentConfig(
        servers=[f"http://127.0.0.1:{port}"],
        address="127.0.0.1",
        state_dir=str(state / "agent"),
        stop_shards_on_exit=True,
    )
    server_path, agent_path = state / "server.yaml", state / "agent.yaml"
    header = "# written by `llmgw up`; it is rewritten on every run\n"
    server_path.write_text(header + cfg.dump(server))
    agent_path.write_text(header + cfg.dump(agent))
    return server_path, agent_path


async def api_key(state: Path, server_config: cfg.ServerConfig) -> str:
    """The key `llmgw up` made on its first run (kept, 0600, so that it can be shown
    again), or a new one."""
    path = state / "server" / "secrets" / "up-api-key"
    store = await open_store(store_url(server_config))
    try:
        if path.exists():
            key = path.read_text().strip()
            prefix = key_id(key)
            if prefix and await store.find_api_key(prefix):
                return key
        key, _ = await create_api_key(store, "llmgw up")
    finally:
        await store.close()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


async def wait_ready(base: str, admin_token: str, procs: list[subprocess.Popen],
                     timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    headers = {"authorization": f"Bearer {admin_token}"}
    last = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        with console.status("starting…") as status:
            while time.monotonic() < deadline:
                for proc in procs:
                    if proc.poll() is not None:
                        raise RuntimeError(f"{proc.args[3]} exited with code {proc.returncode}")
                try:
                    async with http.get(f"{base}/api/status", headers=headers) as resp:
                        if resp.status == 401:
                            raise RuntimeError(
                                f"the server at {base} does not take this state directory's "
                                "admin token; is another llmgw already on that port?")
                        body = await resp.json()
                except (aiohttp.ClientError, TimeoutError):
                    status.update("waiting for the server to listen…")
                    await asyncio.sleep(0.2)
                    continue
                model = next((m for m in body["models"] if m["name"] == DEMO_MODEL), None)
                if model and model["replicas_ready"] > 0:
                    return
                text = _progress(body)
                if text != last:
                    status.update(text)
                    last = text
                await asyncio.sleep(0.2)
    raise TimeoutError(f"{DEMO_MODEL} was not ready after {timeout_s:g} s: {last}")


def _progress(status: dict) -> str:
    if not status["nodes"]:
        return "waiting for the local agent to register…"
    for replica in status["replicas"]:
        if replica["model"] == DEMO_MODEL:
            return f"{DEMO_MODEL}: {replica['state']} ({replica['reason']})"
    model = next((m for m in status["models"] if m["name"] == DEMO_MODEL), None)
    return f"{DEMO_MODEL}: {(model and model['unplaced']) or 'placing…'}"


def _spawn(role: str, config: Path, log: Path) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen(
        [sys.executable, "-m", "llmgw", role, "--config", str(config)],
        stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen, timeout_s: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def up(args: argparse.Namespace) -> int:
    state = Path(args.state_dir) if args.state_dir else default_state_dir()
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    server_path, agent_path = write_configs(state, args.port, args.engine)
    server_config = cfg.load(server_path, cfg.ServerConfig)
    (state / "server").mkdir(exist_ok=True, mode=0o700)
    admin_token, _ = load_or_create_admin_token(server_config.state_dir)
    key = asyncio.run(api_key(state, server_config))

    base = f"http://127.0.0.1:{args.port}"
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    server = _spawn("server", server_path, logs / "server.log")
    agent = _spawn("agent", agent_path, logs / "agent.log")
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        asyncio.run(wait_ready(base, admin_token, [server, agent], args.timeout))
        console.print(f"[bold green]llmgw is up[/]: {DEMO_MODEL} is ready\n")
        console.print(f"  OpenAI base URL  {base}/v1")
        console.print(f"  API key          {key}", soft_wrap=True)
        console.print(f"  admin token      {admin_token}", soft_wrap=True)
        console.print(f"  logs             {logs}/\n")
        console.print(
            f"  curl {base}/v1/chat/completions -H 'authorization: Bearer {key}' \\\n"
            f"    -H 'content-type: application/json' \\\n"
            f"    -d '{{\"model\":\"{DEMO_MODEL}\",\"messages\":[{{\"role\":\"user\","
            f"\"content\":\"Hello\"}}]}}'\n", soft_wrap=True)
        console.print("Ctrl-C stops everything.")
        while server.poll() is None and agent.poll() is None:
            time.sleep(0.5)
        dead = server if server.poll() is not None else agent
        console.print(f"[red]{dead.args[3]} exited with code {dead.returncode}; see {logs}/[/]")
        return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as err:
        console.print(f"[red]llmgw up: {err}[/]; see {logs}/")
        return 1
    finally:
        console.print("stopping…")
        _stop(agent)
        _stop(server)
