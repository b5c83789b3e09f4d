"""What an llmgw process imports before it does anything: each start pays it, and the
tests start hundreds (docs/development.md)."""

from __future__ import annotations

import json
import subprocess
import sys


def _loaded(code: str, modules: tuple[str, ...]) -> list[str]:
    """Which of ``modules`` a fresh interpreter has loaded once ``code`` ran."""
    probe = (f"import json, sys; {code}; "
             f"print(json.dumps([m for m in {modules!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True, timeout=60)
    return json.loads(out.stdout)


def test_the_command_line_is_built_without_the_agents_or_the_servers_libraries():
    # Every `llmgw` command builds the whole parser first, and `llmgw ctl` runs in an
    # operator's shell: the agent's weights code once brought aiohttp and pyroute2 with
    # it, 0.4 s of CPU before any command ran, and the version lookup importlib.metadata
    # (50 ms). A command that needs them imports them.
    assert _loaded("from llmgw.cli.main import parser; parser()",
                   ("aiohttp", "pyroute2", "sqlalchemy", "litestar",
                    "importlib.metadata")) == []


def test_a_server_without_tls_does_not_load_the_mtls_listener():
    # The agents' mTLS listener runs on aiohttp; a server without tls (a loopback
    # `llmgw up`) never starts it, and importing it cost 0.27 s of CPU at every start.
    assert _loaded("import llmgw.server.run",
                   ("aiohttp", "llmgw.server.agents.mtls")) == []


def test_a_server_on_uvicorn_does_not_load_granian():
    # granian is imported only when listen.server asks for it.
    assert _loaded("import llmgw.server.run", ("granian", "llmgw.server.serve_granian")) == []
