"""The memory report of critic-free runs and of groups: no critic anywhere without one, no
reference at β = 0, no reward model with reward functions alone, and slots B + Δ·G."""

import functools

import pytest

from oppo_jax.config import PPOConfig, load_config
from oppo_jax.models.model_config import ModelConfig
from oppo_tools.memory.cli import config_memory_report, format_table
from oppo_tools.memory.report import Lowering, ReportModels, ReportSettings, RunShapes
from oppo_tools.memory.report import memory_report as report
from tests.run_fixtures import GH200_GRPO_UNREFILLED

MODEL = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16,
)  # fmt: skip
SHAPES = RunShapes(batch_size=8, prompt_len=8, response_len=16, slots=12, chunk_size=4,
                   replay_rows=4)  # fmt: skip
GRPO = PPOConfig(advantage="grpo", kl_coef=0.0, kl_in_reward=False, ppo_epochs=1)
PPO = PPOConfig(ppo_epochs=1)
KERNELS = ("update", "score_chunk")


@functools.cache
def _report(roles: tuple[str, ...], ppo: PPOConfig, kernels=KERNELS, lora: int = 0) -> dict:
    model = MODEL.replace(lora_rank=lora)
    settings = ReportSettings((1, 2, 1), ppo=ppo)
    return report(ReportModels(model, roles=roles), SHAPES, settings, Lowering(kernels))


def test_a_critic_free_run_holds_no_critic_and_at_beta_0_no_reference():
    ppo = _report(("reference", "critic", "reward"), PPO)
    free = _report(("reward",), GRPO)
    b, p = free["bytes"], ppo["bytes"]
    assert b["critic_params"] == 0 and b["reference_params"] == 0
    assert b["actor_params"] == p["actor_params"] and b["reward_params"] == p["reward_params"]
    # One optimizer: the actor's two moments and its two int32 step counts.
    assert b["optimizer"] == 2 * b["actor_params"] + 2 * 4
    assert set(b["kv_caches"]) == {"actor", "reward"}
    assert b["kv_caches"]["actor"] == p["kv_caches"]["actor"]
    resident = b["actor_params"] + b["optimizer"] + b["reward_params"] + b["ppo_batch"]
    assert free["resident"] == resident + sum(b["kv_caches"].values())
    assert free["roles"] == ["reward"] and set(free["models"]) == {"actor", "reward"}
    # The update donates the actor's state only; it differentiates one model, not two.
    update, ppo_update = free["kernels"]["update"], ppo["kernels"]["update"]
    assert update["alias"] == b["actor_params"] + b["optimizer"] + 4
    assert 0 < update["temp"] < ppo_update["temp"]
    # The scorer chunk lowered is the first scorer the run has: the reward model here.
    assert free["kernels"]["score_chunk"]["argument"] < ppo["kernels"]["score_chunk"]["argument"]
    table = format_table(free)
    assert "critic parameters" not in table and "reference parameters" not in table
    assert "scorers: reward." in table and "(actor; critic-free)" in table


def test_without_scorers_only_the_actor_remains():
    """β = 0 and reward functions only: no scorer, no scorer chunk, one KV cache; with LoRA
    the actor's frozen base stays (it is the actor), under the reference's row."""
    none = _report((), GRPO, ("update",))
    assert set(none["bytes"]["kv_caches"]) == {"actor"} and none["bytes"]["reward_params"] == 0
    assert set(none["kernels"]) == {"update"}
    assert "scorers: none (reward functions only)." in format_table(none)
    lora = _report((), GRPO, (), lora=4)["bytes"]
    with_reference = _report(("reference",), GRPO, (), lora=4)["bytes"]
    assert lora["reference_params"] == with_reference["reference_params"] > 0
    assert lora["reward_params"] == 0 and lora["critic_params"] == 0


def _state(name: str, *sets: str) -> dict:
    return config_memory_report(load_config(name, list(sets)), kernels=())


