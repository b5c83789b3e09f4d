"""Where shards run: behind one small interface, so the agent does not care which."""

from llmgw.agent.runtime.base import Runtime, ShardRecord
from llmgw.agent.runtime.process import ProcessRuntime

__all__ = ["ProcessRuntime", "Runtime", "ShardRecord"]
