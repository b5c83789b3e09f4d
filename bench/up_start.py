"""How long ``llmgw up --engine sim`` takes to its banner and to its first answer, and where
the time goes.

Each run spawns ``llmgw up --engine sim --state-dir DIR --port FREE`` exactly as a person
would, and measures from the spawn: the banner ("llmgw is up") on its output, then the first
chat completion answered through the official ``openai`` client with the key the banner
shows. The same run is broken into phases from what the processes themselves record: the
server's and agent's start times (from the OS, while the run is under way) and the
timestamps of their log lines (server listening, agent registered, replica placed, engine
started, replica ready).

Runs come in two kinds: ``fresh`` (a new state directory, as on a first ``llmgw up``: the
store is created, keys and tokens made) and ``again`` (the state directory of the previous
run, as every later ``llmgw up``). One unmeasured run first warms the page cache and the
bytecode, so the figures are "warm". Then ``python -X importtime`` of the server's and the
agent's entry points lists the heaviest imports.

    .venv/bin/python -m bench.up_start                  # 5 runs of each kind
    .venv/bin/python -m bench.up_start --runs 3 --budget 60 --no-importtime

Nothing is asserted: it prints a table of medians and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import psutil
from rich.console import Console
from rich.table import Table

console = Console(width=110) if not sys.stdout.isatty() else Console()
BANNER = "llmgw is up"
# Log lines that mark a phase's end: (phase, log file, pattern).
LOG_MARKS = [
    ("server listening", "server.log", r"serving on "),
    ("agent registered", "agent.log", r"registered with "),
    ("replica placed", "server.log", r"replica \S+ of \S+: placed on"),
    ("engine started", "agent.log", r"started llmgw-shard-"),
    ("replica ready", "server.log", r"-> ready"),
]
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


@dataclass
class Run:
    kind: str
    # Seconds from the spawn of `llmgw up` to each mark; a mark not seen is missing.
    marks: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_times(path: Path) -> list[tuple[float, str]]:
    """(epoch seconds, line) for each timestamped line of a log (local time, as logging
    writes it)."""
    out = []
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        m = LOG_TIME.match(line)
        if m:
            stamp = datetime.strptime(m[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append((stamp, line))
    return out


def _child_start(up: psutil.Process, role: str, seen: dict[str, float]) -> None:
    """Note when `up` spawned its ``role`` child (``python -m llmgw server|agent``)."""
    if role in seen:
        return
    try:
        for child in up.children():
            cmd = child.cmdline()
            if len(cmd) > 3 and cmd[1:4] == ["-m", "llmgw", role]:
                seen[role] = child.create_time()
    except psutil.Error:
        pass


async def first_answer(base: str, key: str, model: str, deadline: float) -> None:
    """Poll with the official client until one chat completion comes back."""
    from openai import AsyncOpenAI, OpenAIError

    client = AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=10)
    try:
        while True:
            try:
                await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": "Hello"}])
                return
            except OpenAIError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.01)
    finally:
        await client.close()


def one_run(kind: str, state: Path, timeout_s: float, env: dict[str, str]) -> Run:
    run = Run(kind)
    port = free_port()
    out_path = state.parent / f"{state.name}.out"
    with open(out_path, "wb") as out:
        began_wall, began = time.time(), time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "up", "--engine", "sim", "--state-dir", str(state),
             "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, env=env)
    up = psutil.Process(proc.pid)
    up_started = up.create_time()
    spawned: dict[str, float] = {}
    deadline = began + timeout_s
    try:
        while BANNER not in out_path.read_text(errors="replace"):
            _child_start(up, "server", spawned)
            _child_start(up, "agent", spawned)
            if proc.poll() is not None or time.monotonic() > deadline:
                run.error = (f"exited with code {proc.returncode}" if proc.poll() is not None
                             else "no banner in time")
                return run
            time.sleep(0.005)
        run.marks["banner"] = time.monotonic() - began
        text = out_path.read_text(errors="replace")
        key = re.search(r"API key\s+(\S+)", text)[1]
        model = re.search(r'"model":"([^"]+)"', text)[1]
        asyncio.run(first_answer(f"http://127.0.0.1:{port}", key, model, deadline))
        run.marks["first answer"] = time.monotonic() - began
    except Exception as err:  # a run that fails says why, and the bench goes on
        run.error = f"{type(err).__name__}: {err}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # The OS gives start times from a boot time rounded to the second: measured against
    # `up`'s own start, which this process knows, the rounding cancels out.
    for role, at in spawned.items():
        run.marks[f"{role} spawned"] = at - up_started
    logs = state / "logs"
    for phase, log, pattern in LOG_MARKS:
        # The first matching line written by this run (an `again` run's logs go on).
        hit = next((t for t, line in _log_times(logs / log)
                    if t >= began_wall - 0.01 and re.search(pattern, line)), None)
        if hit is not None:
            run.marks[phase] = hit - began_wall
    return run


PHASES = [  # (row, from mark, to mark)
    ("up: import, store, key → server spawned", None, "server spawned"),
    ("server: import, store, start → listening", "server spawned", "server listening"),
    # The agent is spawned with the server; its own start overlaps the server's.
    ("agent: import, start, dial → registered", "server spawned", "agent registered"),
    ("  of which after the server listened", "server listening", "agent registered"),
    ("server: registered → replica placed", "agent registered", "replica placed"),
    ("agent: placed → engine started", "replica placed", "engine started"),
    ("engine: started → replica ready", "engine started", "replica ready"),
    ("up: sees it ready → banner", "replica ready", "banner"),
    ("client: banner → first answer", "banner", "first answer"),
    ("total: spawn → banner", None, "banner"),
    ("total: spawn → first answer", None, "first answer"),
]


def _median(runs: list[Run], start: str | None, end: str) -> str:
    spans = [r.marks[end] - (r.marks[start] if start else 0.0) for r in runs
             if end in r.marks and (start is None or start in r.marks)]
    return f"{statistics.median(spans):.2f}" if spans else "-"


def table(runs: list[Run]) -> Table:
    kinds = [k for k in ("fresh", "again") if any(r.kind == k and not r.error for r in runs)]
    t = Table(title="llmgw up --engine sim: seconds (median of the runs that answered)")
    t.add_column("phase")
    for kind in kinds:
        n = sum(r.kind == kind and not r.error for r in runs)
        t.add_column(f"{kind} (n={n})", justify="right")
    for row, start, end in PHASES:
        t.add_row(row, *(_median([r for r in runs if r.kind == k and not r.error], start, end)
                         for k in kinds))
    return t


def importtime(module: str, top: int, env: dict[str, str]) -> tuple[float, list[tuple[float, str]]]:
    """Wall seconds to import ``module`` in a new interpreter, and the heaviest packages it
    pulls in: each outside llmgw imported first from llmgw's own modules, by cumulative
    time summed per top-level package (llmgw's own modules' self time as "llmgw")."""
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"],
                          capture_output=True, text=True, check=False, env=env)
    wall = time.monotonic() - began
    rows = []
    for line in done.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)", line)
        if m:
            rows.append((int(m[1]) / 1e6, int(m[2]) / 1e6, len(m[3]) // 2, m[4]))
    by_package: dict[str, float] = {}
    ancestors: list[tuple[int, str]] = []
    # Parents are printed after their children: read backwards, the stack is the chain.
    for own, cum, depth, name in reversed(rows):
        while ancestors and ancestors[-1][0] >= depth:
            ancestors.pop()
        inside_llmgw = all(a.split(".")[0] == "llmgw" for _, a in ancestors)
        package = name.split(".")[0]
        if inside_llmgw and package == "llmgw":
            by_package["llmgw"] = by_package.get("llmgw", 0.0) + own
        elif inside_llmgw:
            by_package[package] = by_package.get(package, 0.0) + cum
        ancestors.append((depth, name))
    heavy = sorted(((s, name) for name, s in by_package.items()), reverse=True)[:top]
    return wall, heavy


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="measured runs of each kind (5)")
    p.add_argument("--budget", type=float, default=180.0,
                   help="seconds for all runs; no run starts after it (180)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds one run may take (60)")
    p.add_argument("--no-bytecode", action="store_true",
                   help="keep PYTHONDONTWRITEBYTECODE if set: every start compiles llmgw")
    p.add_argument("--no-importtime", action="store_true", help="skip the import breakdown")
    p.add_argument("--top", type=int, default=8, help="heaviest imports listed (8)")
    args = p.parse_args(argv)

    env = {**os.environ, "COLUMNS": "200"}
    if not args.no_bytecode:
        # As an installed llmgw runs: its modules' bytecode cached, not compiled each start.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    console.print("bytecode cache: " + ("off (PYTHONDONTWRITEBYTECODE)"
                                        if env.get("PYTHONDONTWRITEBYTECODE") else "on"))
    until = time.monotonic() + args.budget
    tmp = Path(tempfile.mkdtemp(prefix="llmgw-up-bench-"))
    runs: list[Run] = []
    try:
        warm = one_run("warm-up", tmp / "warm-up", args.timeout, env)
        if warm.error:
            console.print(f"[red]the warm-up run failed: {warm.error}; see {tmp}[/]")
            return 1
        again_dir = tmp / "again"
        one_run("warm-up", again_dir, args.timeout, env)  # the state directory `again` reuses
        for i in range(args.runs):
            for kind in ("fresh", "again"):
                if time.monotonic() > until:
                    console.print(f"[yellow]budget spent after {len(runs)} runs[/]")
                    break
                state = tmp / f"fresh-{i}" if kind == "fresh" else again_dir
                run = one_run(kind, state, args.timeout, env)
                if run.error:
                    console.print(f"[yellow]{kind} run {i + 1}: {run.error}[/]")
                runs.append(run)
        console.print(table(runs))
        if not args.no_importtime:
            for module in ("llmgw.cli.up", "llmgw.server.run", "llmgw.agent.run"):
                wall, heavy = importtime(module, args.top, env)
                console.print(f"\n[bold]import {module}[/]: {wall:.2f} s in a new interpreter; "
                              "heaviest imports (cumulative s):")
                for cum, name in heavy:
                    console.print(f"  {cum:6.3f}  {name}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
