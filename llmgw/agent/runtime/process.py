"""Shards as plain processes, for machines without a systemd manager.

Each shard runs in its own session (so a signal to the agent does not reach it) with its
output in a log file (so it keeps writing when the agent is gone). A small JSON record
per shard in the state directory lets a restarted agent find and adopt what still runs;
the record's start time guards against a recycled PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from pathlib import Path

import msgspec
import psutil

from llmgw.agent.runtime.base import AGENT_ONLY_ENV, ShardRecord, ShardStartError, log_tail

log = logging.getLogger(__name__)

_POLL_S = 0.2


class ProcessRuntime:
    name = "process"

    def __init__(self, state_dir: str | Path):
        self._dir = Path(state_dir) / "shards"
        self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._children: dict[str, asyncio.subprocess.Process] = {}

    @property
    def directory(self) -> Path:
        return self._dir

    def _record_path(self, unit: str) -> Path:
        return self._dir / f"{unit}.json"

    def log_path(self, unit: str) -> Path:
        """The file the shard's output goes to (stdout and stderr)."""
        return self._dir / f"{unit}.log"

    async def start(self, record: ShardRecord, argv: tuple[str, ...], env: dict[str, str]
                    ) -> ShardRecord:
        running = self._load(record.unit)
        if running is not None and self._alive(running):
            raise ShardStartError(f"{record.unit} is already running (pid {running.pid}); "
                                  "stop it first")
        log_path = self.log_path(record.unit)
        with open(log_path, "wb") as out:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=out,
                    stderr=asyncio.subprocess.STDOUT,
                    env={**{k: v for k, v in os.environ.items() if k not in AGENT_ONLY_ENV},
                         **env},
                    start_new_session=True,
                )
            except OSError as err:
                raise ShardStartError(f"cannot run {argv[0]}: {err.strerror}") from None
        try:
            started_at = psutil.Process(proc.pid).create_time()
        except psutil.NoSuchProcess:
            started_at = 0.0
        record = msgspec.structs.replace(record, pid=proc.pid, started_at=started_at)
        self._children[record.unit] = proc
        tmp = self._record_path(record.unit).with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(record))
        tmp.replace(self._record_path(record.unit))
        return record

    def _load(self, unit: str) -> ShardRecord | None:
        try:
            return msgspec.json.decode(self._record_path(unit).read_bytes(), type=ShardRecord)
        except (OSError, msgspec.DecodeError):
            return None

    @staticmethod
    def _alive(record: ShardRecord) -> bool:
        try:
            proc = psutil.Process(record.pid)
            return (
                abs(proc.create_time() - record.started_at) < 0.5
                and proc.status() != psutil.STATUS_ZOMBIE
            )
        except psutil.Error:
            return False

    async def running(self) -> list[ShardRecord]:
        found = []
        for path in sorted(self._dir.glob("*.json")):
            record = self._load(path.stem)
            if record is None:
                log.warning("ignoring unreadable shard record %s", path)
                continue
            if self._alive(record):
                found.append(record)
            else:
                path.unlink(missing_ok=True)
                self.log_path(path.stem).unlink(missing_ok=True)
        return found

    async def wait_exit(self, unit: str) -> int | None:
        child = self._children.get(unit)
        if child is not None:
            return await child.wait()
        # Adopted from an earlier agent: not our child, so watch it instead of waiting.
        record = self._load(unit)
        while record is not None and self._alive(record):  # noqa: ASYNC110 - not our child: poll
            await asyncio.sleep(_POLL_S)
        return None

    async def stop(self, unit: str, timeout_s: float = 10.0) -> None:
        record = self._load(unit)
        child = self._children.pop(unit, None)
        if record is not None and self._alive(record):
            # The whole process group: an engine's helpers go with it.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(record.pid, signal.SIGTERM)
            if not await self._gone(record, child, timeout_s):
                log.warning("%s did not stop within %g s; killing it", unit, timeout_s)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(record.pid, signal.SIGKILL)
                await self._gone(record, child, 5.0)
        elif child is not None and child.returncode is None:
            await child.wait()
        self._record_path(unit).unlink(missing_ok=True)
        # Its last lines were reported on failure; a node restarting shards for months
        # must not keep a log per shard forever.
        self.log_path(unit).unlink(missing_ok=True)

    async def _gone(self, record: ShardRecord, child, timeout_s: float) -> bool:
        async def wait() -> None:
            if child is not None:
                await child.wait()
            while self._alive(record):  # noqa: ASYNC110 - not our child: poll
                await asyncio.sleep(_POLL_S)

        try:
            await asyncio.wait_for(wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def output_tail(self, unit: str, lines: int = 20) -> list[str]:
        return log_tail(self.log_path(unit), lines)
