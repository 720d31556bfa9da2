"""The warm-up: compile every shape a run can meet before its first measured step, and count
the XLA compilations of each step afterwards.

Without it a run compiles whenever a step first meets a shape (a chunk size under tuning, a
replay shape of carried prefixes, a kept-cache bucket, a smaller slot bucket of compaction),
and that step looks like a hang: on the
CPU demo 20-50 s against 0.3 s, on a GPU with 7B models minutes. ``warm_up`` runs each kernel
once on throwaway inputs of every shape ``warmup_shapes`` lists (from ``compile_plan``, the
one place to extend when a kernel gains a shape), with the same shardings the run uses, so the
run's jits find them compiled; eager device ops between kernels compile too, so the step
keeps them out of its loop (host arrays, jitted gathers) or the warm-up runs the step's own
code on them.
The run's own train state, host state and prompt stream are never touched: the throwaway step
updates a copy of the trained parameters and optimizer states (``trained_copy``: never the
frozen LoRA bases, reference or reward model, which it shares).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from oppo_jax.base import shapes as shape_rules
from oppo_jax.base.host_maps import check_map_room
from oppo_jax.base.shapes import family_of, packed_width
from oppo_jax.models import kernel_check
from oppo_jax.models.attention import implementations
from oppo_jax.pipeline.carry import AdmitRule, CarryBuffer, admit
from oppo_jax.pipeline.compile_plan import compaction_moves, kept_rows, plan_programs, run_shapes
from oppo_jax.pipeline.host_state import HostState
from oppo_jax.pipeline.kernels import feed_replay, prompts_only
from oppo_jax.pipeline.scoring_kernels import compile_packed_chunks, keep_rows, restore_rows
from oppo_jax.pipeline.step import cut_rule, device_admission, run_step
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.pipeline.warmup_compaction import compile_compaction, scorer_params
from oppo_jax.scoring.kept import FROZEN
from oppo_jax.scoring.replay import REPLAY_CHUNK, ReplayChunk

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
    if floor is not None:
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
    cfg, engine = ctx.cfg, ctx.engine
    r, plan = engine.kernels.rollout, host.plan(cfg)
    slots = engine.placement.num_slots(plan.reserved)
    rule = AdmitRule(plan.batch_size + plan.overcommit, slots, plan.reserved > plan.batch_size,
                     engine.max_deferrals, plan.group_size)  # fmt: skip
    fresh = _Prompts([(i, [r.pad_id + 2] * 2) for i in range(rule.num_sequences)])
    slot_batch = admit(CarryBuffer(), fresh, rule, r.prompt_width, r.max_response_len, r.pad_id)
    return device_admission(slot_batch)


def compile_replay(ctx, host, state, rows: int, kv_width: int) -> None:
    """Feed a replay chunk of ``rows`` leading rows reading ``kv_width`` cache columns into a
    fresh admission of the actor and of every scorer, so that the first step replaying
    carried prefixes at that shape finds it compiled."""
    k, place = ctx.engine.kernels, ctx.engine.placement
    admission = _admission(ctx, host)
    prompt_width = k.rollout.prompt_width
    chunk = ReplayChunk(
        np.zeros((rows, REPLAY_CHUNK), np.int32), np.zeros(rows, np.int32), kv_width
    )
    outputs = [k.admit(state.actor_model_params, admission, ctx.engine.sample_key, [chunk])]
    on_scoring, params = place.to_scoring(admission), scorer_params(ctx, state)
    prompts = prompts_only(on_scoring, prompt_width)
    for role in k.scorer_specs.present():
        fresh, _ = k.scorer_admit(role)(params[role], prompts)
        spec = getattr(k.scorer_specs, role)
        outputs.append(feed_replay(spec, params[role], fresh, [chunk]))
    jax.block_until_ready(outputs)


def compile_kept(ctx, host, state, rows: int) -> None:
    """Keep ``rows`` (a kept bucket) of every frozen scorer's state and restore them into a
    fresh admission's, as a step that carries that many rows and the next one do."""
    k, place = ctx.engine.kernels, ctx.engine.placement
    on_scoring, params = place.to_scoring(_admission(ctx, host)), scorer_params(ctx, state)
    roles = [r for r in k.scorer_specs.present() if r in FROZEN]
    states = {r: k.scorer_admit(r)(params[r], on_scoring)[0] for r in roles}
    kept = keep_rows(states, [0], rows, [])
    fresh = {r: k.scorer_admit(r)(params[r], on_scoring)[0] for r in roles}
    jax.block_until_ready([restore_rows(fresh[r], kept.states[r], 1) for r in roles])


