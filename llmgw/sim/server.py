"""The sim engine's process: an OpenAI-compatible HTTP server with deterministic output.

It behaves like a real engine where the gateway and the agent can tell: it binds the
port it is given, answers /health only when its whole group is ready, streams tokens at
a set pace and stops work when a client goes away. However many tokens are asked for, it
generates them one at a time as they are sent, a reply at most ``CONTEXT_TOKENS`` long
(as a real engine's context bounds it), and gives its loop a turn between tokens, so
that it keeps answering /health while it generates. What it says is fake but stable: the
reply is a function of the prompt, so a test can compare two paths by their bytes.
Rank 0 serves HTTP; ranks >= 1 only hold their place in the group (see rendezvous.py).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import itertools
import logging
import math
import random
import re
import signal
import struct
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import msgspec
from aiohttp import web

from llmgw.sim.rendezvous import Group, Hello, RendezvousError, join_group, parse_address

log = logging.getLogger("llmgw.sim")
T = TypeVar("T")

DEFAULT_MAX_TOKENS = 16
# The longest reply, whatever max_tokens says (finish_reason "length"): a non-streamed
# one is held whole, a few hundred KB at most.
CONTEXT_TOKENS = 32768
# Generating faster than the pace (or with none), the loop gets a turn every so many
# tokens.
_TOKENS_PER_TURN = 64
SHUTDOWN_GRACE_S = 0.25
VOCABULARY = (
    "the", "cluster", "serves", "a", "token", "model", "node", "replica", "quietly", "and",
    "every", "shard", "answers", "with", "one", "stream", "of", "words", "from", "its",
    "leader", "while", "workers", "wait", "for", "gpus", "to", "warm", "up", "so", "fast", "now",
)


class ContentPart(msgspec.Struct):
    type: str = "text"
    text: str = ""


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ChatRequest(msgspec.Struct):
    messages: list[ChatMessage]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(msgspec.Struct):
    prompt: str | list[str]
    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None


class RerankRequest(msgspec.Struct):
    model: str
    query: str
    documents: list[str]
    top_n: int | None = None


class EmbeddingRequest(msgspec.Struct):
    input: str | list[str]
    model: str | None = None
    encoding_format: str = "float"
    dimensions: int | None = None


class ApiError(Exception):
    """A refusal that leaves as an OpenAI error envelope."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type_)

    def response(self) -> web.Response:
        error = {"message": self.message, "type": self.type, "param": self.param,
                 "code": self.code}
        return web.json_response({"error": error}, status=self.status)


