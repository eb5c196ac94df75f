"""Inference: sampling, KV-cached generation and streaming detokenisation."""

from lmforge.infer.generate import StreamingDecoder, generate_text, generate_tokens, sample_next

__all__ = ["StreamingDecoder", "generate_text", "generate_tokens", "sample_next"]
