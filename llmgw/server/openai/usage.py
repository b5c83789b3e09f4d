"""Recording what each API key used, off the request path and in batches.

Answers' tokens are summed in memory per (key, model) and written once a second, every
busy key and model in one transaction (`Store.record_usages`), whatever the request rate:
a flood costs neither a write per request nor an unbounded pile of pending writes, and
many busy keys not a statement each (1,000 keys and models: 13 ms of CPU, against 1.5-1.7
s as a statement each; bench/usage_flush.py). Token limits
see usage at most a flush late, which only moves by a second when a limit refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime

from llmgw.core.recent import RecentMinutes
from llmgw.core.usage import Usage
from llmgw.store import Store, StoreError, StoreUnavailable, UsageEntry

log = logging.getLogger(__name__)

FLUSH_S = 1.0


class UsageRecorder:
    def __init__(self, store: Store, flush_s: float = FLUSH_S) -> None:
        self._store = store
        self._flush_s = flush_s
        # (key id, model) -> [requests, prompt tokens, completion tokens]
        self._pending: dict[tuple[int, str], list[int]] = {}
        # This server's requests and tokens per minute, for the cluster page.
        self.recent = RecentMinutes()
        self._requests = self._tokens = 0  # since the last flush, for ``recent``

    def add(self, key_id: int, model: str, usage: Usage | None) -> None:
        counts = self._pending.get((key_id, model))
        if counts is None:
            counts = self._pending[key_id, model] = [0, 0, 0]
        counts[0] += 1
        self._requests += 1
        if usage is not None:
            counts[1] += usage.prompt_tokens
            counts[2] += usage.completion_tokens
            self._tokens += usage.prompt_tokens + usage.completion_tokens

    async def flush(self) -> None:
        if self._requests:
            self.recent.add(time.time(), self._requests, self._tokens)
            self._requests = self._tokens = 0
        pending, self._pending = self._pending, {}
        if not pending:
            return
        entries = [UsageEntry(key_id=key_id, model=model, requests=requests,
                              prompt_tokens=prompt, completion_tokens=completion)
                   for (key_id, model), (requests, prompt, completion) in pending.items()]
        try:
            await self._store.record_usages(entries, datetime.now(UTC))
        except StoreUnavailable:
            # Kept for the next flush, added to what comes meanwhile: one count per key and
            # model however long the outage (the store logged it once).
            for key, (requests, prompt, completion) in pending.items():
                counts = self._pending.setdefault(key, [0, 0, 0])
                counts[0] += requests
                counts[1] += prompt
                counts[2] += completion
        except StoreError as err:
            log.warning("could not record the usage of %d keys and models (%d requests): %s",
                        len(entries), sum(e.requests for e in entries), err)

    async def run(self) -> None:
        """Flush every second until cancelled, then once more."""
        try:
            while True:
                await asyncio.sleep(self._flush_s)
                await self.flush()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.flush())
