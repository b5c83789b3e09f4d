"""The gateway's limits on a slow engine, told apart: an engine that sends its status line
at once and its first token only after a long prefill (or a wait in its own queue) is
given the first-byte limit for it, not the idle one; each refusal names its limit.

In process, on loopback: the gateway's routes on llmgw's HTTP server, in front of a raw
asyncio engine that writes each answer's head at once and its body when the test says.
"""

from __future__ import annotations

import asyncio
import json

import aiohttp

from llmgw.config import Gateway
from tests.integration.gateway_state import engine_answering, gateway_in_process

MODEL = "prefill-model"
LIMITS = Gateway(first_byte_timeout_s=1.5, idle_timeout_s=0.3)
EVENT = b'data: {"choices":[{"delta":{"content":"tok"}}]}\n\n'


async def _answer(head: bytes, body: bytes, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> bool | None:
    """The head at once; the body after the request's ``prefill`` seconds, or never if
    that is negative: a stream of three events, or a JSON answer."""
    request = json.loads(body)
    stream = request.get("stream", False)
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: %b\r\ntransfer-encoding: chunked\r\n\r\n"
                 % (b"text/event-stream" if stream else b"application/json"))
    await writer.drain()
    if request["prefill"] < 0:
        await reader.read()  # not a byte of the body, until the gateway goes
        return False
    await asyncio.sleep(request["prefill"])
    data = EVENT * 3 + b"data: [DONE]\n\n" if stream else b'{"choices":[]}'
    writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data))
    return None


async def test_a_slow_first_token_gets_the_first_byte_limit_and_refusals_name_theirs():
    loop = asyncio.get_running_loop()

    async def post(http: aiohttp.ClientSession, url: str, stream: bool, prefill: float
                   ) -> tuple[int, bytes, float]:
        began = loop.time()
        async with http.post(url, json={"model": MODEL, "stream": stream, "prefill": prefill,
                                        "messages": [{"role": "user", "content": "hi"}]}
                             ) as resp:
            return resp.status, await resp.read(), loop.time() - began

    async with (gateway_in_process(MODEL, engine_answering(_answer), LIMITS) as port,
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http):
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        # First token after twice the idle limit, within the first-byte one: whole.
        status, body, _ = await post(http, url, True, 0.6)
        assert status == 200 and body == EVENT * 3 + b"data: [DONE]\n\n", body
        status, body, _ = await post(http, url, False, 0.6)
        assert (status, body) == (200, b'{"choices":[]}')

        # Never a token: the stream ends with an error event at the first-byte limit.
        status, body, took = await post(http, url, True, -1)
        assert status == 200 and body.startswith(b"data: "), body
        error = json.loads(body[6:])["error"]
        assert error["code"] == "upstream_timeout"
        assert "within 1.5 s (gateway.first_byte_timeout_s)" in error["message"]
        assert 1.4 <= took < 5, took

        # Not streamed: 504, naming the same limit.
        status, body, took = await post(http, url, False, -1)
        assert status == 504, body
        assert "within 1.5 s (gateway.first_byte_timeout_s)" in json.loads(
            body)["error"]["message"]
        assert 1.4 <= took < 5, took
