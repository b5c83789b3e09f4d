"""Supervising the shards on this node: launch, readiness, exit, and what to report.

Each shard has one supervising task. It reports ``starting``, waits until the engine's
health endpoint answers (or the process dies, or the profile's startup timeout passes),
reports ``ready``, then waits for the process to exit and reports ``failed`` with the
engine's last lines, unless the control plane asked it to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import sys
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
import psutil
from opentelemetry import trace

from llmgw import engines, wire
from llmgw.agent.client_errors import describe
from llmgw.agent.discovery import gpus, host
from llmgw.agent.runtime.base import Runtime, ShardRecord, ShardStartError
from llmgw.agent.weights import WeightsError, WeightsStore, model_path
from llmgw.config import ShardHealth
from llmgw.core.names import hostport, shard_unit, unbracket
from llmgw.engines.base import gpu_env
from llmgw.tracing import OFF, Tracing, end

log = logging.getLogger(__name__)

Report = Callable[[wire.ShardStatus], None]

_HEALTH_POLL_S = 0.1
# How long after its health check answers a GPU shard may take to show on its GPUs.
_GPU_SETTLE_S = 5.0


class ShardSupervisor:
    def __init__(self, runtime: Runtime, bind_address: str, binaries: dict[str, str],
                 report: Report, weights: WeightsStore | None = None,
                 weights_changed: Callable[[], None] = lambda: None, nvml: Any = None,
                 health: ShardHealth | None = None, tracing: Tracing = OFF):
        self._runtime = runtime
        self._tracing = tracing
        # Each starting shard's span, continuing the control plane's replica start; ended
        # when the shard is ready, fails or is stopped.
        self._spans: dict[str, trace.Span] = {}
        self._health = health or ShardHealth()
        self._nvml = nvml  # pynvml unless a test gives an NVML-shaped fake
        self._weights = weights
        self._weights_changed = weights_changed
        self._facts = engines.NodeFacts(bind_address, sys.executable, binaries)
        self._report = report
        self._tasks: dict[str, asyncio.Task] = {}
        self._records: dict[str, ShardRecord] = {}
        self._preparing: dict[str, ShardRecord] = {}  # fetching weights, starting sidecars
        self._sidecars: dict[str, list[ShardRecord]] = {}  # engine unit -> its sidecars
        self._states: dict[str, wire.ShardState] = {}
        self._stopping: set[str] = set()
        self._stopping_records: dict[str, ShardRecord] = {}
        self._background: set[asyncio.Task] = set()
        self._http: aiohttp.ClientSession | None = None

    def set_bind_address(self, address: str) -> None:
        self._facts = dataclasses.replace(self._facts, bind_address=address)

    def set_binary(self, engine: str, path: str | None) -> None:
        """An engine the agent installed (or no longer has): later shards launch it."""
        binaries = dict(self._facts.binaries)
        if path is None:
            binaries.pop(engine, None)
        else:
            binaries[engine] = path
        self._facts = dataclasses.replace(self._facts, binaries=binaries)

    async def __aenter__(self) -> ShardSupervisor:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2))
        return self

    async def __aexit__(self, *exc) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._http:
            await self._http.close()

    # --- what the stream asks --------------------------------------------------------------

    def running(self) -> list[wire.RunningShard]:
        return [
            wire.RunningShard(
                replica=r.replica, rank=r.rank, world_size=r.world_size, epoch=r.epoch,
                model=r.model, profile=r.profile, engine=r.engine, port=r.port,
                state=self._states.get(unit, "starting"),
            )
            for unit, r in sorted({**self._preparing, **self._records}.items())
        ]

    async def adopt_running(self) -> int:
        """Take over the shards an earlier agent started; none of them is restarted."""
        found = await self._runtime.running()
        for record in found:
            if record.sidecar_of:
                known = self._sidecars.setdefault(record.sidecar_of, [])
                if all(r.unit != record.unit for r in known):
                    known.append(record)
        for record in found:
            if record.unit in self._records or record.sidecar_of:
                continue
            log.info("adopting %s (pid %d) left running by an earlier agent", record.unit,
                     record.pid)
            if self._tracing.enabled:
                end(self._tracing.start(f"adopt {record.unit}", attributes={
                    "llmgw.replica": record.replica, "llmgw.rank": record.rank,
                    "llmgw.engine": record.engine, "llmgw.pid": record.pid}))
            self._records[record.unit] = record
            self._tasks[record.unit] = asyncio.create_task(self._watch(record, adopted=True))
        for unit in set(self._sidecars) - set(self._records):
            # Its engine died while no agent ran: nothing is left for the sidecar to serve.
            log.info("stopping the sidecars of %s, whose engine is gone", unit)
            self._spawn(self._stop_sidecars(unit))
        return len(self._records)

    def start(self, msg: wire.StartShard) -> None:
        unit = shard_unit(msg.replica, msg.rank)
        if unit in self._preparing:
            log.info("already preparing %s; ignoring a second start", unit)
            return
        if unit in self._records:
            known = self._records[unit]
            if known.epoch >= msg.epoch:
                log.info("already running %s (epoch %d); ignoring a start for epoch %d",
                         unit, known.epoch, msg.epoch)
                self._report(self._status(known, self._states.get(unit, "starting")))
                return
        self._tasks[unit] = asyncio.create_task(self._run(unit, msg))

    def stop(self, msg: wire.StopShard) -> None:
        unit = shard_unit(msg.replica, msg.rank)
        record = self._records.get(unit)
        if record is not None and record.epoch > msg.epoch:
            log.info("refusing to stop %s: epoch %d is older than %d", unit, msg.epoch,
                     record.epoch)
            return
        log.info("stopping %s (epoch %d, leader's term %d): %s", unit, msg.epoch, msg.term,
                 msg.reason or "asked by the control plane")
        self._spawn(self._stop(unit, msg))

    async def stop_all(self) -> None:
        units = set(self._records) | set(self._sidecars)
        await asyncio.gather(*(self._stop(u, None) for u in units))

    def _spawn(self, coro) -> None:
        # Keep a reference: the loop holds tasks only weakly.
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- supervision -----------------------------------------------------------------------

    def _status(self, record: ShardRecord, state: wire.ShardState, **extra) -> wire.ShardStatus:
        return wire.ShardStatus(replica=record.replica, rank=record.rank, epoch=record.epoch,
                                state=state, port=record.port, **extra)

    def _set(self, record: ShardRecord, state: wire.ShardState, **extra) -> None:
        self._states[record.unit] = state
        self._report(self._status(record, state, **extra))

    async def _weights_path(self, record: ShardRecord, msg: wire.StartShard) -> str | None:
        """The path the engine loads: the profile's own, else weights held in a weights
        directory, else fetched from the profile's source into one."""
        profile = msg.profile
        if profile.weights or self._weights is None:
            return profile.weights
        key = profile.weights_key or msg.model
        directory = await asyncio.to_thread(self._weights.find, key)
        if directory is None:
            if not profile.source:
                return None
            log.info("%s: fetching %s from %s", record.unit, key, profile.source)

            def progress(text: str) -> None:
                self._set(record, "fetching", detail=text)

            directory = await self._weights.ensure(key, profile.source, list(profile.files),
                                                   msg.model, progress,
                                                   caused_by=self._spans.get(record.unit))
            self._weights_changed()
        return str(model_path(directory, profile.engine))

    async def _run(self, unit: str, msg: wire.StartShard) -> None:
        profile = msg.profile
        record = ShardRecord(
            unit=unit, replica=msg.replica, rank=msg.rank, world_size=msg.world_size,
            epoch=msg.epoch, model=msg.model, profile=profile.name, engine=profile.engine,
            startup_timeout_s=profile.startup_timeout_s, gpus=tuple(msg.gpus),
        )
        # Reported in running() while it prepares (a fetch can take an hour), so that a
        # reconnection in between does not read as a shard gone missing.
        self._preparing[unit] = record
        if self._tracing.enabled:
            self._spans[unit] = self._tracing.start(
                f"start {unit}", parent=self._tracing.context_of(msg.trace), attributes={
                    "llmgw.replica": msg.replica, "llmgw.rank": msg.rank,
                    "llmgw.world_size": msg.world_size, "llmgw.model": msg.model,
                    "llmgw.engine": profile.engine, "llmgw.port": msg.port or 0,
                    "llmgw.gpus": list(msg.gpus)})
        try:
            launched = await self._prepare_and_launch(unit, msg, record)
        finally:
            self._preparing.pop(unit, None)
            if unit not in self._records:
                self._states.pop(unit, None)
        if launched is None:
            self._started(unit, "did not start")
        else:
            self._set(launched, "starting")
            await self._watch(launched, adopted=False)

    async def _prepare_and_launch(self, unit: str, msg: wire.StartShard,
                                  record: ShardRecord) -> ShardRecord | None:
        """Weights, sidecars, then the engine; the launched record, or None (reported)."""
        profile = msg.profile
        span = self._spans.get(unit)
        try:
            with self._tracing.step("weights", span, **{
                    "llmgw.weights_key": profile.weights_key or msg.model}):
                weights = await self._weights_path(record, msg)
        except WeightsError as err:
            self._report(self._status(record, "failed", detail=str(err)))
            self._started(unit, str(err))
            return None
        request = engines.ShardRequest(
            replica=msg.replica, rank=msg.rank, world_size=msg.world_size, model=msg.model,
            args=tuple(profile.args), env=tuple(sorted(profile.env.items())), port=msg.port,
            gpus=tuple(msg.gpus), weights=weights, leader_address=msg.leader_address,
            rendezvous_port=msg.rendezvous_port, peers=tuple(msg.peers),
            embeddings=profile.embeddings, launch_mode=profile.launch_mode,
        )
        try:
            launch = engines.render(profile.engine, request, self._facts)
            record = msgspec.structs.replace(
                record, port=launch.port, health_path=launch.health_path,
                tcp_ready=launch.tcp_ready,
            )
            if launch.port is not None and not host.port_free(self._facts.bind_address,
                                                              launch.port):
                raise ShardStartError(
                    f"port {launch.port} is already in use by another process on this node; "
                    "the control plane will place the shard on another port")
            if profile.sidecars:
                with self._tracing.step("sidecars", span):
                    await self._start_sidecars(record, msg)
            if launch.wait_for:
                self._report(self._status(record, "starting", detail="waiting for "
                                          + ", ".join(launch.wait_for)))
                with self._tracing.step("rendezvous", span,
                                        **{"llmgw.peers": list(launch.wait_for)}):
                    if not await _all_accept(launch.wait_for, profile.startup_timeout_s):
                        raise ShardStartError(
                            f"{', '.join(launch.wait_for)} did not accept connections "
                            f"within {profile.startup_timeout_s:g} s")
            with self._tracing.step("launch", span, **{"llmgw.argv": list(launch.argv)}
                                    ) as step:
                record = await self._runtime.start(record, launch.argv, launch.env)
                step.set_attribute("llmgw.pid", record.pid)
        except (engines.EngineError, ShardStartError) as err:
            await self._stop_sidecars(unit)
            self._report(self._status(record, "failed", detail=str(err)))
            self._started(unit, str(err))
            return None
        log.info("started %s (pid %d), epoch %d, leader's term %d: %s", unit, record.pid,
                 msg.epoch, msg.term, " ".join(launch.argv))
        self._records[unit] = record
        return record

    async def _start_sidecars(self, record: ShardRecord, msg: wire.StartShard) -> None:
        """Start the profile's sidecars, in order, each ready before the next; the engine
        starts only after all of them."""
        for sc in msg.profile.sidecars:
            sidecar = msgspec.structs.replace(
                record, unit=f"{record.unit}-{sc.name}", engine=f"sidecar {sc.name}",
                port=sc.port, health_path=None, tcp_ready=sc.port is not None, gpus=(),
                startup_timeout_s=sc.startup_timeout_s, sidecar_of=record.unit)
            self._report(self._status(record, "starting", detail=f"starting sidecar {sc.name}"))
            if sc.port is not None and not host.port_free("127.0.0.1", sc.port):
                raise ShardStartError(
                    f"sidecar {sc.name}'s port {sc.port} is already in use on this node "
                    "(another shard of this profile, or another program): a sidecar's port "
                    "is fixed, so one shard of the profile per node")
            env = {**gpu_env(tuple(msg.gpus)), **sc.env}
            sidecar = await self._runtime.start(sidecar, tuple(sc.command), env)
            self._sidecars.setdefault(record.unit, []).append(sidecar)
            log.info("started sidecar %s (pid %d): %s", sidecar.unit, sidecar.pid,
                     " ".join(sc.command))
            if sc.port is None:
                continue
            exited = asyncio.create_task(self._runtime.wait_exit(sidecar.unit))
            try:
                ready = await _all_accept((f"127.0.0.1:{sc.port}",), sc.startup_timeout_s,
                                          exited.done)
            finally:
                exited.cancel()
            if not ready:
                why = "exited" if exited.done() and not exited.cancelled() else (
                    f"did not accept connections on 127.0.0.1:{sc.port} within "
                    f"{sc.startup_timeout_s:g} s")
                tail = " | ".join(self._runtime.output_tail(sidecar.unit, 3))
                raise ShardStartError(f"sidecar {sc.name} {why}; its last output: {tail}")

    async def _stop_sidecars(self, unit: str) -> None:
        for sidecar in reversed(self._sidecars.pop(unit, [])):
            await self._runtime.stop(sidecar.unit)

    async def _first_exit(self, record: ShardRecord) -> tuple[str, int | None]:
        """Wait until the engine or one of its sidecars exits: (that unit, exit code)."""
        units = [record.unit, *(s.unit for s in self._sidecars.get(record.unit, []))]
        waits = {asyncio.create_task(self._runtime.wait_exit(u)): u for u in units}
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            first = done.pop()
            return waits[first], first.result()
        finally:
            for task in waits:
                task.cancel()

    async def _watch(self, record: ShardRecord, adopted: bool) -> None:
        startup_timeout_s = record.startup_timeout_s
        exit_task = asyncio.create_task(self._first_exit(record))
        try:
            if adopted and self._watched_address(record) is None:
                # Started (and made ready) by an agent before this one, and still running.
                ready = not exit_task.done()
            else:
                with self._tracing.step("readiness", self._spans.get(record.unit),
                                        **{"llmgw.health": self._health_address(record)}
                                        ) as step:
                    ready = await self._until_ready(record, exit_task, startup_timeout_s)
                    step.set_attribute("llmgw.ready", ready)
            off_gpu = await self._gpus_not_held(record) if ready and not adopted else []
            if off_gpu:
                self._started(record.unit, "runs on the CPU, not on its GPUs")
                self._finish(record, f"answers its health check but holds no memory on GPU "
                             f"{', '.join(map(str, off_gpu))} (of {_indices(record.gpus)}): "
                             "it is running on the CPU; check the engine's CUDA build "
                             "against the driver (llmgw doctor)", None)
                await self._runtime.stop(record.unit)
                return
            why = ""
            self._started(record.unit, None if ready else (
                "exited before it was ready" if exit_task.done()
                else f"not ready after {startup_timeout_s:g} s"))
            if ready:
                self._set(record, "ready")
                unit, code, why = await self._serve(record, exit_task)
            elif exit_task.done():
                unit, code = exit_task.result()
            else:
                self._finish(record, f"not ready after {startup_timeout_s:g} s", None)
                await self._runtime.stop(record.unit)
                return
            how = why or ("exited" if code is None else f"exited with code {code}")
            if unit != record.unit:
                how = f"sidecar {unit.removeprefix(record.unit + '-')} {how}"
            self._finish(record, how, code, tail_of=unit)
        finally:
            exit_task.cancel()

    async def _gpus_not_held(self, record: ShardRecord) -> list[int]:
        """The GPUs given to the shard that none of its processes holds memory on. An
        engine whose CUDA backend fails to load may fall back to the CPU and answer its
        health check all the same (llama.cpp does): ready would be a lie."""
        # Only a single-node shard that serves: a rank that serves nothing is "ready" the
        # moment it runs, long before it loads anything, and a multi-node engine's GPU
        # memory may sit in processes outside this shard's tree (Ray's workers).
        if not record.gpus or record.world_size > 1 or self._health_address(record) is None:
            return []
        missing: list[int] | None = []
        deadline = time.monotonic() + _GPU_SETTLE_S
        while True:
            pids = await asyncio.to_thread(_process_tree, record.pid)
            report = await asyncio.to_thread(gpus.discover_gpus, self._nvml)
            missing = gpus.gpus_not_held(report, record.gpus, pids)
            if missing is None:
                log.info("%s: NVML cannot tell which processes use GPUs %s; not checking",
                         record.unit, _indices(record.gpus))
                return []
            if not missing or time.monotonic() >= deadline:
                return missing
            await asyncio.sleep(_HEALTH_POLL_S * 5)

    def _health_address(self, record: ShardRecord) -> str | None:
        """Where the shard's health is checked; None for a rank that serves nothing."""
        if record.port is None or (record.health_path is None and not record.tcp_ready):
            return None
        return hostport(self._facts.bind_address, record.port)

    def _watched_address(self, record: ShardRecord) -> str | None:
        """Where a shard that has been ready (started so, or adopted) is checked; None to
        watch its process only. A shard ready by a TCP connection (``tcp_ready``, no HTTP)
        is not probed again: llama.cpp's RPC worker serves one client at a time, its
        leader, with a listen backlog of one, so once the leader is connected each probe
        stays in its accept queue; from the third on they time out, and a healthy worker
        would be failed (or, adopted after agent restarts, never ready again)."""
        return None if record.health_path is None else self._health_address(record)

    async def _unhealthy(self, record: ShardRecord, address: str) -> str | None:
        """None when the engine answers its health check, else what it did instead."""
        if record.health_path is None:
            return None if await _accepts(address) else f"{address} refuses connections"
        url = f"http://{address}{record.health_path}"
        try:
            async with self._http.get(url) as resp:
                return None if resp.status == 200 else f"{record.health_path} answered " \
                    f"{resp.status}"
        except (aiohttp.ClientError, TimeoutError) as err:
            return f"{record.health_path}: {describe(err)}"

    async def _until_ready(self, record: ShardRecord, exit_task: asyncio.Task,
                           timeout_s: float) -> bool:
        address = self._health_address(record)
        if address is None:
            # A rank that serves nothing is ready once it runs; its leader decides the rest.
            return not exit_task.done()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not exit_task.done():
            if await self._unhealthy(record, address) is None:
                return True
            await asyncio.wait([exit_task], timeout=_HEALTH_POLL_S)
        return False

    async def _serve(self, record: ShardRecord, exit_task: asyncio.Task
                     ) -> tuple[str, int | None, str]:
        """Watch a ready shard until it exits or stays unhealthy: (unit, code, why). A
        ready engine can stop answering without exiting (a multi-node leader whose worker
        died answers 503): it is reported unhealthy, so the gateway stops sending it
        requests, then failed if it does not recover. A shard with no address to watch
        (``_watched_address``) is watched for its exit only."""
        address = self._watched_address(record)
        failing_since: float | None = None
        while True:
            await asyncio.wait([exit_task], timeout=self._health.every_s)
            if exit_task.done():
                unit, code = exit_task.result()
                return unit, code, ""
            if address is None:
                continue
            why = await self._unhealthy(record, address)
            now = time.monotonic()
            if why is None:
                if failing_since is not None and self._states.get(record.unit) != "ready":
                    log.info("%s answers its health check again", record.unit)
                    self._set(record, "ready")
                failing_since = None
                continue
            failing_since = failing_since if failing_since is not None else now
            if now - failing_since >= self._health.fail_after_s:
                return record.unit, None, (f"its health check failed for "
                                           f"{self._health.fail_after_s:g} s: {why}")
            if now - failing_since >= self._health.unhealthy_after_s and \
                    self._states.get(record.unit) == "ready":
                log.warning("%s fails its health check: %s", record.unit, why)
                self._set(record, "unhealthy", detail=why)

    def _finish(self, record: ShardRecord, how: str, code: int | None,
                tail_of: str | None = None) -> None:
        """Report the shard failed, with the last output of whichever unit ended it."""
        if record.unit in self._stopping or record.unit not in self._records:
            return
        del self._records[record.unit]
        self._states.pop(record.unit, None)
        tail = self._runtime.output_tail(tail_of or record.unit)
        log.warning("%s %s; last output:\n%s", record.unit, how, "\n".join(tail[-5:]))
        self._report(self._status(record, "failed", detail=how, exit_code=code,
                                  output_tail=tail))
        self._spawn(self._stop_units(record.unit))

    async def _stop_units(self, unit: str) -> None:
        """The engine, then its sidecars."""
        await self._runtime.stop(unit)
        await self._stop_sidecars(unit)

    def own_ports(self) -> set[int]:
        """Ports our shards hold, those still stopping included."""
        # Sidecars' ports are not ours to give: reported busy, placement keeps off them.
        records = [*self._records.values(), *self._stopping_records.values()]
        return {r.port for r in records if r.port is not None}

    def _started(self, unit: str, error: str | None) -> None:
        """The shard is ready (``error`` None) or will not be: its start span ends."""
        span = self._spans.pop(unit, None)
        if span is not None:
            end(span, error=error)

    async def _stop(self, unit: str, msg: wire.StopShard | None) -> None:
        reason = (msg.reason if msg is not None else "") or "asked to stop"
        self._started(unit, f"stopped before it was ready: {reason}")
        if not self._tracing.enabled:
            await self._stop_unit(unit, msg)
            return
        parent = self._tracing.context_of(msg.trace) if msg is not None else None
        span = self._tracing.start(f"stop {unit}", parent=parent, attributes={
            "llmgw.unit": unit, "llmgw.reason": reason})
        try:
            await self._stop_unit(unit, msg)
        finally:
            end(span)

    async def _stop_unit(self, unit: str, msg: wire.StopShard | None) -> None:
        self._stopping.add(unit)
        record = self._records.pop(unit, None) or self._preparing.get(unit)
        if record is not None:
            self._stopping_records[unit] = record
        task = self._tasks.pop(unit, None)
        try:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await self._stop_units(unit)
        finally:
            self._stopping.discard(unit)
            self._stopping_records.pop(unit, None)
            self._states.pop(unit, None)
        if record is not None and msg is not None:
            self._report(self._status(record, "stopped", detail=msg.reason))


async def _accepts(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        _, writer = await asyncio.wait_for(
            asyncio.open_connection(unbracket(host), int(port)), 2.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _all_accept(addresses: tuple[str, ...], timeout_s: float,
                      gave_up: Callable[[], bool] = lambda: False) -> bool:
    """Whether every address accepts a connection before the deadline (or ``gave_up``)."""
    deadline = time.monotonic() + timeout_s
    waiting = list(addresses)
    while waiting and time.monotonic() < deadline and not gave_up():
        waiting = [a for a in waiting if not await _accepts(a)]
        if waiting:
            await asyncio.sleep(_HEALTH_POLL_S)
    return not waiting


def _indices(gpus: tuple[int, ...]) -> str:
    return ", ".join(map(str, gpus))


def _process_tree(pid: int) -> set[int]:
    """``pid`` and every process below it (engines spawn workers that hold the GPUs)."""
    try:
        root = psutil.Process(pid)
        return {pid, *(p.pid for p in root.children(recursive=True))}
    except psutil.Error:
        return {pid}
