from tokenmill.executor.attention.base import (ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata,
                                               select_attention_backend)

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "select_attention_backend"]
