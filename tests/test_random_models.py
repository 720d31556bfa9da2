"""Random models of any size and random prompts: no tokenizer and no files, end to end
through ``oppo-jax train`` and ``oppo-jax bench``."""

import json

import jax
import numpy as np
import pytest

from oppo_jax.cli import main
from oppo_jax.config import ConfigError, load_config
from oppo_jax.data.random_prompts import NUM_RESERVED_IDS, random_prompts
from oppo_jax.models.model_config import PRESETS
from oppo_jax.run.log import read_metrics
from oppo_jax.run.setup import prepare_run

# A run of the ~25M-parameter `small` preset, as short as it can be.
SMALL = [
    "model.actor_path=random", "model.reward_path=random", "model.preset=small",
    "data.prompts=random", "data.random_prompt_len=[2,8]", "rollout.max_prompt_len=8",
    "rollout.max_response_len=16", "rollout.batch_size=4", "rollout.length_sampler=lognormal",
    "rollout.length_median=4", "rollout.length_p99=16", "ppo.ppo_epochs=1",
    "pipeline.chunk_size=4", "pipeline.overcommit=2", "pipeline.adaptive_overcommit=false",
    "pipeline.overcommit_max=4", "train.checkpoint_every=0",
]  # fmt: skip


def test_presets_have_the_advertised_sizes():
    assert PRESETS["tiny"].hidden_size == 64 and PRESETS["tiny"].num_layers == 2
    assert PRESETS["tiny"].vocab_size == 512
    assert 20e6 < PRESETS["small"].num_params() < 30e6


def test_random_prompts_are_seeded_in_range_and_avoid_special_ids():
    prompts = random_prompts(512, (3, 9), count=500, exclude=[7])
    again = random_prompts(512, (3, 9), count=500, exclude=[7])
    assert all(np.array_equal(a, b) for a, b in zip(prompts, again, strict=True))
    lengths = [len(p) for p in prompts]
    assert min(lengths) == 3 and max(lengths) == 9
    ids = np.concatenate(prompts)
    assert ids.min() >= NUM_RESERVED_IDS and ids.max() < 512 and 7 not in ids
    assert not np.array_equal(prompts[0], random_prompts(512, (3, 9), 500, seed=1)[0])


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["model.actor_path=random", "model.reward_path=random", "data.prompts=random"],
         "model.preset"),
        (["model.actor_path=random", "model.reward_path=demo", "model.preset=tiny",
          "data.prompts=random"], "model.actor_path"),
        (["model.actor_path=random", "model.reward_path=random", "model.preset=tiny"],
         "data.prompts"),
        (["model.actor_path=random", "model.reward_path=random", "model.preset=tiny",
          "data.prompts=random", "rollout.max_prompt_len=16", "data.random_prompt_len=[4,40]"],
         "data.random_prompt_len"),
        (["rollout.length_sampler=lognormal", "rollout.length_median=100",
          "rollout.length_p99=50"], "rollout.length_median"),
        (["rollout.length_sampler=uniform"], "rollout.length_sampler"),
    ],
)  # fmt: skip
def test_bad_sources_are_config_errors_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, overrides)


def test_random_prompt_len_is_ignored_unless_prompts_are_random():
    # Prompts read from a file never look at the range, so a narrow prompt width is fine.
    cfg = load_config(None, ["rollout.max_prompt_len=4", "data.random_prompt_len=[4,40]"])
    assert cfg.rollout.max_prompt_len == 4


def test_random_models_build_without_files(monkeypatch, tmp_path):
    monkeypatch.setenv("OPPO_JAX_CACHE", str(tmp_path / "nothing-here"))
    cfg = load_config(None, [*SMALL, "model.preset=tiny", "model.critic_init=actor"])
    ctx, state = prepare_run(cfg, progress=False)
    assert ctx.tokenizer is None and ctx.gold_fn is None and ctx.actor_dir is None
    assert ctx.kernels.rollout.eos_ids == (1,) and ctx.kernels.rollout.pad_id == 0
    assert ctx.kernels.rollout.lengths is not None
    # The critic starts from the actor's backbone, with a score head of its own.
    np.testing.assert_array_equal(
        state.critic_params["embed_tokens"]["embedding"],
        state.actor_params["embed_tokens"]["embedding"],
    )
    assert state.critic_params["score"]["kernel"].shape == (64, 1)
    assert len(ctx.prompts) == 4096 and max(len(p) for p in ctx.prompts) == 8
    assert not (tmp_path / "nothing-here").exists()
    other, _ = prepare_run(load_config(None, [*SMALL, "model.preset=tiny", "seed=3"]), False)
    a, b = (jax.tree.leaves(x.engine.ref_params)[0] for x in (ctx, other))
    assert not np.array_equal(a, b)  # seeded: another seed, other weights


@pytest.mark.slow  # two CLI runs of a 25M-parameter model
def test_small_random_model_trains_and_benches_end_to_end(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPPO_JAX_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    assert main(["train", "--out", str(run), "--quiet", "--set", *SMALL, "train.steps=2"]) == 0
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert "gold" not in records[0] and np.isfinite(records[-1]["policy_loss"])
    assert all(r["response_len_max"] <= 16 for r in records)
    bench = tmp_path / "bench"
    # sync and oppo: the reference and the schedule with every mechanism (--schedules)
    argv = ["bench", "--out", str(bench), "--steps", "2", "--warmup", "1", "--schedules",
            "oppo,sync", "--set", *SMALL]  # fmt: skip
    assert main(argv) == 0
    result = json.loads((bench / "bench.json").read_text())
    assert result["workload"]["target_gold"] is None
    assert "no gold score" in result["workload"]["no_gold"]
    assert list(result["schedules"]) == ["sync", "oppo"]  # in the schedules' own order
    for s in result["schedules"].values():
        assert s["time_to_target_s"] is None and s["final_gold"] is None
        assert s["ideal_bound"]["ideal_step_s"] > 0
        # the bench's up-front warm-up (its default) left no shape for a measured step
        assert s["measured_steps_that_compiled"] == 0
    printed = capsys.readouterr().out
    assert "time to target: no gold score" in printed and "measured/ideal" in printed
    assert not (tmp_path / "cache").exists()  # nothing was built or downloaded
