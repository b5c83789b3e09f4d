"""How big the cluster page's pages are, and how long the server takes to answer them, for
a large cluster; each beside the JSON the admin API answers for the same data.

One real server app (``llmgw.server.app.build``) in this process, on SQLite in a temporary
directory, its lifespan running (it leads, its controller plans), filled at realistic
sizes through its own parts: nodes registered with the controller as the agent stream
registers them (8 H100s each, vector extensions, two weights directories, engines, RDMA
ports; a few lost, behind, without AVX2 or with a failed install), models added over
``POST /api/models`` and placed by the controller's own pass (their shards then reported
ready), one model that fits nowhere, API keys with a usage row per key, model and day,
and an admin signed in with a session. Each page and its baseline is then asked for
through the ASGI app itself (no socket, no HTTP client), in turn, ``--repeats`` times:
the answer's size, and the median wall time and CPU time of the process (the event
loop's thread and SQLite's) of the request. Nothing is asserted. Run it with
``.venv/bin/python -m bench.ui_pages`` (``--help`` for options).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import gzip
import io
import json
import logging
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from litestar.types import ASGIApp
from rich.console import Console
from rich.table import Table

import llmgw
from llmgw import wire
from llmgw.config import Controller, EngineRelease, NodeTimeouts, ServerConfig
from llmgw.core.catalog import Catalog
from llmgw.core.reconcile import Place
from llmgw.core.replicas import ReplicaState
from llmgw.server.app import Server, build
from llmgw.server.auth.sessions import COOKIE, open_session
from llmgw.store import AccountRecord, ApiKeyRecord, Store, UsageEntry, open_store, sqlite_url

ADMIN_TOKEN = "bench-admin-token"
BUDGET_S = 120.0
REPEATS = 7
PAGE_LIMIT_KB = 100  # issue 38: each page under 100 KB
# --profile: pages whose CPU is over this many times their baseline's, or over this long
PROFILE_OVER = 5.0
PROFILE_OVER_MS = 100.0

H100 = "NVIDIA H100 80GB HBM3"
H100_MIB = 81_559
AVX512 = ["avx", "avx2", "avx512_vnni", "avx512bw", "avx512f", "avx512vl", "f16c", "fma"]
NO_AVX2 = ["avx", "f16c"]  # an old CPU, or a VM given a generic CPU model
LLAMA_FAILED = ("failed: sha256 of llama-b11434-bin-ubuntu-vulkan-x64.tar.gz is 3f9c…, "
                "SHA256SUMS says 9a1e…; the mirror may be part-way through a sync")
LLAMA_INSTALLING = "installing: downloading llama-b11434-bin-ubuntu-x64.tar.gz (7.0 MB)"

# (name stem, gpus, nodes, replicas, engine): shapes of the catalog, cycled to --models;
# 40 models take 872 of 200 nodes' 1,600 GPUs.
SHAPES = (
    ("chat-8b", 1, 1, 24, "vllm"),
    ("code-14b", 1, 1, 16, "vllm"),
    ("chat-32b", 2, 1, 12, "vllm"),
    ("vision-32b", 2, 1, 8, "vllm"),
    ("chat-70b", 4, 1, 8, "vllm"),
    ("embed-small", 0, 1, 12, "llama.cpp"),
    ("chat-235b", 8, 1, 4, "vllm"),
    ("chat-405b", 8, 2, 2, "vllm"),
)
UNPLACEABLE = "org/chat-671b-fp16"  # wants more GPU memory than an H100 has: refused by all

console = Console()
if not console.is_terminal:  # a file or a pipe: wide enough for the table on one line
    console.width = 160


# --- the cluster --------------------------------------------------------------------------


def node_id(i: int) -> str:
    return f"gpu-{i:04d}"


def register(i: int, nodes: int, weights_keys: list[str]) -> wire.Register:
    """Node ``i`` as its agent registers it: a DGX-class machine; every 50th has no AVX2,
    every 40th failed to install llama.cpp, every 30th is installing it, every 25th runs
    an older llmgw."""
    engines = [wire.Engine("vllm", "0.11.0"), wire.Engine("sim")]
    if i % 40 == 7:
        engines.append(wire.Engine("llama.cpp", "b11434", "failed", LLAMA_FAILED))
    elif i % 30 == 11:
        engines.append(wire.Engine("llama.cpp", "b11434", "installing", LLAMA_INSTALLING))
    else:
        engines.append(wire.Engine("llama.cpp", "b11434"))
    local = weights_keys[i % len(weights_keys):][:6] if weights_keys else []
    inventory = wire.Inventory(
        hostname=f"{node_id(i)}.dc1.example.net", os="ubuntu 24.04", os_like="debian",
        kernel="6.8.0-52-generic", arch="x86_64",
        cpu_model="AMD EPYC 9654 96-Core Processor", cpu_count=192,
        cpu_flags=NO_AVX2 if i % 50 == 13 else AVX512,
        ram_total_mib=2_063_731, ram_available_mib=1_900_000,
        gpus=[wire.Gpu(g, H100, H100_MIB, H100_MIB - 512, uuid=f"GPU-{i:04x}{g:04x}-bench",
                       pci_bus_id=f"00000000:{0x18 + g * 0x10:02X}:00.0") for g in range(8)],
        gpu_driver="570.124.06", cuda="12.8", engines=engines,
        fabric="ib-a" if i < nodes // 2 else "ib-b",
        labels={"rack": f"r{i // 16:02d}", "zone": "dc1-a" if i % 2 else "dc1-b"},
        weights=weights_keys,  # local ones, and the filer's (every model)
        weights_dirs=[
            wire.WeightsDir("/var/lib/llmgw/weights", total_mib=7_153_664,
                            free_mib=5_100_000, held=local),
            wire.WeightsDir("/mnt/models", shared=True, total_mib=512 * 2**20,
                            free_mib=301 * 2**20, held=weights_keys,
                            note="nfs4 filer01:/models"),
        ],
        rdma=[wire.RdmaPort(f"mlx5_{p}", 1, "ACTIVE", 400.0, "InfiniBand") for p in range(8)],
    )
    return wire.Register(
        node_id=node_id(i), address=f"10.{i // 250}.{i % 250}.1", inventory=inventory,
        agent_version="0.0.1" if i % 25 == 3 else llmgw.__version__,
        installable_engines=["llama.cpp", "vllm", "sglang", "comfyui"])


def heartbeat(i: int, session_gpus: int, busy: dict[str, int]) -> wire.Heartbeat:
    used = busy.get(node_id(i), 0)
    return wire.Heartbeat(
        ram_available_mib=1_700_000,
        gpu_memory_free_mib=[1_024 if g < used else H100_MIB - 512
                             for g in range(session_gpus)],
        weights_free_mib=[5_000_000, 301 * 2**20], sent_at=time.time())


def model_specs(count: int) -> list[dict]:
    """``count`` models as ``POST /api/models`` takes them (the last one placeable
    nowhere)."""
    specs = []
    for n in range(count - 1):
        stem, gpus, nodes, replicas, engine = SHAPES[n % len(SHAPES)]
        name = f"org/{stem}-v{n // len(SHAPES) + 1}"
        profile = {"engine": engine, "gpus": gpus, "nodes": nodes,
                   "source": f"hf://org/{stem}-v{n // len(SHAPES) + 1}",
                   "args": ["--max-model-len", "32768"] if engine == "vllm" else []}
        if engine == "llama.cpp":
            profile["files"] = ["*Q4_K_M.gguf"]
        specs.append({"name": name, "description": f"{stem} for the bench, v{n}",
                      "replicas": replicas, "profiles": [profile]})
    specs.append({"name": UNPLACEABLE, "description": "needs 141 GB GPUs", "replicas": 1,
                  "profiles": [{"engine": "vllm", "gpus": 8,
                                "gpu_memory_mib": 141 * 1024}]})
    return specs


@dataclass
class Cluster:
    server: Server
    cookie: str
    node: str  # a node with replicas
    model: str  # the model with the most replicas
    key: str  # the prefix of a key with limits
    sizes: dict[str, int] = field(default_factory=dict)


async def fill(server: Server, store: Store, args) -> Cluster:
    controller = server.controller
    for spec in model_specs(args.models):
        status, answer = await asgi_request(
            server.asgi, "POST", "/api/models", body=json.dumps(spec).encode(),
            headers=((b"authorization", f"Bearer {ADMIN_TOKEN}".encode()),
                     (b"content-type", b"application/json")))
        if status != 201:
            raise SystemExit(f"POST /api/models {spec['name']}: {status} {answer.decode()}")
    weights_keys = [m.weights_key(p) for m in controller.catalog.models for p in m.profiles]
    now = time.time()
    for i in range(args.nodes):
        await controller.node_registered(register(i, args.nodes, weights_keys), now)
        controller.node_welcomed(node_id(i), now)
    # Passes until one places nothing more (the first ones may wait for nodes to settle).
    for _ in range(10):
        if not any(isinstance(a, Place) for a in (await controller.pass_once()).actions):
            break
    busy: dict[str, int] = {}
    starting = 0
    for n, replica in enumerate(sorted(controller.replicas.values(), key=lambda r: r.id)):
        for shard in replica.shards:
            busy[shard.node_id] = busy.get(shard.node_id, 0) + len(shard.gpus)
        if n % 50 == 17:  # a few still loading their weights
            starting += 1
            continue
        for shard in replica.shards:
            controller.shard_status(shard.node_id, wire.ShardStatus(
                replica=replica.id, rank=shard.rank, epoch=replica.epoch, state="ready",
                port=shard.port), time.time())
    for i in range(args.nodes):
        controller.sessions.heartbeat(node_id(i), heartbeat(i, 8, busy), time.time())
    # Two nodes gone quiet: lost, as the controller words it once their time is up.
    for i in (args.nodes - 1, args.nodes - 2):
        session = controller.sessions.get(node_id(i))
        controller.node_disconnected(session.node_id, session.connection)
        session.live.last_seen = now - 3 * 3600
    await controller.pass_once()
    # The overview's last hour of traffic.
    for minute in range(60):
        server.gateway.usage.recent.add(now - minute * 60, 900 + minute * 7,
                                        1_200_000 + minute * 5_000)
    keys = await fill_keys(store, args, [m.name for m in controller.catalog.models][:-1])
    account = await store.add_account(AccountRecord(
        username="admin", password_hash="unused: signed in by a session made here",
        role="admin", created_at=datetime.now(UTC)))
    token, _ = await open_session(store, account.id, 3600)
    busiest = max(controller.catalog.models, key=lambda m: m.replicas).name
    held = max(controller.sessions.all(),
               key=lambda s: sum(1 for r in controller.replicas.values()
                                 if any(sh.node_id == s.node_id for sh in r.shards)))
    ready = sum(1 for r in controller.replicas.values() if r.state is ReplicaState.READY)
    return Cluster(server, f"{COOKIE}={token}", held.node_id, busiest, keys[0], sizes={
        "nodes": args.nodes, "models": len(controller.catalog.models),
        "replicas": len(controller.replicas), "ready": ready, "starting": starting,
        "keys": args.keys, "usage rows": keys[1]})


async def fill_keys(store: Store, args, models: list[str]) -> tuple[str, int]:
    """``args.keys`` keys of 20 accounts (a few revoked, limited or narrowed to some
    models), each using one to four models a day for ``args.days`` days. Returns the
    prefix of a key in use with limits, and the number of usage rows."""
    now = datetime.now(UTC)
    owners = [await store.add_account(AccountRecord(
        username=f"user{n:02d}", password_hash="unused", role="user",
        created_at=now - timedelta(days=400))) for n in range(20)]
    ids = []
    for k in range(args.keys):
        record = await store.add_api_key(ApiKeyRecord(
            prefix=f"llmgw_bench{k:04d}", secret_hash="unused", name=f"service-{k:03d}",
            allowed_models=models[k % 7:k % 7 + 3] if k % 5 == 0 else None,
            created_at=now - timedelta(days=200 - k % 100),
            revoked_at=now - timedelta(days=k % 30) if k % 23 == 0 else None,
            account_id=owners[k % len(owners)].id))
        if k % 9 == 0:
            await store.update_api_key_limits(record.prefix, rpm=600, tpm=2_000_000,
                                              tokens_per_day=50_000_000)
        ids.append(record.id)
    rows = 0
    for day in range(args.days - 1, -1, -1):
        entries = [UsageEntry(key_id=key_id, model=models[(k + m * 5 + day) % len(models)],
                              requests=50 + (k * 37 + day * 11) % 900,
                              prompt_tokens=40_000 + (k * 7919 + day) % 400_000,
                              completion_tokens=9_000 + (k * 104_729 + day) % 90_000)
                   for k, key_id in enumerate(ids) for m in range(1 + (k + day) % 4)]
        await store.record_usages(entries, now - timedelta(days=day))
        rows += len({(e.key_id, e.model) for e in entries})
    await store.prune_usage_windows(now)
    shown = next((k for k in range(args.keys) if k % 9 == 0 and k % 23), 0)
    return f"llmgw_bench{shown:04d}", rows


# --- asking the app -----------------------------------------------------------------------


async def asgi_request(app: ASGIApp, method: str, target: str, cookie: str = "",
                       body: bytes = b"", headers: tuple[tuple[bytes, bytes], ...] = ()
                       ) -> tuple[int, bytes]:
    """``method target`` (path and query) sent to the ASGI app itself, as an HTTP server
    hands it a request; the status and the whole body of the answer."""
    path, _, query = target.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": method, "scheme": "http", "path": path,
             "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(b"host", b"bench.local"), (b"cookie", cookie.encode()),
                         (b"accept", b"text/html,application/json"),
                         (b"content-length", str(len(body)).encode()), *headers],
             "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8080), "state": {}}
    sent = False
    status, chunks = 0, []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays; the app never asks again
        return {}

    async def send(message: dict) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


async def asgi_get(app: ASGIApp, target: str, cookie: str) -> tuple[int, bytes]:
    return await asgi_request(app, "GET", target, cookie)


@contextlib.asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """The app's lifespan, run on this event loop (its controller, leadership and usage
    tasks beside the requests, as under uvicorn)."""
    events: asyncio.Queue[dict] = asyncio.Queue()
    answers: asyncio.Queue[dict] = asyncio.Queue()
    running = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"},
                                       "state": {}}, events.get, answers.put))
    await events.put({"type": "lifespan.startup"})
    started = await answers.get()
    if started["type"] != "lifespan.startup.complete":
        raise SystemExit(f"the server did not start: {started}")
    try:
        yield
    finally:
        await events.put({"type": "lifespan.shutdown"})
        await answers.get()
        await running


@dataclass
class Target:
    label: str
    path: str
    # (wall, the process's CPU, the event loop thread's CPU), in seconds
    runs: list[tuple[float, float, float]] = field(default_factory=list)
    size: int = 0
    gz: int = 0
    status: int = 0

    def median(self, i: int) -> float:
        return statistics.median(r[i] for r in self.runs) * 1e3


async def timed(app: ASGIApp, target: Target, cookie: str) -> None:
    gc.collect()
    wall, cpu, loop = time.perf_counter(), time.process_time(), time.thread_time()
    status, body = await asgi_get(app, target.path, cookie)
    target.runs.append((time.perf_counter() - wall, time.process_time() - cpu,
                        time.thread_time() - loop))
    if status != 200:
        raise SystemExit(f"GET {target.path}: {status}\n{body[:2000].decode(errors='replace')}")
    target.status, target.size, target.gz = status, len(body), len(gzip.compress(body))


def pairs(cluster: Cluster, days: int) -> list[tuple[Target, Target]]:
    """Each page and the answer that carries the same data without HTML: the API call
    ``llmgw ctl`` makes for it (for all keys' usage, which no API call gives, the page's
    own CSV download)."""
    model = cluster.model
    return [
        (Target("overview", "/ui/"), Target("", "/api/status")),
        (Target("nodes", "/ui/nodes"), Target("", "/api/status")),
        (Target("a node", f"/ui/nodes/{cluster.node}"), Target("", "/api/nodes")),
        (Target("models", "/ui/models"), Target("", "/api/models")),
        (Target("a model", f"/ui/models/{model}"), Target("", "/api/models")),
        (Target("unplaced model", f"/ui/models/{UNPLACEABLE}"), Target("", "/api/models")),
        (Target("keys (admin)", "/ui/keys"), Target("", "/api/keys")),
        (Target("a key", f"/ui/keys/{cluster.key}"),
         Target("", f"/api/keys/{cluster.key}/usage")),
        (Target(f"usage, {days} days", f"/ui/usage?days={days}"),
         Target("", f"/ui/usage.csv?days={days}")),
    ]


async def measure(cluster: Cluster, args) -> list[tuple[Target, Target]]:
    app = cluster.server.asgi
    measured = pairs(cluster, args.days)
    for page, api in measured:  # warm: templates compiled, statements prepared
        await asgi_get(app, page.path, cluster.cookie)
        await asgi_get(app, api.path, cluster.cookie)
    deadline = time.perf_counter() + args.budget
    for _ in range(args.repeats):
        if measured[0][0].runs and time.perf_counter() > deadline:
            console.print(f"note: budget of {args.budget:g} s spent; figures from "
                          f"{len(measured[0][0].runs)} run(s)")
            break
        for page, api in measured:  # in turn, so the machine's drift hits both alike
            await timed(app, page, cluster.cookie)
            await timed(app, api, cluster.cookie)
    return measured


def table(measured: list[tuple[Target, Target]], cluster: Cluster) -> Table:
    sizes = ", ".join(f"{v:,} {k}" for k, v in cluster.sizes.items())
    out = Table(title=f"cluster page against the API ({sizes}); median ms of "
                      f"{len(measured[0][0].runs)} runs; CPU: the process's, loop: the "
                      "event loop thread's")
    for column in ("page", "KB", "gz KB", "ms", "CPU ms", "loop ms", "baseline", "KB", "ms",
                   "CPU ms", "loop ms", "CPU page/API", "KB page/API"):
        out.add_column(column, justify="left" if column in ("page", "baseline") else "right")
    for page, api in measured:
        over = page.size / 1024 > PAGE_LIMIT_KB
        out.add_row(
            f"{page.label}\n[dim]{page.path}[/dim]",
            f"[bold red]{page.size / 1024:.1f}[/]" if over else f"{page.size / 1024:.1f}",
            f"{page.gz / 1024:.1f}", f"{page.median(0):.1f}", f"{page.median(1):.1f}",
            f"{page.median(2):.1f}", api.path, f"{api.size / 1024:.1f}", f"{api.median(0):.1f}",
            f"{api.median(1):.1f}", f"{api.median(2):.1f}",
            f"{page.median(1) / api.median(1):.2f}", f"{page.size / api.size:.2f}")
    return out


async def profile(cluster: Cluster, measured: list[tuple[Target, Target]], runs: int) -> None:
    """cProfile of each page whose CPU is over PROFILE_OVER times its baseline's or over
    PROFILE_OVER_MS: where the time goes, by cumulative time."""
    for page, api in measured:
        if (page.median(1) / api.median(1) <= PROFILE_OVER
                and page.median(1) <= PROFILE_OVER_MS):
            continue
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(runs):
            await asgi_get(cluster.server.asgi, page.path, cluster.cookie)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(30)
        console.rule(f"{page.path}: {runs} requests, by cumulative time")
        console.print(text.getvalue().split("\n\n", 1)[-1].rstrip(), markup=False,
                      highlight=False)


async def save(cluster: Cluster, measured: list[tuple[Target, Target]], folder: Path) -> None:
    """Each page's HTML in ``folder``, to look at what was measured."""
    folder.mkdir(parents=True, exist_ok=True)
    for page, _ in measured:
        _, body = await asgi_get(cluster.server.asgi, page.path, cluster.cookie)
        name = page.path.strip("/").replace("/", "_").replace("?", "_") or "ui"
        (folder / f"{name}.html").write_bytes(body)
    console.print(f"pages saved in {folder}")


