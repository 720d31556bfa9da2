"""Rollout: admission prefill, chunked decoding, and sampling (pure functions)."""

from oppo_jax.rollout.admission import Admission, prefill
from oppo_jax.rollout.decode import CutRule, DecodeState, decode_chunk
from oppo_jax.rollout.sampling import SamplingConfig, sample_tokens, token_keys
from oppo_jax.rollout.spec import RolloutSpec

__all__ = [
    "Admission",
    "CutRule",
    "DecodeState",
    "RolloutSpec",
    "SamplingConfig",
    "decode_chunk",
    "prefill",
    "sample_tokens",
    "token_keys",
]
