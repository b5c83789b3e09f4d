"""Recording what each API key used, off the request path and in batches.

Answers' tokens are summed in memory per (key, model) and written once a second: one
store statement per key and model that was busy, whatever the request rate, so a flood
costs neither a write per request nor an unbounded pile of pending writes. Token limits
see usage at most a flush late, which only moves by a second when a limit refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

from llmgw.core.usage import Usage
from llmgw.store import Store, StoreError

log = logging.getLogger(__name__)

FLUSH_S = 1.0


class UsageRecorder:
    def __init__(self, store: Store, flush_s: float = FLUSH_S) -> None:
        self._store = store
        self._flush_s = flush_s
        # (key id, model) -> [requests, prompt tokens, completion tokens]
        self._pending: dict[tuple[int, str], list[int]] = {}

    def add(self, key_id: int, model: str, usage: Usage | None) -> None:
        counts = self._pending.get((key_id, model))
        if counts is None:
            counts = self._pending[key_id, model] = [0, 0, 0]
        counts[0] += 1
        if usage is not None:
            counts[1] += usage.prompt_tokens
            counts[2] += usage.completion_tokens

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        now = datetime.now(UTC)
        for (key_id, model), (requests, prompt, completion) in pending.items():
            try:
                await self._store.record_usage(key_id, model, prompt, completion, now,
                                               requests=requests)
            except StoreError as err:
                log.warning("could not record the usage of key %s on %s (%d requests): %s",
                            key_id, model, requests, err)

    async def run(self) -> None:
        """Flush every second until cancelled, then once more."""
        try:
            while True:
                await asyncio.sleep(self._flush_s)
                await self.flush()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.flush())
