"""The per-device memory report: state bytes equal hand-computed ones, kernels are compiled."""

import functools
import json

import pytest

from oppo_jax.config import ConfigError, PPOConfig
from oppo_jax.models.model_config import ModelConfig
from oppo_tools.memory.cli import format_table, main
from oppo_tools.memory.report import (
    KERNELS,
    Lowering,
    ReportModels,
    ReportSettings,
    RunShapes,
    memory_report,
)

# No biases and an untied head: only the RMSNorm scales, (2L + 1) x D values, are replicated.
MODEL = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=16,
)  # fmt: skip
SHAPES = RunShapes(batch_size=8, prompt_len=8, response_len=16, slots=10, chunk_size=4,
                   replay_rows=2)  # fmt: skip
FSDP = 4


@functools.cache
def _report():
    ppo = PPOConfig(ppo_epochs=1, num_minibatches=2, grad_accum_steps=2)
    return memory_report(ReportModels(MODEL), SHAPES, ReportSettings((1, FSDP, 1), ppo=ppo))


def _param_bytes(cfg: ModelConfig) -> int:
    """float32 parameters split over fsdp along the model width, norm scales on every device."""
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    return 4 * ((cfg.num_params() - norms) // FSDP + norms)


def test_state_bytes_equal_hand_computed_ones():
    b = _report()["bytes"]
    actor, critic = _param_bytes(MODEL), _param_bytes(MODEL.replace(head="score"))
    assert b["actor_params"] == b["reference_params"] == actor
    assert b["critic_params"] == b["reward_params"] == critic
    # AdamW: two moments per parameter, and two int32 step counts (Adam's, the schedule's)
    # per optimizer.
    assert b["optimizer"] == 2 * (actor + critic) + 2 * 2 * 4
    # 10 slots padded to 12, 3 per device; keys and values [L, 3, K, P + R, Dh], lengths [3].
    slots = 3
    per_cache = 2 * 2 * slots * 2 * (8 + 16) * 16 * 4 + slots * 4
    assert b["kv_caches"] == dict.fromkeys(("actor", "critic", "reference", "reward"), per_cache)
    rows = 8 // FSDP  # tokens [2, 24] int32; six float32 [2, 16]; mask bool; two [2] vectors
    assert b["ppo_batch"] == rows * (24 * 4 + 6 * 16 * 4 + 16 + 4 + 4)
    assert (
        _report()["resident"]
        == 2 * (actor + critic) + b["optimizer"] + 4 * per_cache + (b["ppo_batch"])
    )
    assert _report()["shapes"]["slots_padded"] == 12


def test_kernels_are_compiled_with_positive_temporaries():
    report = _report()
    kernels = report["kernels"]
    assert tuple(kernels) == KERNELS
    for name, k in kernels.items():
        assert k["temp"] > 0, name
        assert k["peak"] == k["argument"] + k["output"] - k["alias"] + k["temp"]
        own = report["bytes"]["kv_caches"]["actor"] if name == "admission" else 0
        assert k["with_resident"] == (
            report["resident"] + k["temp"] + k["output"] - k["alias"] - own
        )
        assert k["with_live"] == k["live"] + k["temp"] + k["output"] - k["alias"]
    # The admission and the update run without the rollout's KV caches, but for the frozen
    # scorers' kept rows: Δ_max = 2 of the 12 padded slots of the reference and reward caches.
    caches = report["bytes"]["kv_caches"]
    kept = int(2 / 12 * (caches["reference"] + caches["reward"]))
    for name in ("admission", "update"):
        assert kernels[name]["live"] == report["resident"] - sum(caches.values()) + kept
    # The replay of carried prefixes runs on the actor's admitted cache, donated in and out.
    assert kernels["replay"]["live"] == kernels["admission"]["live"] + caches["actor"]
    assert kernels["replay"]["alias"] >= caches["actor"]
    assert kernels["decode_chunk"]["live"] == kernels["score_chunk"]["live"] == report["resident"]
    b = report["bytes"]
    state = b["actor_params"] + b["critic_params"] + b["optimizer"] + 4  # + the step counter
    assert kernels["update"]["alias"] == state  # the train state is donated, updated in place
    assert kernels["decode_chunk"]["alias"] >= b["kv_caches"]["actor"]  # the cache too
    table = format_table(report)
    assert "| update |" in table and "KV cache: reward" in table and "CPU backend" in table
    json.dumps(report)  # JSON-ready


def test_the_update_is_compiled_packed_at_its_largest_shape():
    """The run's update: compiled at its one packed shape, its table line says so."""
    from oppo_jax.ppo.packing import packed_shapes

    report = _report()
    m = SHAPES.batch_size // 4  # 2 minibatches x 2 accumulation steps
    full = SHAPES.prompt_len + SHAPES.response_len
    largest, count = packed_shapes(m, full, SHAPES.response_len, 16, FSDP, chunks=2)
    assert tuple(report["shapes"]["packed_update"]) == largest
    assert report["shapes"]["packed_update_chunks"] == count
    assert report["kernels"]["update"]["argument"] > 0
    assert f"packed, at its one shape {largest[0]} rows x {largest[1]} columns" in (
        format_table(report)
    )


def test_extrapolation_from_one_and_two_layers_is_exact_at_two():
    full = _report()["kernels"]["update"]
    ppo = PPOConfig(ppo_epochs=1, num_minibatches=2, grad_accum_steps=2)
    settings = ReportSettings((1, FSDP, 1), ppo=ppo)
    cut = memory_report(ReportModels(MODEL), SHAPES, settings, Lowering(("update",), layers=1))
    assert cut["kernels"]["update"] == full
    assert "extrapolated linearly to 2" in cut["note"]


@pytest.mark.parametrize("remat", ["full"])
def test_command_reports_the_7b_update_per_device(capsys, remat):
    # Qwen2.5-7B on four GH200s, all 28 layers, abstract: the update's state is 1/4 of the
    # float32 master parameters and moments (optim.master_dtype), and with per-layer remat its
    # temporaries stay far below the no-remat activations (CPU float32 upper bound).
    # Moments on the device here (the config rests them on the host): the whole state is
    # donated and updated in place.
    args = [
        "--kernels",
        "update",
        "--remat",
        remat,
        "--target",
        "cpu",
        "--set",
        "optim.offload=false",
    ]
    main(["qwen2.5-7b_gh200x4", "--json", *args])
    report = json.loads(capsys.readouterr().out)
    b, update = report["bytes"], report["kernels"]["update"]
    params = 7_615_616_512 * 4 / 4  # Qwen2.5-7B parameters, float32 masters, over fsdp = 4
    assert abs(b["actor_params"] - params) / params < 0.01
    assert update["alias"] == b["actor_params"] + b["critic_params"] + b["optimizer"] + 4
    assert report["models"]["actor"]["remat"] == remat
    assert 0 < update["temp"] < 48 * 2**30


def test_command_names_the_missing_preset():
    with pytest.raises(ConfigError, match="model.preset"):
        main(["demo_cpu", "--kernels", "update"])


def test_memory_is_an_oppo_jax_subcommand(capsys):
    """``oppo-jax memory`` reaches the report; bad input exits 2 with one line."""
    from oppo_jax.cli import main

    assert main(["memory", "demo_cpu"]) == 2
    assert "model.preset" in capsys.readouterr().err


def test_lora_trains_adapters_over_shared_bases_and_offload_moves_moments_to_the_host():
    from oppo_jax.config import OptimConfig

    lora_model = MODEL.replace(lora_rank=4)
    settings = lambda optim: ReportSettings((1, FSDP, 1), optim=optim)  # noqa: E731
    none = Lowering(kernels=())
    plain = memory_report(ReportModels(MODEL), SHAPES, settings(OptimConfig()), none)["bytes"]
    lora = memory_report(ReportModels(lora_model), SHAPES, settings(OptimConfig()), none)
    b = lora["bytes"]
    # The frozen bases are the reference and the reward model: counted once, as without LoRA.
    assert b["reference_params"] == plain["reference_params"]
    assert b["reward_params"] == plain["reward_params"]
    assert b["frozen_params"] == 0
    # Only adapters (and the critic's value head) are trained, with float32 moments.
    assert 0 < b["actor_params"] < plain["actor_params"] / 5
    assert b["optimizer"] == 2 * (b["actor_params"] + b["critic_params"]) + 2 * 2 * 4
    assert lora["models"]["actor"]["lora_rank"] == 4
    off = memory_report(
        ReportModels(lora_model), SHAPES, settings(OptimConfig(offload=True)), none
    )["bytes"]
    assert off["optimizer"] == 0 and off["host"]["optimizer"] == b["optimizer"]
    # bfloat16 masters halve the trained bytes and their moments.
    half = memory_report(
        ReportModels(lora_model), SHAPES, settings(OptimConfig(master_dtype="bfloat16")), none
    )["bytes"]
    assert 2 * half["actor_params"] == b["actor_params"]


def test_unknown_memory_target_is_refused():
    from oppo_tools.memory.target import target_devices

    with pytest.raises(ValueError, match="memory target 'gpu': unknown compile target 'gpu'"):
        target_devices("gpu", 1)


# Weights (25 MiB of MLP in bf16) that outweigh a TPU's tile padding of the small buffers.
BF16 = MODEL.replace(
    dtype="bfloat16", param_dtype="bfloat16", hidden_size=256, intermediate_size=8192, head_dim=64
)


def test_tpu_target_keeps_bf16_where_the_cpu_makes_float32_copies():
    """XLA:CPU converts a bf16 model's stacked weights to float32 copies (its temporaries hold
    more than the weights themselves); the TPU compiler (deviceless v5p, with libtpu) keeps
    them bf16. Without libtpu the target says what to install."""
    import importlib.util

    lowering = lambda target: Lowering(("decode_chunk",), target=target)  # noqa: E731
    report = lambda target: memory_report(  # noqa: E731
        ReportModels(BF16), SHAPES, ReportSettings((1, 1, 1)), lowering(target)
    )
    cpu = report("cpu")
    weights = cpu["bytes"]["reference_params"]  # the bf16 weights the decode chunk reads
    assert cpu["kernels"]["decode_chunk"]["temp"] > weights  # the float32 copies
    if importlib.util.find_spec("libtpu") is None:
        with pytest.raises(ValueError, match=r"tpu-aot"):
            report("tpu-v5p")
        return
    tpu = report("tpu-v5p")
    assert "compiled ahead of time by XLA:TPU" in tpu["note"]
    assert tpu["kernels"]["decode_chunk"]["temp"] < weights / 2
