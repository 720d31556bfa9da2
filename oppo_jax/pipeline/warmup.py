"""The warm-up: compile every shape a run can meet before its first measured step, and count
the XLA compilations of each step afterwards.

Without it a run compiles whenever a step first meets a shape (a chunk size under tuning, a
bucket of carried rows or prefix widths), and that step looks like a hang: on the CPU demo
20-50 s against 0.3 s, on a GPU with 7B models minutes. ``warm_up`` runs each kernel once on
throwaway inputs of every shape ``warmup_shapes`` lists (the one place to extend when a kernel
gains a bucket), with the same shardings the run uses, so the run's jits find them compiled.
The run's own train state, host state and prompt stream are never touched: the throwaway step
updates a copy of the train state (for a moment twice its memory; ``train(warmup=False)`` /
``--no-warmup`` skip it where that does not fit).
"""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from oppo_jax.pipeline.carry import (
    AdmitRule,
    Carried,
    CarryBuffer,
    admit,
    carried_bucket,
    prefix_bucket,
)
from oppo_jax.pipeline.host_state import HostState
from oppo_jax.pipeline.step import device_admission, run_step
from oppo_jax.pipeline.timeline import Timeline
from oppo_jax.rollout.decode import CutRule

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per XLA compilation
_lock = threading.Lock()
_totals = [0, 0.0]  # compilations and their seconds since the listener was registered
_listening = False


def _listen(event: str, duration: float, **_) -> None:
    if event == COMPILE_EVENT:
        with _lock:
            _totals[0] += 1
            _totals[1] += duration


class CompileCounter:
    """Counts XLA backend compilations (served from a persistent cache: not counted) and their
    seconds through ``jax.monitoring``. One listener serves every counter of the process (jax
    has no public way to remove one), so a run that starts many counters adds none."""

    def __init__(self):
        global _listening
        with _lock:
            if not _listening:
                jax.monitoring.register_event_duration_secs_listener(_listen)
                _listening = True
        self._mark = self._now()

    @staticmethod
    def _now() -> tuple[int, float]:
        with _lock:
            return _totals[0], _totals[1]

    def take(self) -> tuple[int, float]:
        """(compilations, seconds) since the last ``take`` (or since creation)."""
        now = self._now()
        count, seconds = now[0] - self._mark[0], now[1] - self._mark[1]
        self._mark = now
        return count, seconds


@dataclasses.dataclass(frozen=True)
class WarmupShapes:
    """The shapes a run can meet beyond those of its first step."""

    chunk_sizes: tuple[int, ...]  # C of every decode chunk (and streamed scorer chunk)
    prefix_widths: tuple[int, ...]  # context room for carried prefixes (admission), tokens
    carried_rows: tuple[int, ...]  # buckets of leading carried rows (admission)


def warmup_shapes(ctx, host, carry: bool) -> WarmupShapes:
    """Every shape bucket the run's controllers and carried sequences (``carry``: the schedule
    carries) can pick. Kernels that gain a bucket (packed update lengths, live-prefix widths,
    scoring widths) list it here."""
    cfg, engine = ctx.cfg, ctx.engine
    r, chunks = engine.kernels.rollout, host.chunks
    sizes = {chunks.current, *(chunks.candidates if chunks.tuning else ())}
    widths, rows = (), ()
    if carry and host.deltas.slots_needed > 0:
        plan = host.plan(cfg)
        slots = engine.placement.num_slots(plan.reserved)
        longest = r.max_response_len
        widths = sorted({prefix_bucket(n, longest) for n in range(1, longest + 1)})
        rows = sorted({carried_bucket(n, slots) for n in range(1, slots - plan.batch_size + 1)})
    return WarmupShapes(tuple(sorted(sizes)), tuple(widths), tuple(rows))


class _Prompts:
    """A fixed list of (prompt_id, tokens) with ``take(k)``, for throwaway admissions."""

    def __init__(self, pairs):
        self.pairs = list(pairs)

    def take(self, k: int):
        taken, self.pairs = self.pairs[:k], self.pairs[k:]
        return taken


def _admission(ctx, host, width: int, rows: int):
    """A throwaway admission with ``rows`` carried sequences of ``width`` prefix tokens (two
    token prompts; the shapes, not the values, matter)."""
    cfg, engine = ctx.cfg, ctx.engine
    r, plan = engine.kernels.rollout, host.plan(cfg)
    slots = engine.placement.num_slots(plan.reserved)
    rule = AdmitRule(plan.batch_size + plan.overcommit, slots, plan.reserved > plan.batch_size,
                     engine.max_deferrals)  # fmt: skip
    token, prompt = r.pad_id + 2, [r.pad_id + 2] * 2
    carried = [
        Carried(10**9 + i, prompt, [token] * width, [0.0] * width, [0] * width, 1)
        for i in range(rows)
    ]
    fresh = _Prompts([(i, prompt) for i in range(rule.num_sequences)])
    slot_batch = admit(CarryBuffer(carried), fresh, rule, r.prompt_width, r.max_response_len,
                       r.pad_id)  # fmt: skip
    return device_admission(slot_batch)


def _scorer_params(ctx, state) -> dict:
    engine = ctx.engine
    k, place = engine.kernels, engine.placement
    critic = place.critic_for_scoring(k.spec.critic, state.critic_model_params)
    return {"reference": engine.ref_params, "critic": critic, "reward": engine.reward_params}


