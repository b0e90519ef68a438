"""Generation engine: the model-owning scheduler thread with continuous batching,
chunked prefill, per-request sampling and a prefix cache."""

from .scheduler import Scheduler
from .types import EngineRequest, LogitsProcessor, QueueFull, SamplingParams, Step

__all__ = ["EngineRequest", "LogitsProcessor", "QueueFull", "SamplingParams", "Scheduler", "Step"]
