"""API keys and the admin token.

An API key looks like ``llmgw_<12-char id><32-char secret><6-char checksum>``: the fixed
prefix and the CRC let secret scanners recognise a leaked key and reject typos without a
database round trip. Only the key's SHA-256 is stored (a 190-bit random secret needs no
slow hash), and it is looked up by its id part, which is also how keys are listed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import secrets
import string
import time
import zlib
from collections.abc import Callable
from datetime import UTC, datetime

import msgspec

from llmgw.store import ApiKeyRecord, Store, StoreError, StoreUnavailable

log = logging.getLogger(__name__)
# KeyCache.run's shortest period: a tiny auth.key_cache_s must not query in a loop.
_MIN_REFRESH_S = 0.25

KEY_PREFIX = "llmgw_"
_ALPHABET = string.digits + string.ascii_letters
_ID_LEN, _SECRET_LEN, _CRC_LEN = 12, 32, 6
KEY_LEN = len(KEY_PREFIX) + _ID_LEN + _SECRET_LEN + _CRC_LEN
_PREFIX_LEN = len(KEY_PREFIX) + _ID_LEN  # what key_id returns


def _base62(number: int, width: int) -> str:
    out = []
    for _ in range(width):
        number, digit = divmod(number, 62)
        out.append(_ALPHABET[digit])
    return "".join(reversed(out))


def _checksum(body: str) -> str:
    return _base62(zlib.crc32(body.encode()), _CRC_LEN)


def new_api_key() -> str:
    body = "".join(secrets.choice(_ALPHABET) for _ in range(_ID_LEN + _SECRET_LEN))
    return KEY_PREFIX + body + _checksum(KEY_PREFIX + body)


def key_id(key: str) -> str | None:
    """The listed, stored id of a well-formed key (``llmgw_`` plus 12 characters), or
    ``None`` when the string cannot be one of our keys."""
    if len(key) != KEY_LEN or not key.startswith(KEY_PREFIX):
        return None
    body, crc = key[:-_CRC_LEN], key[-_CRC_LEN:]
    if not hmac.compare_digest(_checksum(body), crc):
        return None
    return key[:_PREFIX_LEN]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


# Where ``_digest_once`` keeps the last key of a client's connection and its digest.
_LAST_DIGEST = "llmgw.auth.last_digest"


def _digest_once(key: str, memo: dict) -> bytes:
    """``_digest(key)``, worked out once for a client's connection as long as it sends the
    same key (``memo`` lives as long as the connection: ``BodyWriter.connection_memo``).
    A kept-alive client sends its key with every request, and SHA-256 through OpenSSL on
    caches that relayed streams left cold costs 10-15 µs (under one in a loop): side by
    side, a plain proxied request cost about 5 µs less with this (docs/security.md).
    The key is compared in constant time: a proxy's connection may carry several
    clients' requests, one after the other."""
    raw = key.encode()
    last = memo.get(_LAST_DIGEST)
    if last is not None and hmac.compare_digest(last[0], raw):
        return last[1]
    digest = _digest(key)
    memo[_LAST_DIGEST] = (raw, digest)
    return digest


def hash_key(key: str) -> str:
    """What the store keeps of a key."""
    return _digest(key).hex()


async def create_api_key(store: Store, name: str, allowed_models: list[str] | None = None,
                         *, account_id: int | None = None, expires_at: datetime | None = None
                         ) -> tuple[str, ApiKeyRecord]:
    """Make and store a key; the plaintext is returned once and never kept."""
    key = new_api_key()
    record = await store.add_api_key(ApiKeyRecord(
        prefix=key_id(key), secret_hash=hash_key(key), name=name,
        allowed_models=allowed_models, created_at=datetime.now(UTC),
        account_id=account_id, expires_at=expires_at))
    return key, record


_MALFORMED = "the API key is malformed; it should start with llmgw_ and be copied whole"
_NOT_VALID = "the API key is not valid"


