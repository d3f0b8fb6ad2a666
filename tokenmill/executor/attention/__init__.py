from tokenmill.executor.attention.base import (ATTENTION_BACKENDS, AttentionBackend, AttentionMetadata, row_slots,
                                               row_spans, select_attention_backend, token_rows, token_slots)

__all__ = ["ATTENTION_BACKENDS", "AttentionBackend", "AttentionMetadata", "row_slots", "row_spans",
           "select_attention_backend", "token_rows", "token_slots"]
