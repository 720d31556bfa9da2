"""One step's programs walked in the step's own data-flow order, from abstract arguments: the
way the registry (``pipeline.registry``) lowers every program the compile plan lists.

The walk follows DESIGN §3 with shapes instead of arrays: the admission (the actor's prompt
prefill, its replays of carried prefixes, the decode state), each decode chunk, the scorers
that stream it (or, without streaming, the packed scoring of the batch), the batch and the
update. Each program's arguments are the abstract outputs of the program before it
(``compiled.out_info``: shapes, dtypes and the shardings the compiler chose), so a chunk's
tokens are followed from the decode into the scorers and the batch; what the step builds on
the host (the admission, the plans of packed calls, the update's indices) enters as the
host's arrays do, uncommitted (no sharding).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from oppo_jax.base.shapes import chunk_budget, score_rows_per_call, score_width
from oppo_jax.pipeline.carry import prompt_sharing
from oppo_jax.pipeline.compile_plan import RunShapes, plan_programs
from oppo_jax.pipeline.kernels import (
    Kernels,
    oppo_admission_prefill,
    oppo_decode,
    oppo_decode_start,
    oppo_experience,
    oppo_replay,
    oppo_streamed_scoring,
    oppo_sync_scoring,
)
from oppo_jax.pipeline.placement import Placement
from oppo_jax.pipeline.refill_loop import oppo_refill_place, oppo_refill_prompts, oppo_refill_start
from oppo_jax.pipeline.registry import Registry, abstract_like
from oppo_jax.ppo.packed_update import make_update
from oppo_jax.ppo.packing import padding_indices
from oppo_jax.ppo.update import batch_shardings
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import CutRule, ResponseBatch
from oppo_jax.scoring.carried import REPLAY_CHUNK
from oppo_jax.scoring.packed import PackedBatch
from oppo_jax.scoring.stream import ScorerOutputs, padding_plan

# (family, shape, role, Kernel, abstract arguments) -> the compiled program's abstract
# outputs (``Registry`` compiles it, or finds it compiled already)
Build = Callable[[str, tuple, str, "Kernel", tuple], Any]


@dataclasses.dataclass(frozen=True)
class Kernel:
    """A jitted kernel with its static settings bound (``kernels.kernel_jit``), as the walk
    lowers it: equal kernels (one function, equal settings) are one program."""

    fn: Callable
    statics: tuple = ()  # sorted (name, value) pairs of its keyword-only static arguments

    @classmethod
    def of(cls, fn: Callable, **statics) -> Kernel:
        return cls(fn, tuple(sorted(statics.items())))

    def lower(self, *args):
        return self.fn.lower(*args, **dict(self.statics))


@dataclasses.dataclass(frozen=True)
class AbstractRun:
    """What a run's programs are lowered at: its kernels, placement and planned shapes, and
    the abstract (ShapeDtypeStruct) parameters and train state, with their shardings."""

    kernels: Kernels
    placement: Placement
    shapes: RunShapes  # ``compile_plan.run_shapes`` of the run's config
    # role -> parameters where that model runs: "actor" (the rollout's tree: adapters over
    # the frozen base with LoRA), "reference", "critic" (this step's, where the scorers run),
    # "reward"
    params: dict
    train_state: Any  # the update's state (``ppo.update.TrainState`` of ShapeDtypeStructs)


def sds(shape, dtype, sharding=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def host_array(array) -> jax.ShapeDtypeStruct:
    """A host array as a program argument: its shape and dtype, placed by the program."""
    array = np.asarray(array)
    return sds(array.shape, array.dtype)


def _admission(slots: int, prompt: int, response: int, carry: bool) -> Admission:
    """The step's admission as the host hands it over (``step.slot_admission``): its
    context P wide, P + R with room for carried prefixes (``carry.admit``)."""
    i32, flag = sds((slots,), jnp.int32), sds((slots,), jnp.bool_)
    context = sds((slots, prompt + (response if carry else 0)), jnp.int32)
    behaviour = sds((slots, response), jnp.float32)
    return Admission(context, i32, i32, flag, behaviour, i32, i32, flag, flag)


def _prompts(admission: Admission, prompt_width: int) -> Admission:
    """An abstract admission with its context cut to P columns (the batch's prompts)."""
    context = admission.context
    return admission.replace(context=sds((context.shape[0], prompt_width), context.dtype))


def _replicated_on(mesh, tree):
    return jax.tree.map(lambda x: sds(x.shape, x.dtype, NamedSharding(mesh, PartitionSpec())), tree)


@contextlib.contextmanager
def shape_checks_off():
    """Runtime shape checks (jaxtyping's, on in the tests) reject ShapeDtypeStruct leaves in
    the rollout's typed dataclasses; the abstract inputs are built and lowered without them."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


def walk_programs(run: AbstractRun, build: Build) -> None:
    """Lower every program of ``run``'s compile plan through ``build``, in a step's order."""
    with shape_checks_off():  # the typed dataclasses hold ShapeDtypeStructs here
        _walk(run, build)


def _walk(run: AbstractRun, build: Build) -> None:
    k, s = run.kernels, run.shapes
    planned = {f.name: f.shapes for f in plan_programs(s)}
    if s.refill_store_rows:
        return _walk_refill(run, build, planned)
    admission = _admission(s.slots, s.prompt_width, s.response_len, s.carry)
    decoding = _actor_admission(run, build, admission, planned.get("replay", ()))
    chunks = _decode(run, build, admission, decoding, planned["decode"])
    if s.stream:
        scored = _streamed(run, build, admission, chunks, planned.get("replay", ()))
    else:
        scored = _sync_scoring(run, build)
    scored = _on_generation(run, scored)
    rows = sds((s.batch_size,), jnp.int32)
    kl_coef = sds((), jnp.float32)
    prompts = _prompts(admission, s.prompt_width)
    fn = Kernel.of(oppo_experience, spec=k.spec, rollout=k.rollout)
    batch, _ = build(
        "experience", ("batch",), "actor", fn, (decoding, rows, prompts, scored, kl_coef)
    )
    _update(run, build, batch, planned["update"][0])


def _walk_refill(run: AbstractRun, build: Build, planned: dict) -> None:
    """A refilling step's programs (``pipeline.refill_step``), in its order: the rows (empty,
    or those in flight replayed), the prompt stores and the placements into rows, the decode,
    the batch's packed scoring (the actor's old log-probs too, where read), the batch and the
    update."""
    k, s, actor = run.kernels, run.shapes, run.params["actor"]
    i32, flag, rows = jnp.int32, jnp.bool_, s.slots
    key = sds((), jax.random.key(0).dtype)
    empty = Kernel.of(oppo_refill_start, cfg=k.spec.actor, rollout=k.rollout, rows=rows)
    build("refill start", ("rows",), "actor", empty, (key,))
    admission = _admission(rows, s.prompt_width, s.response_len, True)
    decoding = _actor_admission(run, build, admission, planned["replay"], group_size=1)
    statics = dict(cfg=k.spec.actor, rollout=k.rollout, rows=s.refill_store_rows)
    stores = []  # one per bucket: their shapes agree, their shardings may not
    for q in planned["refill prompts"]:
        args = (actor, sds((q, s.prompt_width), i32), sds((q,), i32), sds((q,), i32))
        fn = Kernel.of(oppo_refill_prompts, **statics)
        stores.append(build("refill prompts", (q,), "actor", fn, args)[0])
    place = Kernel.of(oppo_refill_place, rollout=k.rollout)
    for m in planned["refill place"]:
        for store in stores:  # equal lowerings are one program (``registry_build``)
            args = (decoding, store, sds((m,), i32), sds((m,), i32), sds((m,), i32))
            placed, _ = build("refill place", (m,), "actor", place, args)
        decoding = placed
    rule = CutRule(sds((rows,), flag), sds((rows,), flag), sds((), i32), sds((rows,), i32))
    decoded = decoding
    for _, size, width in planned["decode"]:
        decode = Kernel.of(oppo_decode, **k.decode_settings(size, width if s.live_prefix else None))
        decoded, _ = build("decode", (rows, size, width), "actor", decode, (actor, decoding, rule))
    for m in planned["refill place"]:  # later refill points place into a decoded state
        for store in stores:
            args = (decoded, store, sds((m,), i32), sds((m,), i32), sds((m,), i32))
            build("refill place", (m,), "actor", place, args)
    b = s.batch_size
    scored = _sync_scoring(run, build, b, actor_too=s.refill_old_logprobs)
    scored = _on_generation(run, scored, b)
    # the old log-probs as ``refill_step.old_logprobs`` leaves them: replicated, scoring mesh
    repl = NamedSharding(run.placement.scoring_mesh, PartitionSpec())
    view = ResponseBatch(
        tokens=sds((b, s.response_len), i32),
        logprobs=sds((b, s.response_len), jnp.float32, repl),
        num_generated=sds((b,), i32),
    )
    batch_admission = _admission(b, s.prompt_width, s.response_len, False)
    fn = Kernel.of(oppo_experience, spec=k.spec, rollout=k.rollout)
    args = (view, sds((b,), i32), batch_admission, scored, sds((), jnp.float32))
    batch, _ = build("experience", ("batch",), "actor", fn, args)
    _update(run, build, batch, planned["update"][0])


def _actor_admission(
    run: AbstractRun, build: Build, admission: Admission, replays, group_size=None
) -> Any:
    """The actor's prompt prefill (each group's prompt once where ``group_size``, default the
    run's sharing, says), its replays of carried prefixes, the decode state."""
    k, s, actor = run.kernels, run.shapes, run.params["actor"]
    g = _shared(run) if group_size is None else group_size
    prefill = Kernel.of(
        oppo_admission_prefill, spec=k.actor_spec, prompt_width=s.prompt_width, group_size=g
    )
    prefilled, _ = build("admission prefill", ("prompts",), "actor", prefill, (actor, admission))
    _replays(build, "actor", k.actor_spec, actor, prefilled, replays)
    start = Kernel.of(oppo_decode_start, cfg=k.actor_spec.model, rollout=k.rollout)
    key = sds((), jax.random.key(0).dtype)
    made = (prefilled.cache, prefilled.last_hidden, prefilled.per_token)
    decoding, _ = build("decode start", ("slots",), "actor", start, (actor, admission, key, *made))
    return decoding


