"""The warm-up: build the run's registry of programs before its first measured step, and
count the XLA compilations of each step afterwards.

The registry (``pipeline.registry``) is every program of the run's compile plan
(``compile_plan``: chunk sizes under tuning, live widths, replay shapes of carried prefixes,
slot compaction's buckets, the update's packed shape), lowered from abstract arguments with
the shardings the run's own arrays have and compiled ahead of time (``program_walk``), so the
run's jits find them compiled; nothing runs, and the train state is read for its shapes only.
The step then asks its kernels for programs through the registry: a shape the plan did not
list raises ``UnplannedProgram``. Small helper programs that are no kernel (the kept rows'
gathers, compaction's moves, the update plan's shuffles, the batch's sequences for packed
scoring) are compiled by running them once on throwaway inputs. Each record's ``compiles``
then says 0 (the suite checks it for every schedule).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import jax
import numpy as np
from tqdm.auto import tqdm

from oppo_jax.base import shapes as shape_rules
from oppo_jax.base.host_maps import check_map_room
from oppo_jax.base.shapes import family_of, packed_width
from oppo_jax.models import kernel_check
from oppo_jax.models.attention import implementations
from oppo_jax.parallel.targets import Target
from oppo_jax.pipeline.carry import CarryBuffer, admit, prompt_sharing
from oppo_jax.pipeline.compile_plan import compaction_moves, kept_rows, plan_programs, run_shapes
from oppo_jax.pipeline.program_walk import AbstractRun, registry_build, walk_programs
from oppo_jax.pipeline.refill_step import scoring_replicated
from oppo_jax.pipeline.registry import Registry, compile_program
from oppo_jax.pipeline.step import admit_rule, rollout_shape, slot_admission
from oppo_jax.pipeline.step_scorers import batch_sequences, keep_rows, restore_rows
from oppo_jax.pipeline.warmup_compaction import compile_compaction, scorer_params
from oppo_jax.rollout.decode import ResponseBatch
from oppo_jax.scoring.carried import FROZEN

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # a compilation or a cache read
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # a program read from the persistent cache
_lock = threading.Lock()
_totals = [0, 0.0, 0]  # compile events, their seconds, and cache hits since the listeners began
_families: collections.Counter = collections.Counter()  # compile events by kernel family
_family_s: collections.Counter = collections.Counter()  # and their seconds
_listening = False


def _listen(event: str, duration: float, fun_name: str = "", **_) -> None:
    if event == COMPILE_EVENT:
        with _lock:
            _totals[0] += 1
            _totals[1] += duration
            if (family := family_of(fun_name)) is not None:
                _families[family] += 1
                _family_s[family] += duration


def _listen_hits(event: str, **_) -> None:
    if event == CACHE_HIT_EVENT:
        with _lock:
            _totals[2] += 1


class CompileCounter:
    """Counts XLA compilations and their seconds through ``jax.monitoring``; a program read
    back from the persistent compilation cache is not a compilation (jax reports both as a
    compile event, and the reads as cache hits too). One pair of listeners serves every
    counter of the process (jax has no public way to remove one)."""

    def __init__(self):
        global _listening
        with _lock:
            if not _listening:
                jax.monitoring.register_event_duration_secs_listener(_listen)
                jax.monitoring.register_event_listener(_listen_hits)
                _listening = True
        self._mark = self._now()
        with _lock:
            self._start = collections.Counter(_families), collections.Counter(_family_s)

    def programs(self) -> dict[str, tuple[int, float]]:
        """Kernel programs compiled or read from the persistent cache since this counter was
        made, and their seconds, by compile-plan family (``shapes.family_of``; helpers are in
        no family)."""
        with _lock:
            count, seconds = _families - self._start[0], _family_s - self._start[1]
        return {f: (n, round(seconds[f], 3)) for f, n in count.items()}

    @staticmethod
    def _now() -> tuple[int, float, int]:
        with _lock:
            return _totals[0], _totals[1], _totals[2]

    def take(self) -> tuple[int, float]:
        """(compilations, seconds of compilations and cache reads) since the last ``take``."""
        count, seconds, _ = self.take_with_hits()
        return count, seconds

    def take_with_hits(self) -> tuple[int, float, int]:
        """(compilations, seconds, programs read from the persistent cache) since the last
        ``take``."""
        now = self._now()
        events, seconds, hits = (n - m for n, m in zip(now, self._mark, strict=True))
        self._mark = now
        return events - hits, seconds, hits


@dataclasses.dataclass(frozen=True)
class WarmupShapes:
    """The shapes a run can meet beyond those of its first step (``compile_plan``)."""

    chunk_sizes: tuple[int, ...]  # C of every decode chunk (and streamed scorer chunk)
    replay: tuple[tuple[int, int], ...]  # (rows, live width) of carried prefixes' replay
    kept_rows: tuple[int, ...]  # row buckets of the frozen scorers' kept caches
    compaction_moves: tuple[tuple[int, int], ...]  # (rows, bucket) of slot compaction


def warmup_shapes(ctx, host, schedule) -> WarmupShapes:
    """Every shape bucket the run's controllers, carried sequences, kept caches and slot
    compaction can pick: ``compile_plan.run_shapes`` of the run's config (the one function
    ``oppo-jax compile-plan`` prints), checked against the engine the run built."""
    engine, plan = ctx.engine, host.plan(ctx.cfg)
    shapes = run_shapes(ctx.cfg, schedule, head_dim=engine.kernels.spec.actor.head_dim)
    slots = engine.placement.num_slots(plan.reserved)
    floor = engine.kernels.compaction_floor
    built = (slots, floor, engine.kernels.live_prefix)
    planned = (shapes.slots, shapes.compaction_floor, shapes.live_prefix)
    if built != planned:  # a bug: the plan must describe the kernels the run built
        raise RuntimeError(
            f"compile plan drifted from the engine: (slots, compaction floor, live widths) "
            f"{planned} planned, {built} built"
        )
    families = {f.name: f for f in plan_programs(shapes)}
    replay = families["replay"].shapes if "replay" in families else ()
    kept = kept_rows(shapes)
    moves = ()
    if floor is not None and not shapes.refill_store_rows:  # a refilling decode never compacts
        moves = compaction_moves(slots, floor)
    return WarmupShapes(
        chunk_sizes=shapes.chunk_sizes,
        replay=tuple(replay),
        kept_rows=tuple(kept),
        compaction_moves=tuple(moves),
    )


class _Prompts:
    """A fixed list of (prompt_id, tokens) with ``take(k)``, for throwaway admissions."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def take(self, k: int):
        taken, self.pairs = self.pairs[:k], self.pairs[k:]
        return taken


