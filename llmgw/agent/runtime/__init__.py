"""Where shards run: behind one small interface, so the agent does not care which."""

from llmgw.agent.runtime.base import Runtime, ShardRecord, ShardStartError
from llmgw.agent.runtime.process import ProcessRuntime
from llmgw.agent.runtime.systemd import ManagerUnreachable, SystemdRuntime
from llmgw.agent.runtime.systemd_bus import available

__all__ = ["ManagerUnreachable", "ProcessRuntime", "Runtime", "ShardRecord", "ShardStartError",
           "SystemdRuntime", "available"]
