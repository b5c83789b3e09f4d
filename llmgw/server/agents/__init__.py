"""The agent stream: one session per node, and the WebSocket endpoint."""