def _admission(ctx, host):
    """A throwaway admission of the run's B + Δ new prompts (two tokens each; the shapes, not
    the values, matter), with the room for carried prefixes a step of the run gives."""
    return slot_admission(_slots(ctx, host))


def _slots(ctx, host):
    """The throwaway admission's ``SlotBatch`` on the host."""
    engine = ctx.engine
    r, rule = engine.kernels.rollout, admit_rule(engine, host.plan(ctx.cfg))  # as a step's
    fresh = _Prompts([(i, [r.pad_id + 2] * 2) for i in range(rule.num_sequences)])
    return admit(CarryBuffer(), fresh, rule, *rollout_shape(r))


def compile_kept(ctx, host, state, rows: int) -> None:
    """Keep ``rows`` (a kept bucket) of every frozen scorer's state and restore them into a
    fresh admission's, as a step that carries that many rows and the next one do."""
    k, place = ctx.engine.kernels, ctx.engine.placement
    on_scoring, params = place.to_scoring(_admission(ctx, host)), scorer_params(ctx, state)
    roles = [r for r in k.scorer_specs.present() if r in FROZEN]
    g = prompt_sharing(on_scoring.num_slots, k.rollout.group_size)  # as the step's admissions
    states = {r: k.prefill_prompts(r, params[r], on_scoring, g)[0] for r in roles}
    kept = keep_rows(states, [0], rows, [])
    fresh = {r: k.prefill_prompts(r, params[r], on_scoring, g)[0] for r in roles}
    jax.block_until_ready([restore_rows(fresh[r], kept.states[r], 1) for r in roles])


