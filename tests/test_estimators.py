"""The advantage estimators (``ppo.estimators``): what each trains, what a run builds from it,
and the advantages each computes against the formulas it names."""

import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.config import load_config
from oppo_jax.config.schema import PPOConfig
from oppo_jax.config.validate import ENUMS
from oppo_jax.pipeline.compile_plan import scorer_roles
from oppo_jax.ppo.estimators import (
    ESTIMATORS,
    estimator,
    gae,
    token_advantages,
    whiten_advantages,
    whiten_rewards,
)
from oppo_jax.run.specs import update_spec
from tests.ppo_fixtures import ACTOR, CRITIC

GROUP = ["rollout.group_size=4", "ppo.loss_agg=seq_mean"]


def test_every_configurable_estimator_is_registered_and_says_what_it_trains():
    """The config's choices are the registry's names; only GAE trains (and so has) a critic,
    as the config's own validation and the JAX-free simulator assume (they name gae)."""
    assert tuple(ESTIMATORS) == ENUMS["ppo.advantage"]
    for name, est in ESTIMATORS.items():
        assert est is estimator(PPOConfig(advantage=name)) and est.name == name
        assert est.trained == (("actor", "critic") if name == "gae" else ("actor",))
        assert est.needs_critic == (name == "gae")
    with pytest.raises(ValueError, match="unknown ppo.advantage 'ppo'; expected one of gae"):
        estimator(PPOConfig(advantage="ppo"))


@pytest.mark.parametrize("name", ["gae", "grpo", "rloo", "reinforce_pp"])
def test_a_run_builds_and_scores_the_models_its_estimator_trains(name):
    """The update spec holds a model (and its optimizer) exactly when the estimator trains it,
    and the critic scores a step's tokens exactly then."""
    extra = [] if name == "gae" else GROUP
    cfg = load_config(None, [f"ppo.advantage={name}", *extra])
    spec = update_spec(cfg, ACTOR, CRITIC)
    assert spec.trained == estimator(cfg.ppo).trained
    assert (spec.critic is None, spec.critic_tx is None) == (name != "gae",) * 2
    assert ("critic" in scorer_roles(cfg)) == (name == "gae")


def _batch(seed=0, rows=8, width=6):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, width + 1, rows)
    mask = jnp.asarray(np.arange(width)[None, :] < lengths[:, None])
    rewards = jnp.where(mask, jnp.asarray(rng.normal(size=(rows, width)), jnp.float32), 0.0)
    values = jnp.where(mask, jnp.asarray(rng.normal(size=(rows, width)), jnp.float32), 0.0)
    return rewards, values, mask


@pytest.mark.parametrize("whiten", [False, True])
def test_gae_is_whitened_gae_over_the_critics_values(whiten):
    rewards, values, mask = _batch()
    ppo = PPOConfig(whiten_rewards=whiten, gamma=0.9, lam=0.8)
    adv, ret = estimator(ppo).advantages(ppo, rewards, values, mask, 1)
    r = whiten_rewards(rewards, mask) if whiten else rewards
    want_adv, want_ret = gae(r, values, mask, 0.9, 0.8)
    np.testing.assert_array_equal(adv, whiten_advantages(want_adv, mask))
    np.testing.assert_array_equal(ret, want_ret)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_pp"])
def test_a_group_estimator_reads_each_sequences_summed_reward_and_no_values(name):
    rewards, values, mask = _batch(seed=1)
    ppo = PPOConfig(advantage=name, scale_rewards="batch")
    adv, ret = estimator(ppo).advantages(ppo, rewards, values, mask, 4)
    adv_no_values, _ = estimator(ppo).advantages(ppo, rewards, 0 * values + 7.0, mask, 4)
    want = token_advantages(jnp.sum(rewards, axis=-1), mask, 4, name, "batch")
    np.testing.assert_array_equal(adv, want)
    np.testing.assert_array_equal(adv_no_values, want)
    np.testing.assert_array_equal(ret, np.zeros_like(want))