def test_the_grpo_configs_report_their_roles_and_slots():
    """Slots are B + Δ_max·G (Δ counts groups); G changes no sequence's bytes, so two runs
    with the same B + Δ·G hold the same state, and more groups in flight hold more cache."""
    gh200 = _state("qwen2.5-7b_gh200x1_lora_grpo", *GH200_GRPO_UNREFILLED)
    assert gh200["roles"] == [] and gh200["shapes"]["slots"] == 112 + 4 * 8
    assert gh200["bytes"]["critic_params"] == gh200["bytes"]["reward_params"] == 0
    assert gh200["bytes"]["reference_params"] > 0  # the LoRA actor's bf16 base
    same = _state("qwen2.5-7b_gh200x1_lora_grpo", *GH200_GRPO_UNREFILLED, "rollout.group_size=16",
                  "pipeline.overcommit_max=2")  # fmt: skip
    assert same["shapes"]["slots"] == 144 and same["bytes"] == gh200["bytes"]
    fewer = _state(
        "qwen2.5-7b_gh200x1_lora_grpo", *GH200_GRPO_UNREFILLED, "pipeline.overcommit_max=2"
    )
    caches = (fewer["bytes"]["kv_caches"]["actor"], gh200["bytes"]["kv_caches"]["actor"])
    assert caches[0] * 144 == pytest.approx(caches[1] * 128, rel=1e-3)
    tpu = _state("qwen2.5-7b_tpu-v5p-8_grpo")
    assert tpu["roles"] == ["reference"] and set(tpu["bytes"]["kv_caches"]) == {
        "actor", "reference"
    }  # fmt: skip
    assert tpu["bytes"]["critic_params"] == 0 and tpu["bytes"]["optimizer"] > 0


def test_a_refilling_run_counts_its_prompt_stores_and_keeps_its_rows_through_the_update():
    """The 7B GRPO config refills: beside its 112 rows it holds two prompt stores (the one
    whose group still waits and the one a refill point fills) of 16 prompts each (1 + 112/8,
    to a power of two), every prompt in a cache of P + R columns with its first token's
    logits; and its rows decode on through the update, so their cache and the stores stay
    live there. The bytes are counted here from Qwen2.5-7B's shape, not the report's code."""
    refill = _state("qwen2.5-7b_gh200x1_lora_grpo")
    unrefilled = _state("qwen2.5-7b_gh200x1_lora_grpo", "rollout.refill_every=0")
    layers, kv_heads, head_dim, vocab, width = 28, 4, 128, 152064, 512 + 1024
    per_prompt = layers * 2 * kv_heads * width * head_dim * 2 + vocab * 4 + 4 + 4  # + length, id
    caches = refill["bytes"]["kv_caches"]
    assert caches["actor prompt stores"] == 2 * 16 * per_prompt
    assert caches["actor"] == 112 * (per_prompt - vocab * 4 - 4)  # the rows, as without refill
    assert caches["actor"] == unrefilled["bytes"]["kv_caches"]["actor"]
    assert "actor prompt stores" not in unrefilled["bytes"]["kv_caches"]
    assert refill["resident"] == unrefilled["resident"] + caches["actor prompt stores"]
    # The update's live bytes, on a tiny model (its kernel is compiled): a refilling run
    # drops nothing for it (no scorer caches here); without refill the actor's cache goes.
    tiny = [
        config_memory_report(load_config("qwen2.5-7b_gh200x1_lora_grpo", ["model.preset=tiny",
                             *sets]), kernels=("update",))
        for sets in ([], ["rollout.refill_every=0"])
    ]  # fmt: skip
    assert tiny[0]["kernels"]["update"]["live"] == tiny[0]["resident"]
    actor = tiny[1]["bytes"]["kv_caches"]["actor"]
    assert tiny[1]["kernels"]["update"]["live"] == tiny[1]["resident"] - actor > 0
