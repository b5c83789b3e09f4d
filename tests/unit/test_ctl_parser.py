"""How `llmgw ctl` reads its command line (no server needed)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest

from llmgw.cli.main import parser


@pytest.mark.parametrize("argv", [
    ["ctl", "nodes", "list", "--json", "--server", "http://cp:8080"],
    ["ctl", "nodes", "--json", "--server", "http://cp:8080", "list"],
    ["ctl", "nodes", "--json", "--server", "http://cp:8080"],
    ["ctl", "models", "--server", "http://cp:8080", "--json"],
])
def test_options_on_the_group_or_its_command_are_kept(argv):
    args = parser().parse_args(argv)
    assert (args.json, args.server, args.token) == (True, "http://cp:8080", None)


def test_a_group_alone_lists_as_its_list_does():
    alone, listed = (parser().parse_args(["ctl", "nodes", *rest]) for rest in ([], ["list"]))
    assert alone.nodes_command is None and listed.nodes_command == "list"
    assert vars(alone).keys() - {"func"} == vars(listed).keys() - {"func"}
    assert (alone.json, alone.server) == (listed.json, listed.server) == (False, None)


def test_a_command_under_a_group_still_needs_its_arguments(capsys):
    with pytest.raises(SystemExit):
        parser().parse_args(["ctl", "nodes", "drain"])
    assert "node" in capsys.readouterr().err


def test_the_command_line_is_built_without_the_agents_or_the_servers_libraries():
    # Every `llmgw` command builds the whole parser first, and `llmgw ctl` runs in an
    # operator's shell: the agent's weights code once brought aiohttp and pyroute2 with
    # it, 0.4 s of CPU before any command ran, and the version lookup importlib.metadata
    # (50 ms). A command that needs them imports them.
    heavy = ("aiohttp", "pyroute2", "sqlalchemy", "litestar", "importlib.metadata")
    code = ("import sys; from llmgw.cli.main import parser; parser(); "
            f"print([m for m in {heavy!r} if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout


def test_version_is_printed_on_stdout_when_asked_for():
    out = subprocess.run([sys.executable, "-m", "llmgw", "--version"], capture_output=True,
                         text=True, check=True, timeout=60)
    assert (out.stdout, out.stderr) == (f"llmgw {version('llmgw')}\n", "")
