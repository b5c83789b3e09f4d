"""What the gateway costs per request: CPU, latency and time to first token, against the floor.

Four targets (five with ``--observe``), measured in one run, round after round in turn
(the order rotates each round, so drift in the machine's load hits them all alike):

- direct: the client talks to the engine itself;
- floor: through a bare L7 proxy on uvloop and httptools (``bench/fake_engine.py
  proxy``), the least a Python proxy can cost;
- llmgw: through a real ``llmgw server`` on its default HTTP server (uvicorn), which
  learnt of the engine from a real ``llmgw agent``, exactly as in a deployment; every
  request carries an API key (one without limits), as in a deployment (``--no-key`` turns
  keys off);
- granian: the same on granian (``listen.server: granian``): a second server with its own
  agent and fake engine, so that each server's process holds only its own requests
  (``--no-granian`` leaves it out);
- observed (``--observe tracing``, ``access-log`` or ``both``): llmgw on uvicorn again, a
  cluster of its own, with every request traced (``tracing.sample_ratio``, 1 by default:
  ``--trace-ratio``) to an OTLP/HTTP sink in this process that answers every export and
  keeps nothing, or written to the access log (``logging.access: json``), or both; what
  that costs is its CPU against the llmgw target's, round by round.

The engine is a fake (``bench/fake_engine.py engine``: prepared bytes, no JSON read), so
what a gateway adds is most of what there is to see. The agent launches it through llmgw's
own llama.cpp adapter: the agent's llama.cpp binary is a small script written to the run's
temporary directory that runs the fake engine for a model whose weights are not a GGUF
file, and the real llama-server for one whose weights are. When llama.cpp and SmolLM2 are
in llmgw's cache (``llmgw up`` puts them there), a last part compares tokens/s of a real
llama-server directly and through llmgw.

Per target, mode (plain JSON or SSE stream) and concurrency: requests, the CPU the
gateway's processes used per request (and per streamed event) from /proc, the engine's,
latency p50/p99 (for streams: time to the first event), and the figures against direct and
against the floor: the CPU of all rounds together over the floor's, and the median of the
rounds' own ratios (each round measures llmgw and the floor minutes apart at most, so a
round a busy machine slowed slows both; the targets are judged by the median). Then the
targets of the issue, each marked. Nothing is asserted: it
prints figures and exits 0. Run with ``.venv/bin/python -m bench.gateway`` (``--quick``
for a run under a minute; ``--help`` for options).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.table import Table

from llmgw import config as cfg
from llmgw.agent.install import pypi
from llmgw.server.auth import load_or_create_admin_token

HERE = Path(__file__).resolve().parent
FAKE_ENGINE = HERE / "fake_engine.py"
FAKE_MODEL = "bench-fake"
LLAMA_MODEL = "smollm2-135m"
TARGETS = ("direct", "floor", "llmgw")
# llmgw on granian: the second cluster's llmgw target (Cluster.granian).
GRANIAN = "granian"
# llmgw with tracing or the access log on: the third cluster's (Cluster.observed).
OBSERVED = "observed"
HEADERS = {"content-type": "application/json"}
# Waited after the load before the gateways' idle CPU is read again: past a usage flush,
# a key refresh and a controller pass, which the load's last second leaves due.
IDLE_SETTLE_S = 5.0

# The issue's targets, for llmgw (CPU at concurrency >= 16, latency at concurrency 1).
CPU_PER_REQUEST_US = 100.0
CPU_PER_EVENT_US = 10.0
ADDED_P50_MS = 0.3
ADDED_TTFT_MS = 0.5
TOKENS_RATIO = 0.99
# The floor where the issue measured its targets: on a machine slower or faster than that,
# the CPU targets are also judged as these ratios to the floor measured in the same run.
ISSUE_FLOOR_US = {"request": 18.0, "event": 9.0}

console = Console(width=110) if not sys.stdout.isatty() else Console()


# --- CPU from /proc ------------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command's name: state, ppid, ... (empty
    when the process is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return []


def process_tree(root: int) -> list[int]:
    """``root`` and every process below it (this kernel has no /proc/*/task/*/children)."""
    parents = {int(p): int((_stat(int(p)) or [0, 0])[1]) for p in os.listdir("/proc")
               if p.isdigit()}
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, parent in parents.items() if parent in frontier]
        tree += frontier
    return tree


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def cpu_ns(pids: list[int]) -> int:
    """CPU time of every thread of ``pids``, in ns, from /proc/PID/task/TID/schedstat.

    /proc/PID/stat's utime + stime count in clock ticks (10 ms here), too coarse for a
    round that costs the floor 50 ms; schedstat counts nanoseconds, but only for threads
    still alive, so ``stat_ns`` is kept beside it as a check.
    """
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
    return total


_TICK_NS = 1e9 / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> tuple[int, int]:
    """(steal, all) clock ticks of the machine's CPUs so far, from /proc/stat: steal is
    the time the hypervisor ran something else while this machine wanted the CPU."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7] if len(fields) > 7 else 0, sum(fields[:8])


def stat_ns(pids: list[int]) -> int:
    """utime + stime of ``pids`` (threads that exited included), in ns, tick-grained."""
    return int(sum(int(f[11]) + int(f[12]) for f in map(_stat, pids) if f) * _TICK_NS)


# --- the processes -------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], log: Path) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 - the child keeps it
    return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True, cwd=HERE.parent)