def compile_batch_sequences(ctx, host, state) -> None:
    """The batch's sequences gathered from a decode state for the packed scoring after the
    cut (``step_scorers.batch_sequences``), as a step without streaming does."""
    k, slots = ctx.engine.kernels, _slots(ctx, host)
    admission = slot_admission(slots)
    g = prompt_sharing(slots.num_slots, k.rollout.group_size)  # as the step's admissions
    decoding, _ = k.prefill_actor(state.actor_model_params, admission, ctx.engine.sample_key, (), g)
    rows = np.arange(host.plan(ctx.cfg).batch_size, dtype=np.int32)
    jax.block_until_ready(batch_sequences(k, ctx.engine.placement, decoding, rows, slots))


def compile_refill_sequences(ctx, host) -> None:
    """The batch's sequences gathered from a refilling step's B responses
    (``rollout.decode.ResponseBatch``) for its packed scoring, as ``refill_step`` does."""
    k, b = ctx.engine.kernels, host.plan(ctx.cfg).batch_size
    r = k.rollout
    logprobs = np.zeros((b, r.max_response_len), np.float32)
    view = ResponseBatch(
        jax.device_put(np.zeros((b, r.max_response_len), np.int32)),
        jax.device_put(logprobs, scoring_replicated(ctx.engine)),  # as the step places them
        jax.device_put(np.ones(b, np.int32)),
    )
    slots = _slots(ctx, host)
    slots = dataclasses.replace(slots, context=slots.context[:b], prompt_len=slots.prompt_len[:b])
    rows = np.arange(b, dtype=np.int32)
    jax.block_until_ready(batch_sequences(k, ctx.engine.placement, view, rows, slots))


def chunk_widths(kernels, chunk_size: int) -> tuple[int | None, ...]:
    """The live cache widths a decode chunk of ``chunk_size`` tokens can read for these
    kernels (``shapes.chunk_widths``); (None,) when they read the whole cache."""
    if not getattr(kernels, "live_prefix", False):  # absent: decode reads every column
        return (None,)
    r = kernels.rollout
    return shape_rules.chunk_widths(r.prompt_width + r.max_response_len, chunk_size)


def _abstract(tree):
    """``tree``'s arrays as program arguments: shape, dtype and where they live."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def host_run(ctx, schedule, host, state) -> AbstractRun:
    """The run as the registry's walk lowers it (``program_walk.AbstractRun``): its own
    kernels and placement, its planned shapes, and its parameters and train state as they
    lie on this host's devices."""
    engine = ctx.engine
    shapes = run_shapes(ctx.cfg, schedule, head_dim=engine.kernels.spec.actor.head_dim)
    params = scorer_params(ctx, state)
    params["actor"] = state.actor_model_params
    params = {role: _abstract(p) for role, p in params.items() if p is not None}
    return AbstractRun(engine.kernels, engine.placement, shapes, params, _abstract(state))


def build_programs(run: AbstractRun, bar) -> Registry:
    """Every program of ``run``'s compile plan compiled for this host, each counted on
    ``bar``: the registry the run's steps dispatch (``Kernels.registry``)."""
    backend = Target.parse("host")
    registry = Registry(backend.name, backend.compiler)

    def compile_one(family, shape, role, fn, args):
        bar.set_postfix_str(f"{family} {' x '.join(map(str, shape))} ({role})", refresh=True)
        program = compile_program(family, shape, role, fn, args)
        bar.update()
        return program

    walk_programs(run, registry_build(registry, compile_one))
    return registry


def _chunk_label(chunk_size: int, width: int | None) -> str:
    """A chunk task's name on the warm-up bar: "chunk 16 width 128", or "chunk 16, whole
    cache" where the decode reads every column (no live widths)."""
    return f"chunk {chunk_size}" + (", whole cache" if width is None else f" width {width}")