def _shared(run: AbstractRun) -> int:
    """The slots sharing each prompt's prefill in the run's admissions."""
    return prompt_sharing(run.shapes.slots, run.kernels.rollout.group_size)


def _replays(build: Build, role: str, spec, params, state, replays) -> None:
    for rows, width in replays:
        tokens, count = sds((rows, REPLAY_CHUNK), jnp.int32), sds((rows,), jnp.int32)
        replay = Kernel.of(oppo_replay, spec=spec, kv_width=width)
        build("replay", (rows, width), role, replay, (params, state, tokens, count))


def _decode(run: AbstractRun, build: Build, admission: Admission, decoding, shapes) -> dict:
    """Every decode chunk of the plan: (C, width) -> its abstract ChunkTokens (at S slots)."""
    k, s = run.kernels, run.shapes
    group = None
    if k.rollout.group_size > 1:
        group = sds((s.slots,), jnp.int32)
    rule = CutRule(admission.active, admission.must_finish, sds((), jnp.int32), group)
    chunks = {}
    for rows, size, width in shapes:
        state, cut = decoding, rule
        if rows != s.slots:  # a compacted bucket: the first ``rows`` slots, gathered
            state, cut = _bucket(decoding, s.slots, rows), _bucket(rule, s.slots, rows)
        settings = k.decode_settings(size, width if s.live_prefix else None)
        kernel = Kernel.of(oppo_decode, **settings)
        _, chunk = build(
            "decode", (rows, size, width), "actor", kernel, (run.params["actor"], state, cut)
        )
        if rows == s.slots:
            chunks[(size, width)] = chunk
    return chunks


