"""Rollout: prefill, chunked lax.scan decoding, and sampling."""

from oppo_jax.rollout.decode import (
    DecodeState,
    decode_chunk,
    make_decode_chunk,
    make_start_decode,
    prefill,
    start_decode,
)
from oppo_jax.rollout.sampling import SamplingConfig, sample_tokens, token_keys

__all__ = [
    "DecodeState",
    "SamplingConfig",
    "decode_chunk",
    "make_decode_chunk",
    "make_start_decode",
    "prefill",
    "sample_tokens",
    "start_decode",
    "token_keys",
]
