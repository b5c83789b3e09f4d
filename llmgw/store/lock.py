"""The state-directory lock: one process at a time owns `<state_dir>`.

The server holds it for its whole life; `llmgw store backup|restore|migrate-to-postgres`
hold it for the whole operation. So an operation refuses while a server runs, and no
server can start half way through one.

It is an exclusive `flock` on `<state_dir>/llmgw.lock`, released by the kernel when the
holder exits however it exits, so a crash never leaves a stale lock behind. The file holds
the holder's pid and name, for the refusal message only: the lock is the flock, not the
file.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from llmgw.store import StoreError

LOCK_NAME = "llmgw.lock"
SERVER = "the llmgw server"
# The holder writes its pid just after taking the lock; a refusal waits this long for it.
_PID_WAIT_S = 0.5


@contextmanager
def hold_state_lock(state_dir: str | Path, holder: str = SERVER) -> Iterator[Path]:
    """Hold the exclusive lock on `state_dir` until the block ends; yields the lock file.

    `holder` says who holds it (e.g. "`llmgw store backup`"), for another process's
    refusal. Raises StoreError, naming the holder and its pid, when another process holds
    it. The directory is created (0700) if missing, as the server would create it.
    """
    state_dir = Path(state_dir)
    path = state_dir / LOCK_NAME
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot open the lock file {path}: {exc.strerror}") from exc
    try:
        _own_like_directory(fd, state_dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreError(_refusal(state_dir, *_holder(fd))) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n{holder}\n".encode(), 0)
        try:
            yield path
        finally:
            # Clear the pid while still holding the lock, so no one reads a stale one.
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # releases the flock


def _refusal(state_dir: Path, pid: str, holder: str) -> str:
    if holder == SERVER:
        return (
            f"the llmgw server using {state_dir} is running (pid {pid}); stop it first, "
            "e.g. `systemctl stop llmgw-server`"
        )
    return f"{holder} is using {state_dir} (pid {pid}); wait for it to finish, then try again"


def _own_like_directory(fd: int, state_dir: Path) -> None:
    """Root running `llmgw store` must not leave a lock file the server's own user cannot
    open: the file takes the directory's owner, where it can."""
    want, now = state_dir.stat(), os.fstat(fd)
    if (now.st_uid, now.st_gid) != (want.st_uid, want.st_gid):
        with contextlib.suppress(PermissionError):
            os.fchown(fd, want.st_uid, want.st_gid)


def _holder(fd: int) -> tuple[str, str]:
    """The holder's pid and name, as it wrote them; it writes them just after locking."""
    deadline = time.monotonic() + _PID_WAIT_S
    while True:
        pid, _, holder = os.pread(fd, 256, 0).decode("utf-8", "replace").partition("\n")
        if pid.strip().isdigit() or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    pid = pid.strip() if pid.strip().isdigit() else "unknown"
    return pid, holder.strip() or SERVER
