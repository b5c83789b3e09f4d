"""Forwarding one request to an engine, and writing its answer to the client, stream or not.

The client's body is forwarded exactly as sent (but for a request sent to an alias, whose
``model`` admission set to the model's name, and one sent to a static endpoint with a name
of its own for the model, whose ``model`` is set to that name: ``body_for``); only
``model`` and ``stream`` were read to route it. A static endpoint's requests carry its
path, key and TLS (its ``transport.target.Target``). The answer is written through the
server's BodyWriter where it offers one (llmgw's own server does): a whole answer at
once (``write_whole``), a streamed one chunk by chunk as the engine writes it, from the
engine connection's callback, never buffered.
Under another server it goes through the request's ASGI ``send``. Cancelling the task
that forwards (the route does when the client goes away) closes the upstream connection,
so the engine stops generating for nobody.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

import msgspec

from llmgw.config import Gateway
from llmgw.core.usage import StreamUsage
from llmgw.server.endpoints import key_refused
from llmgw.server.errors import ApiError
from llmgw.server.openai.admission import body_with_model
from llmgw.server.openai.router import Lease
from llmgw.server.openai.timing import StreamClock, timed_sink
from llmgw.transport.answer import Answer
from llmgw.transport.errors import ConnectError, UpstreamError, UpstreamTimeout
from llmgw.transport.pool import JSON_TYPE, Pool
from llmgw.transport.writer import BodyWriter

if TYPE_CHECKING:
    from llmgw.server.openai.admission import Ask, GatewayContext


log = logging.getLogger(__name__)

Send = Callable[[dict], Awaitable[None]]



# How a body that stopped at the end of a server-sent event ends: a blank line, which is
# two line ends in a row, each an LF, a CRLF or a lone CR.
_EVENT_ENDS = (b"\n\n", b"\r\r", b"\n\r", b"\n\r\n", b"\r\r\n")


def ends_an_event(last: bytes) -> bool:
    """Whether a stream whose body so far ends with ``last`` (a part of it: what was
    written last) stopped between two events, so that an event of llmgw's may follow;
    True when nothing was written. Inside an event, one of ours would be read as part of
    it. (Engines write an event a chunk: a part that ends an event ends with its blank
    line. One whose blank line is split over two parts is taken as inside an event.)"""
    return not last or last.endswith(_EVENT_ENDS)


def stream_error(message: str, code: str) -> bytes:
    """An OpenAI-shaped error as the stream's last event: a client reading SSE sees why."""
    body = msgspec.json.encode({"error": {"message": message, "type": "server_error",
                                          "code": code}})
    return b"data: " + body + b"\n\n"


def upstream_pool(gateway: Gateway) -> Pool:
    """One pool of engine connections for every upstream request of this server process."""
    return Pool(connect_timeout_s=gateway.connect_timeout_s)


class Retryable(Exception):
    """No engine worked on the request: no connection could be made to the replica, or
    its engine answered 503. Another replica may take it."""


class Progress(Protocol):
    """Told as the answer goes out, for the request's metrics (and its span and log)."""

    def started(self, status: int) -> None:
        """The answer's status line is about to be sent."""

    def first_bytes(self) -> None:
        """The first bytes of the answer's body are about to be sent."""

    def stream_clock(self) -> StreamClock:
        """The answer is relayed as a stream: the clock its reads are timed with."""

    def answered(self, content: bytes) -> None:
        """A whole answer succeeded; ``content`` is its body, which holds its usage."""

    def streamed(self, reader: StreamUsage) -> None:
        """A stream is over, however it ended; ``reader`` has read its usage."""

ACCEPT_STREAM = b"text/event-stream"
# Names the model whose engine answered (a fallback, or the model sent), on every answer
# to a request for a model that names fallbacks.
MODEL_HEADER = b"x-llmgw-model"


