"""tokenmill: a throughput-first LLM inference engine."""

from tokenmill.config import EngineConfig
from tokenmill.engine.request import CompletionOutput, RequestOutput
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
