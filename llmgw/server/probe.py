"""The gateway's own health check of engines whose node it cannot vouch for.

A replica is routed to while its node reports it ready. When the node does not (it is
unreachable or lost, or it has not reported to this server since it started or took the
lead, or this server follows and the leader says so), the engine may well still serve:
this check asks it directly, about once a second, and the replica stays in routing while
it answers 200 (Controller.unsure_endpoints, Controller.set_probe_failed).
"""

from __future__ import annotations

import asyncio
import logging

from llmgw.engines import health_path
from llmgw.server.controller import Controller
from llmgw.transport.check import get_status

log = logging.getLogger(__name__)

_CONCURRENCY = 64


class EngineProbe:
    def __init__(self, controller: Controller, interval_s: float = 1.0,
                 timeout_s: float = 1.0) -> None:
        self.controller = controller
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._limit = asyncio.Semaphore(_CONCURRENCY)

    async def run(self) -> None:
        while True:
            await self.check_once()
            await asyncio.sleep(self.interval_s)

    async def check_once(self) -> None:
        targets = self.controller.unsure_endpoints()
        answers = await asyncio.gather(*(self._check(*t) for t in targets.values()))
        failed = frozenset(rid for rid, ok in zip(targets, answers, strict=True) if not ok)
        for rid in sorted(failed - self.controller.probe_failed):
            log.warning("replica %s does not answer this server's health check: not routed "
                        "to until it does, or its node reports it ready", rid)
        for rid in sorted(self.controller.probe_failed - failed):
            if rid in targets:
                log.info("replica %s answers this server's health check again", rid)
        # Replicas no longer unsure are vouched for by their node again.
        self.controller.set_probe_failed(failed)

    async def _check(self, engine: str, host: str, port: int) -> bool:
        async with self._limit:
            return await get_status(host, port, health_path(engine), self.timeout_s) == 200
