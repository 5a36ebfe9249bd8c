"""The serving runtime: asyncio engine, scheduler, OpenAI-compatible server, embedded API."""

from deltaserve.args import EngineArgs
from .engine import AsyncEngine, CapacityError, EngineDeadError, QueueFullError, RequestOutput
from .params import SamplingParams

__all__ = ["AsyncEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CapacityError", "EngineDeadError",
           "QueueFullError"]