def stop(pid: int, timeout_s: float = 15.0) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; reaps it when it is our child."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        if _stat(pid)[:1] in ([], ["Z"]):  # gone, or a zombie its parent will reap
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def llama_files() -> tuple[Path, Path] | None:
    """llama-server and the SmolLM2 GGUF, when both are already in llmgw's cache."""
    if pypi.installed(pypi.LLAMA_CPP) is None or pypi.installed(pypi.SMOLLM2) is None:
        return None
    return pypi.ensure_llama_cpp(), pypi.ensure_smollm2()


def write_cluster(tmp: Path, port: int, events: int, gap_ms: float,
                  llama: tuple[Path, Path] | None, keys: bool,
                  key_cache_s: float | None = None, http_server: str = "uvicorn",
                  observe: dict | None = None) -> tuple[Path, Path]:
    """server.yaml, agent.yaml and the agent's llama.cpp "binary"; ``observe``: the
    server's ``tracing`` and ``logging`` settings, if any."""
    wrapper = tmp / "llama-server"
    real = f'    *.gguf) exec {llama[0]} "$@" ;;\n' if llama else ""
    wrapper.write_text(
        "#!/bin/sh\n# Written by bench/gateway.py: llmgw's llama.cpp adapter runs this as\n"
        "# llama-server. A GGUF model runs the real one; any other runs the fake engine.\n"
        f'for arg; do\n  case "$arg" in\n{real}  esac\ndone\n'
        f'exec {sys.executable} {FAKE_ENGINE} engine "$@"\n')
    wrapper.chmod(0o755)
    models = [cfg.Model(name=FAKE_MODEL, profiles=[cfg.Profile(
        engine="llama.cpp", weights=str(FAKE_ENGINE), startup_timeout_s=60,
        args=["--events", str(events), "--gap-ms", str(gap_ms)])])]
    if llama:
        # One thread: the gateway and the client run on the other core, so what llmgw
        # costs shows as time added, not as CPU taken from the engine.
        models.append(cfg.Model(name=LLAMA_MODEL, profiles=[cfg.Profile(
            engine="llama.cpp", weights=str(llama[1]), startup_timeout_s=300,
            args=["--threads", "1"])]))
    server = cfg.ServerConfig(
        listen=cfg.Listen(host="127.0.0.1", port=port, server=http_server),
        state_dir=str(tmp / "server"),
        auth=cfg.Auth(require_api_key=keys, **(
            {"key_cache_s": key_cache_s} if key_cache_s is not None else {})),
        models=models, log_level="warning", **(observe or {}))
    agent = cfg.AgentConfig(
        servers=[f"http://127.0.0.1:{port}"], node_id="bench", address="127.0.0.1",
        state_dir=str(tmp / "agent"), runtime="process", stop_shards_on_exit=True,
        engines={"llama.cpp": cfg.EnginePath(binary=str(wrapper))},
        weights=cfg.Weights(directories=[cfg.WeightsDirectory(path=str(tmp / "weights"))]),
        log_level="warning")
    server_path, agent_path = tmp / "server.yaml", tmp / "agent.yaml"
    server_path.write_text(cfg.dump(server))
    agent_path.write_text(cfg.dump(agent))
    return server_path, agent_path


async def api_key(base: str, token: str) -> str:
    """A new API key without limits, made with the admin token."""
    async with (aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
                http.post(f"{base}/api/keys", json={"name": "bench"},
                          headers={"authorization": f"Bearer {token}"}) as resp):
        if resp.status != 201:
            raise RuntimeError(f"POST /api/keys answered {resp.status}: {await resp.text()}")
        return (await resp.json())["key"]


async def wait_ready(base: str, token: str, models: list[str], procs: list[subprocess.Popen],
                     timeout_s: float) -> dict[str, int]:
    """The engine port of each model once the controller has a ready replica of it."""
    deadline = time.monotonic() + timeout_s
    last = "the server did not answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"{' '.join(proc.args[1:4])} exited with code "
                                       f"{proc.returncode}")
            try:
                async with http.get(f"{base}/api/status",
                                    headers={"authorization": f"Bearer {token}"}) as resp:
                    body = await resp.json()
            except (aiohttp.ClientError, TimeoutError):
                await asyncio.sleep(0.2)
                continue
            ports = {r["model"]: r["shards"][0]["port"] for r in body["replicas"]
                     if r["state"] == "ready"}
            if all(m in ports for m in models):
                return ports
            last = "; ".join(f"{r['model']} {r['state']} {r['reason']}"
                             for r in body["replicas"]) or "no replica placed yet"
            await asyncio.sleep(0.2)
    raise TimeoutError(f"not ready after {timeout_s:g} s: {last}")


@dataclass
class Cluster:
    tmp: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    engine_pids: list[int] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)
    # Sent with every request to llmgw: its API key, as every deployment sends one.
    llmgw_headers: dict[str, str] = field(default_factory=dict)
    llama_url: str | None = None  # the real llama-server, direct
    # llmgw on granian: a cluster of its own (server, agent, engine; no floor), whose
    # llmgw target is this one's GRANIAN target.
    granian: Cluster | None = None
    # llmgw traced or access-logged: the same, this one's OBSERVED target.
    observed: Cluster | None = None

    def _others(self) -> dict[str, Cluster]:
        """The clusters of their own, by the target they serve."""
        return {target: cluster for target, cluster in ((GRANIAN, self.granian),
                                                         (OBSERVED, self.observed))
                if cluster is not None}

    def targets(self) -> tuple[str, ...]:
        return TARGETS + tuple(self._others())

    def gateways(self) -> dict[str, list[int]]:
        """The processes whose CPU is the gateway's, per target."""
        out = {"direct": [], "floor": process_tree(self.procs["floor"].pid),
               "llmgw": process_tree(self.procs["server"].pid)}
        for target, other in self._others().items():
            out[target] = process_tree(other.procs["server"].pid)
        return out

    def url(self, target: str) -> str:
        other = self._others().get(target)
        return other.urls["llmgw"] if other else self.urls[target]

    def headers(self, target: str) -> dict[str, str] | None:
        """What every request to ``target`` carries beside the body's type: llmgw's key."""
        other = self._others().get(target)
        if other:
            return other.llmgw_headers
        return self.llmgw_headers if target == "llmgw" else None

    def engines(self, target: str) -> list[int]:
        """The engine processes ``target``'s requests reach."""
        other = self._others().get(target)
        return other.engine_pids if other else self.engine_pids

    def stop(self) -> None:
        """The floor, the agent (which stops its engines), the server; then any engine
        the agent left behind, by PID. The other clusters first, the same way."""
        for other in self._others().values():
            other.stop()
        agent = self.procs.get("agent")
        if agent is not None:
            self.engine_pids += [p for p in process_tree(agent.pid)[1:]
                                 if p not in self.engine_pids]
        for name in ("floor", "agent", "server"):
            if name in self.procs:
                stop(self.procs[name].pid)
        for pid in self.engine_pids:
            if _stat(pid):
                stop(pid, 5.0)