def _bucket(tree, slots: int, rows: int):
    """``tree`` with its slot axis cut to ``rows`` (slot compaction's gathered state)."""

    def cut(x):
        shape = (rows, *x.shape[1:]) if x.shape and x.shape[0] == slots else x.shape
        if len(x.shape) > 1 and x.shape[1] == slots and x.shape[0] != slots:  # [L, S, ...] caches
            shape = (x.shape[0], rows, *x.shape[2:])
        return sds(shape, x.dtype, getattr(x, "sharding", None))

    return jax.tree.map(cut, tree)


def _streamed(run: AbstractRun, build: Build, admission: Admission, chunks: dict, replays):
    """Each scorer admitted (prompts, replays) and fed every planned chunk; their outputs."""
    k, s, place = run.kernels, run.shapes, run.placement
    on_scoring = _scoring_copy(place, admission)
    states = {}
    for role in s.scorers:
        spec, params = getattr(k.scorer_specs, role), run.params[role]
        prefill = Kernel.of(
            oppo_admission_prefill, spec=spec, prompt_width=s.prompt_width, group_size=_shared(run)
        )
        state, _ = build("admission prefill", ("prompts",), role, prefill, (params, on_scoring))
        _replays(build, role, spec, params, state, replays)
        for (size, width), chunk in chunks.items():
            live = width if s.live_prefix else None
            kernel = Kernel.of(
                oppo_streamed_scoring, spec=spec, kv_width=live, packed=k.packs_chunks
            )
            plan = None
            if k.packs_chunks:
                plan = jax.tree.map(host_array, padding_plan(chunk_budget(s.slots, size), s.slots))
            args = (params, state, _scoring_copy(place, chunk), plan)
            state, _ = build("streamed scoring", (size, width), role, kernel, args)
        states[role] = state
    get = lambda role, field: getattr(states[role], field) if role in states else None  # noqa: E731
    return ScorerOutputs(
        get("reference", "per_token"), get("critic", "per_token"), get("reward", "score")
    )


def _scoring_copy(place: Placement, tree):
    """``tree`` as ``Placement.to_scoring`` hands it to the scorers."""
    return _replicated_on(place.scoring_mesh, tree) if place.disaggregated else tree


