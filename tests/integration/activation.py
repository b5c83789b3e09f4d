"""Playing systemd's socket activation in tests: the test holds the listening socket and
starts each server on it as fd 3, with LISTEN_FDS and LISTEN_PID set as systemd sets them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

# Moves the socket to fd 3 (SD_LISTEN_FDS_START), sets LISTEN_PID to its own pid, then
# execs: the server keeps that pid, as under systemd.
_ACTIVATE = """import os, sys
fd = int(sys.argv[1])
if fd != 3:
    os.dup2(fd, 3, inheritable=True)
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.argv[2], sys.argv[2:])
"""


def listener(host: str = "127.0.0.1") -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((host, 0))
    sock.listen(128)
    return sock


def start_activated(sock: socket.socket, config: Path, log: Path,
                    env: dict[str, str] | None = None) -> subprocess.Popen:
    fd = sock.fileno()
    return subprocess.Popen(
        [sys.executable, "-c", _ACTIVATE, str(fd),
         sys.executable, "-m", "llmgw", "server", "--config", str(config)],
        env={**os.environ, "LISTEN_FDS": "1", **(env or {})}, pass_fds=[fd],
        stdout=open(log, "ab"), stderr=subprocess.STDOUT,  # the child owns it
        stdin=subprocess.DEVNULL, start_new_session=True)