def _as_is(role: str, argv: list[str]) -> list[str]:
    return argv


async def start(cluster: Cluster, events: int, gap_ms: float,
                llama: tuple[Path, Path] | None, keys: bool = True, *,
                launch: Callable[[str, list[str]], list[str]] = _as_is,
                key_cache_s: float | None = None, ready_s: float = 60.0,
                http_server: str = "uvicorn", floor: bool = True,
                observe: dict | None = None) -> list[str]:
    """The cluster started and ready within ``ready_s``, its server on ``http_server``;
    without ``floor``, no floor proxy (its urls have no floor). ``launch(role, argv)`` may
    change the command line of the ``server`` and the ``floor`` (to run them under a
    counter, say). ``observe``: the server's ``tracing`` and ``logging`` settings."""
    tmp, notes = cluster.tmp, []
    tmp.mkdir(exist_ok=True)
    port, floor_port = free_port(), free_port()
    server_yaml, agent_yaml = write_cluster(tmp, port, events, gap_ms, llama, keys,
                                            key_cache_s, http_server, observe)
    (tmp / "server").mkdir(mode=0o700)
    token, _ = load_or_create_admin_token(tmp / "server")
    python = [sys.executable, "-m", "llmgw"]
    cluster.procs["server"] = spawn(launch("server", [*python, "server", "-c",
                                                      str(server_yaml)]),
                                    tmp / "server.log")
    cluster.procs["agent"] = spawn([*python, "agent", "-c", str(agent_yaml)], tmp / "agent.log")
    base = f"http://127.0.0.1:{port}"
    procs = list(cluster.procs.values())
    ports = await wait_ready(base, token, [FAKE_MODEL], procs, ready_s)
    engine = ports[FAKE_MODEL]
    if keys:
        cluster.llmgw_headers = {"authorization": f"Bearer {await api_key(base, token)}"}
    cluster.engine_pids = [p for p in process_tree(cluster.procs["agent"].pid)[1:]
                           if str(FAKE_ENGINE) in cmdline(p)]
    path = "/v1/chat/completions"
    cluster.urls = {"direct": f"http://127.0.0.1:{engine}{path}", "llmgw": base + path}
    if not floor:
        return notes
    cluster.procs["floor"] = spawn(launch("floor", [
        sys.executable, str(FAKE_ENGINE), "proxy", "--port", str(floor_port),
        "--upstream", f"127.0.0.1:{engine}"]), tmp / "floor.log")
    cluster.urls["floor"] = f"http://127.0.0.1:{floor_port}{path}"
    if llama:
        try:
            ports = await wait_ready(base, token, [LLAMA_MODEL], procs, 300.0)
            cluster.llama_url = f"http://127.0.0.1:{ports[LLAMA_MODEL]}{path}"
        except (TimeoutError, RuntimeError) as err:
            notes.append(f"llama-server part skipped: {err}")
    # The floor listens within a moment; wait for it rather than guess.
    for _ in range(100):
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", floor_port)):
            break
        await asyncio.sleep(0.05)
    return notes


# --- load ----------------------------------------------------------------------------------


@dataclass
class Cell:
    """Every round of one target at one mode and concurrency, added up."""

    requests: int = 0
    errors: int = 0
    events: int = 0
    wall_s: float = 0.0
    gateway_ns: int = 0
    gateway_stat_ns: int = 0
    engine_ns: int = 0
    latencies: list[float] = field(default_factory=list)  # whole answer, s
    firsts: list[float] = field(default_factory=list)  # first event of a stream, s
    # Each round's gateway CPU (ns) and what it served (requests, or a stream's events).
    rounds: list[tuple[int, int]] = field(default_factory=list)
    # Each round's p50, s: time to the first event (a stream) or of the whole answer.
    waits: list[float] = field(default_factory=list)


def body(model: str, stream: bool, **extra) -> bytes:
    return json.dumps({"model": model, "stream": stream, "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Say hello."}],
                       **extra}).encode()


async def one_request(http: aiohttp.ClientSession, url: str, data: bytes, stream: bool,
                      headers: dict[str, str] = HEADERS
                      ) -> tuple[int, float, float | None, int]:
    """(status, seconds, seconds to the first event, events) of one request."""
    start = time.perf_counter()
    first, events = None, 0
    async with http.post(url, data=data, headers=headers) as resp:
        if stream:
            async for chunk in resp.content.iter_any():
                if first is None:
                    first = time.perf_counter() - start
                events += chunk.count(b"data: ")
            events -= 1  # data: [DONE]
        else:
            await resp.read()
        return resp.status, time.perf_counter() - start, first, events


