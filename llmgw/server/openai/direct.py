"""An engine's answer relayed from callbacks, with no task: the hot path of a ``/v1``
request on llmgw's own server.

``proxy.forward`` relays an answer in the request's task, awaiting each step. For a
stream, that task, its coroutines and the ASGI messages around them cost more CPU than
relaying every event of the stream (bench/README.md); for a whole answer, more than the
rest of the request. So ``routes.GatewayFront.serve_now`` sends a request that needs no
wait (its key read lately, a free slot, an idle connection to the engine) at once, from
the server's callback, and an Exchange answers it from the engine connection's callbacks:
the head when it comes, then a stream's body through the client's BodyWriter, then the
end; or a whole answer at once when it is all in. A stream the engine sends in chunks, as
engines do, is relayed as it came, chunk framing and all (``Answer.start_relay``): each
read from the engine is written to the client from the engine connection's callback, with
no Python call of llmgw's in between; any other is handed on by ``pipe`` and framed in
chunks again. What it says in each case (timeouts, an engine that breaks off, usage,
metrics) is what ``proxy.forward`` says: the words are the same functions.

A request that no engine worked on goes back to the request's task path, which sends it
again, as long as nothing was written to the client: one the engine refused with 503 (to
another replica), and one whose kept-alive connection the engine had closed before the
request reached it (``upstream.Undelivered``: the engine's TCP never acknowledged it). One
that broke off after it reached the engine is answered 502 and sent nowhere else
(``proxy.no_head``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmgw.core.usage import SETTLE_BYTES, StreamUsage, Usage, answer_of, usage_from_body
from llmgw.server.errors import ApiError
from llmgw.server.openai.proxy import (
    Retryable,
    answer_headers,
    broken_answer,
    broken_stream,
    ends_an_event,
    is_event_stream,
    no_head,
    show_model,
    stream_error,
    write_whole,
)
from llmgw.server.openai.router import Lease
from llmgw.server.openai.timing import StreamClock, timed_sink, timed_write
from llmgw.server.openai.trail import Done, Origin
from llmgw.transport.answer import Answer
from llmgw.transport.errors import Undelivered
from llmgw.transport.writer import BodyWriter

if TYPE_CHECKING:
    from llmgw.server.openai.admission import Ask, GatewayContext

log = logging.getLogger(__name__)

# Where a request handed back to the task path carries the replica that refused it and why,
# for its retries (a scope extension: ``CallbackRoutes.serve_now``'s ``fall_back``).
REFUSED = "llmgw.refused"


class Exchange:
    """One request sent to an engine, answered from callbacks until it is over; and the
    request's progress (``proxy.Progress``), for its metrics.

    ``fall_back(extensions)`` (the server's: ``CallbackRoutes.serve_now``) hands the
    request back to the task path before anything was written, with the replica that did
    not take it and why under ``REFUSED`` (a retry, counted in ``metrics``), or with no
    extensions when it was not the replica's fault (a kept-alive connection the engine
    had closed before the request reached it). Once the answer is over, however it
    ended, it is counted in the gateway's metrics as a request for the ask's model and
    kind, what it used against the ask's key, if it has one, and, with an ``origin``
    (the request's head, read when a span or access-log line is asked for), it is
    recorded in the gateway's trail."""

    __slots__ = ("_answer", "_began", "_clock", "_fall_back", "_gateway", "_kept", "_key",
                 "_kind", "_lease", "_metrics", "_model", "_origin", "_over", "_path",
                 "_reader", "_relayed", "_relaying", "_reported", "_response_model",
                 "_shows_model", "_status", "_stream", "_streaming", "_usage", "_writer")

    def __init__(self, state: GatewayContext, ask: Ask, lease: Lease, answer: Answer,
                 writer: BodyWriter, fall_back: Callable[[dict | None], None],
                 origin: Origin | None = None):
        self._answer = answer
        self._stream = ask.stream  # the client asked for a stream
        self._lease = lease
        self._gateway = state.config.gateway
        self._writer = writer
        self._metrics = state.metrics
        self._model = ask.model
        self._shows_model = ask.shows_model
        self._kind = ask.kind
        self._path = ask.path
        key = self._key = ask.key
        # Copied out of the ask: each is read on the answer's callbacks.
        self._usage = state.usage if key is not None else None
        self._origin = origin
        self._fall_back = fall_back
        self._began = time.perf_counter()
        self._status = 0  # the answer's, once started
        self._over = False
        self._streaming = False  # relayed as a stream; else kept whole in ``_kept``
        self._kept: list[bytes] | None = None
        self._reader: StreamUsage | None = None
        self._clock: StreamClock | None = None
        self._reported: Usage | None = None
        self._response_model: str | None = None
        self._relayed = False  # some of a stream's body was written
        self._relaying = False  # the stream is relayed as the engine framed it
        answer.watch(self._step)
        writer.on_disconnect(self._client_gone)

    # proxy.Progress

    def started(self, status: int) -> None:
        self._status = status

    def first_bytes(self) -> None:
        if self._stream:
            self._metrics.first_byte(self._model, time.perf_counter() - self._began)

    def stream_clock(self) -> StreamClock:
        clock = self._clock = StreamClock(self._metrics.stream_series(self._model),
                                          self._began)
        return clock

    def answered(self, content: bytes) -> None:
        if self._origin is None:
            usage = self._reported = usage_from_body(content)
        else:  # and the model it names, for the span
            usage, self._response_model = answer_of(content)
            self._reported = usage
        if self._usage is not None:
            self._usage.add(self._key.id, self._model, usage)  # type: ignore[union-attr]

    def streamed(self, reader: StreamUsage) -> None:
        counted, self._reported = reader.both()
        self._response_model = reader.model
        if self._usage is not None:
            self._usage.add(self._key.id, self._model, counted)  # type: ignore[union-attr]

    def _step(self) -> None:
        if self._over:
            return
        try:
            answer = self._answer
            if self._kept is None and not self._streaming:
                if not answer.status:
                    if answer.error is not None:
                        self._no_head()
                    return
                if self._shows_model:
                    show_model(answer, self._model)
                if (answer.done and not self._stream and answer.error is None
                        and answer.status != 503):
                    # Whole with its head, as most whole answers come: at once.
                    self._whole(answer.take())
                    return
                if not self._head():
                    return
            if answer.done or answer.error is not None:
                self._end()
        except Exception:
            log.exception("unexpected error relaying an answer of %s", self._lease.replica)
            self._abandon()

    def _no_head(self) -> None:
        err = self._answer.error
        if isinstance(err, Undelivered):
            # The engine had closed the kept-alive connection: no engine has the request.
            # The task path sends it again (``Pool.post``: a new connection when no other
            # idle one is left).
            self._hand_back(None)
            return
        outcome = no_head(err, self._lease.replica, self._gateway)
        if isinstance(outcome, Retryable):
            self._hand_back(str(outcome))
        else:
            self._end_with(outcome)

    def _head(self) -> bool:
        """The head came: start the answer. False when it was handed back instead."""
        answer, writer = self._answer, self._writer
        if answer.status == 503:
            self._hand_back(f"{self._lease.replica} answered 503")
            return False
        if not (self._stream and is_event_stream(answer.status, answer.headers)):
            kept = self._kept = []

            def keep(chunks: list[bytes]) -> bool:
                kept.extend(chunks)
                return True

            answer.start_pipe(keep)
            return True
        self._streaming = True
        self._status = 200
        reader = self._reader = StreamUsage()
        clock = self.stream_clock()
        early = answer.relayable()
        headers = answer_headers(answer.headers, whole=False)
        if early is None:
            if answer.pending:
                writer.hold()  # the first chunk came with the head: both in one write
            writer.start(200, headers)
            answer.start_pipe(timed_sink(writer.sink(answer.resume, self._first_bytes,
                                                     reader), clock))
            writer.release()
            return True
        self._relaying = True
        on_first: Callable[[], None] | None = None
        if answer.pending:
            self._first_bytes()
        else:
            on_first = self._first_bytes
        writer.start(200, headers, then=early)  # the first chunk, if it came, with the head
        if early:
            clock.read(early)
        write = writer.relay(b"", answer.pause, answer.resume)
        answer.start_relay(timed_write(write, clock), on_first, reader.feed,
                           SETTLE_BYTES // 2,  # with what `feed` keeps: SETTLE_BYTES
                           self._relayed_whole)
        return True

    def _relayed_whole(self) -> None:
        """The relayed stream ended where the engine ended it, its end relayed too: the
        answer is complete (``Answer.start_relay``'s ``on_end``: no watch, no ``_end``)."""
        if self._over:
            return
        self._over = True
        try:
            self._writer.on_disconnect(None)
            self._writer.end_relayed()
            self._finish()
        except Exception:
            log.exception("unexpected error relaying an answer of %s", self._lease.replica)
            self._abandon()

    def _end(self) -> None:
        """The answer is complete, or broke off after its head. The read that ended it is
        still pending (``Answer.take``): written here with the end, in one write."""
        answer, writer = self._answer, self._writer
        err = answer.error
        last = answer.take() if answer.pending else b""
        if self._relaying:
            self._over = True
            writer.on_disconnect(None)
            self._end_relay(b"" if err is None else
                            broken_stream(err, self._lease.replica, self._gateway))
            self._finish()
        elif self._streaming:
            self._over = True
            writer.on_disconnect(None)
            if last:
                if not self._relayed:
                    self._first_bytes()
                # Settled as the usage is read.
                self._reader.pending.append(last)  # type: ignore[union-attr]
                self._clock.read(last)  # type: ignore[union-attr]
            if err is None:
                writer.finish(last)
            else:
                self._end_piped(last, broken_stream(err, self._lease.replica,
                                                    self._gateway))
            self._finish()
        elif err is not None:
            self._end_with(broken_answer(err, self._lease.replica, self._gateway))
        else:
            self._whole(b"".join(self._kept) + last)

    def _whole(self, content: bytes) -> None:
        """The whole answer came: ``content`` is its body."""
        self._over = True
        self._writer.on_disconnect(None)
        answer = self._answer
        write_whole(self._writer, answer.status, answer.headers, content, self)
        self._finish()

    def _end_piped(self, last: bytes, event: bytes) -> None:
        """End a piped stream that broke off, after ``last`` (what came last, maybe
        nothing), with ``event`` if it stopped between two events; else close the
        client's connection after ``last``: its client sees the stream break."""
        writer = self._writer
        if ends_an_event(last or writer.last_part):
            writer.finish(last + event)
        else:
            if last:
                writer.write(last)
            writer.cut()

    def _end_relay(self, event: bytes) -> None:
        """End a relayed stream that broke off, or was stopped, with ``event``, if it
        stopped at a chunk's end; else close the client's connection: its client sees the
        stream break. (One whose end was relayed is complete as it is.)"""
        answer = self._answer
        if answer.done and answer.error is None:
            self._writer.end_relayed()
        elif answer.at_chunk_end():
            self._writer.finish(event)
        else:
            self._writer.cut()

    def _first_bytes(self) -> None:
        self._relayed = True
        self.first_bytes()

    def _hand_back(self, refusal: str | None) -> None:
        """To the task path, which tries again (nothing was written): on another replica
        if ``refusal`` says why this one did not take the request."""
        self._over = True
        self._writer.on_disconnect(None)
        self._close_upstream()
        if refusal is None:
            self._fall_back(None)
        else:
            self._metrics.retry(self._model)
            self._fall_back({REFUSED: (self._lease.replica, refusal)})

    def _end_with(self, err: ApiError) -> None:
        """Answer ``err``: nothing of the answer was written yet."""
        self._over = True
        self._writer.on_disconnect(None)
        self._close_upstream()
        self._write_error(err)
        self._writer.served()
        self._count()

    def _write_error(self, err: ApiError) -> None:
        headers, body = err.raw()
        self._status = err.status
        self._writer.start(err.status, headers, len(body))
        self._writer.finish(body)

    def _client_gone(self) -> None:
        if not self._over:
            self._over = True
            self._finish()

    def _abandon(self) -> None:
        """After a bug: the client is told, nothing is held."""
        self._over = True
        self._writer.on_disconnect(None)
        try:
            error = stream_error("internal error; the server's log has the details",
                                 "internal_error")
            if self._relaying:
                self._answer.stop_pipe()  # nothing more relayed before the end
                self._end_relay(error)
            elif self._streaming:
                self._end_piped(b"", error)
            else:
                self._write_error(ApiError(500, "internal error; the server's log has the "
                                           "details", code="internal_error"))
        except Exception:
            log.exception("could not answer after an unexpected error")
        finally:
            self._finish()

    def _close_upstream(self) -> None:
        """Drop the answer (its connection goes back to the pool only when read to the
        end) and free the slot."""
        self._answer.close()
        self._lease.release()

    def _finish(self) -> None:
        self._close_upstream()
        reader = self._reader
        if reader is not None:
            # Counted however the stream ended (broken off, or the client left): the
            # tokens were spent.
            self.streamed(reader)
            self._clock.done()  # type: ignore[union-attr]  # made with the reader
        self._writer.served()
        self._count()

    def _count(self) -> None:
        """The request is over: in the metrics (499 if the client left unanswered), and
        in the trail when its origin was read for it."""
        status = self._status or 499
        seconds = time.perf_counter() - self._began
        self._metrics.request_done(self._model, self._kind, status, seconds, self._key,
                                   self._reported)
        if self._origin is not None:
            clock = self._clock
            self._metrics.trail.record(Done(  # type: ignore[union-attr]  # origin: it is on
                path=self._path, kind=self._kind, model=self._model, status=status,
                seconds=seconds, stream=self._stream,
                first_token=None if clock is None else clock.first_token,
                usage=self._reported, response_model=self._response_model,
                replica=self._lease.replica, key=self._key), self._origin)
