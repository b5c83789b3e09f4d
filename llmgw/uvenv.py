"""Running uv: in this process's environment without anything that would steer uv or pip
elsewhere (an index, a configuration, a virtual environment), with uv's cache where the
caller says, bounded in time, its report read the one way. The agent's engine installs
and ``llmgw bundle create`` both use it."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path


def uv_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("UV_", "PIP_")) and k not in (
               "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME")}
    return {**env, "UV_CACHE_DIR": str(cache), "UV_NO_CONFIG": "1", "NO_COLOR": "1",
            "UV_NO_PROGRESS": "1"}


class UvFailed(Exception):
    """uv exited non-zero (the message is its report, progress left out) or ran past its
    time (``timed_out``); callers word it for what they asked."""

    def __init__(self, report: str, timed_out: bool = False):
        super().__init__(report)
        self.timed_out = timed_out


async def run_uv(args: list[str], *, cache: Path, timeout_s: float, stdin: str = "") -> str:
    """``uv ARGS`` in ``uv_env(cache)``, fed ``stdin``; its standard output. UvFailed with
    uv's own report (from its "error:", or a cross, U+00D7, on a resolution) otherwise."""
    from uv import find_uv_bin

    proc = await asyncio.create_subprocess_exec(
        find_uv_bin(), *args, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE, env=uv_env(cache))
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin.encode()), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise UvFailed(f"took over {timeout_s:.0f} s", timed_out=True) from None
    if proc.returncode != 0:
        lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
        start = next((i for i, line in enumerate(lines)
                      if line.startswith(("error:", "\u00d7"))), max(0, len(lines) - 8))
        raise UvFailed(" / ".join(line.strip() for line in lines[start:][:12]))
    return out.decode()