async def run_round(http: aiohttp.ClientSession, url: str, data: bytes, stream: bool,
                    concurrency: int, seconds: float, limit: int, expect_events: int,
                    cell: Cell | None = None, gateway: list[int] = (),
                    engine: list[int] = ()) -> None:
    """``concurrency`` clients in a loop until ``seconds`` or ``limit`` requests; every
    request started is finished before the CPU is read again."""
    issued = 0
    deadline = time.perf_counter() + seconds
    out = cell or Cell()

    async def client() -> None:
        nonlocal issued
        while issued < limit and time.perf_counter() < deadline:
            issued += 1
            try:
                status, took, first, events = await one_request(http, url, data, stream)
            except (aiohttp.ClientError, TimeoutError):
                out.errors += 1
                continue
            if status != 200 or (stream and events != expect_events):
                out.errors += 1
                continue
            out.requests += 1
            out.latencies.append(took)
            if stream:
                out.firsts.append(first)
                out.events += events

    g0, s0, e0 = cpu_ns(gateway), stat_ns(gateway), cpu_ns(engine)
    served = out.events if stream else out.requests
    times = out.firsts if stream else out.latencies
    seen = len(times)
    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    out.wall_s += time.perf_counter() - start
    out.waits.append(statistics.median(times[seen:]) if len(times) > seen else float("nan"))
    used = cpu_ns(gateway) - g0
    out.gateway_ns += used
    out.rounds.append((used, (out.events if stream else out.requests) - served))
    out.gateway_stat_ns += stat_ns(gateway) - s0
    out.engine_ns += cpu_ns(engine) - e0


def rotations(targets: tuple[str, ...], rounds: int) -> Iterator[tuple[str, ...]]:
    """The targets in turn, each round starting one further along."""
    for r in range(rounds):
        k = r % len(targets)
        yield targets[k:] + targets[:k]


async def measure(cluster: Cluster, args: argparse.Namespace
                  ) -> dict[tuple[bool, int, str], Cell]:
    gateways, targets = cluster.gateways(), cluster.targets()
    cells: dict[tuple[bool, int, str], Cell] = {}
    sessions = {t: aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=60),
                                         headers=cluster.headers(t))
                for t in targets}
    try:
        for stream in (False, True):
            data = body(FAKE_MODEL, stream)
            for conc in args.concurrency:
                what = f"{'stream' if stream else 'plain'}, concurrency {conc}"
                console.print(f"measuring {what} ...", style="dim")
                for target in targets:  # warm: connections open, code paths hot
                    await run_round(sessions[target], cluster.url(target), data, stream,
                                    conc, args.warm, args.max_requests, args.events)
                for order in rotations(targets, args.rounds):
                    for target in order:
                        cell = cells.setdefault((stream, conc, target), Cell())
                        await run_round(sessions[target], cluster.url(target), data, stream,
                                        conc, args.round_s, args.max_requests, args.events,
                                        cell, gateways[target], cluster.engines(target))
    finally:
        for session in sessions.values():
            await session.close()
    return cells


async def idle_cpu(cluster: Cluster, seconds: float = 3.0) -> dict[str, float]:
    """µs of CPU per second each gateway uses doing nothing: llmgw's controller passes
    (every 2 s) and the agent's heartbeats (every 3 s) run in the gateway's process."""
    pids = {t: p for t, p in cluster.gateways().items() if p}
    before = {t: cpu_ns(p) for t, p in pids.items()}
    await asyncio.sleep(seconds)
    return {t: (cpu_ns(p) - before[t]) / 1e3 / seconds for t, p in pids.items()}


@dataclass
class Generation:
    rates: list[float] = field(default_factory=list)  # SSE events per second, each
    firsts: list[float] = field(default_factory=list)
    by_round: dict[int, float] = field(default_factory=dict)  # round -> its rate
    # llama-server's own rate of each generation (``timings``: predicted_n / predicted_ms)
    engine_rates: list[float] = field(default_factory=list)
    # round -> the client's time from the first event to the last over the time
    # llama-server says it spent generating (``timings.predicted_ms``)
    stretch_by_round: dict[int, float] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        """The median generation's rate: one stalled by another job on the machine
        moves it less than it would move a sum."""
        return pct(self.rates, 0.5)


@dataclass
class Streamed:
    """One streamed generation of llama-server as the client saw it."""

    status: int
    took: float  # s, the whole request
    first: float | None  # s to the first event
    events: int  # ``data:`` events, [DONE] excepted
    span: float  # s from the first event's read to the last's
    engine_ms: float | None  # llama-server's ``timings.predicted_ms``
    engine_tokens: int | None  # and ``timings.predicted_n``


async def llama_request(http: aiohttp.ClientSession, url: str, data: bytes,
                        headers: dict[str, str]) -> Streamed:
    """A streamed generation, with the ``timings`` llama-server puts in its last event
    (the one with the usage, asked for with ``stream_options.include_usage``)."""
    start = time.perf_counter()
    first = last = None
    events, tail = 0, b""
    async with http.post(url, data=data, headers=headers) as resp:
        async for chunk in resp.content.iter_any():
            now = time.perf_counter()
            if first is None:
                first = now
            n = chunk.count(b"data: ")
            if n:
                events += n
                if b"[DONE]" not in chunk or n > 1:
                    last = now  # the read that brought the last event before [DONE]
            tail = (tail + chunk)[-4096:]
        status = resp.status
    took = time.perf_counter() - start
    engine_ms = engine_tokens = None
    at = tail.rfind(b'"timings"')
    begins = tail.rfind(b"data: ", 0, at) if at >= 0 else -1
    if begins >= 0:
        line = tail[begins + 6:].split(b"\n", 1)[0]
        with contextlib.suppress(ValueError, KeyError, TypeError):
            timings = json.loads(line)["timings"]
            engine_ms, engine_tokens = float(timings["predicted_ms"]), int(timings["predicted_n"])
    return Streamed(status, took, None if first is None else first - start,
                    events - 1, (last or start) - (first or start), engine_ms, engine_tokens)


