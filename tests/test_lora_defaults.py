"""LoRA at its defaults (BENCHMARKS.md, "LoRA on the demo"): optim.lora_lr_scale multiplies
both models' rates when model.lora_rank > 0, a full fine-tune's rates are the configured ones,
unchanged, and model.lora_train_head trains the actor's untied head from its loaded weights."""

import jax
import pytest

from oppo_jax.config import ConfigError, load_config
from oppo_jax.models.model_config import preset
from oppo_jax.run import specs


def test_lora_scales_both_learning_rates_by_three_and_full_fine_tuning_keeps_its_own():
    full = load_config(None, [])
    assert full.learning_rate("actor") == full.optim.actor_lr == 1.5e-4  # configs/demo_cpu
    assert full.learning_rate("critic") == full.optim.critic_lr == 1e-3
    lora = load_config(None, ["model.lora_rank=8"])
    assert lora.optim.lora_lr_scale == 3.0
    assert lora.learning_rate("actor") == pytest.approx(4.5e-4)
    assert lora.learning_rate("critic") == pytest.approx(3e-3)
    own = load_config(None, ["model.lora_rank=8", "optim.lora_lr_scale=1"])
    assert own.learning_rate("actor") == own.optim.actor_lr


@pytest.mark.parametrize("rank", [0, 8])
def test_the_update_is_built_with_those_rates(rank):
    cfg = load_config(None, [f"model.lora_rank={rank}"])
    model = preset("tiny")
    spec = specs.update_spec(cfg, model, model.replace(head="score", num_labels=1))
    updates = cfg.train.steps * cfg.ppo.ppo_epochs * cfg.ppo.num_minibatches
    for name, tx in (("actor", spec.actor_tx), ("critic", spec.critic_tx)):
        assert tx is specs._optimizer(cfg.optim, cfg.learning_rate(name), updates)  # cached


def test_a_lora_lr_scale_that_is_not_positive_is_refused_by_name():
    with pytest.raises(ConfigError, match="optim.lora_lr_scale"):
        load_config(None, ["optim.lora_lr_scale=0"])


def test_lora_trains_the_actors_untied_head_from_its_own_weights():
    """model.lora_train_head (default on): the actor's lm_head is trained beside the adapters,
    starting from the loaded head (not a fresh one); the critic keeps its value head alone."""
    import numpy as np

    from oppo_jax.models import lora
    from oppo_jax.run.setup import prepare_run
    from tests.test_run_dirs import TINY

    cfg = load_config(None, [*TINY, "model.lora_rank=4"])
    assert cfg.model.lora_train_head
    ctx, state = prepare_run(cfg, progress=False)
    assert "lm_head" in state.actor_params and "lm_head" not in state.frozen["actor"]
    loaded = ctx.engine.ref_params["lm_head"]["kernel"]  # the reference: the loaded actor
    np.testing.assert_array_equal(np.asarray(state.actor_params["lm_head"]["kernel"]), loaded)
    assert set(state.critic_params) - {"layers"} == {"score"}
    tied = preset("tiny", lora_rank=4, lora_train_head=True, tie_word_embeddings=True)
    trained, frozen = lora.split(jax.eval_shape(lambda: _params(tied)), tied)
    assert "embed_tokens" in frozen and "lm_head" not in trained  # a tied head stays frozen
    off = load_config(None, [*TINY, "model.lora_rank=4", "model.lora_train_head=false"])
    assert "lm_head" not in prepare_run(off, progress=False)[1].actor_params


def _params(cfg):
    from oppo_jax.models.transformer import init_params

    return init_params(cfg, jax.random.key(0))


def test_a_lora_run_from_before_the_new_defaults_resumes_only_with_its_own_settings():
    from oppo_jax.config import to_yaml
    from oppo_jax.run.log import config_differences

    def older(*sets):  # config.yaml as written before the two keys existed
        lines = to_yaml(load_config(None, list(sets))).splitlines()
        return "\n".join(
            x for x in lines if "lora_train_head" not in x and "lora_lr_scale" not in x
        )

    lora = ["model.lora_rank=8"]
    assert config_differences(older(*lora), load_config(None, lora)) == [
        "model.lora_train_head",
        "optim.lora_lr_scale",
    ]
    as_before = [*lora, "model.lora_train_head=false", "optim.lora_lr_scale=1"]
    assert config_differences(older(*lora), load_config(None, as_before)) == []
    assert config_differences(older(), load_config(None, [])) == []  # full fine-tuning
