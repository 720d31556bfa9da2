"""LoRA: adapters on frozen bases, one copy of each base serving two models.

References: the merged dense weights W + (alpha / r) A B (for the adapted forward), the base
model loaded on its own (for the reference log-probs), and transformers itself (for export).
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oppo_jax.models import lora
from oppo_jax.models.model_config import preset
from oppo_jax.models.transformer import Transformer, init_params
from oppo_jax.run.checkpoint import abstract_like
from oppo_jax.run.setup import cache_dir, prepare_run
from oppo_jax.train import train
from tests.oracles import policy_logprobs
from tests.run_fixtures import OPPO_WITH_CARRYING, metric_values, small_demo_config

# optim.lora_lr_scale=1: these tests' rates are the adapters' own
LORA = ("model.lora_rank=4", "model.lora_alpha=8", "optim.actor_lr=1e-3", "optim.lora_lr_scale=1")


def _random_adapters(trained, seed: int, scale: float = 0.05):
    """Adapters with a non-zero B (a fresh adapter is the identity)."""
    leaves, tree = jax.tree.flatten(trained)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [
        x + scale * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(tree, noisy)


@pytest.mark.parametrize("targets", [lora.ALL_TARGETS, ("q_proj", "v_proj", "down_proj")])
def test_adapted_forward_equals_merged_dense_weights(targets):
    cfg = preset("tiny", lora_rank=4, lora_alpha=8.0, lora_targets=targets)
    trained, frozen = lora.split(init_params(cfg, jax.random.key(0)), cfg)
    adapted = lora.combine(_random_adapters(trained, 1), frozen)
    n_adapted = sum("lora_a" in path for path in _paths(adapted))
    assert n_adapted == len(targets)
    tokens = jax.random.randint(jax.random.key(2), (3, 9), 0, cfg.vocab_size)
    got, _ = Transformer(cfg).apply({"params": adapted}, tokens)
    dense_cfg = cfg.replace(lora_rank=0)
    want, _ = Transformer(dense_cfg).apply({"params": lora.merged(adapted, cfg)}, tokens)
    assert np.max(np.abs(np.asarray(got) - np.asarray(want))) <= 1e-5
    # The adapter matters (so the comparison could fail), and without it the model is the base.
    base, _ = Transformer(dense_cfg).apply({"params": frozen}, tokens)
    assert np.max(np.abs(np.asarray(got) - np.asarray(base))) > 1e-3
    off, _ = Transformer(cfg).apply({"params": frozen}, tokens)
    np.testing.assert_array_equal(np.asarray(off), np.asarray(base))


def _paths(tree):
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def test_split_trains_adapters_and_the_value_head_only():
    cfg = preset("tiny", lora_rank=2, head="score")
    trained, frozen = lora.split(init_params(cfg, jax.random.key(0)), cfg)
    assert all("lora_" in p or p.startswith("['score']") for p in _paths(trained))
    assert not any("lora_" in p or "score" in p for p in _paths(frozen))
    plain = preset("tiny")
    params = init_params(plain, jax.random.key(0))
    assert lora.split(params, plain) == (params, None)  # no LoRA: everything is trained


@pytest.fixture(scope="module")
def lora_run(demo_cache, tmp_path_factory):
    """A LoRA demo run that carries sequences across steps, checkpointed at steps 2 and 4."""
    out = tmp_path_factory.mktemp("lora_run")
    train(small_demo_config(*LORA, *OPPO_WITH_CARRYING), out, progress=False)
    return out


@pytest.mark.slow
def test_lora_run_checkpoints_adapters_only_and_resumes_bit_identically(lora_run, tmp_path):
    full = metric_values(lora_run / "metrics.jsonl")
    assert full[1]["carried"] > 0  # sequences in flight at the step-2 checkpoint
    assert full[-1]["kl"] > 0  # the adapted actor left the reference
    meta = json.loads((lora_run / "checkpoints" / "4" / "train_state" / "_METADATA").read_text())
    names = list(meta["tree_metadata"])
    params = [n for n in names if n.startswith("('actor_params'") or "'mu'" in n]
    # Adapters, the value head, and (model.lora_train_head, the default) the actor's own
    # untied head; no base weight.
    assert params and all("lora_" in n or "'score'" in n or "'lm_head'" in n for n in params), (
        params
    )
    assert any("'lm_head'" in n for n in params) and any("lora_" in n for n in params), params
    # Half the run, then resume: identical to the uninterrupted run.
    cfg = small_demo_config(*LORA, *OPPO_WITH_CARRYING, "train.steps=2")
    train(cfg, tmp_path / "c", progress=False)
    train(small_demo_config(*LORA, *OPPO_WITH_CARRYING), tmp_path / "c", resume=True,
          progress=False)  # fmt: skip
    assert metric_values(tmp_path / "c" / "metrics.jsonl") == full


def test_one_base_serves_actor_and_reference(demo_cache):
    import oppo_jax

    cfg = small_demo_config(*LORA)
    ctx, state = prepare_run(cfg, progress=False)
    # No second copy: the reference and the reward model are the frozen bases themselves.
    ref_leaf = jax.tree.leaves(ctx.engine.ref_params)[0]
    assert ref_leaf is jax.tree.leaves(state.frozen["actor"])[0]
    reward_layers = ctx.engine.reward_params["layers"]
    assert jax.tree.leaves(state.frozen["critic"]["layers"])[0] is jax.tree.leaves(reward_layers)[0]
    # Reference log-probs are the base model's own, the actor's those of base + adapter.
    state = state.replace(actor_params=_random_adapters(state.actor_params, 3))
    base = oppo_jax.load_hf_model(cache_dir() / "demo" / "actor")
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(2, base.config.vocab_size, (4, 12)), jnp.int32)
    prompt_len, t = jnp.array([3, 4, 5, 6]), cfg.rollout.temperature
    spec = ctx.kernels.spec
    ref, _ = policy_logprobs(spec.actor, ctx.engine.ref_params, tokens, prompt_len, 6, t)
    want, _ = policy_logprobs(base.config, base.params, tokens, prompt_len, 6, t)
    assert np.max(np.abs(np.asarray(ref) - np.asarray(want))) <= 1e-5
    actor, _ = policy_logprobs(spec.actor, state.actor_model_params, tokens, prompt_len, 6, t)
    assert np.max(np.abs(np.asarray(actor) - np.asarray(want))) > 1e-3


@pytest.mark.slow
def test_export_merges_adapters_and_transformers_reloads_them(lora_run, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from oppo_jax.config import load_config
    from oppo_jax.export import export_run
    from oppo_jax.run.checkpoint import RunCheckpointer

    export_run(lora_run, tmp_path / "hf", critic=True)
    cfg = load_config(lora_run / "config.yaml")
    ctx, initial = prepare_run(cfg, progress=False)
    with RunCheckpointer(lora_run / "checkpoints") as ckpt:
        state, _ = ckpt.restore(None, abstract_like(initial))
    ids = np.array([[2, 8, 9, 3, 10, 11], [2, 12, 3, 13, 14, 15]])
    # Our adapted model (adapters unmerged, over the shared base) against transformers.
    want, _ = Transformer(ctx.kernels.spec.actor).apply(
        {"params": state.actor_model_params}, jnp.asarray(ids)
    )
    torch_model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    with torch.no_grad():
        got = torch_model(torch.tensor(ids)).logits.numpy()
    assert np.max(np.abs(got - np.asarray(want))) <= 1e-4
    base, _ = Transformer(ctx.kernels.spec.actor).apply(
        {"params": ctx.engine.ref_params}, jnp.asarray(ids)
    )
    assert np.max(np.abs(np.asarray(base) - got)) > 1e-4  # the adapters were merged in
    assert (tmp_path / "hf" / "critic" / "model.safetensors").is_file()


@pytest.mark.slow  # a 30-step demo run
def test_lora_ppo_raises_the_gold_score(demo_cache, tmp_path):
    steps = 30
    cfg = small_demo_config(
        *LORA, "model.lora_rank=8", f"train.steps={steps}", "rollout.batch_size=16",
        "train.checkpoint_every=0", "ppo.kl_coef=0.05", "optim.critic_lr=1e-3",
    )  # fmt: skip
    train(cfg, tmp_path, progress=False)
    gold = [r["gold"] for r in metric_values(tmp_path / "metrics.jsonl")]
    first, last = np.mean(gold[:8]), np.mean(gold[-8:])
    print(f"gold: first 8 steps {first:.3f}, last 8 steps {last:.3f}")
    assert last > first + 0.01, gold