async def measure_llama(cluster: Cluster, rounds: int, tokens: int
                        ) -> dict[str, Generation]:
    """One streamed generation of ``tokens`` tokens per target per round, in turn."""
    urls = {"direct": cluster.llama_url, "llmgw": cluster.urls["llmgw"]}
    headers = {"direct": HEADERS, "llmgw": {**HEADERS, **cluster.llmgw_headers}}
    data = body(LLAMA_MODEL, True, max_tokens=tokens, temperature=0, seed=1,
                ignore_eos=True, stream_options={"include_usage": True},
                messages=[{"role": "user", "content": "Tell a long story about a cat."}])
    out = {t: Generation() for t in urls}
    console.print("measuring llama-server tokens/s ...", style="dim")
    # A new connection per generation: llama-server closes an idle kept-alive one, which
    # the client would find only by failing on it. Both targets pay the same connect.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120),
                                     connector=aiohttp.TCPConnector(force_close=True)) as http:
        for target, url in urls.items():  # warm: the prompt is in llama-server's cache
            await llama_request(http, url, data, headers[target])
        for r, order in enumerate(rotations(tuple(urls), rounds)):
            for target in order:
                try:
                    got = await llama_request(http, urls[target], data, headers[target])
                except (aiohttp.ClientError, TimeoutError):
                    continue
                if got.status != 200 or got.first is None:
                    continue
                gen, rate = out[target], got.events / got.took
                gen.rates.append(rate)
                gen.firsts.append(got.first)
                gen.by_round[r] = rate
                if got.engine_ms and got.engine_tokens and got.span > 0:
                    gen.engine_rates.append(got.engine_tokens / got.engine_ms * 1e3)
                    gen.stretch_by_round[r] = got.span * 1e3 / got.engine_ms
    return out


def paired_generations(gens: dict[str, Generation]) -> list[float]:
    """Each round's tokens/s through llmgw over direct's in the same round: llama-server's
    own speed wanders by a sixth within a minute on a shared machine (36-53 tokens/s seen
    in one run), in streaks of seconds, which two generations one after the other mostly
    share."""
    direct, llmgw = gens["direct"].by_round, gens["llmgw"].by_round
    return [rate / direct[r] for r, rate in llmgw.items() if r in direct]


def paired_delivery(gens: dict[str, Generation]) -> list[float]:
    """Each round's tokens/s through llmgw over direct's, each generation's rate taken
    against llama-server's own for it: direct's stretch (the client's time from the first
    event to the last over the time llama-server spent generating) over llmgw's. The
    engine's speed, which moves both terms of a stretch alike, drops out; what a gateway
    on the way adds to the time tokens take to arrive stays in."""
    direct, llmgw = gens["direct"].stretch_by_round, gens["llmgw"].stretch_by_round
    return [direct[r] / stretch for r, stretch in llmgw.items() if r in direct]


# --- the report ----------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _us(ns: float, n: int) -> float:
    return ns / 1e3 / n if n else float("nan")


def cpu_per(cell: Cell, stream: bool) -> float:
    """The gateway's µs per request, or per event for a stream."""
    return _us(cell.gateway_ns, cell.events if stream else cell.requests)


def paired_ratios(cell: Cell, floor: Cell) -> list[float]:
    """Each round's gateway CPU per request (or event) over the floor's in the same
    round."""
    return [(used / n) / (floor_used / floor_n)
            for (used, n), (floor_used, floor_n) in zip(cell.rounds, floor.rounds, strict=True)
            if n and floor_n and floor_used]


def paired_ratio(cell: Cell, floor: Cell) -> float:
    """The median of ``paired_ratios``. Each round runs the targets one after the other,
    so a round that a busy machine slowed slows both: one slow round moves the median
    little, where it moves the ratio of all rounds added up as much as its share of the
    time."""
    ratios = paired_ratios(cell, floor)
    return statistics.median(ratios) if ratios else float("nan")


def paired_added(cell: Cell, direct: Cell) -> list[float]:
    """Each round's p50 latency (or time to first event) less direct's in the same round,
    in ms: on these machines the hypervisor takes the CPU away for seconds at a time (the
    steal time the run's notes give), and a round it hits moves both figures, and the
    median of the rounds little."""
    return [(ours - theirs) * 1e3
            for ours, theirs in zip(cell.waits, direct.waits, strict=True)
            if not math.isnan(ours - theirs)]


def middle_half(ratios: list[float], digits: int = 2) -> str:
    """Where the middle half of the rounds' ratios lie (their quartiles): how far one run's
    median may be trusted on this machine."""
    if len(ratios) < 4:
        return "too few rounds for a spread"
    low, _, high = statistics.quantiles(ratios, n=4, method="inclusive")
    return f"the middle half of the rounds {low:.{digits}f}-{high:.{digits}f}"


