"""The runtime interface: start, stop, list and watch shard processes.

Two runtimes share it: systemd transient units (a real node) and plain processes (a
machine without a systemd manager). The agent speaks only to this interface.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path
from typing import Protocol

import msgspec

# What systemd sets for the agent's own service: it describes the agent's unit (its
# notify socket, credentials, directories), never a shard's; no runtime passes it on.
AGENT_ONLY_ENV = frozenset({
    "NOTIFY_SOCKET", "INVOCATION_ID", "JOURNAL_STREAM", "LISTEN_PID", "LISTEN_FDS",
    "LISTEN_FDNAMES", "WATCHDOG_PID", "WATCHDOG_USEC", "MANAGERPID", "SYSTEMD_EXEC_PID",
    "CREDENTIALS_DIRECTORY", "RUNTIME_DIRECTORY", "STATE_DIRECTORY", "CACHE_DIRECTORY",
    "LOGS_DIRECTORY", "CONFIGURATION_DIRECTORY",
})


class ShardRecord(msgspec.Struct, kw_only=True, frozen=True):
    """A running shard as the runtime remembers it; enough to report it for adoption."""

    unit: str
    replica: str
    rank: int
    world_size: int
    epoch: int
    model: str
    profile: str
    engine: str
    port: int | None = None
    health_path: str | None = None
    tcp_ready: bool = False
    startup_timeout_s: float = 600.0
    # The node's GPUs this shard was given (PCI bus order); ready means it holds each.
    gpus: tuple[int, ...] = ()
    # For a sidecar: the unit of the engine it serves (started before it, stopped with it).
    sidecar_of: str = ""
    pid: int = 0
    # The process's start time, so a recycled PID is never mistaken for our shard.
    started_at: float = 0.0


def log_tail(path: Path, lines: int) -> list[str]:
    """The last ``lines`` lines of an engine's log file (read from its last 64 KiB)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            tail = deque(f.read().decode("utf-8", "replace").splitlines(), maxlen=lines)
    except OSError:
        return []
    return list(tail)


class ShardStartError(Exception):
    """A shard the runtime could not start; the message is for the operator."""


class Runtime(Protocol):
    name: str

    async def start(self, record: ShardRecord, argv: tuple[str, ...], env: dict[str, str]
                    ) -> ShardRecord:
        """Start the shard; returns the record with its pid and start time filled in."""

    async def stop(self, unit: str, timeout_s: float = 10.0) -> None:
        """Stop the shard (TERM, then KILL after ``timeout_s``) and forget it."""

    async def running(self) -> list[ShardRecord]:
        """Shards that are running now, including ones a previous agent started."""

    async def wait_exit(self, unit: str) -> int | None:
        """Resolve when the shard's process has exited; its exit code where known."""

    def output_tail(self, unit: str, lines: int = 20) -> list[str]:
        """The engine's last lines of output."""

    def log_path(self, unit: str) -> Path:
        """The file the shard's output goes to (stdout and stderr), there while it runs
        and until it is stopped; ``llmgw ctl logs`` reads it."""
