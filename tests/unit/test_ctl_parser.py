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


def test_version_is_printed_on_stdout_when_asked_for():
    out = subprocess.run([sys.executable, "-m", "llmgw", "--version"], capture_output=True,
                         text=True, check=True, timeout=60)
    assert (out.stdout, out.stderr) == (f"llmgw {version('llmgw')}\n", "")
