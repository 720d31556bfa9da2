"""The decode chunk updates the KV cache in place on the accelerators' compilers: no loop of
its optimized program (decode steps, layers, the skip of a step whose slots are all done)
copies a buffer of the cache's full shape.

Compiled deviceless for an H100 (XLA:GPU, the ragged kernel in Triton) and a TPU v5p
(XLA:TPU, the ragged kernel in Mosaic), with the ragged kernel ("auto" picks it there) and
with XLA's attention. Found on both: XLA:GPU copied the whole cache into and out of the
``lax.cond`` that skipped a step's forward (each step); XLA:TPU laid the carried cache out
for the scatter that wrote each token's keys, [K, Dh] windows minor, and copied it into the
Mosaic kernel's row-major layout at every layer of every step. For Qwen2.5-7B on a GH200 (112
slots, 1536 columns: a 12 GiB cache) one copy per step is about three times the step's weight
reads. Where a target's compiler is not installed its tests skip and name the extra.
"""

import functools
import importlib.util
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from oppo_jax.models.kv_cache import init_cache
from oppo_jax.models.model_config import preset
from oppo_jax.parallel.sharding import abstract_params, make_mesh, param_shardings, slot_shardings
from oppo_jax.parallel.targets import Target
from oppo_jax.pipeline.kernels import oppo_decode
from oppo_jax.rollout.decode import CutRule, DecodeState
from oppo_jax.rollout.sampling import SamplingConfig

HAS_TPU = importlib.util.find_spec("libtpu") is not None
HAS_GPU = importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
needs_tpu = pytest.mark.skipif(not HAS_TPU, reason="the TPU compiler: pip install -e '.[tpu-aot]'")
needs_gpu = pytest.mark.skipif(not HAS_GPU, reason="the GPU compiler: pip install -e '.[gpu-aot]'")
SLOTS, CAPACITY, RESPONSE, CHUNK = 16, 128, 64, 8  # 128 columns: both ragged forms take them
KERNEL = {"gpu": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}  # the ragged kernel's call
_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) ([a-z][\w\-]*)\(")
_CALLS = re.compile(  # what an instruction runs: fusions, reducers, loops, conditionals' branches
    r"(?:calls|to_apply|body|condition|true_computation|false_computation|branch_computations)"
    r"=\{?%([\w.\-]+(?:, %[\w.\-]+)*)"
)


def _state(cfg) -> DecodeState:
    """A decode state of SLOTS slots (zeros: only its shapes are used)."""
    i32, zeros = jnp.int32, jnp.zeros
    slots = lambda dtype: zeros((SLOTS,), dtype)  # noqa: E731
    return DecodeState(
        cache=init_cache(cfg, SLOTS, CAPACITY),
        next_logits=zeros((SLOTS, cfg.vocab_size), jnp.float32),
        tokens=zeros((SLOTS, RESPONSE), i32), logprobs=zeros((SLOTS, RESPONSE), jnp.float32),
        num_generated=slots(i32), finished=slots(bool), finish_step=slots(i32),
        prompt_id=slots(i32), sample_index=slots(i32), step=zeros((), i32),
        base_key=zeros((2,), jnp.uint32), target_len=slots(i32),
    )  # fmt: skip


def _lowered(cfg, program, mesh):
    """``program`` (the jitted decode chunk) lowered for ``mesh`` at abstract arguments. The
    state and the rule go in as flat leaves, rebuilt inside the trace: their dataclasses'
    runtime type checks take arrays, not ShapeDtypeStructs."""
    state = _state(cfg)  # small host arrays: their shapes, laid out on the target's devices
    rule = CutRule(jnp.zeros(SLOTS, bool), jnp.zeros(SLOTS, bool), jnp.zeros((), jnp.int32))
    whole = NamedSharding(mesh, PartitionSpec())
    sds = lambda x, s=whole: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)  # noqa: E731
    laid = zip(jax.tree.leaves(state), slot_shardings(state, mesh), strict=True)
    states = [sds(x, s) for x, s in laid]
    params = jax.tree.map(sds, abstract_params(cfg), param_shardings(cfg, mesh))

    def run(params, states, rules):
        rebuilt = (jax.tree.unflatten(jax.tree.structure(x), y) for x, y in
                   ((state, states), (rule, rules)))  # fmt: skip
        return program(params, *rebuilt)

    rules = [sds(x) for x in jax.tree.leaves(rule)]
    return jax.jit(run, donate_argnums=(1,)).lower(params, states, rules)


def _in_loops(text: str) -> dict[str, list[str]]:
    """{computation: its instruction lines} of every computation a loop body runs (the body,
    what it calls, loops nested in it): from the optimized HLO module's text."""
    comps, name = {}, None
    for line in text.splitlines():
        if (head := _HEADER.match(line)) is not None:
            name, comps[head.group(1)] = head.group(1), []
        elif name is not None:
            comps[name].append(line)
            name = None if line.rstrip() == "}" else name
    todo = [m.group(1) for lines in comps.values() for line in lines
            if (m := re.search(r"\bwhile\(.*\bbody=%([\w.\-]+)", line))]  # fmt: skip
    found = {}
    while todo:
        current = todo.pop()
        if current in found or current not in comps:
            continue
        found[current] = comps[current]
        for line in comps[current]:
            for called in _CALLS.findall(line):
                todo += [c.strip().lstrip("%") for c in called.split(",")]
    return found


def _cache_copies(text: str, shape: tuple[int, ...]) -> list[str]:
    """Instructions inside loops that copy (or start copying) a buffer of ``shape``."""
    full = re.compile(r"\b[a-z]\w*\[" + ",".join(map(str, shape)) + r"\]")
    return [f"{comp}: {line.strip()[:160]}" for comp, lines in _in_loops(text).items()
            for line in lines if (m := _INSTRUCTION.match(line)) and m.group(2) in
            ("copy", "copy-start") and full.search(m.group(1))]  # fmt: skip


@pytest.mark.parametrize("attention", ["auto", "xla"])
@pytest.mark.parametrize(
    "target", [pytest.param("h100", marks=needs_gpu), pytest.param("tpu-v5p", marks=needs_tpu)]
)
def test_decode_chunk_holds_no_full_cache_copy_inside_a_loop(target, attention):
    cfg = preset("tiny", dtype="bfloat16", param_dtype="bfloat16", attention=attention)
    t = Target.parse(target)
    mesh = make_mesh(1, 1, 1, t.devices(1))
    statics = dict(cfg=cfg, sampling=SamplingConfig(), chunk_size=CHUNK, mesh=mesh, kv_width=None)
    program = functools.partial(oppo_decode, **statics)
    compiled = _lowered(cfg, program, mesh).compile(t.compile_options or None)
    text = compiled.runtime_executable().hlo_modules()[0].to_string()
    ragged = f'custom_call_target="{KERNEL[t.platform]}"' in text
    assert ragged == (attention == "auto")  # the kernel reading the stacked cache, or XLA's
    shape = (cfg.num_layers, SLOTS, cfg.num_kv_heads, CAPACITY, cfg.head_dim)
    assert _in_loops(text), "the decode chunk compiled to no loop: nothing was checked"
    assert _cache_copies(text, shape) == []
