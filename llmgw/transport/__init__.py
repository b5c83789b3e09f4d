"""The byte-level HTTP both sides of the gateway speak: the server the clients reach
(``server``: uvicorn's protocol with bounded heads, and ``writer``: writing responses from
callbacks) and the client to the engines (``pool``, ``connection``, ``answer``, ``errors``).

It knows bytes, connections and HTTP/1.1 framing; not models, keys or tokens. The gateway
(llmgw.server.openai) gives it what it needs of those as plain hooks (``writer.ChunkTap``).
"""
