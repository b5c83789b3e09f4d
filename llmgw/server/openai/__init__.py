"""``/v1``: the OpenAI-compatible gateway."""
