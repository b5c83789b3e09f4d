"""The environment llmgw runs uv in: this process's, without anything that would steer uv
or pip elsewhere (an index, a configuration, a virtual environment), with uv's cache where
the caller says. The agent's engine installs and ``llmgw bundle create`` both use it."""

from __future__ import annotations

import os
from pathlib import Path


def uv_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("UV_", "PIP_")) and k not in (
               "VIRTUAL_ENV", "CONDA_PREFIX", "PYTHONPATH", "PYTHONHOME")}
    return {**env, "UV_CACHE_DIR": str(cache), "UV_NO_CONFIG": "1", "NO_COLOR": "1",
            "UV_NO_PROGRESS": "1"}