class _Known(msgspec.Struct, frozen=True):
    """A key as the store last showed it, with whether its owner (if any) may use it."""

    record: ApiKeyRecord
    owner_enabled: bool
    digest: bytes  # record.secret_hash, as _digest gives it

    def judge(self, key: str, now: datetime | None, digest: bytes | None = None
              ) -> ApiKeyRecord | str:
        """``now`` None: the time is read only if the key can expire; ``digest``, the key's
        ``_digest`` if the caller has it."""
        record = self.record
        if digest is None:
            digest = _digest(key)
        if not hmac.compare_digest(self.digest, digest):
            return _NOT_VALID
        if record.revoked_at is not None:
            return "the API key has been revoked"
        if record.expires_at is not None and record.expires_at <= (now or datetime.now(UTC)):
            return "the API key has expired"
        if not self.owner_enabled:
            return "the account that owns this API key is disabled"
        return record


def _known(record: ApiKeyRecord, owner_enabled: bool) -> _Known:
    return _Known(record, owner_enabled, bytes.fromhex(record.secret_hash))


async def _lookup(store: Store, prefix: str) -> _Known | None:
    found = await store.find_api_keys([prefix])
    return _known(*found[0]) if found else None


async def check_api_key(store: Store, key: str, now: datetime) -> ApiKeyRecord | str:
    """The key's record, or why it was refused (in words for the client), read from the
    store now. The gateway asks a KeyCache instead."""
    prefix = key_id(key)
    if prefix is None:
        return _MALFORMED
    known = await _lookup(store, prefix)
    return _NOT_VALID if known is None else known.judge(key, now)


