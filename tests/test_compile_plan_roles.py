"""The compile plan follows the config's scorers and groups: the reference only at β > 0, the
critic only with GAE, the reward model only when it weighs; slots B + Δ·G. The PPO configs'
program counts are unchanged and the GRPO configs stay within them."""

import pytest

from oppo_jax.config import load_config
from oppo_jax.pipeline.compile_plan import plan_programs, run_shapes, scorer_roles
from oppo_jax.pipeline.schedule import Schedule
from oppo_tools.compile_report import total_programs
from tests.run_fixtures import GH200_GRPO_UNREFILLED


def _programs(name: str, mode: str, backend: str, *sets: str) -> int:
    cfg = load_config(name, list(sets))
    return total_programs(plan_programs(run_shapes(cfg, Schedule.named(mode), backend)))


@pytest.mark.parametrize(
    ("name", "sets", "roles"),
    [
        ("qwen2.5-7b_gh200x1_lora", (), ("reference", "critic", "reward")),
        ("qwen2.5-7b_gh200x1_lora", ("ppo.kl_coef=0",), ("critic", "reward")),
        ("qwen2.5-7b_gh200x1_lora", ("ppo.kl_coef=0", "ppo.adaptive_kl=true"),
         ("reference", "critic", "reward")),  # an adaptive β needs the reference
        ("qwen2.5-7b_gh200x1_lora", ("reward.model_weight=0", "reward.functions=[m:f]",
                                     "model.critic_init=actor"),
         ("reference", "critic")),
        ("qwen2.5-7b_gh200x1_lora_grpo", (), ()),
        ("qwen2.5-7b_tpu-v5p-8_grpo", (), ("reference",)),
        ("qwen2.5-7b_tpu-v5p-8_grpo", ("reward.model_weight=1",), ("reference", "reward")),
    ],
)  # fmt: skip
def test_scorer_roles_follow_the_config(name, sets, roles):
    cfg = load_config(name, list(sets))
    assert scorer_roles(cfg) == roles
    assert run_shapes(cfg, backend="gpu").scorers == roles


# PPO configs: as at a194689 (BENCHMARKS.md, "Few programs"), but for the bf16 configs
# without LoRA, whose float32 master copy of the actor is another parameter tree than the
# bf16 reference, so the reference's admission and replay are programs of their own (3 more
# under oppo; counted since the deviceless registry compiled them); the GRPO configs below.
COUNTS = [
    ("qwen2.5-7b_gh200x1_lora", "gpu", 10, 27),
    ("qwen2.5-7b_gh200x4", "gpu", 10, 27),
    ("qwen2.5-7b_tpu-v5p-8", "tpu", 10, 27),
    # no scorer at all, C = 32 alone: sync admission, decode start, the decode, experience,
    # update; oppo refills: its empty rows, admission, 6 replay row buckets, decode start, 3
    # prompt-store and 5 placement buckets, the decode, experience, update (compiled for sm_90a
    # deviceless: 20, docs/REFILL.md)
    ("qwen2.5-7b_gh200x1_lora_grpo", "gpu", 5, 20),
    # the reference (bf16) beside the float32 master actor: its own admission and 4 replay
    # row buckets, its streamed chunks 3 more (one per chunk size), its sync scoring 1
    ("qwen2.5-7b_tpu-v5p-8_grpo", "tpu", 8, 19),
    # the 32B configs on 32 devices: the 7B ones' plans (the mesh and the widths change no shape
    # family); compiled for their targets in docs/benchmarks/aot/
    ("qwen2.5-32b_tpu-v5p-64", "tpu", 10, 27),
    ("qwen2.5-32b_h100x32", "gpu", 10, 27),
    ("qwen2.5-32b_tpu-v5p-64_grpo", "tpu", 8, 19),
    ("qwen2.5-32b_h100x32_grpo", "gpu", 8, 19),
]


@pytest.mark.parametrize(("name", "backend", "sync", "oppo"), COUNTS)
def test_program_counts(name, backend, sync, oppo):
    assert _programs(name, "sync", backend) == sync
    assert _programs(name, "oppo", backend) == oppo


