"""How an engine's non-streamed answer is passed on: its status and body as they came,
its content type (JSON when it named none), a length of llmgw's own. In process, on
loopback, in front of a raw asyncio engine."""

from __future__ import annotations

import asyncio

import aiohttp

from tests.integration.gateway_state import engine_answering, gateway_in_process

MODEL = "answers-model"
BODY = b'{"choices":[{"message":{"content":"hi"}}]}'


async def _answer(head: bytes, body: bytes, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    """By the path: /typed names its type, /untyped names none; both 201."""
    typed = b"content-type: text/plain\r\n" if b" /v1/typed " in head else b""
    writer.write(b"HTTP/1.1 201 Created\r\n%bx-engine: dropped\r\n"
                 b"content-length: %d\r\n\r\n%b" % (typed, len(BODY), BODY))


async def test_an_answer_keeps_its_status_body_and_type_and_gets_json_when_it_names_none():
    async with (gateway_in_process(MODEL, engine_answering(_answer)) as port,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http):
        for path, expected in (("untyped", "application/json"), ("typed", "text/plain")):
            async with http.post(f"http://127.0.0.1:{port}/v1/{path}",
                                 json={"model": MODEL}) as resp:
                assert resp.status == 201
                assert await resp.read() == BODY
                assert resp.headers["content-type"] == expected
                assert resp.headers["content-length"] == str(len(BODY))
                assert "x-engine" not in resp.headers
