"""Writing a file so that nobody ever sees half of it, or sees it with the wrong mode."""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def write_atomically(path: Path, data: bytes, mode: int | None = None) -> None:
    """Replace ``path`` by ``data`` with one rename: a reader (the next connection, a crash
    in between) sees the old file or the new one, never half of one. ``mode`` None keeps
    the mode of the file there (0600 for a new one). The data is written while the file
    is readable by its owner alone, so a key is never readable by others, even for a
    moment; the mode is set before the rename, not narrowed by the umask."""
    if mode is None:
        mode = path.stat().st_mode & 0o7777 if path.exists() else 0o600
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
