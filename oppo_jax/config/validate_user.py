"""Checks of the user-data keys: ``data.*`` formats, ``reward.*`` and ``eval.*``.

Each problem names the dotted key and its value (as ``config.validate`` does for the rest).
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oppo_jax.config.schema import Config

# "package.module:function" (a dotted module path, a colon, one attribute name)
FUNCTION_NAME = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")
NONFINITE_CHOICES = ("error", "skip")


def _data_problems(cfg: Config) -> list[str]:
    d, problems = cfg.data, []
    if d.messages_field is not None and not d.chat_template:
        problems.append(
            f"data.messages_field={d.messages_field!r}: needs data.chat_template=true (chat "
            "messages become prompt text through the actor tokenizer's chat template)"
        )
    if d.chat_template and d.prompts in ("demo", "random"):
        problems.append(
            f"data.chat_template=true: data.prompts={d.prompts!r} has no records to render "
            "(use a prompt file or dataset)"
        )
    if d.prompts == "demo" and cfg.model.actor_path != "demo":
        problems.append(
            f"data.prompts='demo': the demo task's prompts need the demo actor "
            f"(model.actor_path={cfg.model.actor_path!r}); set data.prompts to a prompt file "
            "or dataset"
        )
    if d.system_prompt is not None and not d.chat_template:
        problems.append(
            f"data.system_prompt={d.system_prompt[:40]!r}: needs data.chat_template=true (a "
            "system message becomes prompt text through the actor tokenizer's chat template)"
        )
    if d.answer_field is not None and d.prompts in ("demo", "random"):
        problems.append(
            f"data.answer_field={d.answer_field!r}: data.prompts={d.prompts!r} has no records "
            "with answers (use a prompt file or dataset)"
        )
    for key in ("prompt_field", "messages_field", "split", "answer_field"):
        value = getattr(d, key)
        if value is not None and not value.strip():
            problems.append(f"data.{key}={value!r}: must not be empty")
    return problems


def _reward_problems(cfg: Config) -> list[str]:
    rw, problems = cfg.reward, []
    for i, name in enumerate(rw.functions):
        if not FUNCTION_NAME.match(name):
            problems.append(
                f"reward.functions[{i}]={name!r}: must be 'package.module:function', e.g. "
                "oppo_jax.rewards.demo:sentiment"
            )
    if rw.weights and len(rw.weights) != len(rw.functions):
        problems.append(
            f"reward.weights={rw.weights!r}: must give one weight per reward.functions entry "
            f"({len(rw.functions)}), or be empty (all 1.0)"
        )
    if rw.kwargs and len(rw.kwargs) != len(rw.functions):
        problems.append(
            f"reward.kwargs={rw.kwargs!r}: must give one mapping per reward.functions entry "
            f"({len(rw.functions)}), or be empty (no keyword arguments)"
        )
    if not all(math.isfinite(w) for w in rw.weights):
        problems.append(f"reward.weights={rw.weights!r}: must be finite")
    if rw.model_weight and cfg.model.reward_path == "demo_arith":
        problems.append(
            f"reward.model_weight={rw.model_weight!r}: model.reward_path='demo_arith' names no "
            "reward model (the addition task is scored by its rule reward); set it to 0"
        )
    if rw.model_weight < 0:
        problems.append(f"reward.model_weight={rw.model_weight!r}: must be >= 0")
    if rw.model_weight == 0 and not rw.functions:
        problems.append(
            "reward.model_weight=0 and reward.functions=[]: a run needs a reward model or at "
            "least one reward function"
        )
    # gae: the one estimator with a critic (``ppo.estimators``, a higher layer)
    if rw.model_weight == 0 and cfg.model.critic_init == "reward" and cfg.ppo.advantage == "gae":
        problems.append(
            "model.critic_init='reward': there is no reward model when reward.model_weight=0; "
            "set model.critic_init=actor"
        )
    if rw.nonfinite not in NONFINITE_CHOICES:
        problems.append(f"reward.nonfinite={rw.nonfinite!r}: must be one of error, skip")
    if rw.workers < 1:
        problems.append(f"reward.workers={rw.workers!r}: must be a positive integer")
    return problems


def _eval_problems(cfg: Config) -> list[str]:
    ev, problems = cfg.eval, []
    for key in ("every", "num_prompts", "samples_per_prompt", "mean_at_k"):
        low = 0 if key in ("every", "mean_at_k") else 1
        if (v := getattr(ev, key)) < low:
            problems.append(f"eval.{key}={v!r}: must be >= {low}")
    if ev.greedy and ev.samples_per_prompt > 1:
        problems.append(
            f"eval.samples_per_prompt={ev.samples_per_prompt}: greedy decoding gives one "
            "response per prompt; set eval.greedy=false to sample several"
        )
    if ev.prompts is None and ev.split is not None and cfg.data.prompts in ("demo", "random"):
        problems.append(
            f"eval.split={ev.split!r}: data.prompts={cfg.data.prompts!r} has no splits; set "
            "eval.prompts"
        )
    if ev.prompts == "random":
        problems.append("eval.prompts='random': random prompts have no held-out set")
    if ev.prompts == "demo" and cfg.model.actor_path != "demo":
        problems.append(
            f"eval.prompts='demo': the demo's held-out prompts need the demo actor "
            f"(model.actor_path={cfg.model.actor_path!r})"
        )
    return problems


def user_data_problems(cfg: Config) -> list[str]:
    """Problems of the ``data``, ``reward`` and ``eval`` sections' values and relations."""
    return _data_problems(cfg) + _reward_problems(cfg) + _eval_problems(cfg)