async def forward(state: GatewayContext, lease: Lease, ask: Ask, send: Send,
                  progress: Progress, writer: BodyWriter | None = None) -> None:
    """Forward ``ask`` on ``lease`` and write the answer with ``send``; where the
    server offers a ``writer``, a stream's chunks go through it, and a response's head
    leaves in one write with the first bytes that came with it. Raises ``Retryable`` or
    ``ApiError`` only before anything was sent to the client; the lease is released however
    this ends. What a successful answer used (the tokens the engine reported, or None) is
    told to ``progress`` once (``Progress.answered``, ``Progress.streamed``)."""
    endpoint, gateway, stream = lease.endpoint, state.config.gateway, ask.stream
    remote = endpoint.remote  # None for a replica
    try:
        try:
            upstream = await state.upstream.post(
                endpoint.host, endpoint.port, ask.path,
                ask.body if remote is None else body_for(ask, remote.model),
                ACCEPT_STREAM if stream else JSON_TYPE,
                first_byte_timeout_s=gateway.first_byte_timeout_s,
                idle_timeout_s=gateway.idle_timeout_s, content_type=ask.content_type,
                target=None if remote is None else remote.target)
        except UpstreamError as err:
            if remote is not None and isinstance(err, ConnectError):
                state.controller.endpoints.recheck()  # out of routing soon, if it is down
            raise no_head(err, lease.replica, gateway) from None
        if ask.shows_model:
            show_model(upstream, ask.model)
        try:
            if upstream.status == 503:
                raise Retryable(f"{lease.replica} answered 503")
            if remote is not None and upstream.status in (401, 403):
                # Its key (llmgw's, not the client's) was refused: the client is not told
                # its own was. No work was done: another replica or endpoint may take it.
                state.controller.endpoints.recheck()
                raise Retryable(f"{lease.replica} ({remote.endpoint.url}): "
                                f"{key_refused(remote.endpoint, upstream.status)}")
            if stream and is_event_stream(upstream.status, upstream.headers):
                await _relay(upstream, lease.replica, gateway, send, progress, writer)
            else:
                await _answer(upstream, lease.replica, gateway, send, progress, writer)
        finally:
            # Back to the pool when read to the end; dropped where the answer was cut
            # short, which is how the engine learns that nobody is listening any more.
            upstream.close()
    finally:
        lease.release()


def body_for(ask: Ask, upstream_model: str | None) -> bytes:
    """The body of ``ask`` as a static endpoint with its own name for the model
    (``upstream_model``) is sent it: that name as ``model``. The ask's own body is kept
    for a retry on another replica or endpoint."""
    if upstream_model is None or upstream_model == ask.model:
        return ask.body
    return body_with_model(ask.body, ask.content_type, upstream_model)


def show_model(answer: Answer, model: str) -> None:
    """The answer to a request for a model that names fallbacks says which model's engine
    answered it (``MODEL_HEADER``): the model sent, or the fallback it went to."""
    answer.headers = [*answer.headers, (MODEL_HEADER, model.encode())]


def no_head(err: UpstreamError, replica: str, gateway: Gateway) -> Retryable | ApiError:
    """What to do when the engine's answer broke off before its head came. Only a request
    no engine can have worked on goes to another replica: one that found no connection.
    One that was written to an engine is not sent again, however it broke (the engine
    died while generating, or was killed by its health watch): it would generate the
    same tokens twice, and a request that killed one engine would go on to the next.
    (``Pool.post`` has already sent one again that a kept-alive connection's engine never
    took.)"""
    if isinstance(err, ConnectError):
        return Retryable(f"{replica}: {err}")
    if isinstance(err, UpstreamTimeout):
        return ApiError(504, f"{replica} sent nothing for {gateway.first_byte_timeout_s:g} s "
                        "(gateway.first_byte_timeout_s)", code="upstream_timeout")
    return ApiError(502, f"{replica}: {err}; not retried: the engine may have been working "
                    "on it", code="upstream_error")


