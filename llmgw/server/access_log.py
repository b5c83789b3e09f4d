"""The access log: one JSON line per ``/v1`` request on the ``llmgw.access`` logger, with
``logging.access: json`` in server.yaml.

A line says who asked what of which model and how it went, never what was asked or
answered: no prompt, no answer, no header but the client's ``x-request-id``. Each is a
JSON object (msgspec), written as the log record's whole message; unless the operator
gave the logger handlers of their own, lines go to stderr as they are, without the
server log's time and level in front, so that a log shipper reads them as JSON.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from llmgw.server.openai.trail import Done, Origin

LOGGER = "llmgw.access"
# What of a model's name, as the client sent it, a line keeps.
MODEL_CHARS = 64


class AccessLine(msgspec.Struct, kw_only=True):
    """One request, as a line of the access log."""

    ts: str  # when the request arrived, RFC 3339 in UTC, to the millisecond
    request_id: str | None  # the client's x-request-id, if it sent one
    method: str
    path: str
    model: str | None  # as the client sent it, cut to MODEL_CHARS
    status: int  # 499: the client left before its answer was done
    duration_s: float
    ttft_s: float | None  # a stream's time to its first token
    input_tokens: int | None  # as the engine reported them
    output_tokens: int | None
    replica: str | None  # the replica that answered
    retries: int  # replicas that refused it before one took it
    key_id: str | None  # the API key's public id (its prefix), never the secret
    account_id: int | None  # the account that owns the key
    client: str | None  # the client's address
    stream: bool


_encode = msgspec.json.Encoder().encode


class AccessLog:
    """Writes access-log lines to the ``llmgw.access`` logger."""

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self._log = logger or logging.getLogger(LOGGER)
        if not self._log.handlers:
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            self._log.addHandler(handler)
            self._log.propagate = False
        # Asked for in server.yaml: written whatever the server's log_level.
        self._log.setLevel(logging.INFO)

    def write(self, done: Done, origin: Origin, wall_end: float) -> None:
        """``done``, which ended at ``wall_end`` (``time.time()``)."""
        usage = done.usage
        key = done.key
        began = wall_end - done.seconds
        line = AccessLine(
            ts=time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(began))
            + f".{int(began % 1 * 1000):03d}Z",
            request_id=origin.request_id, method="POST", path=done.path[:256],
            model=None if done.model is None else done.model[:MODEL_CHARS],
            status=done.status, duration_s=round(done.seconds, 6),
            ttft_s=None if done.first_token is None else round(done.first_token, 6),
            input_tokens=None if usage is None else usage.prompt_tokens,
            output_tokens=None if usage is None else usage.completion_tokens,
            replica=done.replica, retries=done.retries,
            key_id=None if key is None else key.prefix,
            account_id=None if key is None else key.account_id,
            client=origin.client, stream=done.stream)
        log = self._log
        if log.isEnabledFor(logging.INFO):
            # A record made here rather than by ``info``, which would walk the stack for
            # the caller's file and line (a third of a line's cost), which no line shows.
            log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0,
                                      _encode(line).decode(), (), None))