def table(cells: dict[tuple[bool, int, str], Cell], stream: bool,
          concurrency: list[int], targets: tuple[str, ...] = TARGETS) -> Table:
    if stream:
        title = "streams: CPU per event, time to first event (TTFT)"
        columns = ("target", "conc", "streams", "events/s", "gateway\nµs/event",
                   "gateway\nµs/stream", "engine\nµs/stream", "TTFT\np50 ms", "TTFT\np99 ms",
                   "added\nTTFT ms", "CPU /\nfloor", "per round\n(median)")
    else:
        title = "plain JSON: CPU per request, latency"
        columns = ("target", "conc", "requests", "req/s", "gateway\nµs/req", "engine\nµs/req",
                   "p50 ms", "p99 ms", "added\np50 ms", "CPU /\nfloor", "per round\n(median)")
    out = Table(title=title)
    for name in columns:
        out.add_column(name, justify="left" if name == "target" else "right")
    for conc in concurrency:
        direct = cells[(stream, conc, "direct")]
        floor = cells[(stream, conc, "floor")]
        for target in targets:
            cell = cells[(stream, conc, target)]
            times = cell.firsts if stream else cell.latencies
            added = "-" if target == "direct" else _ms(
                pct(times, 0.5) - pct(direct.firsts if stream else direct.latencies, 0.5))
            gateway = "-" if target == "direct" else f"{cpu_per(cell, stream):.1f}"
            floor_cpu = cpu_per(floor, stream)
            ratio = "-" if target == "direct" or not floor_cpu else \
                f"{cpu_per(cell, stream) / floor_cpu:.2f}"
            paired = "-" if target == "direct" else f"{paired_ratio(cell, floor):.2f}"
            count = f"{cell.requests}" + (f" ({cell.errors} err)" if cell.errors else "")
            rate = (cell.events if stream else cell.requests) / cell.wall_s
            row = [target, f"{conc}", count, f"{rate:.0f}", gateway]
            if stream:
                per_stream = _us(cell.gateway_ns, cell.requests)
                row.append("-" if target == "direct" else f"{per_stream:.0f}")
            row += [f"{_us(cell.engine_ns, cell.requests):.1f}", _ms(pct(times, 0.5)),
                    _ms(pct(times, 0.99)), added, ratio, paired]
            out.add_row(*row, end_section=target == targets[-1])
    return out


def llama_table(gens: dict[str, Generation], tokens: int) -> Table:
    out = Table(title=f"llama-server (SmolLM2-135M, 1 thread): {tokens} tokens per "
                      "streamed generation")
    for name in ("target", "generations", "tokens/s\n(median)", "min-max", "/ direct",
                 "per round\n(median)", "llama-server's\nown tokens/s", "against its\n"
                 "own, per round", "TTFT p50 ms"):
        out.add_column(name, justify="left" if name == "target" else "right")
    ratios, delivered = paired_generations(gens), paired_delivery(gens)
    for target, gen in gens.items():
        direct = target == "direct"
        out.add_row(target, f"{len(gen.rates)}", f"{gen.rate:.1f}",
                    f"{min(gen.rates, default=0):.0f}-{max(gen.rates, default=0):.0f}",
                    "-" if direct else f"{gen.rate / gens['direct'].rate:.3f}",
                    "-" if direct or not ratios else f"{statistics.median(ratios):.3f}",
                    f"{pct(gen.engine_rates, 0.5):.1f}" if gen.engine_rates else "-",
                    "-" if direct or not delivered else f"{statistics.median(delivered):.3f}",
                    _ms(pct(gen.firsts, 0.5)))
    return out


def verdicts(cells: dict[tuple[bool, int, str], Cell], concurrency: list[int],
             gens: dict[str, Generation] | None) -> list[tuple[str, str, bool]]:
    """(what, measured, within target) for each of the issue's targets."""
    out = []
    for conc in (c for c in concurrency if c >= 16):
        for stream, limit, unit in ((False, CPU_PER_REQUEST_US, "request"),
                                    (True, CPU_PER_EVENT_US, "event")):
            cell, floor = cells[(stream, conc, "llmgw")], cells[(stream, conc, "floor")]
            cpu, floor_cpu = cpu_per(cell, stream), cpu_per(floor, stream)
            out.append((f"llmgw CPU per {unit}, concurrency {conc}: <= {limit:g} µs",
                        f"{cpu:.1f} µs (floor {floor_cpu:.1f})", cpu <= limit))
            ratio = limit / ISSUE_FLOOR_US[unit]
            paired = paired_ratio(cell, floor)
            out.append((f"  the same against this run's floor: <= {ratio:.2f} x floor "
                        f"({limit:g} / the issue's floor of {ISSUE_FLOOR_US[unit]:g} µs)",
                        f"{paired:.2f} x floor, the median of {len(cell.rounds)} rounds "
                        f"({middle_half(paired_ratios(cell, floor))}; all rounds together "
                        f"{cpu / floor_cpu:.2f} x)", paired <= ratio))
    if 1 in concurrency:
        for stream, limit, what in ((False, ADDED_P50_MS, "added p50 latency"),
                                    (True, ADDED_TTFT_MS, "added time to first token")):
            direct, cell = cells[(stream, 1, "direct")], cells[(stream, 1, "llmgw")]
            key = "firsts" if stream else "latencies"
            overall = (pct(getattr(cell, key), 0.5) - pct(getattr(direct, key), 0.5)) * 1e3
            added = paired_added(cell, direct)
            median = statistics.median(added) if added else overall
            out.append((f"llmgw {what}, concurrency 1: <= {limit:g} ms",
                        f"{median:.2f} ms, the median of {len(added)} rounds' own "
                        f"({middle_half(added)}; all rounds together {overall:.2f} ms)",
                        median <= limit))
    if gens:
        ratios, delivered = paired_generations(gens), paired_delivery(gens)
        paired = statistics.median(ratios) if ratios else float("nan")
        apart = gens["llmgw"].rate / gens["direct"].rate
        what = f"llama-server tokens/s through llmgw: >= {TOKENS_RATIO:g} of direct"
        raw = (f"{paired:.3f} as the client saw them, the median of {len(ratios)} rounds "
               f"({middle_half(ratios, 3)}; the ratio of the two targets' medians "
               f"{apart:.3f})")
        if delivered:
            # The verdict: each generation against llama-server's own time for it.
            median = statistics.median(delivered)
            engine = (pct(gens["llmgw"].engine_rates, 0.5)
                      / pct(gens["direct"].engine_rates, 0.5))
            # Tokens cannot reach a client faster than the engine makes them: a stretch
            # well under direct's means they came bunched (buffered), which fails too.
            bunched = median > 2 - TOKENS_RATIO
            out.append((what, f"{median:.3f}, each generation against llama-server's own "
                        f"time for it, the median of {len(delivered)} rounds "
                        f"({middle_half(delivered, 4)}); {raw}; llama-server itself ran "
                        f"{engine:.3f} as fast in llmgw's generations"
                        + ("; over 1.01: the tokens came bunched, not as made" if bunched
                           else ""), median >= TOKENS_RATIO and not bunched))
        else:
            out.append((what, raw + "; llama-server gave no timings", paired >= TOKENS_RATIO))
    return out


