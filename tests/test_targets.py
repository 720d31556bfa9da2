"""A run's registry compiled ahead of time for targets this host does not have: a TPU v5p
slice (XLA:TPU, Mosaic for the Pallas kernels) and GH200/H100 nodes (XLA:GPU to sm_90a,
Triton for the Pallas kernels), deviceless. Each target's compiler is an optional extra;
where it is not installed its tests skip and name the extra."""

import importlib.util
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from oppo_jax.config import load_config
from oppo_jax.parallel.targets import Target, TargetError
from oppo_jax.pipeline.compile_plan import plan_programs
from oppo_jax.pipeline.program_cost import program_cost
from oppo_jax.pipeline.registry import UnplannedProgram
from oppo_jax.pipeline.schedule import Schedule
from oppo_tools.aot import build_registry, default_target

HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
needs_tpu = pytest.mark.skipif(not HAS_TPU, reason="the TPU compiler: pip install -e '.[tpu-aot]'")
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="the GPU compiler: pip install -e '.[gpu-aot]'")
# A tiny random-weight run whose cache (P 16 + R 64 = 80 columns) the ragged decode's Triton
# and Mosaic forms both take (key blocks of 16); bf16 so that a GPU's packed update runs the
# segment attention kernel; Δ 2 so that the oppo plan replays carried prefixes.
TINY = (
    "model.actor_path=random", "model.reward_path=random", "model.preset=tiny",
    "model.dtype=bfloat16", "model.param_dtype=bfloat16", "data.prompts=random",
    "data.random_prompt_len=[2,16]", "rollout.max_prompt_len=16", "pipeline.overcommit=2",
    "mesh.fsdp=2",
)  # fmt: skip


def _custom_calls(program) -> set[str]:
    return set(re.findall(r'custom_call_target="([^"]+)"', program.compiled.as_text() or ""))


def _nested_scans(mesh):
    """Three passes of eight tanh-matmul layers (nested scans): 3·8·2·64·256·256 FLOPs."""

    def f(w, x):
        layer = lambda x, wi: (jnp.tanh(x @ wi), None)  # noqa: E731
        return jax.lax.scan(lambda x, _: (jax.lax.scan(layer, x, w)[0], None), x, None, 3)[0]

    sh = NamedSharding(mesh, PartitionSpec())
    w = jax.ShapeDtypeStruct((8, 256, 256), jnp.float32, sharding=sh)
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32, sharding=sh)
    return jax.jit(f).lower(w, x), 3 * 8 * 2 * 64 * 256 * 256


@pytest.mark.parametrize(
    "target",
    ["host", pytest.param("tpu-v5p", marks=needs_tpu), pytest.param("h100", marks=needs_gpu)],
)
def test_costs_multiply_the_loops_trip_counts_in(target):
    """XLA counts a loop's body once; the registry's costs count every trip (within 2% of the
    FLOPs of the matmuls, the rest being tanh and the loops' own arithmetic)."""
    described = Target.parse(target)
    lowered, want = _nested_scans(Mesh(np.array(described.devices(1)), ("d",)))
    cost = program_cost(lowered.compile(described.compile_options))
    assert cost["loops_multiplied"] and not cost["upper_bound"]
    assert want <= cost["flops"] <= 1.02 * want


def _registry(target: str, mode: str):
    cfg = load_config(None, list(TINY))
    return build_registry(cfg, Target.parse(target), Schedule.named(mode), progress=False)


def _check_plan(registry, run):
    planned = {f.name: f.programs for f in plan_programs(run.shapes)}
    assert {f: len(ps) for f, ps in registry.by_family().items()} == planned
    for p in registry.programs:
        assert p.compile_s > 0 and p.memory.argument > 0 and p.cost["loops_multiplied"]


@needs_tpu
def test_tiny_registry_compiles_for_a_v5p_slice_with_mosaic_kernels():
    registry, run = _registry("tpu-v5p", "oppo")
    assert registry.compiler.startswith("XLA:TPU (libtpu ")
    assert {d.platform for d in run.placement.groups.training.devices.flat} == {"tpu"}
    _check_plan(registry, run)
    (decode,) = registry.by_family()["decode"]
    assert "tpu_custom_call" in _custom_calls(decode)  # the ragged decode, Mosaic
    assert decode.cost["upper_bound"]  # the chunk's loop stops at the cut: counted to C steps
    with pytest.raises(UnplannedProgram, match=r"decode program at shape \(24, 8, 80\)"):
        registry.program("decode", (24, 8, 80))


