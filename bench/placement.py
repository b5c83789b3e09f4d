"""How long a reconcile pass takes as the cluster grows.

For each size: a cluster of 8x80 GiB GPU nodes in two fabrics, with vllm and sim, and a
catalog that wants two replicas per node (one-, two- and four-GPU models, CPU models and one
two-node model). Two figures per size, each the median of a few runs:

- cold plan: nothing runs yet, so ``plan`` places every wanted replica;
- steady pass: every replica placed and ready, so ``plan`` finds nothing to do (the pass a
  controller runs every few seconds, and the one that must stay cheap).

Growth is shown against the previous size and against n log n (a ratio near or under 1 is
"no worse than n log n"). Nothing is asserted: this prints figures, it does not pass or
fail. Run it with ``.venv/bin/python -m bench.placement`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from llmgw.core.catalog import Catalog, Model, Profile
from llmgw.core.inventory import EngineStatus, Gpu, Node, NodeState
from llmgw.core.names import replica_id
from llmgw.core.reconcile import Place, Plan, plan
from llmgw.core.replicas import Replica, apply_status, new_replica

SIZES = (10, 100, 1000, 5000)
BUDGET_S = 120.0
TARGET_MS = 100.0
TARGET_NODES = 1000

GPU_MIB = 80 * 1024
FABRICS = ("ib-a", "ib-b")
ENGINES = (EngineStatus("vllm", "0.11.0"), EngineStatus("sim"))

# (model, profile, replicas per 10 nodes): 20 replicas per 10 nodes, 40 of their 80 GPUs.
MIX = (
    ("org/chat-8b", Profile("tp1", "vllm", gpus=1), 5),
    ("org/code-14b", Profile("tp1", "vllm", gpus=1, gpu_memory_mib=40 * 1024), 3),
    ("org/chat-32b", Profile("tp2", "vllm", gpus=2), 2),
    ("org/vision-32b", Profile("tp2", "vllm", gpus=2), 2),
    ("org/chat-70b", Profile("tp4", "vllm", gpus=4), 2),
    ("org/embed-small", Profile("cpu", "sim"), 3),
    ("org/rerank-small", Profile("cpu", "sim"), 2),
    ("org/chat-405b", Profile("pp2", "vllm", nodes=2, gpus=8), 1),
)


def cluster(n: int) -> list[Node]:
    """``n`` nodes, the first half on ib-a and the rest on ib-b."""
    gpus = tuple(Gpu(i, "NVIDIA H100 80GB HBM3", GPU_MIB, GPU_MIB - 512) for i in range(8))
    return [
        Node(id=f"node{i:05d}", address=f"10.{i // 250}.{i % 250}.1", state=NodeState.READY,
             gpus=gpus, engines=ENGINES, cpu_flags=frozenset({"avx2"}),
             fabric=FABRICS[i * len(FABRICS) // n])
        for i in range(n)
    ]


def catalog(n: int) -> Catalog:
    return Catalog(tuple(Model(name, (profile,), replicas=per_10 * n // 10)
                         for name, profile, per_10 in MIX))


def wanted(n: int) -> int:
    return sum(per_10 * n // 10 for _, _, per_10 in MIX)


def ready_replicas(cold: Plan, now: float) -> list[Replica]:
    """What the controller would hold once every placed shard has reported ready."""
    replicas = []
    for epoch, action in enumerate((a for a in cold.actions if isinstance(a, Place)), 1):
        placement = action.placement
        replica = new_replica(replica_id(placement.model, epoch), placement, epoch, now)
        for shard in placement.shards:
            replica = apply_status(replica, rank=shard.rank, epoch=epoch, state="ready",
                                   now=now)
        replicas.append(replica)
    return replicas


def timed(fn: Callable[[], Plan], repeats: int, deadline: float) -> tuple[float, int, Plan]:
    """The median of up to ``repeats`` runs (at least one, fewer once past ``deadline``)."""
    runs: list[float] = []
    result = None
    while len(runs) < repeats and (not runs or time.perf_counter() < deadline):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs), len(runs), result


@dataclass
class Row:
    nodes: int
    placed: int
    wanted: int
    cold_s: float
    cold_runs: int
    steady_s: float
    steady_runs: int
    steady_actions: int
    # With --split: the cold plan of the one-node models alone, and of the two-node one.
    single_s: float | None = None
    multi_s: float | None = None


def nlogn(n: int) -> float:
    return n * math.log(n)


def measure(n: int, repeats: int, deadline: float, split: bool = False) -> Row:
    nodes, declared = cluster(n), catalog(n)
    cold_s, cold_runs, cold = timed(lambda: plan(declared, nodes, [], {}, 0.0), repeats,
                                    deadline)
    replicas = ready_replicas(cold, 0.0)
    steady_s, steady_runs, steady = timed(
        lambda: plan(declared, nodes, replicas, {}, 10.0), max(repeats, 5), deadline)
    row = Row(n, len(replicas), wanted(n), cold_s, cold_runs, steady_s, steady_runs,
              len(steady.actions))
    if split:
        for attr, multi in (("single_s", False), ("multi_s", True)):
            part = Catalog(tuple(m for m in declared.models
                                 if (m.profiles[0].nodes > 1) == multi))
            seconds, _, _ = timed(lambda part=part: plan(part, nodes, [], {}, 0.0), repeats,
                                  deadline)
            setattr(row, attr, seconds)
    return row


def predicted_cold_s(rows: list[Row], n: int) -> float:
    """The next cold plan's time, from the growth seen so far (quadratic until two sizes
    have been measured, and never assumed better than linear)."""
    last = rows[-1]
    exponent = 2.0
    if len(rows) >= 2 and rows[-2].cold_s > 0:
        before = rows[-2]
        exponent = math.log(last.cold_s / before.cold_s) / math.log(last.nodes / before.nodes)
    return last.cold_s * (n / last.nodes) ** max(1.0, min(exponent, 2.0))


def growth_cells(rows: list[Row], i: int, value: Callable[[Row], float]) -> tuple[str, str]:
    if i == 0:
        return "-", "-"
    now, before = rows[i], rows[i - 1]
    growth = value(now) / value(before)
    return f"{growth:.1f}x", f"{growth / (nlogn(now.nodes) / nlogn(before.nodes)):.2f}"


def table(rows: list[Row]) -> Table:
    out = Table(title="plan(): cold (place everything) and steady (nothing to do)")
    for name in ("nodes", "replicas\nplaced", "cold plan\nms", "cold\ngrowth",
                 "cold /\nn log n", "steady\npass ms", "steady\ngrowth", "steady /\nn log n"):
        out.add_column(name, justify="right")
    for i, row in enumerate(rows):
        cold_growth, cold_ratio = growth_cells(rows, i, lambda r: r.cold_s)
        steady_growth, steady_ratio = growth_cells(rows, i, lambda r: r.steady_s)
        placed = f"{row.placed}" + (f" of {row.wanted}" if row.placed != row.wanted else "")
        out.add_row(f"{row.nodes}", placed,
                    f"{row.cold_s * 1e3:.1f}" + (" (1 run)" if row.cold_runs == 1 else ""),
                    cold_growth, cold_ratio, f"{row.steady_s * 1e3:.2f}", steady_growth,
                    steady_ratio)
    return out


def split_table(rows: list[Row]) -> Table:
    out = Table(title="cold plan, split: one-node models alone, the two-node model alone")
    for name in ("nodes", "one-node\nms", "growth", "/ n log n", "two-node\nms", "growth",
                 "/ n log n"):
        out.add_column(name, justify="right")
    for i, row in enumerate(rows):
        single = growth_cells(rows, i, lambda r: r.single_s)
        multi = growth_cells(rows, i, lambda r: r.multi_s)
        out.add_row(f"{row.nodes}", f"{row.single_s * 1e3:.1f}", *single,
                    f"{row.multi_s * 1e3:.1f}", *multi)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.placement",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, SIZES)),
                        help="node counts, comma-separated (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per cold figure, median taken (default: %(default)s)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help="seconds for the whole run (default: %(default)s)")
    parser.add_argument("--split", action="store_true",
                        help="also time the one-node models and the two-node model apart "
                             "(about doubles the run)")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    # Wide enough for the table when the output is a pipe or a file, not a terminal.
    console = Console(width=100) if not sys.stdout.isatty() else Console()
    start = time.perf_counter()
    deadline = start + args.budget
    rows: list[Row] = []
    notes: list[str] = []
    for n in sizes:
        if rows:
            guess = predicted_cold_s(rows, n)
            left = deadline - time.perf_counter()
            # One cold run, the replicas built from it and a steady pass: about 1.5 colds.
            if guess * (3.0 if args.split else 1.5) > left:
                notes.append(f"skipped {n} nodes: its cold plan would take about {guess:.0f} s "
                             f"(from the growth so far) and {left:.0f} s of the "
                             f"{args.budget:.0f} s budget are left")
                break
        console.print(f"measuring {n} nodes ...", style="dim")
        rows.append(measure(n, args.repeats, deadline, args.split))
    console.print(table(rows))
    if args.split:
        console.print(split_table(rows))
    for row in rows:
        if row.steady_actions:
            notes.append(f"the {row.nodes}-node steady pass emitted {row.steady_actions} "
                         "actions; it should emit none")
        if row.cold_runs < args.repeats:
            notes.append(f"{row.nodes} nodes: cold figure from {row.cold_runs} run(s), "
                         "the budget allowed no more")
    target = next((r for r in rows if r.nodes == TARGET_NODES), None)
    if target is not None:
        for what, seconds in (("steady pass", target.steady_s), ("cold plan", target.cold_s)):
            ms = seconds * 1e3
            verdict = ("within" if ms <= TARGET_MS
                       else f"{ms / TARGET_MS:.1f}x over")
            console.print(f"{TARGET_NODES} nodes, {what}: {ms:.1f} ms against the "
                          f"{TARGET_MS:.0f} ms target ({verdict})")
    for note in notes:
        console.print(f"note: {note}")
    console.print(f"total {time.perf_counter() - start:.1f} s", style="dim")
    return 0


if __name__ == "__main__":
    sys.exit(main())