def _on_generation(run: AbstractRun, scored: ScorerOutputs, slots=None) -> ScorerOutputs:
    """The scorers' outputs as ``Placement.to_generation`` and the reward functions hand them
    to the batch (functions' scores: a host array), over ``slots`` rows (default S)."""
    place = run.placement
    if place.disaggregated:
        scored = _replicated_on(place.groups.generation, scored)
    if run.kernels.reward_model is None:  # reward functions alone score
        scored = scored.replace(scores=sds((slots or run.shapes.slots,), jnp.float32))
    return scored


def _sync_scoring(run: AbstractRun, build: Build, slots=None, actor_too=False) -> ScorerOutputs:
    """Each scorer's packed call over the batch after the cut (``scoring.packed``), writing
    outputs over ``slots`` rows (default S); ``actor_too``: and the actor's, its old
    log-probs (a refilling step's)."""
    k, s = run.kernels, run.shapes
    repl = NamedSharding(run.placement.scoring_mesh, PartitionSpec())
    b, full = s.batch_size, s.prompt_width + s.response_len
    slots = slots or s.slots
    n, t = score_rows_per_call(b), score_width(full)
    i32 = jnp.int32
    batch = PackedBatch(
        sds((b, full), i32, repl), sds((b,), i32, repl), sds((b,), i32, repl),
        sds((n, t), i32, repl), sds((n, t), i32, repl), sds((b,), i32, repl), sds((b,), i32, repl),
    )  # fmt: skip
    out = {}
    specs = {role: getattr(k.scorer_specs, role) for role in s.scorers}
    specs |= {"actor": k.actor_spec} if actor_too else {}
    for role, spec in specs.items():
        shape = (slots,) if spec.kind == "score" else (slots, s.response_len)
        kernel = Kernel.of(oppo_sync_scoring, spec=spec, pad_id=k.rollout.pad_id, num_slots=slots)
        args = (run.params[role], sds(shape, jnp.float32, repl), batch, sds((b,), i32, repl))
        out[role], _ = build("sync scoring", ("packed",), role, kernel, args)
    return ScorerOutputs(out.get("reference"), out.get("critic"), out.get("reward"))


def _update(run: AbstractRun, build: Build, batch, shape) -> None:
    """The packed update at the plan's one shape (``ppo.packed_update``)."""
    k = run.kernels
    mesh = run.placement.groups.training
    update, ppo = make_update(k.spec, mesh), k.spec.ppo
    _, chunks = update.shape(run.shapes.batch_size, run.shapes.capacity, run.shapes.response_len)
    outer = (ppo.ppo_epochs, ppo.num_minibatches, chunks)
    indices = padding_indices(outer, shape, run.shapes.batch_size // ppo.num_minibatches)
    on_mesh = jax.tree.map(lambda x, sh: sds(x.shape, x.dtype, sh), batch, batch_shardings(mesh))
    # The plan's indices are placed replicated before the call (``UpdateLayout.place``).
    repl = NamedSharding(mesh, PartitionSpec())
    indices = jax.tree.map(lambda x: sds(np.shape(x), np.asarray(x).dtype, repl), indices)
    args = (run.train_state, on_mesh, indices, sds((), jnp.float32))
    build("update", (shape,), "actor", Kernel(update), args)


def registry_build(registry: Registry, compile_one: Callable) -> Build:
    """A ``Build`` that compiles each program once (``compile_one(family, shape, role, fn,
    args)`` -> Program) into ``registry`` and hands its abstract outputs on. A program asked
    for twice with the same function and arguments (the reference served by the actor's own
    programs) is compiled once, and recorded as serving both keys."""
    seen: dict = {}

    def build(family, shape, role, fn, args):
        key = (fn, jax.tree.structure(args), tuple(_aval_key(x) for x in jax.tree.leaves(args)))
        if key not in seen:
            seen[key] = compile_one(family, shape, role, fn, args)
            registry.add(seen[key])
        else:
            registry.add(seen[key], (family, tuple(shape), role))
        return abstract_like(seen[key].compiled.out_info)

    return build


def _aval_key(x) -> tuple:
    """Shape, dtype and layout: the sharding as the compiler reads it (its HLO sharding and
    devices), so two spellings of one layout (XLA:GPU hands a decode's outputs back as
    P('tensor', 'fsdp') where its inputs were P('fsdp', 'tensor'), on a mesh of one device)
    are one program, as XLA compiles them."""
    sharding = getattr(x, "sharding", None)
    if sharding is not None and hasattr(sharding, "_to_xla_hlo_sharding"):
        devices = tuple(d.id for d in sharding._device_assignment)
        sharding = (str(sharding._to_xla_hlo_sharding(len(x.shape))), devices)
    return (tuple(x.shape), str(x.dtype), str(sharding))