def is_event_stream(status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """The answer to a streamed request is relayed as a stream (else as a whole)."""
    media_type = _content_type(headers) or JSON_TYPE
    return status == 200 and media_type.startswith(ACCEPT_STREAM)


def broken_answer(err: UpstreamError, replica: str, gateway: Gateway) -> ApiError:
    """The error sent for a whole answer whose body broke off."""
    if isinstance(err, UpstreamTimeout):
        return ApiError(504, _silence(replica, err, gateway, "its answer"),
                        code="upstream_timeout")
    return ApiError(502, f"the engine of {replica} broke off its answer: {err}",
                    code="upstream_error")


def broken_stream(err: UpstreamError, replica: str, gateway: Gateway) -> bytes:
    """The last event of a stream that broke off (logged)."""
    if isinstance(err, UpstreamTimeout):
        why = _silence(replica, err, gateway, "the stream")
        log.warning("%s; ending the stream", why)
        return stream_error(why, "upstream_timeout")
    log.warning("%s broke off its stream: %s", replica, err)
    return stream_error(f"the engine of {replica} broke off the stream", "upstream_error")


def answer_headers(headers: list[tuple[bytes, bytes]], whole: bool
                   ) -> list[tuple[bytes, bytes]]:
    """The headers sent to the client for an engine's answer, but its length: its kept
    headers, then, for a ``whole`` answer, its type where the engine gave none; for a
    stream, a word to proxies in front not to buffer it."""
    if not whole:
        return [*headers, (b"x-accel-buffering", b"no")]
    if _content_type(headers) is None:
        return [*headers, (b"content-type", JSON_TYPE)]
    return headers


def _content_type(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    # A loop, not next() over a generator: this runs for every answer.
    for name, value in headers:
        if name == b"content-type":
            return value
    return None


async def _answer(upstream: Answer, replica: str, gateway: Gateway, send: Send,
                  progress: Progress, writer: BodyWriter | None) -> None:
    try:
        content = await upstream.read()
    except UpstreamError as err:
        raise broken_answer(err, replica, gateway) from None
    if writer is not None:
        write_whole(writer, upstream.status, upstream.headers, content, progress)
        return
    progress.started(upstream.status)
    await send({"type": "http.response.start", "status": upstream.status,
                "headers": [*answer_headers(upstream.headers, whole=True),
                            (b"content-length", str(len(content)).encode())]})
    if content:
        progress.first_bytes()
    await send({"type": "http.response.body", "body": content})
    _count_whole(upstream.status, content, progress)


def write_whole(writer: BodyWriter, status: int, headers: list[tuple[bytes, bytes]],
                content: bytes, progress: Progress) -> None:
    """An engine's whole answer (``status``, its ``headers``, ``content``) written to the
    client at once, head and body in one write, from a task or from a callback."""
    progress.started(status)
    writer.hold()
    try:
        writer.start(status, answer_headers(headers, whole=True), len(content))
        if content:
            progress.first_bytes()
        writer.finish(content)
    finally:
        writer.release()
    _count_whole(status, content, progress)


def _count_whole(status: int, content: bytes, progress: Progress) -> None:
    if 200 <= status < 300:
        progress.answered(content)


async def _relay(upstream: Answer, replica: str, gateway: Gateway, send: Send,
                 progress: Progress, writer: BodyWriter | None) -> None:
    progress.started(200)
    if writer is not None and upstream.pending:
        # The first chunk came with the head: both go to the client in one write.
        writer.hold()
    try:
        await send({"type": "http.response.start", "status": 200,
                    "headers": answer_headers(upstream.headers, whole=False)})
        await _body(upstream, replica, gateway, send, progress, writer)
    finally:
        if writer is not None:
            writer.release()


async def _body(upstream: Answer, replica: str, gateway: Gateway, send: Send,
                progress: Progress, writer: BodyWriter | None) -> None:
    tail = b""
    reader = StreamUsage()
    clock = progress.stream_clock()
    sent = _Sent()
    try:
        try:
            if writer is not None:
                await upstream.pipe(timed_sink(
                    writer.sink(upstream.resume, progress.first_bytes, reader), clock))
            else:
                await _copy(upstream, send, progress, reader, sent, clock)
        except UpstreamError as err:
            tail = broken_stream(err, replica, gateway)
            if not ends_an_event(writer.last_part if writer is not None else sent.last):
                # Inside an event, an event of llmgw's would be read as part of it: the
                # body is left unended, and the client sees the stream break.
                if writer is not None:
                    writer.cut()  # as a relayed stream's (direct.Exchange._end_relay)
                # Else the server closes the connection of a response its app left
                # unended (ASGI), which is all an app under another server can do.
                return
        await send({"type": "http.response.body", "body": tail, "more_body": False})
    finally:
        # Counted however the stream ended (broken off, or the client left): the tokens
        # were spent.
        progress.streamed(reader)
        clock.done()


def _silence(replica: str, err: UpstreamTimeout, gateway: Gateway, what: str) -> str:
    """Why an answer whose status line came was cut short by a limit, naming the limit."""
    if err.phase == "first_byte":
        return (f"{replica} sent no part of {what} within "
                f"{gateway.first_byte_timeout_s:g} s (gateway.first_byte_timeout_s)")
    return (f"{replica} sent nothing for {gateway.idle_timeout_s:g} s in the middle of "
            f"{what} (gateway.idle_timeout_s)")


class _Sent:
    """What ``_copy`` sent last, for ending a stream that broke off as it stood."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = b""


async def _copy(upstream: Answer, send: Send, progress: Progress, reader: StreamUsage,
                sent: _Sent, clock: StreamClock) -> None:
    """The stream chunk by chunk through ``send``, for a server that offers no writer."""
    chunk = await upstream.chunk()
    if chunk:
        progress.first_bytes()
    while chunk:
        reader.feed([chunk])
        clock.read(chunk)
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
        sent.last = chunk
        chunk = await upstream.chunk()
