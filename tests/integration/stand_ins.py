"""Stand-ins for the machine's service and package managers, put first on PATH for
`llmgw store migrate-to-postgres`: the machine's own units and packages are never touched.

- `systemctl is-active|stop|start UNIT` runs a real `llmgw server --config CONFIG` as the
  unit (its pid in `<state>/<UNIT>.pid`, its own process group). `start` fails, as
  systemd says it, while `<state>/start-fails` holds a count above 0, taking one off.
- `apt-get update|install` installs nothing; `install` fails as apt does when
  `<state>/apt-fails` exists. `pg_lsclusters` lists one cluster, on the test's port, down.
- `pg_ctlcluster VERSION CLUSTER start` "starts" it: a forwarder to the real PostgreSQL,
  on 127.0.0.1:PORT and on a socket `<socket dir>/.s.PGSQL.PORT`, where psql finds it
  through PGHOST. So a port where nothing answered has a PostgreSQL after the install.

Every call is recorded, argv as JSON, one line each, in `<state>/calls.log`.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from sqlalchemy.engine import make_url

from tests.integration.cluster import wait_for
from tests.pg import ADMIN_DSN

ROOT = Path(__file__).resolve().parents[2]

_RECORD = r'''#!{python}
import json, os, signal, subprocess, sys, time
from pathlib import Path

state = Path({state!r})
args = sys.argv[1:]
with open(state / "calls.log", "a") as log:
    log.write(json.dumps([Path(sys.argv[0]).name, *args]) + "\n")


def running(name):
    try:
        pid = int((state / f"{{name}}.pid").read_text())
        fields = Path(f"/proc/{{pid}}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None
    return None if fields[0] == "Z" else pid


def launch(name, argv):
    with open(state / f"{{name}}.log", "ab") as out:
        proc = subprocess.Popen(argv, cwd={root!r}, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    (state / f"{{name}}.pid").write_text(str(proc.pid))
'''

SYSTEMCTL = _RECORD + r'''
verb, unit = args[0], args[-1]
if verb == "is-active":
    print("active" if running(unit) else "inactive")
    sys.exit(0 if running(unit) else 3)
if verb == "stop":
    pid = running(unit)
    if pid:
        os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while running(unit) and time.monotonic() < deadline:
            time.sleep(0.05)
        if running(unit):
            os.killpg(pid, signal.SIGKILL)
    sys.exit(0)
if verb == "start":
    fails = state / "start-fails"
    left = int(fails.read_text()) if fails.exists() else 0
    if left:
        fails.write_text(str(left - 1))
        print(f"Job for {{unit}}.service failed because the control process exited with "
              "error code.", file=sys.stderr)
        sys.exit(1)
    if not running(unit):
        launch(unit, [{python!r}, "-m", "llmgw", "server", "--config", {config!r}])
    sys.exit(0)
sys.exit(f"systemctl stand-in: {{verb}} is not known here")
'''

APT_GET = _RECORD + r'''
if args[0] == "install" and (state / "apt-fails").exists():
    print("E: Unable to locate package postgresql", file=sys.stderr)
    sys.exit(100)
print("Reading package lists...")
'''

PG_LSCLUSTERS = _RECORD + r'''
print("15  main    {port} down   postgres /var/lib/postgresql/15/main "
      "/var/log/postgresql/postgresql-15-main.log")
'''

PG_CTLCLUSTER = _RECORD + r'''
launch("forwarder", [{python!r}, {forwarder!r}, "{port}", {socket_dir!r}, {target_host!r},
                     "{target_port}"])
deadline = time.monotonic() + 10
while not Path({socket_dir!r}, ".s.PGSQL.{port}").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
'''

FORWARDER = r'''
import asyncio, os, sys

port, socket_dir, target_host, target_port = sys.argv[1:]


async def pipe(reader, writer):
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


async def handle(reader, writer):
    target_reader, target_writer = await asyncio.open_connection(target_host, int(target_port))
    await asyncio.gather(pipe(reader, target_writer), pipe(target_reader, writer),
                         return_exceptions=True)


async def main():
    await asyncio.start_server(handle, "127.0.0.1", int(port))
    path = os.path.join(socket_dir, f".s.PGSQL.{port}")
    await asyncio.start_unix_server(handle, path)
    os.chmod(path, 0o777)  # psql runs as the postgres user
    await asyncio.Event().wait()


asyncio.run(main())
'''


class StandIns:
    """A directory of stand-ins for one test; `stop()` ends what they started, by pid."""

    def __init__(self, state: Path, config: Path, pg_port: int) -> None:
        self.state, self.bin, self.pg_port = state, state / "bin", pg_port
        self.bin.mkdir(parents=True)
        # psql runs as the postgres user, who must reach the forwarder's socket.
        self.socket_dir = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
        self.socket_dir.chmod(0o755)
        target = make_url(ADMIN_DSN)
        values = {"python": sys.executable, "state": str(state), "root": str(ROOT),
                  "config": str(config), "port": pg_port, "socket_dir": str(self.socket_dir),
                  "forwarder": str(state / "forwarder.py"), "target_host": target.host,
                  "target_port": target.port or 5432}
        (state / "forwarder.py").write_text(FORWARDER)
        for name, script in (("systemctl", SYSTEMCTL), ("apt-get", APT_GET),
                             ("pg_lsclusters", PG_LSCLUSTERS), ("pg_ctlcluster", PG_CTLCLUSTER)):
            path = self.bin / name
            path.write_text(script.format(**values))
            path.chmod(0o755)

    def env(self, forwarded: bool = False) -> dict[str, str]:
        """The stand-ins first on PATH; `forwarded`: psql finds PostgreSQL at the
        forwarder's socket, as at the stand-in port (not at 5432)."""
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}"}
        return {**env, "PGHOST": str(self.socket_dir)} if forwarded else env

    def calls(self) -> list[list[str]]:
        log = self.state / "calls.log"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def forget_calls(self) -> None:
        (self.state / "calls.log").unlink(missing_ok=True)

    def systemctl(self, *args: str) -> int:
        """Run the stand-in as an operator would, e.g. to start the unit before a test."""
        return subprocess.run([str(self.bin / "systemctl"), *args], env=self.env(),
                              timeout=60, check=False).returncode

    def pid(self, name: str) -> int | None:
        try:
            return int((self.state / f"{name}.pid").read_text())
        except (OSError, ValueError):
            return None

    def log(self, name: str) -> str:
        path = self.state / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """End the servers and the forwarder the stand-ins started, by process group."""
        for path in self.state.glob("*.pid"):
            pid = int(path.read_text())
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
            try:
                wait_for(lambda pid=pid: not _alive(pid), 20, f"pid {pid} to exit")
            except AssertionError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        shutil.rmtree(self.socket_dir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] != "Z"
