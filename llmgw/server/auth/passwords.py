"""Password hashing with argon2id, bounded so that a login flood cannot exhaust memory.

Each hash takes ``memory_kib`` of memory; without a bound, N concurrent logins take N
times that. Hashing takes one of a few slots and waits for one otherwise. An unknown
username is checked against a dummy hash, so the time a login takes does not tell which
accounts exist.
"""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass

import argon2
from argon2.exceptions import InvalidHashError, VerificationError

# OWASP's minimum for argon2id is 19 MiB, 2 passes, 1 lane; argon2-cffi's defaults
# (RFC 9106's low-memory choice: 64 MiB, 3 passes, 4 lanes) are above it and are ours.
MIN_MEMORY_KIB = 19 * 1024
MIN_TIME_COST = 2


@dataclass(frozen=True, slots=True)
class Checked:
    ok: bool
    # The stored hash was made with other parameters than today's: store a new one.
    rehash: str | None = None


class PasswordHasher:
    def __init__(self, slots: int = 2, memory_kib: int = 65536, time_cost: int = 3,
                 parallelism: int = 4):
        if memory_kib < MIN_MEMORY_KIB or time_cost < MIN_TIME_COST:
            raise ValueError(f"argon2id below OWASP's minimum ({MIN_MEMORY_KIB} KiB, "
                             f"{MIN_TIME_COST} passes)")
        self._argon = argon2.PasswordHasher(time_cost=time_cost, memory_cost=memory_kib,
                                            parallelism=parallelism, type=argon2.Type.ID)
        self.slots = slots
        self._sem = asyncio.Semaphore(slots)
        self.in_use = 0
        self.peak = 0
        self._dummy = self._argon.hash(secrets.token_urlsafe(16))

    async def _run(self, fn, *args):
        async with self._sem:
            self.in_use += 1
            self.peak = max(self.peak, self.in_use)
            try:
                return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
            finally:
                self.in_use -= 1

    def _verify(self, stored: str, password: str) -> bool:
        return self._argon.verify(stored, password)

    async def hash(self, password: str) -> str:
        return await self._run(self._argon.hash, password)

    async def check(self, stored: str | None, password: str) -> Checked:
        """Verify ``password``; with ``stored`` None (no such user) burn the same time."""
        target = stored or self._dummy
        try:
            await self._run(self._verify, target, password)
        except (VerificationError, InvalidHashError):
            return Checked(False)
        if stored is None:
            return Checked(False)
        if self._argon.check_needs_rehash(stored):
            return Checked(True, await self.hash(password))
        return Checked(True)

    def stats(self) -> dict[str, int]:
        return {"slots": self.slots, "in_use": self.in_use, "peak": self.peak}
