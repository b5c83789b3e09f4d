"""What the gateway executes per request, counted instead of timed: machine instructions
(valgrind's callgrind) or Python bytecodes per function, for llmgw and the floor under the
same load.

On a shared machine a request's CPU time moves by 10 % and more between runs, and even
side by side (``bench.gateway_ab``) a change of a few per cent takes dozens of rounds to
see. Counts do not move with the machine's load: the same requests give the same counts
within a per cent, so a small change shows in one run, and the bytecode table says where
it is. They are not what the issue's targets are in: a bytecode run on a busy machine
costs several times what it costs in a tight loop (bench/README.md has the figures), so
read a count as where time may go, and confirm with ``bench.gateway_ab``.

The cluster is ``bench.gateway``'s (server, agent, fake engine, floor), with the server
and the floor started under the counter, counting off. Each target is warmed, then counted
over ``--requests`` requests at ``--concurrency`` (streamed: ``--events`` events
``--gap-ms`` apart, far enough apart under valgrind that each event is a read of its own;
or ``--plain``). So that the window holds requests only: llmgw's usage is flushed once an
hour instead of once a second and its API keys are read again once an hour, and with
``--instructions`` what llmgw's process does when idle for as long as the window lasted
is counted too and taken off.

    .venv/bin/python -m bench.gateway_counts --bytecodes
    .venv/bin/python -m bench.gateway_counts --instructions      # needs valgrind
    .venv/bin/python -m bench.gateway_counts --instructions --split 4

``--split K`` counts a second cluster too, whose streams are K times as long, and splits
a stream's count into its request's (once a stream) and each event's.

Nothing is asserted; it prints tables and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
from rich.table import Table

from bench.gateway import FAKE_MODEL, HEADERS, Cluster, body, console, one_request, start

ROOT = Path(__file__).resolve().parent.parent
# The first argument of a process counted with --bytecodes: where it writes them.
_TO = "--bytecodes-to="
# What the usage recorder and the key cache wait between passes in a counted server.
_QUIET_S = 3600.0


# --- inside a counted process ----------------------------------------------------------------


class _Bytecodes:
    """Counts the bytecodes each function runs, from SIGUSR1 to SIGUSR2 (then written as
    JSON to ``out``): ``sys.settrace`` with opcode events, which slows the process tenfold
    and more but counts the same either way."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.ops: dict = {}
        self.calls: dict = {}
        signal.signal(signal.SIGUSR1, self.on)
        signal.signal(signal.SIGUSR2, self.off)

    def _op(self, frame, event, arg):
        if event == "opcode":
            code = frame.f_code
            self.ops[code] = self.ops.get(code, 0) + 1
        return self._op

    def _call(self, frame, event, arg):
        if event != "call":
            return None
        frame.f_trace_opcodes = True
        self.calls[frame.f_code] = self.calls.get(frame.f_code, 0) + 1
        return self._op

    def on(self, *_) -> None:
        self.ops, self.calls = {}, {}
        sys.settrace(self._call)

    def off(self, *_) -> None:
        sys.settrace(None)
        rows = [[c.co_filename, c.co_firstlineno, c.co_name, n, self.calls.get(c, 0)]
                for c, n in self.ops.items()]
        self.out.write_text(json.dumps(rows))


def _counted(argv: list[str]) -> list[str]:
    """``argv`` without its leading ``--bytecodes-to=PATH``, counting if it had one."""
    if argv[:1] and argv[0].startswith(_TO):
        _Bytecodes(Path(argv[0][len(_TO):]))
        return argv[1:]
    return argv


def _serve(argv: list[str]) -> int:
    """``llmgw`` with ``argv``, its usage flushed once an hour, not once a second."""
    from llmgw.cli.main import main
    from llmgw.server.openai import usage

    usage.UsageRecorder.__init__.__defaults__ = (_QUIET_S,)
    return main(_counted(argv))


def _floor(argv: list[str]) -> int:
    """The floor proxy with ``argv``."""
    sys.path.insert(0, str(ROOT / "bench"))
    import fake_engine

    return fake_engine.main(_counted(argv))


# --- the run ---------------------------------------------------------------------------------


def _launcher(how: str, out: Path):
    """bench.gateway's ``launch``: the server and the floor through this module, under
    callgrind with counting off (--instructions) or with the bytecode counter."""

    def launch(role: str, argv: list[str]) -> list[str]:
        # The server: python -m llmgw server ...; the floor: python fake_engine.py proxy ...
        rest = argv[3:] if role == "server" else argv[2:]
        argv = [sys.executable, "-m", "bench.gateway_counts",
                "--serve" if role == "server" else "--floor"]
        if how == "instructions":
            return ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                    "--dump-instr=no", f"--callgrind-out-file={out}/{role}.%p", *argv, *rest]
        return [*argv, f"{_TO}{out / role}.json", *rest]

    return launch


