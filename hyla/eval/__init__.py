"""Evaluation: memory (state vs KV cache); recall and perplexity come later."""

from hyla.eval.memory import kv_cache_bytes, memory_report, parse_context, state_bytes

__all__ = ["kv_cache_bytes", "memory_report", "parse_context", "state_bytes"]
