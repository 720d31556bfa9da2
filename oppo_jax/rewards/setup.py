"""The run's ``RewardFunctions`` from its config (``reward.*``), or None when the reward model
alone, at weight 1, scores."""

from __future__ import annotations

from oppo_jax.rewards.functions import resolve
from oppo_jax.rewards.runner import RewardFunctions


def prompt_records(prompts, tokenizer):
    """prompt_id -> the prompt's dataset record. A ``PromptSet`` reads it from its source; the
    built-in prompt sets have none, so their record is ``{"prompt": decoded text}``."""
    n = len(prompts)
    if hasattr(prompts, "record"):
        return lambda prompt_id: prompts.record(prompt_id % n)
    return lambda prompt_id: {
        "prompt": tokenizer.decode(list(map(int, prompts[prompt_id % n])), skip_special_tokens=True)
    }


def reward_functions(cfg, tokenizer, prompts, eos_ids) -> RewardFunctions | None:
    """The functions of ``reward.functions`` with their weights and the reward model's weight."""
    rw = cfg.reward
    if not rw.functions and rw.model_weight == 1.0:
        return None
    if rw.functions and tokenizer is None:
        from oppo_jax.base.errors import ConfigError

        raise ConfigError("reward.functions: random models have no tokenizer to decode text")
    return RewardFunctions(
        resolve(rw.functions, rw.weights, rw.kwargs),
        rw.model_weight,
        tokenizer,
        prompt_records(prompts, tokenizer),
        tuple(eos_ids),
        cfg.rollout.max_response_len,
        skip_nonfinite=rw.nonfinite == "skip",
        workers=rw.workers,
    )