def chunk_widths(kernels, chunk_size: int) -> tuple[int | None, ...]:
    """The live cache widths a decode chunk of ``chunk_size`` tokens can read for these
    kernels (``shapes.chunk_widths``); (None,) when they read the whole cache."""
    if not getattr(kernels, "live_prefix", False):  # absent: decode reads every column
        return (None,)
    r = kernels.rollout
    return shape_rules.chunk_widths(r.prompt_width + r.max_response_len, chunk_size)


def compile_chunk(ctx, schedule, host, state, chunk_size: int, kv_width: int | None) -> None:
    """Decode one chunk of ``chunk_size`` tokens reading ``kv_width`` cache columns from a
    fresh admission and, when the schedule streams, feed it to every scorer."""
    engine, plan = ctx.engine, host.plan(ctx.cfg)
    k, place = engine.kernels, engine.placement
    width = () if kv_width is None else (kv_width,)  # kernels without live widths take C only
    admission = _admission(ctx, host)
    decoding, _ = k.admit(state.actor_model_params, admission, engine.sample_key, ())
    rule = cut_rule(admission, plan)
    decoding, chunk = k.decode(chunk_size, *width)(state.actor_model_params, decoding, rule)
    outputs = [decoding, chunk]
    if schedule.stream:
        on_scoring, params = place.to_scoring(admission), scorer_params(ctx, state)
        for role in k.scorer_specs.present():
            scored, _ = k.scorer_admit(role)(params[role], on_scoring)
            fed = (params[role], scored, place.to_scoring(chunk), kv_width)
            if k.packs_chunks:
                outputs.append(compile_packed_chunks(k, role, *fed))
            else:
                outputs.append(k.scorer_chunk(role, *width)(*fed[:3]))
    jax.block_until_ready(outputs)


def trained_copy(state):
    """A copy of what the update replaces (parameters, optimizer states, step), sharing the
    frozen LoRA bases: the update never donates them, and a copy of a 7B base is ~15 GB."""
    frozen = state.frozen
    return jax.tree.map(jnp.copy, state.replace(frozen=None)).replace(frozen=frozen)


def _throwaway_step(ctx, schedule, state):
    """One whole step on the train state, a fresh host state and prompt stream: compiles the
    update, the experience kernel, sync scoring and the controllers' small ops. Returns the
    train state as it was. On one process the step takes the state itself (its update donates
    it) while its trained part waits in host memory, and it is put back, bit for bit, on its
    shardings: the warm-up's peak is a step's. With several processes (each holds only its
    shards) the step takes a device copy of the trained part instead (``trained_copy``)."""
    host = HostState.fresh(ctx.cfg, schedule, ctx.prompt_iterator())
    one_process = jax.process_count() == 1
    if one_process:
        trained = state.replace(frozen=None)
        parked = jax.device_get(trained), jax.tree.map(lambda x: x.sharding, trained)
        throwaway, frozen = state, state.frozen
        del state, trained  # the update donates them
    else:
        throwaway = trained_copy(state)
    plan, buffer = host.plan(ctx.cfg), CarryBuffer()
    throwaway, _, result = run_step(
        ctx.engine, schedule, plan, throwaway, buffer, host.prompts, Timeline()
    )
    record = {k: float(v) for k, v in jax.device_get(result.metrics).items()}
    host.observe(plan, {**record, "step_time_s": result.wall_s})
    jax.block_until_ready(throwaway)
    if not one_process:
        return state
    del throwaway, result  # freed before the trained part comes back
    return jax.device_put(*parked).replace(frozen=frozen)


