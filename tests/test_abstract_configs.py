"""Real-size configs build their models and lower their sharded update without allocating."""

import math

import jax
import pytest

from oppo_jax.config import CONFIG_DIR, load_config
from oppo_jax.parallel.targets import Target, TargetError
from oppo_jax.ppo.estimators import estimator
from oppo_tools.abstract_checks import abstract_update_check, preset_models
from oppo_tools.aot import default_target

REAL_CONFIGS = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if load_config(p).model.preset)


def _declared_devices(cfg, name):
    """The devices of the declared mesh: this host's, or for a mesh larger than the host (the
    32-device 32B configs) the compile-only devices of the config's target; the update is
    lowered on them, never compiled (the compiled programs are in docs/benchmarks/aot/)."""
    count = math.prod((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
    if count <= len(jax.devices()):
        return jax.devices()[:count]
    try:
        return Target.parse(default_target(cfg, name)).devices(count)
    except TargetError as err:  # its compiler is an optional extra (tpu-aot, gpu-aot)
        pytest.skip(str(err))


def _check(cfg, devices=None):
    actor, critic = preset_models(cfg)
    result = abstract_update_check(cfg, actor, critic, devices)
    shards = cfg.mesh.fsdp * cfg.mesh.tensor  # parameters are replicated over "data"
    itemsize = 2 if cfg.model.param_dtype == "bfloat16" else 4
    for model, key in ((actor, "actor_bytes_per_device"), (critic, "critic_bytes_per_device")):
        if key.startswith("critic") and not estimator(cfg.ppo).needs_critic:
            assert result[key] == 0  # critic-free: no critic parameters anywhere
            continue
        ideal = model.num_params() * itemsize / shards
        # Norm scales (a few thousand numbers per layer) stay replicated: within 1% of ideal.
        assert ideal <= result[key] <= ideal * 1.01, (key, result[key], ideal)
    text = result["lowered"].as_text()
    assert "sharding" in text
    return result


def test_there_are_real_size_configs():
    assert {"qwen2.5-7b_gh200x4", "qwen2.5-7b_tpu-v5p-8", "qwen2.5-3b_gh200x1"} <= set(REAL_CONFIGS)
    assert {"qwen2.5-7b_gh200x1_lora_grpo", "qwen2.5-7b_tpu-v5p-8_grpo"} <= set(REAL_CONFIGS)
    assert {"qwen2.5-32b_tpu-v5p-64", "qwen2.5-32b_tpu-v5p-64_grpo", "qwen2.5-32b_h100x32",
            "qwen2.5-32b_h100x32_grpo"} <= set(REAL_CONFIGS)  # fmt: skip


@pytest.mark.parametrize("name", REAL_CONFIGS)
def test_config_lowers_on_its_declared_mesh(name):
    cfg = load_config(name)
    devices = _declared_devices(cfg, name)
    assert len(devices) == math.prod((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor))
    _check(cfg, devices)


def test_qwen7b_update_on_a_4x2_mesh_has_an_eighth_of_the_parameters_per_device():
    cfg = load_config("qwen2.5-7b_gh200x4", ["mesh.fsdp=4", "mesh.tensor=2"])
    result = _check(cfg)
    actor, _ = preset_models(cfg)
    assert 7.5e9 < actor.num_params() < 7.7e9
    assert result["actor_bytes_per_device"] < actor.num_params() * 2 / 8 * 1.01
