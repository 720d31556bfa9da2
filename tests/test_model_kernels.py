"""The compiled model kernels: scanned layers, an in-place KV cache, packed sequences, remat and
no full-vocabulary tensors, checked on the programs XLA actually compiles (small sizes, CPU):
those a run without the suite's cheap-compile flags compiles (``compile_as_in_production``)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest

from oppo_jax.models.kv_cache import init_cache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.models.transformer import Transformer, init_params
from tests.oracles import policy_logprobs
from tests.xla_flags import compile_as_in_production

CFG = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    qkv_bias=True,
)
SLOTS, CAPACITY = 3, 200  # distinctive sizes, so the cache's shape is easy to find in HLO text


def _abstract_params(cfg):
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def _cache_step(cfg, width: int, donate: bool = True):
    """Compiled forward of ``width`` new tokens through a KV cache (decode: 1, prefill: more)."""
    step = jax.jit(
        lambda p, t, c: Transformer(cfg).apply({"params": p}, t, c),
        donate_argnums=(2,) if donate else (),
    )
    cache = jax.eval_shape(lambda: init_cache(cfg, SLOTS, CAPACITY))
    tokens = jax.ShapeDtypeStruct((SLOTS, width), jnp.int32)
    return compile_as_in_production(step.lower(_abstract_params(cfg), tokens, cache))


def _root_opcodes(hlo: str) -> dict[str, str]:
    """Each computation's name -> the opcode of its ROOT instruction."""
    roots, current = {}, None
    for line in hlo.splitlines():
        header = re.match(r"(?:ENTRY )?%([\w.-]+) \(", line)
        if header:
            current = header.group(1)
        root = re.match(r"\s*ROOT %\S+ = (?:\(.*\)|\S+) ([\w-]+)\(", line)
        if root and current:
            roots[current] = root.group(1)
    return roots


def _ops_making(hlo: str, shape: str) -> dict[str, list[str]]:
    """Opcodes of the instructions whose result is an array of ``shape`` (e.g. "f32[4,3]"); for
    each fusion, the ROOT opcode of the computation it calls."""
    roots = _root_opcodes(hlo)
    found: dict[str, list[str]] = {}
    pattern = rf"^\s*(?:ROOT )?%\S+ = {re.escape(shape)}\{{[^}}]*\}} ([\w-]+)\((.*)$"
    for opcode, rest in re.findall(pattern, hlo, re.M):
        called = re.search(r"calls=%([\w.-]+)", rest)
        found.setdefault(opcode, []).append(roots.get(called.group(1), "?") if called else "")
    return found


@pytest.mark.parametrize("width", [1, 8])
def test_cache_is_updated_in_place_never_copied(width):
    cache_shape = f"f32[{CFG.num_layers},{SLOTS},{CFG.num_kv_heads},{CAPACITY},{CFG.head_dim}]"
    compiled = _cache_step(CFG, width)
    ops = _ops_making(compiled.as_text(), cache_shape)
    # Cache-sized arrays are only passed along (parameters, loop carries) or scattered into.
    assert set(ops) <= {"parameter", "get-tuple-element", "scatter", "fusion", "bitcast"}, ops
    assert ops["fusion"] and all(root == "scatter" for root in ops["fusion"]), ops
    if width == 1:
        # Decode temporaries hold one layer's keys and values, never a whole cache buffer.
        buffer_bytes = (
            np.prod([CFG.num_layers, SLOTS, CFG.num_kv_heads, CAPACITY, CFG.head_dim]) * 4
        )
        assert compiled.memory_analysis().temp_size_in_bytes < buffer_bytes
    # The check has teeth: without donation XLA must copy the cache to keep the input intact.
    undonated = _ops_making(_cache_step(CFG, width, donate=False).as_text(), cache_shape)
    assert "copy" in undonated or any(r == "copy" for r in undonated.get("fusion", []))


def _program_text(compiled) -> str:
    """A compiled program's HLO without its source locations (which name the caller's files and
    the runtime type checker's wrappers, on in tests only)."""
    text = re.sub(r", metadata=\{[^}]*\}", "", compiled.as_text())
    return re.sub(r"^FileNames\n.*?(?=^(?:ENTRY )?%)", "", text, flags=re.M | re.S)


