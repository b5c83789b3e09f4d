"""``llmgw agent rollback``: run the llmgw installed before the last ``llmgw ctl upgrade``
from the agent's next start (agent/self_upgrade.py keeps it)."""

from __future__ import annotations

import argparse
import sys

from llmgw.config import AgentConfig, ConfigError, load


def run(args: argparse.Namespace) -> int:
    from llmgw.agent.install.pypi import InstallError
    from llmgw.agent.self_upgrade import rollback

    try:
        config = load(args.rollback_config, AgentConfig)
        left, back = rollback(config.state_dir)
    except (ConfigError, InstallError, OSError) as err:
        print(f"llmgw agent rollback: {err}", file=sys.stderr)
        return 2
    went = (f"llmgw {back}, the installation before it" if back else
            "the llmgw the agent is started with (its unit's ExecStart)")
    print(f"the agent runs {went}, not llmgw {left}, from its next start: restart it "
          "(systemctl restart llmgw-agent); its engines keep serving")
    return 0


def add_parser(agent_commands) -> None:
    p = agent_commands.add_parser(
        "rollback", help="go back to the llmgw installed before the last upgrade",
        description="Make the agent run, from its next start, the llmgw installed before "
        "the last `llmgw ctl upgrade` (kept in <state_dir>/llmgw/previous), or the one it is "
        "started with when there was none before.")
    p.add_argument("--config", "-c", dest="rollback_config", required=True,
                   metavar="agent.yaml", help="the agent's configuration file")
    p.set_defaults(func=run)