def compile_admission(ctx, host, state, width: int, rows: int) -> None:
    """Run the actor's and every scorer's admission prefill once at (prefix width, carried
    rows), so that the first step meeting that shape finds it compiled."""
    k, place = ctx.engine.kernels, ctx.engine.placement
    admission = _admission(ctx, host, width, rows)
    outputs = [k.admit(state.actor_model_params, admission, ctx.engine.sample_key)]
    on_scoring, params = place.to_scoring(admission), _scorer_params(ctx, state)
    for role in k.scorer_specs.present():
        outputs.append(k.scorer_admit(role)(params[role], on_scoring))
    jax.block_until_ready(outputs)


def compile_admissions(ctx, host, state) -> int:
    """Compile every carried-admission shape ``warmup_shapes`` lists: context width P + each
    prefix bucket by each bucket of leading carried rows, for the actor and the scorers.
    Returns how many shapes were run."""
    shapes = warmup_shapes(ctx, host, carry=True)
    for width in shapes.prefix_widths:
        for rows in shapes.carried_rows:
            compile_admission(ctx, host, state, width, rows)
    return len(shapes.prefix_widths) * len(shapes.carried_rows)


def chunk_widths(kernels, chunk_size: int) -> tuple[int | None, ...]:
    """The live cache widths a decode chunk of ``chunk_size`` tokens (and the scorer chunk fed
    with it) can read: every value of ``Kernels.chunk_width`` over the admitted context
    lengths 1..P+R (later chunks only move further along the same buckets); (None,) when the
    kernels read the whole cache."""
    width_of = getattr(kernels, "chunk_width", None)  # absent: decode reads every column
    if width_of is None:
        return (None,)
    r = kernels.rollout
    capacity = r.prompt_width + r.max_response_len
    widths = {width_of(n, chunk_size, 0) for n in range(1, capacity + 1)}
    return tuple(sorted(widths, key=lambda w: -1 if w is None else w))


def compile_chunk(ctx, schedule, host, state, chunk_size: int, kv_width: int | None) -> None:
    """Decode one chunk of ``chunk_size`` tokens reading ``kv_width`` cache columns from a
    fresh admission and, when the schedule streams, feed it to every scorer."""
    engine, plan = ctx.engine, host.plan(ctx.cfg)
    k, place = engine.kernels, engine.placement
    width = () if kv_width is None else (kv_width,)  # kernels without live widths take C only
    admission = _admission(ctx, host, 0, 0)
    decoding, _ = k.admit(state.actor_model_params, admission, engine.sample_key)
    rule = CutRule(admission.active, admission.must_finish, jnp.int32(plan.batch_size))
    decoding, chunk = k.decode(chunk_size, *width)(state.actor_model_params, decoding, rule)
    outputs = [decoding, chunk]
    if schedule.stream:
        on_scoring, params = place.to_scoring(admission), _scorer_params(ctx, state)
        for role in k.scorer_specs.present():
            scored, _ = k.scorer_admit(role)(params[role], on_scoring)
            feed = k.scorer_chunk(role, *width)
            outputs.append(feed(params[role], scored, place.to_scoring(chunk)))
    jax.block_until_ready(outputs)


def _throwaway_step(ctx, schedule, state) -> None:
    """One whole step on a copy of the train state, a fresh host state and prompt stream:
    compiles the update, the experience kernel, sync scoring and the controllers' small ops."""
    host = HostState.fresh(ctx.cfg, schedule, ctx.prompt_iterator())
    plan, copy = host.plan(ctx.cfg), jax.tree.map(jnp.copy, state)  # the update donates it
    copy, _, result = run_step(ctx.engine, schedule, plan, copy, CarryBuffer(), host.prompts,
                               Timeline())  # fmt: skip
    record = {k: float(v) for k, v in jax.device_get(result.metrics).items()}
    host.observe(plan, {**record, "step_time_s": result.wall_s})
    jax.block_until_ready(copy)


def warm_up(ctx, schedule, host, state, progress: bool = True) -> dict:
    """Compile every shape of ``warmup_shapes`` and one whole step before the run measures
    anything, with its own progress line. Returns the warm-up's report: seconds, shapes,
    compilations and their seconds."""
    shapes = warmup_shapes(ctx, host, schedule.carry)
    tasks = [("one step", lambda: _throwaway_step(ctx, schedule, state))]
    tasks += [
        (f"chunk {c} width {w}", lambda c=c, w=w: compile_chunk(ctx, schedule, host, state, c, w))
        for c in shapes.chunk_sizes
        for w in chunk_widths(ctx.engine.kernels, c)
    ]
    tasks += [
        (f"admission +{w}x{n}", lambda w=w, n=n: compile_admission(ctx, host, state, w, n))
        for w in shapes.prefix_widths
        for n in shapes.carried_rows
    ]
    counter, start = CompileCounter(), time.perf_counter()
    bar = tqdm(tasks, desc="warm-up (compiling)", disable=not progress, unit="shape")
    for label, task in bar:
        bar.set_postfix_str(label, refresh=False)
        task()
    bar.close()
    compiles, seconds = counter.take()
    report = {
        "warmup_s": time.perf_counter() - start,
        "warmup_shapes": len(tasks),
        "warmup_compiles": compiles,
        "warmup_compile_time_s": seconds,
        **{k: list(v) for k, v in dataclasses.asdict(shapes).items()},
    }
    if progress:
        print(
            f"Warm-up: {len(tasks)} shapes, {compiles} compilations, {report['warmup_s']:.1f} s "
            "(not counted in any step's time)",
            flush=True,
        )
    return report