def test_programs_read_by_the_tests_are_those_a_run_without_the_suites_flags_compiles():
    """The suite compiles with cheap-compile flags (tests/xla_flags.py); the tests that read a
    compiled program compile it with ``compile_as_in_production``. That program must be, text
    and memory alike, the one a fresh process without those flags compiles."""
    probe = (
        "import jax.numpy as jnp\n"
        "from tests.test_model_kernels import CFG, _cache_step, _program_text\n"
        "compiled = _cache_step(CFG, 8)\n"
        "print(compiled.memory_analysis().temp_size_in_bytes)\n"
        "print(_program_text(compiled))\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"  # as tests/conftest.py sets it
    root = Path(__file__).resolve().parent.parent
    fresh = subprocess.run(
        [sys.executable, "-c", probe], env=env, cwd=root, capture_output=True, text=True,
        check=True, timeout=300,
    ).stdout  # fmt: skip
    here = _cache_step(CFG, 8)
    assert fresh == f"{here.memory_analysis().temp_size_in_bytes}\n{_program_text(here)}\n"
    # The check has teeth: this process's own flags compile another program.
    step = jax.jit(lambda p, t, c: Transformer(CFG).apply({"params": p}, t, c), donate_argnums=2)
    cache = jax.eval_shape(lambda: init_cache(CFG, SLOTS, CAPACITY))
    tokens = jax.ShapeDtypeStruct((SLOTS, 8), jnp.int32)
    own = step.lower(_abstract_params(CFG), tokens, cache).compile()
    assert _program_text(own) != _program_text(here)


def _hlo_op_count(hlo: str) -> int:
    return len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", hlo, re.M))


def test_hlo_size_does_not_grow_with_layers():
    sizes = {}
    for layers in (2, 6):
        cfg = CFG.replace(num_layers=layers)
        forward = jax.jit(lambda p, t, cfg=cfg: Transformer(cfg).apply({"params": p}, t)[0])
        full = forward.lower(_abstract_params(cfg), jax.ShapeDtypeStruct((2, 16), jnp.int32))
        texts = (compile_as_in_production(full).as_text(), _cache_step(cfg, 1).as_text())
        sizes[layers] = [(len(t), _hlo_op_count(t)) for t in texts]
    for (chars2, ops2), (chars6, ops6) in zip(sizes[2], sizes[6], strict=True):
        assert ops2 == ops6
        assert abs(chars2 - chars6) <= 0.01 * chars2


def test_policy_logprobs_and_gradient_hold_no_vocabulary_sized_activation():
    vocab, block, rows = 1000, 128, (4, 24)
    for tied in (False, True):
        cfg = CFG.replace(vocab_size=vocab, hidden_size=48, head_dim=12, tie_word_embeddings=tied)

        def loss(p, tokens, prompt_len, cfg=cfg):
            logp, entropy = policy_logprobs(cfg, p, tokens, prompt_len, rows[1], 0.7, block)
            return jnp.sum(logp) + 0.1 * jnp.sum(entropy)

        args = (
            jax.ShapeDtypeStruct((rows[0], 40), jnp.int32),
            jax.ShapeDtypeStruct((4,), jnp.int32),
        )
        hlo = compile_as_in_production(
            jax.jit(jax.value_and_grad(loss)).lower(_abstract_params(cfg), *args)
        )
        shapes = set(re.findall(r"[a-z]+\d*\[([\d,]+)\]", hlo.as_text()))
        with_vocab = {s for s in shapes if str(vocab) in s.split(",")}
        # Only the head (or embedding) itself and its gradient span the vocabulary.
        assert with_vocab <= {"1000,48", "48,1000"}, with_vocab
        assert f"{rows[0] * rows[1]},{block}" in shapes  # one block of logits for all rows


def test_packed_segments_equal_separate_forwards():
    cfg = CFG.replace(num_layers=2)
    params = init_params(cfg, jax.random.key(0))
    rng = np.random.default_rng(0)
    lengths = [5, 3, 6]
    seqs = [rng.integers(2, 96, n) for n in lengths]
    width = sum(lengths) + 2  # two padding tokens at the end, in a segment of their own
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : sum(lengths)] = np.concatenate(seqs)
    segment_ids = np.full((1, width), len(lengths), np.int32)
    positions = np.zeros((1, width), np.int32)
    start = 0
    for i, n in enumerate(lengths):
        segment_ids[0, start : start + n] = i
        positions[0, start : start + n] = np.arange(n)
        start += n
    model = Transformer(cfg)
    packed, _ = model.apply(
        {"params": params}, jnp.asarray(tokens), positions=jnp.asarray(positions),
        segment_ids=jnp.asarray(segment_ids),
    )  # fmt: skip
    start = 0
    for seq in seqs:
        alone, _ = model.apply({"params": params}, jnp.asarray(seq, jnp.int32)[None])
        got = packed[0, start : start + len(seq)]
        np.testing.assert_allclose(got, alone[0], rtol=1e-5, atol=1e-5)
        start += len(seq)
    # Without segment ids the later sequences would see the earlier ones.
    mixed, _ = model.apply(
        {"params": params}, jnp.asarray(tokens), positions=jnp.asarray(positions)
    )
    assert np.max(np.abs(mixed[0, 5:8] - packed[0, 5:8])) > 1e-3


