"""``llmgw agent``: run the agent until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from llmgw.agent.agent import Agent, choose_runtime
from llmgw.agent.discovery.gpus import preload_nvml
from llmgw.config import AgentConfig

log = logging.getLogger(__name__)


async def run_agent(config: AgentConfig) -> None:
    preload_nvml(config.nvml_library)
    agent = Agent(config, await choose_runtime(config))
    task = asyncio.create_task(agent.run(), name="agent")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task
    log.info("agent stopped")