@needs_gpu
@pytest.mark.parametrize("mode", ["oppo", "sync"])
def test_tiny_registry_compiles_for_gh200_with_triton_kernels(mode):
    registry, run = _registry("gh200", mode)
    assert registry.compiler.startswith("XLA:GPU sm_90a")
    _check_plan(registry, run)
    (decode,) = registry.by_family()["decode"]
    assert "__gpu$xla.gpu.triton" in _custom_calls(decode)  # the ragged decode
    (update,) = registry.by_family()["update"]
    assert "__gpu$xla.gpu.triton" in _custom_calls(update)  # the segment attention
    assert registry.program("update", update.shape) is update


def test_targets_fit_their_topologies_and_name_bad_ones():
    assert Target.parse("h100")._fitted(16) == "1x2x8"
    assert Target.parse("gh200")._fitted(4) == "1x4x1"
    assert Target.parse("tpu-v5p")._fitted(8) == "2x2x2"
    assert Target.parse("tpu-v5p:4x4x4").topology == "4x4x4"
    assert Target.parse("gh200").hbm_bytes == 101468602368  # its target description's
    with pytest.raises(TargetError, match="unknown compile target 'a100'"):
        Target.parse("a100")
    cfg = load_config("qwen2.5-7b_gh200x1_lora_grpo")
    assert default_target(cfg, "qwen2.5-7b_gh200x1_lora_grpo") == "gh200"
    assert default_target(cfg, "configs/qwen2.5-7b_tpu-v5p-8.yaml") == "tpu-v5p"
    assert default_target(load_config("demo_cpu"), "demo_cpu") == "host"


@needs_tpu
def test_compile_plan_reports_the_registry_against_hbm(tmp_path, capsys):
    """``oppo-jax compile-plan CONFIG --json``: target, compiler, every program with its
    family, shape, seconds and bytes, and the peak per device against the target's HBM."""
    from oppo_jax import cli

    path = tmp_path / "tiny.yaml"
    path.write_text(json.dumps({"mesh": {"target": "tpu-v5p:2x2x1"}}))
    args = ["compile-plan", str(path), "--mode", "sync", "--json", "--set", *TINY]
    assert cli.main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == "tpu-v5p:2x2x1" and report["compiler"].startswith("XLA:TPU")
    families = {p["family"] for p in report["programs"]}
    assert {"decode", "sync scoring", "update"} <= families
    for p in report["programs"]:
        assert p["compile_s"] > 0 and p["argument_bytes"] > 0 and p["flops"] > 0
    decode = next(p for p in report["programs"] if p["family"] == "decode")
    assert decode["kernels"] == ["tpu_custom_call"]  # the ragged decode, by Mosaic
    assert report["resident_bytes_per_device"] < report["peak_bytes_per_device"]
    assert report["hbm_bytes_per_device"] == int(95.74 * 2**30) and report["fits"]


@needs_gpu
def test_memory_compiles_for_the_configs_own_hardware(capsys):
    """``oppo-jax memory`` of a GH200 config compiles with XLA:GPU for a GH200 by default."""
    from oppo_tools.memory.cli import main

    main(["qwen2.5-7b_gh200x1_lora_grpo", "--json", "--kernels", "decode_chunk", "--layers", "1"])
    report = json.loads(capsys.readouterr().out)
    assert "by XLA:GPU sm_90a" in report["note"] and "for gh200" in report["note"]


def test_memory_falls_back_to_labelled_cpu_bounds(monkeypatch, capsys):
    """Without the target's compiler the report is XLA:CPU's, labelled an upper bound, and
    one line says why."""
    from oppo_tools.memory.cli import main

    devices = Target.devices

    def missing(self, count):
        if self.deviceless:
            raise TargetError("the GPU compiler is not installed (gpu-aot)")
        return devices(self, count)

    monkeypatch.setattr(Target, "devices", missing)
    main(["qwen2.5-7b_gh200x1_lora_grpo", "--json", "--kernels", "update", "--layers", "1"])
    out = capsys.readouterr()
    assert json.loads(out.out)["note"].startswith("CPU upper bound")
    assert "CPU upper bounds instead of gh200: the GPU compiler is not installed" in out.err
