"""llama-server's slots on kvscope's cache: prompt reuse, context checkpoints, context shift, in its words."""
from engine.runners.server.log import ServerLog, without_stamp
from engine.runners.server.server import ServerParams, ServerSim
from engine.runners.server.slot import Checkpoint, Slot, Task

__all__ = ["Checkpoint", "ServerLog", "ServerParams", "ServerSim", "Slot", "Task", "without_stamp"]
