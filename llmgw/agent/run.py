"""``llmgw agent``: run the agent until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from llmgw.agent import self_upgrade
from llmgw.agent.agent import Agent, choose_runtime
from llmgw.agent.discovery.gpus import preload_nvml
from llmgw.config import AgentConfig

log = logging.getLogger(__name__)


async def run_agent(config: AgentConfig) -> None:
    handover = self_upgrade.handover(config.state_dir)
    if handover is not None:
        log.info("handing over to the llmgw that `llmgw ctl upgrade` installed last (%s): "
                 "%s", self_upgrade.root_of(config.state_dir) / self_upgrade.CURRENT,
                 " ".join(handover))
        self_upgrade.exec_into(handover)
    preload_nvml(config.nvml_library)
    agent = Agent(config, await choose_runtime(config))
    task = asyncio.create_task(agent.run(), name="agent")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    argv = None
    with contextlib.suppress(asyncio.CancelledError):
        argv = await task
    if argv is not None:
        log.info("agent restarting as %s", " ".join(argv))
        logging.shutdown()
        self_upgrade.exec_into(argv)
    log.info("agent stopped")