class KeyCache:
    """What the store said of each API key id in use, whether it has that key or not,
    trusted for ``ttl_s``: a request reads the store only when its key's id was not read
    within that time, not on every request (on SQLite that read cost ten times the rest of
    a proxied request).

    **Unknown ids are remembered too** (``max_unknown`` of them, the ones read longest ago
    forgotten first), for the same ``ttl_s`` as keys the store has, and refreshed the same
    way. Were such an id read on every request, its answer would take a store read longer
    than a known id's with a wrong secret (about 2 ms against 0.5 on SQLite), telling
    whether an id exists, and any client could make every request cost a store read. A
    second request naming the same id is answered from memory either way, with the same work
    (the key's SHA-256 compared in constant time) and the same answer, ``the API key is
    not valid``. What still differs is the first request naming an id not read lately: it
    reads the store whether the id exists or not; only a key in use is answered at once,
    and naming it needs its id, 71 random bits.

    **Reads of ids not known are batched, one at a time**: the ids that miss while a read
    is on its way wait for it to end and are then read together, in one query per 500
    (``Store.find_api_keys``). A flood of made-up ids, each new, thus costs at most one key
    read in flight at any moment, in batches as large as the flood is wide, not a read per
    request; and requests for the same id share one read.

    Memory is bounded: at most ``max_keys`` known and ``max_unknown`` unknown ids, and
    the ids waiting for a read are those of requests in progress.

    A change made through this server (revoked, limits changed, owner disabled) takes
    effect at once: the admin routes call ``forget``. One made through another server
    sharing the store takes effect here within ``ttl_s``, and that includes a key made
    there whose id was asked for here before it existed: an id remembered as unknown is
    trusted no longer than a revoked key would be. (A key made through this server has a
    new random id, which nobody asked for before, so it works at once.)

    ``run`` reads again, every ``ttl_s / 2`` and in a query per 500 ids, every id used
    since it last did, known or not, and drops the ids not used: a key in use never
    expires (for a ttl of at least twice ``_MIN_REFRESH_S``), so its requests never wait
    for a read, and many keys in use cost a query per 500, not one each. An unknown id
    that the store now has (made elsewhere) is seen at that read.
    """

    def __init__(self, store: Store, ttl_s: float, max_keys: int = 100_000,
                 clock: Callable[[], float] = time.monotonic, max_unknown: int = 10_000):
        self._store = store
        self._clock = clock
        self._ttl_s = ttl_s
        self._max_keys = max_keys
        self._max_unknown = max_unknown
        # prefix -> (what the store said, clock time until which it is trusted)
        self._known: dict[str, tuple[_Known, float]] = {}
        # prefix the store did not have -> clock time until which that is trusted
        self._unknown: dict[str, float] = {}
        # The ids waiting for a read (queued, or in the read on its way) -> what it found.
        self._waiting: dict[str, asyncio.Future[_Known | None]] = {}
        self._queued: list[str] = []  # for the next read
        self._reader: asyncio.Task[None] | None = None
        # Bumped by forget: a read begun before a change must not be kept after it.
        self._generation = 0
        # The ids checked since the last refresh: the ones it reads again. Only ids held
        # in _known or _unknown: what leaves them leaves this too.
        self._used: set[str] = set()

    @property
    def size(self) -> int:
        """How many ids are remembered, known or not."""
        return len(self._known) + len(self._unknown)

    async def check(self, key: str, now: datetime | None = None) -> ApiKeyRecord | str:
        """The key's record, or why it was refused, as check_api_key; ``now`` by default
        read only if the key can expire."""
        known = self._fresh(key)
        if known is not None:
            verdict = known.judge(key, now)
            if verdict is _NOT_VALID and key_id(key) is None:
                return _MALFORMED  # a typo: say so, as for a key not read lately
            return verdict
        prefix = key_id(key)
        if prefix is None:
            return _MALFORMED
        if self._absent(prefix):
            # The work of a wrong secret (a known id's path above), for the same answer.
            hmac.compare_digest(_NO_DIGEST, _digest(key))
            return _NOT_VALID
        known = await self._read(prefix)
        return _NOT_VALID if known is None else known.judge(key, now)

    def good_now(self, key: str, memo: dict | None = None) -> ApiKeyRecord | None:
        """The key's record when it was read lately and is good, without waiting; None
        when ``check`` must read it or refuses it. (Whether its limits admit the request
        is admission's to decide.) With
        ``memo``, a dict kept as long as the client's connection, the key is hashed once
        for as long as the connection sends it (``_digest_once``)."""
        known = self._fresh(key)
        if known is None:
            if len(key) == KEY_LEN and self._absent(key[:_PREFIX_LEN]):
                # Hashed as a wrong secret is, below: the two take the same time.
                hmac.compare_digest(_NO_DIGEST, _digest(key) if memo is None
                                    else _digest_once(key, memo))
            return None
        verdict = known.judge(key, None, None if memo is None else _digest_once(key, memo))
        return None if isinstance(verdict, str) else verdict

    def _fresh(self, key: str) -> _Known | None:
        # A key read lately is known by its id part: its hash, compared by ``judge``,
        # vouches for the rest, so the checksum need not be worked out first.
        head = key[:_PREFIX_LEN]
        cached = self._known.get(head) if len(key) == KEY_LEN else None
        if cached is None or cached[1] <= self._clock():
            return None
        self._used.add(head)
        return cached[0]

    def _absent(self, prefix: str) -> bool:
        """Whether the store did not have the id when it was read lately."""
        until = self._unknown.get(prefix)
        if until is None or until <= self._clock():
            return False
        self._used.add(prefix)
        return True

    async def _read(self, prefix: str) -> _Known | None:
        """What the store has of the id: read with every other id that misses meanwhile."""
        waiting = self._waiting.get(prefix)
        if waiting is None:
            waiting = self._waiting[prefix] = asyncio.get_running_loop().create_future()
            # A request gone before its answer came must not leave an error unretrieved.
            waiting.add_done_callback(_retrieve)
            self._queued.append(prefix)
            if self._reader is None:
                self._reader = asyncio.create_task(self._read_queued())
        # Shielded: a request that goes away does not cancel the read for the others.
        return await asyncio.shield(waiting)

    async def _read_queued(self) -> None:
        """Read the queued ids, those queued meanwhile next, until none is left."""
        try:
            while self._queued:
                batch, self._queued = self._queued, []
                generation = self._generation
                until = self._clock() + self._ttl_s  # from before the read: never longer
                try:
                    found = await self._store.find_api_keys(batch)
                except Exception as err:
                    for prefix in batch:
                        self._waiting.pop(prefix).set_exception(err)
                    continue
                by_id = {record.prefix: _known(record, enabled) for record, enabled in found}
                keep = self._ttl_s > 0 and generation == self._generation
                for prefix in batch:
                    known = by_id.get(prefix)
                    if keep:
                        self._keep(prefix, known, until)
                        self._used.add(prefix)
                    self._waiting.pop(prefix).set_result(known)
        finally:
            self._reader = None
            if self._queued or self._waiting:  # cancelled (the server stopping)
                for waiting in self._waiting.values():
                    waiting.cancel()
                self._waiting.clear()
                self._queued.clear()

    def _keep(self, prefix: str, known: _Known | None, until: float) -> None:
        """Remember what the store said of the id, in place of what it said before; the
        id read longest ago makes room when full."""
        self._known.pop(prefix, None)
        self._unknown.pop(prefix, None)
        kept: dict = self._known if known is not None else self._unknown
        if len(kept) >= (self._max_keys if known is not None else self._max_unknown):
            oldest = next(iter(kept))
            del kept[oldest]
            self._used.discard(oldest)
        kept[prefix] = (known, until) if known is not None else until

    async def refresh(self) -> None:
        """Read again, in one go, every id used since the last refresh, known or not;
        forget the rest (each is read at its next use)."""
        used, self._used = self._used, set()
        for kept in (self._known, self._unknown):
            for prefix in [p for p in kept if p not in used]:
                del kept[prefix]
        wanted = [p for p in used if p in self._known or p in self._unknown]
        if not wanted:
            return
        generation = self._generation
        until = self._clock() + self._ttl_s  # from before the read: never trusted longer
        try:
            found = await self._store.find_api_keys(wanted)
        except StoreUnavailable:
            # Nothing is revoked while the store does not answer: the keys in use keep
            # its last answer, and are read again once it answers.
            for prefix in wanted:
                known = self._known.get(prefix)
                if known is not None:
                    self._known[prefix] = (known[0], until)
                elif prefix in self._unknown:
                    self._unknown[prefix] = until
            raise
        if generation != self._generation:
            return  # a forget came meanwhile: what was read may be older than it
        by_id = {record.prefix: _known(record, enabled) for record, enabled in found}
        for prefix in wanted:  # one the store no longer has is remembered as unknown
            self._keep(prefix, by_id.get(prefix), until)

    async def run(self) -> None:
        """``refresh`` every ``ttl_s / 2`` (at most once every ``_MIN_REFRESH_S``) until
        cancelled; never with a ttl of 0."""
        if self._ttl_s <= 0:
            return
        while True:
            await asyncio.sleep(max(self._ttl_s / 2, _MIN_REFRESH_S))
            try:
                await self.refresh()
            except StoreUnavailable:
                pass  # the store logged the outage; the keys in use were kept
            except Exception as err:  # the loop must outlive any one pass
                # The keys in use then expire as they would without a refresh, and are
                # read at their next use.
                log.warning("could not read the API keys in use again: %s", err,
                            exc_info=not isinstance(err, StoreError))

    def forget(self, prefix: str | None = None) -> None:
        """Read the key (every key, without ``prefix``) from the store at its next use."""
        self._generation += 1
        if prefix is None:
            self._known.clear()
            self._unknown.clear()
            self._used.clear()
        else:
            self._known.pop(prefix, None)
            self._unknown.pop(prefix, None)
            self._used.discard(prefix)


# What an unknown id's key is compared with, as a known id's stored hash would be.
_NO_DIGEST = bytes(hashlib.sha256().digest_size)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
