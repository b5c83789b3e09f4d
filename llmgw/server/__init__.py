"""The control plane and gateway: OpenAI API, admin API, agent stream, controller."""
