"""tokenmill: a throughput-first LLM inference engine."""

import os

# oneDNN JIT-compiles a GEMM kernel for every distinct batch shape and two caches keep
# them (oneDNN's primitive cache and torch's ideep LRU, 1024 entries each by default,
# ~0.5 MB an entry). A step's token count changes every step, so with the defaults
# memory grew by hundreds of MB over a few thousand requests; with 64 entries it stays
# flat and throughput measured the same. Set before the first oneDNN primitive exists;
# the user's own settings win.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
os.environ.setdefault("LRU_CACHE_CAPACITY", "64")

from tokenmill.config import EngineConfig
from tokenmill.engine.request import CompletionOutput, RequestOutput
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
