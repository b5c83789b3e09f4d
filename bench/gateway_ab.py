"""Two llmgw servers side by side: the working tree against an earlier commit, in one run.

On a shared machine the CPU a request costs drifts by 10 % and more between runs minutes
apart, so two ``bench.gateway`` runs cannot tell a 5 % change. This runs both in the same
minutes instead: the commit's tree (checked out with ``git worktree`` into a temporary
directory) and the working tree each get their own cluster from ``bench.gateway`` (server,
agent, fake engine; an API key without limits), then the same load goes to one and the
other in turn, the order swapped each round. Per round it reads each server's CPU per
request (or per streamed event) and the p50 time to the first event (or to the whole
answer), and prints the medians, the median of the per-round CPU ratios, working tree
over commit, and of the per-round latency differences. Running a commit against itself
shows the noise.

    .venv/bin/python -m bench.gateway_ab HEAD~3 --mode plain --concurrency 16 --rounds 12

Nothing is asserted; it exits 0 whatever it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import aiohttp
from rich.table import Table

from bench import gateway
from bench.gateway import FAKE_MODEL, Cell, Cluster, body, console, run_round, start

ROOT = Path(__file__).resolve().parent.parent


@contextlib.contextmanager
def worktree(rev: str):
    """A checkout of ``rev`` in a temporary directory, removed afterwards."""
    where = Path(tempfile.mkdtemp(prefix="llmgw-ab-")) / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(where),
                    rev], check=True)
    try:
        yield where
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                       check=False)
        shutil.rmtree(where.parent, ignore_errors=True)


async def cluster_at(tree: Path | None) -> Cluster:
    """A bench cluster whose server and agent run llmgw from ``tree`` (None: this one):
    ``python -m llmgw`` imports the package from its working directory first."""
    spawn = gateway.spawn

    def spawn_in(argv: list[str], log: Path) -> subprocess.Popen:
        if tree is None or argv[1:3] != ["-m", "llmgw"]:
            return spawn(argv, log)
        out = open(log, "ab")  # noqa: SIM115 - the child keeps it
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=tree)

    cluster = Cluster(Path(tempfile.mkdtemp(prefix="llmgw-ab-")))
    gateway.spawn = spawn_in
    try:
        await start(cluster, 64, 1.0, None)
    except BaseException:
        cluster.stop()
        raise
    finally:
        gateway.spawn = spawn
    return cluster


async def run(args: argparse.Namespace) -> None:
    stream = args.mode == "stream"
    clusters: dict[str, Cluster] = {}
    with worktree(args.rev) as tree:
        try:
            console.print(f"starting llmgw at {args.rev} and at the working tree ...",
                          style="dim")
            clusters[args.rev] = await cluster_at(tree)
            clusters["working tree"] = await cluster_at(None)
            per: dict[str, list[float]] = {name: [] for name in clusters}
            # Each round's p50 time to the first event (a stream) or to the whole answer.
            waits: dict[str, list[float]] = {name: [] for name in clusters}
            data = body(FAKE_MODEL, stream)
            sessions = {name: aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0), headers=c.llmgw_headers,
                timeout=aiohttp.ClientTimeout(total=60)) for name, c in clusters.items()}
            try:
                for name, c in clusters.items():  # warm
                    await run_round(sessions[name], c.urls["llmgw"], data, stream,
                                    args.concurrency, 1.0, args.max_requests, 64)
                names = list(clusters)
                for r in range(args.rounds):
                    for name in names if r % 2 == 0 else names[::-1]:
                        c, cell = clusters[name], Cell()
                        await run_round(sessions[name], c.urls["llmgw"], data, stream,
                                        args.concurrency, args.round_s, args.max_requests,
                                        64, cell, c.gateways()["llmgw"])
                        unit = cell.events if stream else cell.requests
                        per[name].append(cell.gateway_ns / 1e3 / max(unit, 1))
                        waits[name].append(cell.waits[-1] * 1e3)  # run_round's p50
            finally:
                for session in sessions.values():
                    await session.close()
        finally:
            for c in clusters.values():
                c.stop()
    old, new = per[args.rev], per["working tree"]
    ratios = [n / o for o, n in zip(old, new, strict=True)]
    # Latency is compared as a difference: what one tree adds over the other, in ms.
    gaps = [n - o for o, n in zip(waits[args.rev], waits["working tree"], strict=True)]
    unit = "event" if stream else "request"
    wait = "time to first event" if stream else "latency"
    out = Table(title=f"{args.mode}, concurrency {args.concurrency}, {args.rounds} rounds "
                      f"of {args.round_s:g} s each")
    for column in ("", f"CPU µs per {unit} (median)", "min", "max",
                   f"{wait}, ms: p50 (median of rounds)", "min", "max"):
        out.add_column(column, justify="right" if column else "left")
    for name, values in ((args.rev, old), ("working tree", new)):
        out.add_row(name, f"{statistics.median(values):.1f}", f"{min(values):.1f}",
                    f"{max(values):.1f}", f"{statistics.median(waits[name]):.3f}",
                    f"{min(waits[name]):.3f}", f"{max(waits[name]):.3f}")
    out.add_row("working tree / rev, per round (latency: working tree - rev)",
                f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f}",
                f"{max(ratios):.3f}", f"{statistics.median(gaps):+.3f}",
                f"{min(gaps):+.3f}", f"{max(gaps):+.3f}")
    console.print(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.gateway_ab",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the commit to compare the working tree with")
    parser.add_argument("--mode", choices=("plain", "stream"), default="plain")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--round-s", type=float, default=1.5)
    parser.add_argument("--max-requests", type=int, default=50_000)
    args = parser.parse_args(argv)
    try:
        asyncio.run(run(args))
    except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as err:
        console.print(f"[red]bench.gateway_ab: {err}[/]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