def test_grpo_configs_within_their_ppo_configs_budget():
    for grpo, ppo, backend in (
        ("qwen2.5-7b_gh200x1_lora_grpo", "qwen2.5-7b_gh200x1_lora", "gpu"),
        ("qwen2.5-7b_tpu-v5p-8_grpo", "qwen2.5-7b_tpu-v5p-8", "tpu"),
        ("qwen2.5-32b_tpu-v5p-64_grpo", "qwen2.5-32b_tpu-v5p-64", "tpu"),
        ("qwen2.5-32b_h100x32_grpo", "qwen2.5-32b_h100x32", "gpu"),
    ):
        for mode in ("sync", "oppo"):
            assert _programs(grpo, mode, backend) <= _programs(ppo, mode, backend)


def test_slots_count_groups_and_groups_do_not_compact():
    cfg = load_config("qwen2.5-7b_gh200x1_lora_grpo", list(GH200_GRPO_UNREFILLED))
    shapes = run_shapes(cfg, backend="gpu")
    assert shapes.slots == 112 + 4 * 8 and shapes.max_carried == 32  # Δ_max = 4 groups of 8
    assert run_shapes(cfg, Schedule.named("intra"), "gpu").slots == 112
    names = [f.name for f in plan_programs(shapes)]
    assert "streamed scoring" not in names and "sync scoring" not in names  # no 0-program family
    # On the CPU compaction is on by default, but not for groups (it would split them).
    demo = load_config("demo_cpu", ["rollout.group_size=4", "ppo.advantage=grpo",
                                    "ppo.kl_in_reward=false"])  # fmt: skip
    assert run_shapes(demo, backend="cpu").compaction_floor is None
    assert run_shapes(load_config("bench_longtail_cpu"), backend="cpu").compaction_floor


def test_the_grpo_bench_refills_b_rows_with_no_scorer():
    """configs/bench_grpo_longtail_cpu.yaml: 4 prompts x G = 4, its carrying schedules refilling
    B = 16 rows (Δ = 0); β = 0, critic-free and a reward function: nothing scores; no slot
    compaction (groups); the PPO long-tail bench's lengths."""
    grpo, ppo = load_config("bench_grpo_longtail_cpu"), load_config("bench_longtail_cpu")
    shapes = run_shapes(grpo, backend="cpu")
    assert grpo.rollout.refill_every and grpo.pipeline.overcommit == 0 and shapes.slots == 16
    assert shapes.scorers == () and shapes.compaction_floor is None
    assert grpo.rollout.length_median == ppo.rollout.length_median


PPO_REFILL = ["rollout.refill_every=512", "pipeline.adaptive_overcommit=false",
              "pipeline.placement=colocated", "mesh.scoring_devices=0"]  # fmt: skip


@pytest.mark.parametrize(
    "config, refill",
    [("qwen2.5-7b_gh200x1_lora_grpo", []), ("qwen2.5-7b_gh200x1_lora", PPO_REFILL)],
)
def test_the_7b_configs_refilling_stay_within_the_compile_budget(config, refill):
    """The GRPO config as shipped refills (every 32 positions); the PPO one with refill turned
    on (every 512 positions, a multiple of each chunk candidate; fixed Δ, one mesh). The
    refilling step's programs (``compile_plan._refill_programs``) for the GH200: the stores
    and placements in power-of-four buckets keep both within the 32 programs.
    `oppo-jax compile-plan` compiles them for sm_90a deviceless (20 and 28, BENCHMARKS.md)."""
    shapes = run_shapes(load_config(config, refill), None, "gpu")
    families = {f.name: f for f in plan_programs(shapes)}
    assert {"refill start", "refill prompts", "refill place"} <= set(families)
    assert families["refill place"].shapes == (1, 4, 16, 64, shapes.slots)  # S: 120 or 128
    assert sum(f.programs for f in families.values()) <= 32
