"""Which of a model's ready replicas takes a request: pure choices, no waiting.

Two rules, tried in this order by :func:`choose`:

* **Affinity** (when the request has a key: its ``user``, or the start of its conversation).
  The key goes to the replica that owns it on a ring of virtual nodes (consistent
  hashing), so the engine's prefix cache is reused; adding or removing a replica moves
  only that replica's share of keys. The load is bounded (Mirrokni, Thorup and
  Zadimoghaddam, "Consistent Hashing with Bounded Loads"): a replica takes the key only
  while it holds fewer than ``ceil((1 + ε) · (total + 1) / n)`` requests; otherwise the
  key walks clockwise to the next replica. A hot key therefore spills over instead of
  burying one replica.
* **Power of two choices**: two replicas drawn at random, the one with fewer outstanding
  requests wins. Almost as good as "least loaded" but O(1), and it does not send every
  request of a burst to the same momentarily idle replica.

A replica at its slot limit is never chosen; ``None`` means every eligible replica is full
(the caller queues) or there is none (the caller refuses). Randomness is injected, so a
test replays any sequence.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Collection, Iterator, Sequence
from typing import Protocol, TypeVar

VNODES = 64
DEFAULT_EPSILON = 0.25
DEFAULT_PREFIX_BYTES = 512


class Target(Protocol):
    """A replica as routing sees it."""

    @property
    def replica(self) -> str: ...
    @property
    def outstanding(self) -> int: ...
    @property
    def slots(self) -> int: ...


T = TypeVar("T", bound=Target)


def stable_hash(data: str | bytes) -> int:
    """A 64-bit hash that is the same in every process (Python's ``hash`` is salted)."""
    if isinstance(data, str):
        data = data.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class Ring:
    """Replica names on a hash ring, ``vnodes`` points each; built once per table change."""

    __slots__ = ("_owners", "_points", "names")

    def __init__(self, names: Sequence[str], vnodes: int = VNODES) -> None:
        if vnodes < 1:
            raise ValueError("a ring needs at least one point per replica")
        points = sorted((stable_hash(f"{name}#{v}"), i)
                        for i, name in enumerate(names) for v in range(vnodes))
        self.names = tuple(names)
        self._points = [p for p, _ in points]
        self._owners = [i for _, i in points]

    def walk(self, key: str | bytes) -> Iterator[int]:
        """Indices into ``names``, each once, in the order met clockwise from ``key``."""
        count = len(self._points)
        if not count:
            return
        start = bisect.bisect_left(self._points, stable_hash(key))
        seen: set[int] = set()
        for step in range(count):
            owner = self._owners[(start + step) % count]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.names):
                    return

    def owner(self, key: str | bytes) -> str | None:
        """The replica a key belongs to when nobody is loaded."""
        return next((self.names[i] for i in self.walk(key)), None)


def load_bound(total: int, replicas: int, epsilon: float = DEFAULT_EPSILON) -> int:
    """How many requests one replica may already hold and still take an affine key.

    ``total`` is the model's outstanding requests before this one; the new request counts
    too, so the bound is at least 1 and some replica is always under it.
    """
    if replicas < 1:
        return 0
    # The small subtraction keeps float noise (1.1 * 10 / 11 = 1.0000000000000002) from
    # rounding a whole number up.
    return math.ceil((1 + epsilon) * (total + 1) / replicas - 1e-9)


def by_affinity(targets: Sequence[T], ring: Ring, key: str | bytes, total: int,
                epsilon: float = DEFAULT_EPSILON, exclude: Collection[str] = ()) -> T | None:
    """The first replica clockwise from ``key`` that is under both the bound and its slots.

    ``ring`` must have been built from ``[t.replica for t in targets]``, in that order.
    """
    bound = load_bound(total, len(targets), epsilon)
    for i in ring.walk(key):
        target = targets[i]
        if target.replica not in exclude and target.outstanding < min(target.slots, bound):
            return target
    return None


def two_choices(targets: Sequence[T], rng: random.Random,
                exclude: Collection[str] = ()) -> T | None:
    """Power of two choices among the replicas with a free slot, not in ``exclude``.

    The first draw is over all replicas (O(1)); only when it hits a full or excluded one
    are the eligible ones listed and drawn from again. Either way the pair is uniform over
    the eligible pairs. Ties go to the replica with more free slots, then to the first drawn.
    """
    n = len(targets)
    if n >= 2:
        a, b = _draw_two(targets, rng)
        if is_eligible(a, exclude) and is_eligible(b, exclude):
            return _less_loaded(a, b)
    eligible = [t for t in targets if is_eligible(t, exclude)]
    if len(eligible) <= 1:
        return eligible[0] if eligible else None
    return _less_loaded(*_draw_two(eligible, rng))


def choose(targets: Sequence[T], rng: random.Random, *, ring: Ring | None = None,
           key: str | bytes | None = None, total: int = 0,
           epsilon: float = DEFAULT_EPSILON, exclude: Collection[str] = ()) -> T | None:
    """Affinity first when there is a key and a ring, else (or when no replica is under the
    bound) the power of two choices. ``None``: every eligible replica is full, or none is."""
    # With one replica there is nothing for affinity to choose: no hashing of the key.
    if key is not None and ring is not None and len(targets) > 1:
        target = by_affinity(targets, ring, key, total, epsilon, exclude)
        if target is not None:
            return target
    return two_choices(targets, rng, exclude)


_ABSENT = (b"", b"null", b'""', b"[]")


def affinity_key(user: str | bytes | None, conversation: bytes,
                 prefix_bytes: int = DEFAULT_PREFIX_BYTES) -> bytes | None:
    """The key that keeps a client on one replica: its ``user``, else the first bytes of
    its conversation (the ``messages`` or ``prompt`` JSON as sent). ``user`` may be the
    field's raw JSON; ``null`` or ``""`` count as no user.

    The prefix is what later turns of a conversation share with the first, and what the
    engine's prefix cache can reuse. A conversation shorter than ``prefix_bytes`` gets a
    new key on its next turn; a smaller ``prefix_bytes`` keeps keys longer, at the price of
    grouping conversations that share a system prompt (which share cached tokens anyway).
    """
    if isinstance(user, str):
        user = user.encode()
    if user and user not in _ABSENT:
        return b"user:" + user
    if conversation not in _ABSENT:
        return b"conv:" + conversation[:prefix_bytes]
    return None


def is_eligible(target: Target, exclude: Collection[str]) -> bool:
    """The replica has a free slot and is not excluded."""
    return target.outstanding < target.slots and target.replica not in exclude


def _draw_two(targets: Sequence[T], rng: random.Random) -> tuple[T, T]:
    n = len(targets)
    i = rng.randrange(n)
    j = rng.randrange(n - 1)
    return targets[i], targets[j + (j >= i)]


def _less_loaded(a: T, b: T) -> T:
    if a.outstanding != b.outstanding:
        return a if a.outstanding < b.outstanding else b
    return b if b.slots > a.slots else a