async def _load(http: aiohttp.ClientSession, url: str, requests: int, concurrency: int,
                stream: bool, events: int, headers: dict[str, str]) -> int:
    """``requests`` requests, ``concurrency`` at a time; the number answered in full."""
    data = body(FAKE_MODEL, stream)
    sent = good = 0

    async def client() -> None:
        nonlocal sent, good
        while sent < requests:
            sent += 1
            status, _, _, got = await one_request(http, url, data, stream,
                                                  {**HEADERS, **headers})
            good += status == 200 and (got == events or not stream)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return good


def _callgrind(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, capture_output=True)


def _last_dump(out: Path, role: str, pid: int) -> Path:
    """callgrind's latest dump of the process: ROLE.PID.N, N counting up."""
    return max(out.glob(f"{role}.{pid}.*"), key=lambda dump: int(dump.suffix[1:]))


async def _listening(url: str, timeout_s: float) -> None:
    """Once something accepts connections where ``url`` points: the floor under callgrind
    takes longer to start than the server is waited for."""
    where = urlsplit(url)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection(where.hostname, where.port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
            continue
        writer.close()
        await writer.wait_closed()
        return


def _instructions(dump: Path) -> int:
    for line in dump.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dump}")


async def _count(cluster: Cluster, args: argparse.Namespace, out: Path
                 ) -> dict[str, tuple[int, float, list]]:
    """Per target: requests answered in full, what was counted per request, and (bytecodes)
    the rows per function."""
    stream = not args.plain
    pids = {"floor": cluster.procs["floor"].pid, "llmgw": cluster.procs["server"].pid}
    counted: dict[str, tuple[int, float, list]] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=300)) as http:
        for target in ("floor", "llmgw"):
            pid, headers = pids[target], cluster.llmgw_headers if target == "llmgw" else {}
            role = "server" if target == "llmgw" else "floor"
            console.print(f"counting {target} ...", style="dim")
            await _listening(cluster.urls[target], 600.0)
            await _load(http, cluster.urls[target], 2 * args.concurrency, args.concurrency,
                        stream, args.events, headers)
            if args.how == "instructions":
                _callgrind("-i", "on", str(pid))
                began = time.monotonic()
                good = await _load(http, cluster.urls[target], args.requests,
                                   args.concurrency, stream, args.events, headers)
                took = time.monotonic() - began
                _callgrind("-d", "load", str(pid))
                total = _instructions(_last_dump(out, role, pid))
                if target == "llmgw":
                    _callgrind("-z", str(pid))
                    await asyncio.sleep(took)
                    _callgrind("-d", "idle", str(pid))
                    total -= _instructions(_last_dump(out, role, pid))
                _callgrind("-i", "off", str(pid))
                counted[target] = (good, total / max(good, 1), [])
            else:
                os.kill(pid, signal.SIGUSR1)
                await asyncio.sleep(0.2)
                good = await _load(http, cluster.urls[target], args.requests,
                                   args.concurrency, stream, args.events, headers)
                os.kill(pid, signal.SIGUSR2)
                dump = out / f"{role}.json"
                for _ in range(100):
                    if dump.exists() and dump.stat().st_size:
                        break
                    await asyncio.sleep(0.05)
                rows = json.loads(dump.read_text())
                counted[target] = (good, sum(r[3] for r in rows) / max(good, 1), rows)
    return counted


def _tables(counted: dict[str, tuple[int, float, list]], args: argparse.Namespace) -> None:
    unit = "instructions" if args.how == "instructions" else "bytecodes"
    stream = not args.plain
    what = (f"streams of {args.events} events, {args.gap_ms:g} ms apart" if stream
            else "plain requests")
    table = Table(title=f"{unit} per request: {what}, concurrency {args.concurrency}")
    for column in ("target", "requests", f"{unit}\nper request",
                   *((f"{unit}\nper event",) if stream else ()), "/ floor"):
        table.add_column(column, justify="left" if column == "target" else "right")
    floor = counted["floor"][1]
    for target, (good, per, _) in counted.items():
        table.add_row(target, str(good), f"{per:,.0f}",
                      *((f"{per / args.events:,.0f}",) if stream else ()),
                      f"{per / floor:.2f}")
    console.print(table)
    if args.how != "bytecodes":
        return
    good, _, rows = counted["llmgw"]
    top = Table(title=f"llmgw: the {args.top} functions that run the most bytecodes "
                      "per request")
    for column in ("bytecodes\nper request", "calls\nper request", "function", "where"):
        top.add_column(column, justify="right" if "request" in column else "left")
    site = str(ROOT) + "/"
    for filename, line, name, ops, calls in sorted(rows, key=lambda r: -r[3])[:args.top]:
        where = filename.replace(site, "").split("site-packages/")[-1]
        top.add_row(f"{ops / good:,.1f}", f"{calls / good:,.2f}", name, f"{where}:{line}")
    console.print(top)


