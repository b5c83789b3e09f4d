"""The sim engine: a real OpenAI-compatible server whose output is fake but deterministic.

Run it as `python -m llmgw.sim --port 20001 --model sim-small`; the agent starts it the
way it starts llama-server. Multi-node groups rendezvous like a real engine's ranks do.
"""