def _rng(text: str) -> random.Random:
    # Only Random.random() is guaranteed stable across Python versions; use nothing else.
    return random.Random(int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big"))


def reply_tokens(prompt: str) -> Iterator[str]:
    """The reply to a prompt, token by token and without end: the first n tokens,
    concatenated, are the text of a reply n tokens long."""
    rng = _rng(prompt)
    separator = ""
    while True:
        yield separator + VOCABULARY[int(rng.random() * len(VOCABULARY))]
        separator = " "


def embedding(text: str, dim: int) -> list[float]:
    """A unit vector that depends only on the text."""
    rng = _rng(text)
    vector = [rng.random() * 2 - 1 for _ in range(dim)]
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return [x / norm for x in vector]


def _message_text(content: str | list[ContentPart] | None) -> str:
    if isinstance(content, list):
        return "\n".join(part.text for part in content)
    return content or ""


def _positive(value: int | None, param: str) -> int | None:
    if value is not None and value < 1:
        raise ApiError(400, f"{param} must be at least 1, got {value}", param=param)
    return value


class SimServer:
    """The HTTP side of the leader: state, handlers and the middleware around them."""

    def __init__(self, model: str, tokens_per_second: float, embedding_dim: int,
                 group: Group | None = None) -> None:
        self.model = model
        self.tokens_per_second = tokens_per_second
        self.embedding_dim = embedding_dim
        self.group = group
        self.in_flight = 0
        self.requests_total = 0
        self.started = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_get("/health", self.health)
        app.router.add_get("/sim/stats", self.stats)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post("/v1/rerank", self.rerank)
        app.router.add_post("/v1/audio/transcriptions", self.transcriptions)
        return app

    @web.middleware
    async def _middleware(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                          ) -> web.StreamResponse:
        counted = request.path.startswith("/v1/")
        if counted:
            self.in_flight += 1
            self.requests_total += 1
        try:  # finally runs on cancellation too: that is how a dropped stream is uncounted
            if counted and self.group is not None and not self.group.ready:
                raise ApiError(503, f"not ready: waiting for ranks {self.group.missing_ranks()} "
                               f"of {self.group.world_size} to join", type_="server_error",
                               code="not_ready")
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}").response()
        finally:
            if counted:
                self.in_flight -= 1

    async def _decode(self, request: web.Request, kind: type[T]) -> T:
        body = await request.read()
        try:
            parsed = msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as exc:
            found = re.search(r"`\$\.(\w+)|required field `(\w+)`", str(exc))
            param = next((g for g in found.groups() if g), None) if found else None
            raise ApiError(400, f"invalid request: {exc}", param=param) from exc
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        model = getattr(parsed, "model", None)
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist; this engine serves "
                           f"`{self.model}`", param="model", code="model_not_found")
        return parsed

    async def health(self, request: web.Request) -> web.Response:
        if self.group is None or self.group.ready:
            return web.json_response({"status": "ok"})
        return web.json_response({
            "status": "waiting for workers", "joined": self.group.joined,
            "world_size": self.group.world_size, "missing_ranks": self.group.missing_ranks(),
        }, status=503)

    async def stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"in_flight": self.in_flight, "requests_total": self.requests_total})

    async def models(self, request: web.Request) -> web.Response:
        card = {"id": self.model, "object": "model", "created": self.started,
                "owned_by": "llmgw-sim"}
        return web.json_response({"object": "list", "data": [card]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._decode(request, ChatRequest)
        if not body.messages:
            raise ApiError(400, "messages must not be empty", param="messages")
        prompt = "\n".join(_message_text(m.content) for m in body.messages)
        limit = _positive(body.max_completion_tokens, "max_completion_tokens") or _positive(
            body.max_tokens, "max_tokens")
        usage = body.stream_options is not None and body.stream_options.include_usage
        return await self._complete(request, True, prompt, limit, body.stream, usage)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._decode(request, CompletionRequest)
        prompt = body.prompt if isinstance(body.prompt, str) else "\n".join(body.prompt)
        limit = _positive(body.max_tokens, "max_tokens")
        usage = body.stream_options is not None and body.stream_options.include_usage
        return await self._complete(request, False, prompt, limit, body.stream, usage)

    async def _paced(self, tokens: Iterator[str]) -> AsyncIterator[str]:
        """Yield each token at its due time (deadline-based, so pacing does not drift);
        behind the pace, or with none, give the loop a turn every few tokens."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        pace = self.tokens_per_second
        for i, token in enumerate(tokens):
            delay = start + (i + 1) / pace - loop.time() if pace > 0 else 0.0
            if delay > 0:
                await asyncio.sleep(delay)
            elif i % _TOKENS_PER_TURN == _TOKENS_PER_TURN - 1:
                await asyncio.sleep(0)
            yield token

    async def _complete(self, request: web.Request, chat: bool, prompt: str,
                        limit: int | None, stream: bool, include_usage: bool,
                        ) -> web.StreamResponse:
        count = min(limit if limit is not None else DEFAULT_MAX_TOKENS, CONTEXT_TOKENS)
        tokens = itertools.islice(reply_tokens(prompt), count)
        finish = "length" if limit is not None else "stop"
        prompt_tokens = len(prompt.split())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": count,
                 "total_tokens": prompt_tokens + count}
        head: dict[str, Any] = {
            "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": self.model,
        }

        def choice(text: str | None, reason: str | None, role: bool = False) -> dict[str, Any]:
            if not chat:
                return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
            delta = {} if text is None else {"content": text}
            return {"index": 0, "delta": {"role": "assistant", **delta} if role else delta,
                    "logprobs": None, "finish_reason": reason}

        if not stream:
            text = "".join([token async for token in self._paced(tokens)])
            if chat:
                head["object"] = "chat.completion"
                result = {"index": 0, "message": {"role": "assistant", "content": text},
                          "logprobs": None, "finish_reason": finish}
            else:
                result = choice(text, finish)
            return web.json_response({**head, "choices": [result], "usage": usage})

        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)

        async def send(payload: dict[str, Any] | str) -> None:
            data = payload if isinstance(payload, str) else msgspec.json.encode(payload).decode()
            await response.write(f"data: {data}\n\n".encode())

        try:
            if chat:
                await send({**head, "choices": [choice("", None, role=True)]})
            async for token in self._paced(tokens):
                await send({**head, "choices": [choice(token, None)]})
            await send({**head, "choices": [choice(None, finish)]})
            if include_usage:
                await send({**head, "choices": [], "usage": usage})
            await send("[DONE]")
            await response.write_eof()
        except ConnectionResetError:
            log.info("client went away mid-stream")
        return response

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await self._decode(request, EmbeddingRequest)
        inputs = [body.input] if isinstance(body.input, str) else body.input
        if not inputs:
            raise ApiError(400, "input must not be empty", param="input")
        if body.encoding_format not in ("float", "base64"):
            raise ApiError(400, f"encoding_format must be float or base64, got "
                           f"{body.encoding_format!r}", param="encoding_format")
        dim = _positive(body.dimensions, "dimensions") or self.embedding_dim
        data = []
        for index, text in enumerate(inputs):
            vector: Any = embedding(text, dim)
            if body.encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{dim}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": vector})
        words = sum(len(text.split()) for text in inputs)
        return web.json_response({"object": "list", "data": data, "model": self.model,
                                  "usage": {"prompt_tokens": words, "total_tokens": words}})


    async def rerank(self, request: web.Request) -> web.Response:
        """llama.cpp's and vLLM's /v1/rerank shape; the score is the share of the query's
        words a document holds, so the order is predictable."""
        body = await self._decode(request, RerankRequest)
        query = set(body.query.lower().split())
        results = [{"index": i, "relevance_score":
                    len(query & set(doc.lower().split())) / max(len(query), 1)}
                   for i, doc in enumerate(body.documents)]
        results.sort(key=lambda r: (-r["relevance_score"], r["index"]))
        words = len(body.query.split()) + sum(len(d.split()) for d in body.documents)
        return web.json_response({"model": self.model, "results": results[:body.top_n],
                                  "usage": {"prompt_tokens": words, "total_tokens": words}})

    async def transcriptions(self, request: web.Request) -> web.Response:
        """OpenAI's multipart upload; the "transcript" says what came, so a test can tell
        the file arrived whole."""
        form = await request.post()
        model = form.get("model")
        if not model:
            raise ApiError(400, "you must provide a model parameter", param="model")
        if model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist; this engine serves "
                           f"`{self.model}`", param="model", code="model_not_found")
        upload = form.get("file")
        if not isinstance(upload, web.FileField):
            raise ApiError(400, "you must provide a file", param="file")
        data = upload.file.read()
        digest = hashlib.sha256(data).hexdigest()[:12]
        return web.json_response(
            {"text": f"{len(data)} bytes of {upload.filename}, sha256 {digest}"})


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m llmgw.sim",
        description="Deterministic OpenAI-compatible engine for tests and demos.")
    parser.add_argument("--host", default="127.0.0.1", help="HTTP address (rank 0 only)")
    parser.add_argument("--port", type=int, help="HTTP port (rank 0 only; 0 picks one)")
    parser.add_argument("--model", required=True, help="the one model name served")
    parser.add_argument("--tokens-per-second", type=float, default=200.0,
                        help="pace of generated tokens; 0 means as fast as possible")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--rendezvous", metavar="HOST:PORT",
                        help="leader's rendezvous address (required when world size > 1)")
    parser.add_argument("--embedding-dim", type=int, default=16)
    parser.add_argument("--keepalive-timeout", type=float, default=75.0, metavar="SECONDS",
                        help="how long an idle kept-alive connection is kept before the "
                        "engine closes it (llama-server and vLLM: 5)")
    args = parser.parse_args(argv)
    if not (math.isfinite(args.tokens_per_second) and args.tokens_per_second >= 0):
        parser.error("--tokens-per-second must be a finite number >= 0")
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        parser.error(f"--rank {args.rank} must be in 0..world size-1 ({args.world_size - 1})")
    if args.embedding_dim < 1:
        parser.error("--embedding-dim must be at least 1")
    if not (math.isfinite(args.keepalive_timeout) and args.keepalive_timeout > 0):
        parser.error("--keepalive-timeout must be a finite number > 0")
    if args.rank == 0 and (args.port is None or not 0 <= args.port <= 65535):
        parser.error("--port (0..65535) is required for rank 0")
    if args.world_size > 1 and args.rendezvous is None:
        parser.error("--rendezvous HOST:PORT is required when --world-size > 1")
    if args.rendezvous is not None:
        try:
            args.rendezvous = parse_address(args.rendezvous)
        except ValueError as exc:
            parser.error(f"--rendezvous: {exc}")
    return args


async def _run_leader(args: argparse.Namespace, stop: asyncio.Event) -> int:
    group = Group(args.world_size, args.model) if args.world_size > 1 else None
    sim = SimServer(args.model, args.tokens_per_second, args.embedding_dim, group)
    runner = web.AppRunner(sim.app(), handler_cancellation=True, access_log=None,
                           shutdown_timeout=SHUTDOWN_GRACE_S,
                           keepalive_timeout=args.keepalive_timeout)
    await runner.setup()
    try:
        if group is not None:
            host, port = await group.listen(*args.rendezvous)
            log.info("rendezvous on %s:%d; waiting for %d worker(s)", host, port,
                     args.world_size - 1)
        await web.TCPSite(runner, args.host, args.port).start()
        host, port = runner.addresses[0][:2]
        print(f"sim: serving {args.model} on {host}:{port}", flush=True)
        await stop.wait()
        return 0
    except OSError as exc:
        log.error("cannot listen: %s", exc)
        return 1
    finally:
        await runner.cleanup()
        if group is not None:
            await group.close()


async def _run_worker(args: argparse.Namespace, stop: asyncio.Event) -> int:
    host, port = args.rendezvous
    hello = Hello(rank=args.rank, world_size=args.world_size, model=args.model)

    def joined() -> None:
        print(f"sim: rank {args.rank} of {args.world_size} for {args.model} joined the "
              f"leader at {host}:{port}", flush=True)

    membership = asyncio.create_task(join_group(host, port, hello, joined))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({membership, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not membership.done():
        membership.cancel()
        await asyncio.gather(membership, return_exceptions=True)
        return 0
    stopping.cancel()
    exc = membership.exception()
    if isinstance(exc, RendezvousError):
        log.error("%s", exc)
    else:
        log.error("worker failed", exc_info=exc)
    return 1


async def _run(args: argparse.Namespace) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if args.rank > 0:
        return await _run_worker(args, stop)
    return await _run_leader(args, stop)


def main(argv: list[str] | None = None) -> int:
    """Run the sim engine until SIGTERM/SIGINT (exit 0) or a broken group (exit 1)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="sim: %(message)s")
    return asyncio.run(_run(args))
