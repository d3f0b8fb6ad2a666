"""Speculative decoding: proposers that draft tokens (ngram.py) and the exact verification
of the drafts against the target model's own choices (rejection.py)."""