async def run(args) -> None:
    began = time.perf_counter()
    # Not the server's words on what the bench does to it (lost nodes, replicas on them
    # that its health check cannot reach).
    logging.getLogger("llmgw").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-ui-") as tmp:
        store = await open_store(sqlite_url(Path(tmp) / "llmgw.db"))
        config = ServerConfig(
            state_dir=tmp, engines={"llama.cpp": EngineRelease(), "vllm": EngineRelease()},
            # Nobody heartbeats in the bench: nodes stay ready until the bench says not.
            nodes=NodeTimeouts(unreachable_after_s=3_600, lost_after_s=7_200),
            # Passes only when woken, so none lands in a timed request by the clock.
            controller=Controller(interval_s=3_600))
        server = build(config, store, Catalog(), ADMIN_TOKEN)
        try:
            async with lifespan(server.asgi):
                fill_began = time.perf_counter()
                cluster = await fill(server, store, args)
                filled = time.perf_counter() - fill_began
                measured = await measure(cluster, args)
                console.print(table(measured, cluster))
                big = [p.label for p, _ in measured if p.size / 1024 > PAGE_LIMIT_KB]
                console.print(f"pages over {PAGE_LIMIT_KB} KB: {', '.join(big) or 'none'}")
                if args.save:
                    await save(cluster, measured, Path(args.save))
                if args.profile:
                    await profile(cluster, measured, args.profile)
        finally:
            await store.close()
    console.print(f"Python {sys.version.split()[0]}; filled in {filled:.1f} s; "
                  f"total {time.perf_counter() - began:.1f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ui_pages",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=200, help="(default %(default)s)")
    parser.add_argument("--models", type=int, default=40, help="(default %(default)s)")
    parser.add_argument("--keys", type=int, default=300, help="(default %(default)s)")
    parser.add_argument("--days", type=int, default=90,
                        help="days of usage stored, and the usage page's period "
                             "(default %(default)s)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="requests timed per page and baseline (default %(default)s)")
    parser.add_argument("--budget", type=float, default=BUDGET_S,
                        help="seconds of timing, after which no new round starts "
                             "(default %(default)s)")
    parser.add_argument("--profile", type=int, nargs="?", const=5, default=0, metavar="N",
                        help=f"profile N requests (5) of each page over {PROFILE_OVER:g}x "
                             f"its baseline's CPU or over {PROFILE_OVER_MS:g} ms")
    parser.add_argument("--save", metavar="DIR", help="write each page's HTML into DIR")
    args = parser.parse_args(argv)
    if args.nodes < 4 or args.models < 2 or args.keys < 1 or not 1 <= args.days <= 366:
        parser.error("needs at least 4 nodes, 2 models, 1 key, and 1 to 366 days")
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