def granian_lines(cells: dict[tuple[bool, int, str], Cell], concurrency: list[int]
                  ) -> list[str]:
    """Each mode and concurrency: CPU per request (or event) of llmgw on granian and on
    uvicorn as the median of the rounds' ratios to the floor, and their added p50 (or time
    to first event) as the median of the rounds' own against direct."""
    out = []
    for stream in (False, True):
        unit, latency = ("event", "TTFT") if stream else ("request", "p50")
        for conc in concurrency:
            floor, direct = cells[(stream, conc, "floor")], cells[(stream, conc, "direct")]
            figures = []
            for target in ("llmgw", GRANIAN):
                cell = cells[(stream, conc, target)]
                added = paired_added(cell, direct)
                figures.append(f"{target} {paired_ratio(cell, floor):.2f} x floor, added "
                               f"{latency} {statistics.median(added) if added else math.nan:.2f}"
                               " ms")
            out.append(f"CPU per {unit}, concurrency {conc}: " + "; ".join(figures))
    return out


def observed_lines(cells: dict[tuple[bool, int, str], Cell], concurrency: list[int]
                   ) -> list[str]:
    """Each mode and concurrency: what the observed target's server spent per request
    (or event) more than llmgw's, as the median of the rounds' ratios and in µs."""
    out = []
    for stream in (False, True):
        unit = "event" if stream else "request"
        for conc in concurrency:
            plain, observed = cells[(stream, conc, "llmgw")], cells[(stream, conc, OBSERVED)]
            ratios = paired_ratios(observed, plain)
            median = statistics.median(ratios) if ratios else math.nan
            added = cpu_per(observed, stream) - cpu_per(plain, stream)
            per_request = (_us(observed.gateway_ns, observed.requests)
                           - _us(plain.gateway_ns, plain.requests))
            out.append(f"CPU per {unit}, concurrency {conc}: {median:.3f} x llmgw's, the "
                       f"median of {len(ratios)} rounds ({middle_half(ratios, 3)}); "
                       f"{added:+.1f} µs per {unit}"
                       + (f", {per_request:+.1f} µs per stream" if stream else ""))
    return out


class Sink:
    """An OTLP/HTTP receiver that answers every export with an empty success and keeps
    nothing: where the observed server's spans go. A thread of this process, idle but for
    an export every few seconds."""

    def __init__(self) -> None:
        self.exports = 0
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                sink.exports += 1
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def observe_settings(what: str, ratio: float, sink: Sink) -> dict:
    """The observed server's ``tracing`` and ``logging`` settings for ``--observe``."""
    out: dict = {}
    if what in ("tracing", "both"):
        out["tracing"] = cfg.Tracing(endpoint=sink.endpoint, sample_ratio=ratio)
    if what in ("access-log", "both"):
        out["logging"] = cfg.Logging(access="json")
    return out


