"""Shards as systemd transient units, driven over D-Bus through :mod:`.systemd_bus`.

Each shard is ``<unit>.service`` (``llmgw-shard-<replica>-<rank>.service``), started with
``StartTransientUnit`` on the manager at a configured bus address: the system manager's
own socket (``unix:path=/run/systemd/private``) on a real node, a user manager's in the
tests. The unit, not the agent, owns the engine: its processes live in the unit's own
cgroup, so an agent restart or crash leaves them serving, and a restarted agent finds them
again by listing ``llmgw-shard-*.service``.

How it fits together:

- The unit carries its own :class:`ShardRecord`, as the ``LLMGW_SHARD`` variable of its
  environment. Adoption needs nothing but the manager: no record file can go stale or be
  lost with the state directory, and the PID and start time come from systemd itself
  (``MainPID``, ``ExecMainStartTimestamp``), so a recycled PID can never be mistaken for a
  shard. A ``llmgw-shard-*`` unit without a record (started by hand, or by something else)
  is logged and left alone: it cannot be described to the control plane, and killing what
  we cannot identify is worse than leaving it; its GPU memory and port still show in the
  heartbeat, so nothing is placed on top of it.
- ``RemainAfterExit=yes`` keeps a unit loaded after its engine exits: ``active (exited)``
  after a clean exit, ``failed`` otherwise (a failed unit is kept by the default
  ``CollectMode=inactive``). Its ``ExecMainCode``/``ExecMainStatus`` stay readable, by this
  agent or a restarted one, until :meth:`SystemdRuntime.stop` stops and resets it. Without
  it a transient unit that exits cleanly is garbage-collected at once, and its exit status
  with it.
- Output goes to a log file per shard under the state directory (``append:``), so the
  engine's last lines can be reported on failure without a journal. On a real node
  journald would work as well (``StandardOutput=journal``), read back with journalctl;
  the file keeps both runtimes and both kinds of machine the same.
- Waiting is driven by the manager's signals (``JobRemoved``, ``PropertiesChanged``,
  ``UnitRemoved``) with a slow poll behind them, so a missed signal costs a second, not a
  hang.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import msgspec
from dbus_fast import DBusError, Message, MessageType, Variant
from dbus_fast.aio import MessageBus

from llmgw.agent.runtime.base import AGENT_ONLY_ENV, ShardRecord, ShardStartError, log_tail
from llmgw.agent.runtime.systemd_bus import (
    DEST,
    MANAGER,
    PROPS,
    ROOT,
    SERVICE,
    TRANSPORT,
    UNIT,
    call,
    connect,
    is_peer,
    unit_name,
    unit_path,
    why,
)

log = logging.getLogger(__name__)

# Where the operator changes what this runtime talks to (words for error messages).
HINT = "set systemd_bus in agent.yaml, or runtime: process"

_PATTERN = "llmgw-shard-*.service"
_RECORD_VAR = "LLMGW_SHARD"

_START_TIMEOUT_S = 30.0  # Type=exec: the start job ends once execve() has succeeded
_GONE_TIMEOUT_S = 5.0
_POLL_S = 1.0  # behind the signals
_INFINITY = 2**64 - 1
_CLD_EXITED = 1  # ExecMainCode values (waitid's si_code)
_CLD_KILLED, _CLD_DUMPED = 2, 3
# systemd's own exit statuses for a process that never got to run the engine (200 and up)
_SETUP_STATUS = {200: "could not change to its working directory",
                 203: "could not be executed", 209: "could not set up its output"}

_AGENT_ONLY_ENV = AGENT_ONLY_ENV | {_RECORD_VAR}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


class ManagerUnreachable(ShardStartError):
    """The systemd manager at the configured address does not answer."""


def exit_code(props: dict[str, Any]) -> int | None:
    """The main process's exit code as asyncio gives one (minus the signal for a death by
    signal), from a Service's properties; None while it runs."""
    if not props.get("ExecMainExitTimestampMonotonic"):
        return None
    code, status = props.get("ExecMainCode", 0), props.get("ExecMainStatus", 0)
    if code == _CLD_EXITED:
        return status
    if code in (_CLD_KILLED, _CLD_DUMPED):
        return -status
    return None


