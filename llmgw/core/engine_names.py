"""The engines llmgw knows, by the name a profile's ``engine:`` gives: the one list of them.

The engines a node installs are ``config.InstallableEngine``, the type server.yaml's
``engines:`` keys are checked against as the file is read. config sits below core in the
layers, so that list is written there and read from it here. Everything else (the catalog,
core.builds, the agent's installer and doctor) takes the names from this module, and
tests/unit/test_engines.py holds the adapters in llmgw.engines, one per name, to it.
"""

from __future__ import annotations

from typing import get_args

from llmgw import config

# Ships inside llmgw: every node runs it, nothing to install.
BUILTIN: tuple[str, ...] = ("sim",)
# Installed on nodes from their publishers' releases, in the order messages list them.
INSTALLABLE: tuple[str, ...] = get_args(config.InstallableEngine)
ALL: tuple[str, ...] = (*BUILTIN, *INSTALLABLE)
# Run on one GPU of one node, whatever a profile asks.
SINGLE_GPU = frozenset({"comfyui"})
