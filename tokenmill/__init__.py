"""tokenmill: a throughput-first LLM inference engine."""

import os

# oneDNN JIT-compiles a GEMM kernel for every distinct shape and two caches keep them
# (oneDNN's primitive cache and torch's ideep LRU). The packed linear layers round a step's
# rows to a few sizes (layers/linear.py, packed_rows), so a model's shapes are bounded and
# these caches hold them all: with 64 entries, and every row count its own shape, kernels were
# compiled again and again (0.7 ms a layer shape on a Xeon with AMX); with each count its own
# shape and 1,024 entries, memory grew by hundreds of MB over a few thousand requests. Set
# before the first oneDNN primitive exists; the user's own settings win.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "1024")
os.environ.setdefault("LRU_CACHE_CAPACITY", "1024")

from tokenmill.config import EngineConfig
from tokenmill.engine.request import CompletionOutput, RequestOutput
from tokenmill.llm import LLM
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput", "CompletionOutput"]