def _chunk_label(chunk_size: int, width: int | None) -> str:
    """A chunk task's name on the warm-up bar: "chunk 16 width 128", or "chunk 16, whole
    cache" where the decode reads every column (no live widths)."""
    return f"chunk {chunk_size}" + (", whole cache" if width is None else f" width {width}")


def _tasks(ctx, schedule, host, state, shapes: WarmupShapes) -> list:
    """(label, thunk) of every shape to compile; the whole step last, since its update takes
    the train state (``_throwaway_step``), and it returns the state the run goes on with."""
    k = ctx.engine.kernels
    widths = {c: chunk_widths(k, c) for c in shapes.chunk_sizes}
    tasks = []
    tasks += [
        (_chunk_label(c, w), lambda c=c, w=w: compile_chunk(ctx, schedule, host, state, c, w))
        for c, ws in widths.items()
        for w in ws
    ]
    tasks += [
        (f"replay {n}x{w}", lambda n=n, w=w: compile_replay(ctx, host, state, n, w))
        for n, w in shapes.replay
    ]
    tasks += [
        (f"kept {n}", lambda n=n: compile_kept(ctx, host, state, n)) for n in shapes.kept_rows
    ]

    def compaction(c):  # every move and bucket of chunk size c, on a throwaway rollout
        admission = _admission(ctx, host)
        compile_compaction(ctx, schedule, host, state, admission, {c: widths[c]})

    if shapes.compaction_moves:
        tasks += [(f"compaction chunk {c}", lambda c=c: compaction(c)) for c in shapes.chunk_sizes]
    tasks.append(("one step", lambda: _throwaway_step(ctx, schedule, state)))
    return tasks


def _attention(ctx) -> dict[str, str]:
    """The actor's attention kernels at the run's sizes (``models.attention.implementations``)."""
    k = ctx.engine.kernels
    r, ppo = k.rollout, k.spec.ppo
    full = r.prompt_width + r.max_response_len
    width = packed_width(full, ppo.pack_granule, ppo.pack_width_factor)
    return implementations(k.spec.actor, full, width)


def warm_up(ctx, schedule, host, state, progress: bool = True) -> tuple[dict, object]:
    """Compile every shape of ``warmup_shapes`` and one whole step before the run measures
    anything, with its own progress line. Returns the warm-up's report (seconds, shapes,
    compilations and their seconds, in all and by task) and the train state to go on with
    (``state``'s values; its arrays may be new: the whole step's update donates them)."""
    shapes = warmup_shapes(ctx, host, schedule)
    tasks = _tasks(ctx, schedule, host, state, shapes)
    del state  # the last task takes it
    counter, start = CompileCounter(), time.perf_counter()
    bar = tqdm(tasks, desc="warm-up (compiling)", disable=not progress, unit="shape")
    per_task = CompileCounter()
    by_task = []  # [label, compilations, their seconds] of each task
    for label, task in bar:
        bar.set_postfix_str(label, refresh=False)
        state = task()  # the whole step's, last: the train state
        by_task.append([label, *per_task.take()])
        check_map_room(f"the warm-up's {label}")  # a clear stop, not LLVM's segfault
    bar.close()
    compiles, seconds, hits = counter.take_with_hits()
    report = {
        "warmup_s": time.perf_counter() - start,
        "warmup_shapes": len(tasks),
        "warmup_compiles": compiles,
        "warmup_cache_reads": hits,  # programs read back from the persistent cache
        # by compile-plan family (oppo-jax compile-plan): [programs, their seconds]
        "warmup_programs": counter.programs(),
        "warmup_compile_time_s": seconds,
        **{k: list(v) for k, v in dataclasses.asdict(shapes).items()},
        "warmup_by_task": by_task,
        "attention": _attention(ctx),  # the kernel each form runs, after its self-check
        "kernel_checks": kernel_check.checked(),
    }
    if progress:
        print(
            f"Warm-up: {len(tasks)} shapes, {compiles} compilations, {hits} read from the "
            f"compilation cache, {report['warmup_s']:.1f} s (not counted in any step's time)",
            flush=True,
        )
    return report, state