def _helper_tasks(ctx, schedule, host, state, shapes: WarmupShapes) -> list:
    """(label, thunk) of the small programs beyond the plan's kernels a run can meet: the
    frozen scorers' kept rows and slot compaction's moves (gathers and scatters)."""
    k = ctx.engine.kernels
    widths = {c: chunk_widths(k, c) for c in shapes.chunk_sizes}
    tasks = [(f"kept {n}", lambda n=n: compile_kept(ctx, host, state, n)) for n in shapes.kept_rows]

    def compaction(c):  # every move and bucket of chunk size c, on a throwaway rollout
        admission = _admission(ctx, host)
        compile_compaction(ctx, schedule, host, state, admission, {c: widths[c]})

    if shapes.compaction_moves:
        tasks += [(f"compaction chunk {c}", lambda c=c: compaction(c)) for c in shapes.chunk_sizes]
    if host.refill is not None:  # the batch's sequences, for its packed scoring
        tasks.append(("batch sequences", lambda: compile_refill_sequences(ctx, host)))
    elif not schedule.stream and k.scorer_specs.present():
        tasks.append(("batch sequences", lambda: compile_batch_sequences(ctx, host, state)))
    plan = host.plan(ctx.cfg)  # the update's plan draws its minibatch shuffles on the device
    tasks.append(("update plan", lambda: k.update.permutations(plan.update_key, plan.batch_size)))
    return tasks


def _attention(ctx) -> dict[str, str]:
    """The actor's attention kernels at the run's sizes (``models.attention.implementations``)."""
    k = ctx.engine.kernels
    r, ppo = k.rollout, k.spec.ppo
    full = r.prompt_width + r.max_response_len
    width = packed_width(full, ppo.pack_granule, ppo.pack_width_factor)
    return implementations(k.spec.actor, full, width)


def warm_up(ctx, schedule, host, state, progress: bool = True):
    """Build the run's registry (``pipeline.registry``: every program of its compile plan,
    compiled from abstract arguments, nothing run) and compile the small helper programs a
    step can meet, before the run measures anything, with its own progress line. Returns the
    warm-up's report (seconds, shapes, compilations and their seconds, in all and by task)
    and ``ctx`` with the registry in its kernels: from then on a kernel asked for at a shape
    the plan did not list raises ``UnplannedProgram``. The train state is read for its
    shapes and shardings only.

    A refilling run (``host.refill``) walks its own step's programs (``program_walk``)."""
    shapes = warmup_shapes(ctx, host, schedule)
    run = host_run(ctx, schedule, host, state)
    planned = sum(f.programs for f in plan_programs(run.shapes))
    helpers = _helper_tasks(ctx, schedule, host, state, shapes)
    counter, start = CompileCounter(), time.perf_counter()
    bar = tqdm(total=planned + len(helpers), desc="warm-up (compiling)", disable=not progress,
               unit="program")  # fmt: skip
    per_task = CompileCounter()
    registry = build_programs(run, bar)
    by_task = [["programs", *per_task.take()]]  # [label, compilations, their seconds]
    check_map_room("the warm-up's programs")  # a clear stop, not LLVM's segfault
    for label, task in helpers:
        bar.set_postfix_str(label, refresh=False)
        task()
        bar.update()
        by_task.append([label, *per_task.take()])
        check_map_room(f"the warm-up's {label}")
    bar.close()
    compiles, seconds, hits = counter.take_with_hits()
    report = {
        "warmup_s": time.perf_counter() - start,
        "warmup_shapes": len(registry.programs) + len(helpers),
        "warmup_compiles": compiles,
        "warmup_cache_reads": hits,  # programs read back from the persistent cache
        # by compile-plan family (oppo-jax compile-plan): [programs, their seconds]
        "warmup_programs": counter.programs(),
        "warmup_compile_time_s": seconds,
        **{k: list(v) for k, v in dataclasses.asdict(shapes).items()},
        "warmup_by_task": by_task,
        "programs": [p.row() for p in registry.programs],  # the registry, as compile-plan's
        "attention": _attention(ctx),  # the kernel each form runs, after its self-check
        "kernel_checks": kernel_check.checked(),
    }
    if progress:
        print(
            f"Warm-up: {len(registry.programs)} programs and {len(helpers)} helper tasks, "
            f"{compiles} compilations, {hits} read from the compilation cache, "
            f"{report['warmup_s']:.1f} s (not counted in any step's time)",
            flush=True,
        )
    kernels = dataclasses.replace(ctx.engine.kernels, registry=registry)
    return report, dataclasses.replace(ctx, engine=dataclasses.replace(ctx.engine, kernels=kernels))