def test_remat_changes_memory_not_results():
    base = CFG.replace(hidden_size=64, intermediate_size=256, head_dim=16)
    params = init_params(base, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 64), 0, base.vocab_size)
    results, temp = {}, {}
    for mode in ("none", "full", "dots"):
        cfg = base.replace(remat=mode)

        def loss(p, cfg=cfg):
            hidden, _ = Transformer(cfg).apply({"params": p}, tokens, return_hidden=True)
            return jnp.mean(hidden**2)

        step = jax.jit(jax.value_and_grad(loss))
        compiled = compile_as_in_production(step.lower(params))
        temp[mode] = compiled.memory_analysis().temp_size_in_bytes
        results[mode] = step(params)
    for mode in ("full", "dots"):
        for a, b in zip(*(jax.tree.leaves(results[m]) for m in (mode, "none")), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert temp["full"] < temp["dots"] < temp["none"]
    # ValueError from the config's own check; TypeError when runtime type checking is on.
    with pytest.raises((ValueError, TypeError), match="some"):
        base.replace(remat="some")


def test_rollout_kernels_hold_no_vocabulary_sized_activation():
    """The actor's admission (prompt prefill, replay of carried prefixes, start of the decode)
    and the reference scorer's chunk never hold logits for a whole row: the only
    vocabulary-wide arrays are the head itself and the actor's next-token logits, one row per
    slot (what sampling needs)."""
    from oppo_jax.pipeline.kernels import (
        oppo_admission_prefill,
        oppo_decode_start,
        oppo_replay,
        oppo_streamed_scoring,
    )
    from oppo_jax.rollout import Admission, RolloutSpec, SamplingConfig
    from oppo_jax.rollout.decode import ChunkTokens
    from oppo_jax.scoring.stream import ScorerSpec, scorer_admit

    # A vocabulary larger than one block of the head (VOCAB_BLOCK = 4096 columns).
    vocab, slots, prompt, response, chunk = 5000, 3, 6, 20, 5
    cfg = CFG.replace(vocab_size=vocab, hidden_size=48, head_dim=12)
    params = init_params(cfg, jax.random.key(0))
    context = jnp.full((slots, prompt + response), 7, jnp.int32)  # room for carried prefixes
    admission = Admission.fresh(context, jnp.full((slots,), prompt), response)
    admission = admission.replace(prefix_len=jnp.array([9, 4, 0]))
    rollout = RolloutSpec(SamplingConfig(temperature=0.7), prompt, response, (1,))
    spec = ScorerSpec(cfg, "logprob", response, temperature=0.7)
    state = scorer_admit(spec, params, admission, prompt)
    fed = ChunkTokens(jnp.ones((slots, chunk), jnp.int32), state.num_fed, jnp.full((slots,), chunk),
                      jnp.bool_(True))  # fmt: skip
    prefix, count = jnp.ones((slots, 8), jnp.int32), jnp.array([8, 4, 0], jnp.int32)
    key = jax.random.key(0)
    jaxtyping.config.update("jaxtyping_disable", True)  # lowering rebuilds typed structs
    try:
        lowered = [
            oppo_admission_prefill.lower(params, admission, spec=spec, prompt_width=prompt),
            oppo_replay.lower(params, state, prefix, count, spec=spec, kv_width=16),
            oppo_decode_start.lower(
                params,
                admission,
                key,
                state.cache,
                state.last_hidden,
                state.per_token,
                cfg=cfg,
                rollout=rollout,
            ),
            oppo_streamed_scoring.lower(params, state, fed, spec=spec, kv_width=None, packed=False),
        ]
        hlos = [compile_as_in_production(low).as_text() for low in lowered]
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)
    for hlo in hlos:
        shapes = set(re.findall(r"[a-z]+\d*\[([\d,]+)\]", hlo))
        with_vocab = {s for s in shapes if str(vocab) in s.split(",")}
        assert with_vocab <= {f"48,{vocab}", f"{vocab},48", f"{slots},{vocab}"}, with_vocab
