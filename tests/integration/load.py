"""Bounded chat load through the official client, for tests that must fail no request
while something is done to the cluster (a restart, a takeover, a partition)."""

from __future__ import annotations

import threading
import time

import openai


class ChatLoad:
    """Chat requests one after another per thread, until told to stop: at most
    ``max_requests`` per thread and ``max_s`` seconds. Every outcome is kept."""

    def __init__(self, base_url: str, key: str, model: str, threads: dict[str, int],
                 max_requests: int = 1500, max_s: float = 90.0) -> None:
        """``threads``: how many threads send each kind, "plain" or "stream"."""
        self.base_url, self.key, self.model = base_url, key, model
        self.max_requests, self.max_s = max_requests, max_s
        self.stop = threading.Event()
        self.done: list[tuple[str, float, float, object]] = []
        self._threads = [threading.Thread(target=self._run, args=(kind,), daemon=True)
                         for kind, count in threads.items() for _ in range(count)]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def finish(self) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(40)

    def answered_after(self, t: float, until: float = float("inf")) -> int:
        """How many requests were answered in full between ``t`` and ``until``."""
        return sum(1 for _, _, end, outcome in self.done
                   if t < end < until and outcome == "ok")

    def failures(self) -> list[tuple[str, float, object]]:
        """(kind, seconds taken, outcome) of every request not answered in full."""
        return [(kind, round(end - began, 2), outcome)
                for kind, began, end, outcome in self.done if outcome != "ok"]

    def spanning(self, t: float) -> int:
        """How many requests were in flight at ``t``."""
        return sum(1 for _, began, end, _ in self.done if began < t < end)

    def _run(self, kind: str) -> None:
        client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=self.key,
                               max_retries=0, timeout=30)
        deadline = time.monotonic() + self.max_s
        for _ in range(self.max_requests):
            if self.stop.is_set() or time.monotonic() > deadline:
                return
            began = time.monotonic()
            try:
                outcome: object = self._one(client, kind)
            except Exception as exc:  # every failure is counted, and shown
                outcome = exc
            self.done.append((kind, began, time.monotonic(), outcome))
            self.stop.wait(0.02)  # pacing, so that two cores are left for the cluster

    def _one(self, client: openai.OpenAI, kind: str) -> str:
        messages = [{"role": "user", "content": "keep going"}]
        if kind == "plain":
            reply = client.chat.completions.create(model=self.model, max_tokens=6,
                                                   messages=messages)
            return "ok" if reply.choices[0].message.content else "empty answer"
        chunks = client.chat.completions.create(model=self.model, max_tokens=6,
                                                messages=messages, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return "ok" if text else "empty stream"