class SystemdRuntime:
    """Shards as transient units of the systemd manager at ``address``.

    Connects on first use and again after the manager drops the connection (a
    ``daemon-reexec`` does); :meth:`close` (or ``async with``) ends the connection.
    ``stop_timeout_s`` becomes each unit's ``TimeoutStopSec``, the manager's own deadline
    when someone else stops the unit; :meth:`stop` keeps its own ``timeout_s`` as well.
    """

    name = "systemd"

    def __init__(self, address: str, state_dir: str | Path, *, stop_timeout_s: float = 10.0):
        self.address = address
        self._dir = Path(state_dir) / "shards"
        self._dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._stop_timeout_s = stop_timeout_s
        self._bus: MessageBus | None = None
        self._disconnected: asyncio.Future | None = None
        self._lock = asyncio.Lock()
        self._jobs: dict[str, asyncio.Future] = {}  # unit name -> its start job's result
        self._waiters: dict[str, set[asyncio.Event]] = defaultdict(set)
        self._exits: dict[str, int] = {}  # exit codes signalled for watched units
        self._busy: Counter[str] = Counter()
        self._unrecorded: set[str] = set()

    @property
    def directory(self) -> Path:
        return self._dir

    def log_path(self, unit: str) -> Path:
        """The file the shard's output goes to (stdout and stderr)."""
        return self._dir / f"{unit}.log"

    def _work_dir(self, unit: str) -> Path:
        return self._dir / unit

    # --- the connection -------------------------------------------------------------------

    async def connect(self) -> None:
        """Connect now rather than on first use; ManagerUnreachable says why not."""
        await self._connection()

    async def close(self) -> None:
        bus, self._bus = self._bus, None
        if bus is not None:
            bus.disconnect()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(bus.wait_for_disconnect(), 2.0)

    async def __aenter__(self) -> SystemdRuntime:
        await self.connect()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _connection(self) -> MessageBus:
        async with self._lock:
            if self._bus is not None and self._bus.connected:
                return self._bus
            bus = None
            try:
                bus = await connect(self.address)
                bus.add_message_handler(self._on_message)
                if not is_peer(self.address):
                    # On a bus the manager's signals must be asked for; a peer gets them all.
                    await call(bus, "AddMatch", "s", [
                        f"type='signal',sender='{DEST}',path_namespace='{ROOT}'"],
                        path="/org/freedesktop/DBus", interface="org.freedesktop.DBus",
                        destination="org.freedesktop.DBus")
                await call(bus, "Subscribe")
            except (*TRANSPORT, ValueError, DBusError) as err:
                if bus is not None:
                    bus.disconnect()
                raise ManagerUnreachable(
                    f"cannot reach the systemd manager at {self.address}: {why(err)}; "
                    f"{HINT}") from None
            self._bus = bus
            # Whatever waits on the manager's signals asks again at once when they stop.
            self._disconnected = asyncio.ensure_future(bus.wait_for_disconnect())
            self._disconnected.add_done_callback(self._on_disconnect)
            return bus

    def _on_disconnect(self, done: asyncio.Future) -> None:
        if not done.cancelled():
            done.exception()  # retrieved: a lost connection is handled where it is used
        for events in self._waiters.values():
            for event in events:
                event.set()

    async def _call(self, member: str, signature: str = "", body: Any = (),
                    path: str = ROOT, interface: str = MANAGER) -> list:
        bus = await self._connection()
        try:
            return await call(bus, member, signature, body, path, interface)
        except DBusError:
            raise
        except TRANSPORT as err:
            raise ManagerUnreachable(
                f"lost the systemd manager at {self.address}: {why(err)}") from None

    def _on_message(self, msg: Message) -> None:
        if msg.message_type != MessageType.SIGNAL:
            return
        if msg.member == "JobRemoved" and msg.path == ROOT:
            _, _, name, result = msg.body
            job = self._jobs.get(name)
            if job is not None and not job.done():
                job.set_result(result)
            self._wake(unit_path(name))
        elif msg.member == "UnitRemoved" and msg.path == ROOT:
            self._wake(msg.body[1])
        elif msg.member == "PropertiesChanged" and msg.path in self._waiters:
            interface, changed = msg.body[0], msg.body[1]
            if interface == SERVICE:
                code = exit_code({k: v.value for k, v in changed.items()})
                if code is not None:
                    self._exits[unit_name(msg.path)] = code
            self._wake(msg.path)

    def _wake(self, path: str) -> None:
        for event in self._waiters.get(path, ()):
            event.set()

    @contextlib.contextmanager
    def _watching(self, name: str):
        """An event set whenever the manager says something about the unit."""
        path, event = unit_path(name), asyncio.Event()
        self._waiters[path].add(event)
        self._busy[name] += 1
        try:
            yield event
        finally:
            self._busy[name] -= 1
            if not self._busy[name]:
                del self._busy[name]
                self._exits.pop(name, None)
            self._waiters[path].discard(event)
            if not self._waiters[path]:
                del self._waiters[path]

    async def _props(self, name: str, interface: str = SERVICE) -> dict[str, Any] | None:
        """The unit's properties, or None when the manager has no such unit loaded."""
        try:
            path = (await self._call("GetUnit", "s", [name]))[0]
            body = await self._call("GetAll", "s", [interface], path=path, interface=PROPS)
        except DBusError as err:
            if err.type in ("org.freedesktop.systemd1.NoSuchUnit",
                            "org.freedesktop.DBus.Error.UnknownObject"):
                return None
            raise
        return {k: v.value for k, v in body[0].items()}

    # --- the runtime interface ------------------------------------------------------------

    async def start(self, record: ShardRecord, argv: tuple[str, ...], env: dict[str, str]
                    ) -> ShardRecord:
        name = f"{record.unit}.service"
        environment = self._environment(record, env)
        executable = shutil.which(argv[0], path=dict(environment).get("PATH", os.defpath))
        if executable is None:
            reason = "Permission denied" if os.path.exists(argv[0]) else "No such file or directory"
            raise ShardStartError(f"cannot run {argv[0]}: {reason}")
        with self._watching(name):
            await self._clear_leftover(name, record.unit)
            self._exits.pop(name, None)
            self.log_path(record.unit).unlink(missing_ok=True)
            self._work_dir(record.unit).mkdir(exist_ok=True, mode=0o700)
            job = asyncio.get_running_loop().create_future()
            self._jobs[name] = job
            try:
                try:
                    await self._call("StartTransientUnit", "ssa(sv)a(sa(sv))", [
                        name, "fail",
                        self._properties(record, executable, argv, environment), []])
                except DBusError as err:
                    if err.type == "org.freedesktop.systemd1.UnitExists":
                        raise ShardStartError(f"{name} already exists; stop it first") from None
                    raise ShardStartError(f"systemd refused to start {name}: {err.text}"
                                          ) from None
                result = await self._job_result(name, job)
            finally:
                self._jobs.pop(name, None)
            props = await self._props(name)
            if result != "done" or props is None or not props.get("ExecMainPID"):
                await self._collect(name, record.unit)
                raise ShardStartError(self._start_failure(name, argv[0], result, props))
        return msgspec.structs.replace(record, pid=props["ExecMainPID"],
                                       started_at=props["ExecMainStartTimestamp"] / 1e6)

    async def _job_result(self, name: str, job: asyncio.Future) -> str:
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(asyncio.shield(job), _START_TIMEOUT_S)
        # No JobRemoved signal in time: decide from the unit as it is now.
        state = await self._props(name, UNIT)
        return "done" if state is not None and state.get("ActiveState") == "active" else (
            f"without an answer in {_START_TIMEOUT_S:g} s")

    @staticmethod
    def _start_failure(name: str, program: str, result: str,
                       props: dict[str, Any] | None) -> str:
        status = (props or {}).get("ExecMainStatus", 0)
        if status in _SETUP_STATUS:
            return f"cannot run {program}: it {_SETUP_STATUS[status]} (systemd status {status})"
        return f"systemd could not start {name} ({program}): the start job ended {result!r}"

    async def _clear_leftover(self, name: str, unit: str) -> None:
        """Refuse a unit that still runs; clear one whose engine has exited, so that the
        name can be used again."""
        props = await self._props(name)
        if props is None:
            return
        if props.get("MainPID"):
            raise ShardStartError(
                f"{name} is already running (pid {props['MainPID']}); stop it first")
        await self._collect(name, unit)

    def _environment(self, record: ShardRecord, env: dict[str, str]) -> list[tuple[str, str]]:
        """The agent's environment (as a plain child process would inherit it, less what
        describes the agent's own unit), the shard's, and the shard's record."""
        for key, value in env.items():
            if not _ENV_NAME.fullmatch(key) or _CONTROL.search(value):
                raise ShardStartError(
                    f"environment variable {key!r} cannot be passed to a systemd unit: "
                    "names are letters, digits and _, values have no control characters")
        merged = {
            k: v for k, v in os.environ.items()
            if k not in _AGENT_ONLY_ENV and _ENV_NAME.fullmatch(k) and not _CONTROL.search(v)
        }
        merged.update(env)
        blank = msgspec.structs.replace(record, pid=0, started_at=0.0)
        merged[_RECORD_VAR] = msgspec.json.encode(blank).decode()
        return sorted(merged.items())

    def _properties(self, record: ShardRecord, executable: str, argv: tuple[str, ...],
                    environment: list[tuple[str, str]]) -> list[tuple[str, Variant]]:
        log_path = str(self.log_path(record.unit))
        return [
            ("Description", Variant("s", f"llmgw shard: {record.model} replica "
                                         f"{record.replica} rank {record.rank} "
                                         f"({record.engine})")),
            ("ExecStart", Variant("a(sasb)", [(executable, list(argv), False)])),
            ("Environment", Variant("as", [f"{k}={v}" for k, v in environment])),
            ("WorkingDirectory", Variant("s", str(self._work_dir(record.unit)))),
            # exec: the start fails when the binary cannot be run, instead of "succeeding".
            ("Type", Variant("s", "exec")),
            ("Restart", Variant("s", "no")),  # the control plane decides restarts
            # Keep the unit, and its exit status, after the engine exits (module docstring).
            ("RemainAfterExit", Variant("b", True)),
            ("CollectMode", Variant("s", "inactive")),
            # control-group: a stop sends SIGTERM to every process of the unit at once,
            # the engine's workers (vLLM, SGLang, Ray) included, as the process runtime
            # signals the whole process group, and SIGKILL to whatever is left after
            # TimeoutStopSec. "mixed" would SIGTERM only the main process and SIGKILL the
            # rest as soon as it exits, so an engine behind a wrapper that does not forward
            # signals (a shell, uv run) would lose its workers without a graceful stop.
            ("KillMode", Variant("s", "control-group")),
            ("SendSIGKILL", Variant("b", True)),
            ("TimeoutStopUSec", Variant("t", int(self._stop_timeout_s * 1e6))),
            ("StandardOutputFileToAppend", Variant("s", log_path)),
            ("StandardErrorFileToAppend", Variant("s", log_path)),
            # NCCL and RDMA pin host memory; the default 8 MiB makes them fail or crawl.
            ("LimitMEMLOCK", Variant("t", _INFINITY)),
            ("LimitNOFILE", Variant("t", 1048576)),
            # Engines run hundreds of threads per GPU; the default share of pid_max bites.
            ("TasksMax", Variant("t", _INFINITY)),
            # A worker killed for memory leaves a broken engine: stop the whole unit.
            ("OOMPolicy", Variant("s", "stop")),
        ]

    async def stop(self, unit: str, timeout_s: float = 10.0) -> None:
        name = f"{unit}.service"
        with self._watching(name) as changed:
            try:
                await self._call("StopUnit", "ss", [name, "replace"])
            except DBusError as err:
                if err.type != "org.freedesktop.systemd1.NoSuchUnit":
                    raise ShardStartError(f"systemd refused to stop {name}: {err.text}"
                                          ) from None
            if not await self._until_stopped(name, changed, timeout_s):
                log.warning("%s did not stop within %g s; killing it", unit, timeout_s)
                with contextlib.suppress(DBusError):
                    await self._call("KillUnit", "ssi", [name, "all", int(signal.SIGKILL)])
                await self._until_stopped(name, changed, _GONE_TIMEOUT_S)
            await self._collect(name, unit)

    async def _until_stopped(self, name: str, changed: asyncio.Event, timeout_s: float) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            changed.clear()
            state = await self._props(name, UNIT)
            if state is None or state.get("ActiveState") in ("inactive", "failed"):
                return True
            left = deadline - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, _POLL_S))

    async def _collect(self, name: str, unit: str) -> None:
        """Unload a unit whose engine is gone (stop an exited one, reset a failed one),
        wait until the name is free, and remove the shard's log and working directory:
        its last lines were reported on failure, and a node restarting shards for months
        must not keep them forever."""
        with self._watching(name) as changed:
            state = await self._props(name, UNIT)
            if state is not None and state.get("ActiveState") == "active":
                with contextlib.suppress(DBusError):
                    await self._call("StopUnit", "ss", [name, "replace"])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + _GONE_TIMEOUT_S
            # Gone, or a stub the manager is about to drop (a new start may reuse it).
            while (state is not None and state.get("LoadState") == "loaded"
                   and loop.time() < deadline):
                if state.get("ActiveState") == "failed":
                    with contextlib.suppress(DBusError):
                        await self._call("ResetFailedUnit", "s", [name])
                changed.clear()
                state = await self._props(name, UNIT)
                if state is not None:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(changed.wait(), 0.2)
            if state is not None and state.get("LoadState") == "loaded":
                log.warning("%s is still loaded (%s) after %g s", name,
                            state.get("ActiveState"), _GONE_TIMEOUT_S)
        self.log_path(unit).unlink(missing_ok=True)
        shutil.rmtree(self._work_dir(unit), ignore_errors=True)

    async def running(self) -> list[ShardRecord]:
        units = (await self._call("ListUnitsByPatterns", "asas", [[], [_PATTERN]]))[0]
        found = []
        for name, _, _, active, *_ in sorted(units):
            props = await self._props(name)
            if props is None or active == "inactive":
                continue
            record = _record_of(props)
            if record is None:
                if name not in self._unrecorded:
                    self._unrecorded.add(name)
                    log.warning("%s (pid %d) carries no llmgw shard record, so it cannot be "
                                "adopted; leaving it alone (systemctl stop %s ends it)",
                                name, props.get("MainPID", 0), name)
                continue
            if props.get("MainPID") and active in ("active", "activating"):
                found.append(msgspec.structs.replace(
                    record, pid=props["MainPID"],
                    started_at=props["ExecMainStartTimestamp"] / 1e6))
            elif exit_code(props) is not None and name not in self._busy:
                tail = self.output_tail(record.unit, 5)
                log.warning("%s has exited with code %s; removing it. Its last output:\n%s",
                            name, exit_code(props), "\n".join(tail))
                await self._collect(name, record.unit)
        return found

    async def wait_exit(self, unit: str) -> int | None:
        name = f"{unit}.service"
        lost = False
        with self._watching(name) as changed:
            while True:
                changed.clear()
                try:
                    props = await self._props(name)
                except ManagerUnreachable as err:
                    # The unit keeps running without us: keep asking until it answers.
                    if not lost:
                        log.warning("%s: %s; asking again every %g s", unit, err, _POLL_S)
                    lost = True
                    await asyncio.sleep(_POLL_S)
                    continue
                if lost:
                    log.info("%s: the systemd manager answers again", unit)
                    lost = False
                if props is None:  # gone: stopped and unloaded, by us or by someone else
                    return self._exits.get(name)
                code = exit_code(props)
                if code is not None:
                    return code
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), _POLL_S)

    def output_tail(self, unit: str, lines: int = 20) -> list[str]:
        return log_tail(self.log_path(unit), lines)


def _record_of(props: dict[str, Any]) -> ShardRecord | None:
    for entry in props.get("Environment", ()):
        key, _, value = entry.partition("=")
        if key == _RECORD_VAR:
            try:
                return msgspec.json.decode(value, type=ShardRecord)
            except msgspec.DecodeError:
                return None
    return None

