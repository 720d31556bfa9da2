"""Rollout: admission prefill, chunked lax.scan decoding, and sampling (pure functions)."""

from oppo_jax.rollout.admission import Admission, prefill
from oppo_jax.rollout.decode import DecodeState, decode_chunk, start_decode
from oppo_jax.rollout.sampling import SamplingConfig, sample_tokens, token_keys
from oppo_jax.rollout.spec import RolloutSpec

__all__ = [
    "Admission",
    "DecodeState",
    "RolloutSpec",
    "SamplingConfig",
    "decode_chunk",
    "prefill",
    "sample_tokens",
    "start_decode",
    "token_keys",
]
