from tokenmill.executor.attention.base import AttentionBackend, AttentionMetadata
from tokenmill.executor.attention.torch_native import TorchNativeBackend

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchNativeBackend"]