# --- main ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace, notes: list[str]) -> None:
    llama = None if args.no_llama else llama_files()
    if llama is None and not args.no_llama:
        notes.append("no llama.cpp and SmolLM2 in llmgw's cache (`llmgw up` puts them "
                     "there): the llama-server part was skipped")
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-bench-"))
    cluster = Cluster(tmp)
    sink = Sink() if args.observe else None
    ok = False
    try:
        console.print("starting llmgw server, agent, fake engine and floor proxy ...",
                      style="dim")
        starts = [start(cluster, args.events, args.gap_ms, llama, not args.no_key)]
        if not args.no_granian:
            cluster.granian = Cluster(tmp / "granian")
            starts.append(start(cluster.granian, args.events, args.gap_ms, None,
                                not args.no_key, http_server="granian", floor=False))
        if sink is not None:
            cluster.observed = Cluster(tmp / "observed")
            starts.append(start(cluster.observed, args.events, args.gap_ms, None,
                                not args.no_key, floor=False, observe=observe_settings(
                                    args.observe, args.trace_ratio, sink)))
        for started in await asyncio.gather(*starts):
            notes += started
        if args.no_key:
            notes.append("llmgw ran without API keys (--no-key)")
        idle = await idle_cpu(cluster)
        steal_before, ticks_before = cpu_ticks()
        cells = await measure(cluster, args)
        steal_after, ticks_after = cpu_ticks()
        if ticks_after > ticks_before:
            stolen = (steal_after - steal_before) / (ticks_after - ticks_before)
            notes.append(f"the hypervisor took {100 * stolen:.1f} % of this machine's CPU "
                         "time while the load ran (steal, /proc/stat)")
        # Again once the load is over and settled (the clients' connections closed, the
        # last usage written): the first reading may still hold the server's start.
        await asyncio.sleep(IDLE_SETTLE_S)
        idle_after = await idle_cpu(cluster)
        gens = None
        if cluster.llama_url:
            gens = await measure_llama(cluster, args.llama_rounds, args.tokens)
        targets = cluster.targets()
        console.print(table(cells, False, args.concurrency, targets))
        console.print(table(cells, True, args.concurrency, targets))
        if cluster.granian:
            console.print("llmgw: on uvicorn (the default); granian: llmgw on granian "
                          "(listen.server: granian), a cluster of its own", style="dim")
        if gens:
            console.print(llama_table(gens, args.tokens))
        console.print("[bold]targets[/] (informational)")
        for what, measured, within in verdicts(cells, args.concurrency, gens):
            mark = "[green]pass[/]" if within else "[red]FAIL[/]"
            console.print(f"  {mark}  {what}: {measured}")
        if cluster.granian:
            console.print("[bold]granian against llmgw on uvicorn[/] (no target: "
                          "docs/gateway.md, \"The HTTP server\")")
            for line in granian_lines(cells, args.concurrency):
                console.print(f"  {line}")
        if sink is not None:
            what = {"tracing": f"tracing on (sample_ratio {args.trace_ratio:g})",
                    "access-log": "the access log on (logging.access: json)",
                    "both": f"tracing on (sample_ratio {args.trace_ratio:g}) and the "
                            "access log"}[args.observe]
            console.print(f"[bold]observed against llmgw[/]: {what}; the sink took "
                          f"{sink.exports} exports")
            for line in observed_lines(cells, args.concurrency):
                console.print(f"  {line}")
        notes.append("idle CPU, µs per second, just after start: " + ", ".join(
            f"{t} {v:.0f}" for t, v in idle.items()) + "; once the load was over: " + ", ".join(
            f"{t} {v:.0f}" for t, v in idle_after.items()))
        for key, cell in cells.items():
            # schedstat misses threads that exited during a round; stat counts them.
            if cell.gateway_stat_ns > cell.gateway_ns * 1.15 + 30e6:
                notes.append(f"{key[2]} {'stream' if key[0] else 'plain'} conc {key[1]}: "
                             f"utime+stime says {cell.gateway_stat_ns / 1e6:.0f} ms, "
                             f"schedstat {cell.gateway_ns / 1e6:.0f} ms")
        ok = True
    finally:
        cluster.stop()
        if sink is not None:
            sink.close()
        if ok and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            console.print(f"logs and configs kept in {tmp}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a short run (under a minute): 2 rounds of 1 s, concurrency 1,16")
    parser.add_argument("--concurrency", default=None,
                        help="concurrency levels, comma-separated (default 1,16,64; "
                             "--quick 1,16)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds per target and cell (default 3; --quick 2)")
    parser.add_argument("--round-s", type=float, default=None,
                        help="seconds per round (default 2; --quick 1)")
    parser.add_argument("--max-requests", type=int, default=50_000,
                        help="requests per round at most (default %(default)s)")
    parser.add_argument("--events", type=int, default=64,
                        help="SSE events per stream (default %(default)s)")
    parser.add_argument("--gap-ms", type=float, default=1.0,
                        help="ms between two events of a stream (default %(default)s)")
    parser.add_argument("--tokens", type=int, default=64,
                        help="tokens per llama-server generation (default %(default)s)")
    parser.add_argument("--llama-rounds", type=int, default=None,
                        help="llama-server generations per target (default 20; --quick 4)")
    parser.add_argument("--no-llama", action="store_true", help="skip the llama-server part")
    parser.add_argument("--no-granian", action="store_true",
                        help="leave out llmgw on granian (listen.server: granian) and its "
                             "cluster")
    parser.add_argument("--no-key", action="store_true",
                        help="llmgw with auth.require_api_key false and no key sent (by "
                             "default every request to llmgw carries an API key, as in "
                             "any deployment)")
    parser.add_argument("--observe", choices=("tracing", "access-log", "both"),
                        help="add the observed target: llmgw (a cluster of its own) with "
                             "tracing on, to a sink that keeps nothing, or the access log "
                             "on, or both")
    parser.add_argument("--trace-ratio", type=float, default=1.0,
                        help="the observed server's tracing.sample_ratio (default "
                             "%(default)s)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary directory (configs and logs)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.concurrency = [int(c) for c in (args.concurrency or ("1,16" if quick else "1,16,64"))
                        .split(",")]
    args.rounds = args.rounds or (2 if quick else 3)
    args.round_s = args.round_s or (1.0 if quick else 2.0)
    args.llama_rounds = args.llama_rounds or (4 if quick else 20)
    args.warm = min(0.25, args.round_s / 4)
    start = time.perf_counter()
    load_before = os.getloadavg()[0]
    notes: list[str] = []
    try:
        asyncio.run(run(args, notes))
    except (RuntimeError, TimeoutError) as err:
        console.print(f"[red]bench.gateway: {err}[/]")
    for note in notes:
        console.print(f"note: {note}")
    console.print(f"{os.cpu_count()} CPUs, Python {sys.version.split()[0]}, aiohttp "
                  f"{aiohttp.__version__}; load average {load_before:.1f} before, "
                  f"{os.getloadavg()[0]:.1f} after; total {time.perf_counter() - start:.0f} s",
                  style="dim")
    return 0


if __name__ == "__main__":
    sys.exit(main())