def _split_table(short: dict[str, tuple[int, float, list]],
                 long: dict[str, tuple[int, float, list]], args: argparse.Namespace,
                 events: tuple[int, int]) -> None:
    """What a stream costs split in two, from its cost at two lengths: each event's (the
    relay), and the request's own (everything else)."""
    unit = "instructions" if args.how == "instructions" else "bytecodes"
    table = Table(title=f"{unit} split: a stream = its request + each event "
                        f"(from streams of {events[0]} and {events[1]} events)")
    for column in ("target", f"{unit}\nper request", "/ floor", f"{unit}\nper event",
                   "/ floor", "request\nin events"):
        table.add_column(column, justify="left" if column == "target" else "right")
    split = {}
    for target in ("floor", "llmgw"):
        per_event = (long[target][1] - short[target][1]) / (events[1] - events[0])
        split[target] = (short[target][1] - events[0] * per_event, per_event)
    floor_request, floor_event = split["floor"]
    for target, (request, event) in split.items():
        table.add_row(target, f"{request:,.0f}", f"{request / floor_request:.2f}",
                      f"{event:,.0f}", f"{event / floor_event:.2f}",
                      f"{request / event:.1f}")
    console.print(table)
    short_of = [f"{target} at {length} events: {counted[target][0]} of {args.requests}"
                for length, counted in zip(events, (short, long), strict=True)
                for target in ("floor", "llmgw") if counted[target][0] < args.requests]
    if short_of:
        console.print("not every stream was answered in full, so the split is off: "
                      + "; ".join(short_of), style="yellow")


async def _counted_at(args: argparse.Namespace, events: int
                      ) -> dict[str, tuple[int, float, list]]:
    """A cluster whose engine streams ``events`` events (``args.events``: what a stream
    answered in full has), counted."""
    out = Path(tempfile.mkdtemp(prefix="llmgw-counts-"))
    cluster = Cluster(out / "cluster")
    cluster.tmp.mkdir()
    try:
        console.print(f"starting the cluster ({events} events a stream), the server and "
                      "the floor counted ...", style="dim")
        await start(cluster, events, args.gap_ms, None, not args.no_key,
                    launch=_launcher(args.how, out), key_cache_s=_QUIET_S, ready_s=600.0)
        return await _count(cluster, args, out)
    finally:
        cluster.stop()
        shutil.rmtree(out, ignore_errors=True)


async def run(args: argparse.Namespace) -> None:
    counted = await _counted_at(args, args.events)
    _tables(counted, args)
    if args.split:
        longer = argparse.Namespace(**{**vars(args), "events": args.split * args.events})
        _split_table(counted, await _counted_at(longer, longer.events), args,
                     (args.events, longer.events))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve"]:
        return _serve(argv[1:])
    if argv[:1] == ["--floor"]:
        return _floor(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_counts",
                                     description=__doc__.split("\n\n")[0])
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--bytecodes", dest="how", action="store_const", const="bytecodes",
                     help="Python bytecodes per function (the default)")
    how.add_argument("--instructions", dest="how", action="store_const",
                     const="instructions", help="machine instructions (needs valgrind)")
    parser.add_argument("--requests", type=int, default=48,
                        help="requests counted per target (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="requests at a time (default %(default)s)")
    parser.add_argument("--plain", action="store_true", help="plain requests, not streams")
    parser.add_argument("--events", type=int, default=64,
                        help="SSE events per stream (default %(default)s)")
    parser.add_argument("--gap-ms", type=float, default=10.0,
                        help="ms between two events of a stream (default %(default)s)")
    parser.add_argument("--split", type=int, default=0, metavar="K",
                        help="count streams K times longer too (a second cluster), and split "
                        "a stream's cost into its request's and each event's")
    parser.add_argument("--no-key", action="store_true",
                        help="llmgw with auth.require_api_key false and no key sent")
    parser.add_argument("--top", type=int, default=30,
                        help="functions in the bytecode table (default %(default)s)")
    args = parser.parse_args(argv)
    args.how = args.how or "bytecodes"
    if args.split and (args.plain or args.split < 2):
        parser.error("--split needs streams (not --plain) and K of 2 or more")
    if args.how == "instructions" and not (shutil.which("valgrind")
                                           and shutil.which("callgrind_control")):
        parser.error("--instructions needs valgrind and callgrind_control on PATH "
                     "(Debian: apt install valgrind)")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
