"""The programs a run compiles before its first step, from its config alone (no models built):
what the warm-up iterates (``pipeline.warmup``) and ``oppo-jax compile-plan`` prints, one
function for both so that the two cannot drift.

A run's shapes follow from a few sizes (B, Δ_max groups of G, P, R, the chunk sizes, the
mesh's batch shards), the scorers the config runs (``scorer_roles``) and switches (the
schedule's streaming and carrying, the backend's slot compaction), ``RunShapes``; the shape
rules themselves live in ``oppo_jax.base.shapes``. ``plan_programs`` lists every compiled
kernel family with its shapes and its program count, the budget a run's warm-up spends
(DESIGN §3: a few dozen programs at 7B, not hundreds).
"""

from __future__ import annotations

import dataclasses

import jax

from oppo_jax.base.shapes import (
    chunk_widths,
    compaction_default,
    compaction_floor,
    live_widths_pay,
    pow4_buckets,
)
from oppo_jax.base.shapes import refill_store_rows as store_rows
from oppo_jax.pipeline.schedule import Schedule
from oppo_jax.ppo.estimators import estimator
from oppo_jax.ppo.packing import packed_shapes
from oppo_jax.rollout.compaction import compact_bucket
from oppo_jax.scoring.carried import kept_bucket, replay_shapes
from oppo_jax.scoring.stream import ROLES


@dataclasses.dataclass(frozen=True)
class RunShapes:
    """What a run's compiled shapes follow from (a config, its schedule and backend)."""

    stream: bool  # the scorers consume the decode's chunks (intra-step overlap)
    carry: bool  # B + Δ slots, stragglers carried (inter-step overlap)
    batch_size: int  # B
    slots: int  # S: B + Δ_max·G rounded up to the generation mesh's batch shards
    prompt_width: int  # P
    response_len: int  # R
    chunk_sizes: tuple[int, ...]  # every C the chunk controller can pick
    scorers: tuple[str, ...]  # roles that score (``scorer_roles``); may be none
    keeps_frozen: bool  # streaming with carrying keeps the frozen scorers' caches of carried rows
    compaction_floor: int | None  # smallest slot bucket of compaction; None: no compaction
    update: tuple  # ((Rp, W, N), K) of the packed update
    # decode, streamed scoring and replay read power-of-two live widths (``Kernels.live_prefix``);
    # False: the whole cache, where the decode's attention takes lengths as data
    live_prefix: bool = True
    # the reference is the actor as a scorer: colocated without LoRA, and with the trained
    # master copy in the frozen weights' dtype, it runs the actor's own admission and replay
    # programs (same model, mesh and parameter tree; a float32 master of bfloat16 weights is
    # another tree, and so other programs)
    reference_is_actor: bool = False
    # continuous refill (rollout.refill_every, a carrying schedule): the rows of every prompt
    # store (``RefillRule.store_rows``); 0: the run does not refill
    refill_store_rows: int = 0
    # a refilling step's actor pass for the old log-probs of tokens sampled under earlier
    # weights (``PPOConfig.reads_old_logprobs``)
    refill_old_logprobs: bool = False

    @property
    def capacity(self) -> int:
        return self.prompt_width + self.response_len

    @property
    def max_carried(self) -> int:
        return self.slots - self.batch_size if self.carry else 0


def scorer_roles(cfg) -> tuple[str, ...]:
    """The models that score a run's tokens, in dispatch order: the reference when a KL term
    reads it (``ppo.uses_reference``), the critic when the estimator needs one (GAE's values:
    ``estimators.Estimator.needs_critic``),
    the reward model when its score weighs (reward.model_weight > 0). Example: GRPO with β = 0
    and reward functions only -> ()."""
    critic = estimator(cfg.ppo).needs_critic
    present = (cfg.ppo.uses_reference, critic, cfg.reward.model_weight > 0)
    return tuple(role for role, on in zip(ROLES, present, strict=True) if on)


def run_shapes(
    cfg, schedule: Schedule | None = None, backend: str | None = None, head_dim: int | None = None
) -> RunShapes:
    """``RunShapes`` of ``cfg`` under ``schedule`` (default: ``pipeline.mode``) on ``backend``
    (default: JAX's; it decides slot compaction, on the CPU only, and whether the decode's
    attention takes lengths as data: ``models.attention.reads_lengths``, for the actor's
    ``head_dim``: default its ``model.preset``'s, 128 without one)."""
    from oppo_jax.models.attention import reads_lengths
    from oppo_jax.models.model_config import PRESETS

    schedule = schedule or Schedule.named(cfg.pipeline.mode)
    p, r, mesh = cfg.pipeline, cfg.rollout, cfg.mesh
    shards = mesh.data * mesh.fsdp
    delta = (p.overcommit_max if p.adaptive_overcommit else p.overcommit) if schedule.carry else 0
    extra = delta * r.group_size  # Δ counts groups of G sequences
    slots = -(-(r.batch_size + extra) // shards) * shards
    sizes = {p.chunk_size, *(p.chunk_candidates if p.chunk_tuning else ())}
    backend = backend or jax.default_backend()
    compact = compaction_default(backend) if p.compact_slots is None else p.compact_slots
    scoring_shards = cfg.mesh.scoring_devices if p.placement == "disaggregated" else shards
    if head_dim is None:
        head_dim = PRESETS[cfg.model.preset].head_dim if cfg.model.preset in PRESETS else 128
    capacity = r.max_prompt_len + r.max_response_len
    reads = reads_lengths(cfg.model.attention, head_dim, capacity, backend)
    live = live_widths_pay(capacity, reads)
    floor = compaction_floor(
        compact, reads, shards, scoring_shards, p.compact_min_slots, r.group_size
    )
    refills = schedule.carry and r.refill_every > 0
    m = r.batch_size // (cfg.ppo.num_minibatches * cfg.ppo.grad_accum_steps)
    update = packed_shapes(
        m,
        r.max_prompt_len + r.max_response_len,
        r.max_response_len,
        cfg.ppo.pack_granule,
        shards,
        chunks=cfg.ppo.grad_accum_steps,
        width_factor=cfg.ppo.pack_width_factor,
    )
    return RunShapes(
        stream=schedule.stream,
        carry=schedule.carry and extra > 0,
        batch_size=r.batch_size,
        slots=slots,
        prompt_width=r.max_prompt_len,
        response_len=r.max_response_len,
        chunk_sizes=tuple(sorted(sizes)),
        scorers=scorer_roles(cfg),
        keeps_frozen=schedule.stream and schedule.carry and extra > 0,
        compaction_floor=floor,
        update=update,
        live_prefix=live,
        reference_is_actor=p.placement == "colocated"
        and not cfg.model.lora_rank
        and cfg.optim.master_dtype == cfg.model.param_dtype,
        # RefillRule.store_rows; 0: no refill (off, or a schedule that does not carry)
        refill_store_rows=store_rows(slots, r.group_size) if refills else 0,
        refill_old_logprobs=refills and cfg.ppo.reads_old_logprobs,
    )


def compaction_moves(slots: int, minimum: int = 1) -> list[tuple[int, int]]:
    """Every (rows, bucket) move a decode of ``slots`` (S) slots can make: from S or a bucket
    reached from it, into each smaller bucket ``compact_bucket`` allows.

    Example: S 8 -> [(8, 1), (8, 2), (8, 4), (4, 1), (4, 2), (2, 1)].
    """

    def into(n: int) -> list[int]:
        return sorted({b for r in range(n + 1) if (b := compact_bucket(r, n, minimum))})

    return [(n, b) for n in [slots, *reversed(into(slots))] for b in into(n)]


@dataclasses.dataclass(frozen=True)
class Family:
    """One compiled kernel family of a run: its shapes and how many programs they are."""

    name: str
    shapes: tuple  # the family's shapes (what the warm-up compiles)
    per_shape: int  # programs per shape (one per model or scorer that runs it)

    @property
    def programs(self) -> int:
        return len(self.shapes) * self.per_shape


def plan_programs(shapes: RunShapes) -> list[Family]:
    """Every kernel family the run compiles, with its shapes: the warm-up's work list.

    Programs of small helpers (gathers, the kept caches' moves, compaction's scatters) are
    not kernels and are left out; slot compaction's decode buckets are in ``decode``."""
    s = shapes
    whole = (s.capacity,)
    widths = {c: chunk_widths(s.capacity, c) if s.live_prefix else whole for c in s.chunk_sizes}
    chunks = tuple((c, w) for c in s.chunk_sizes for w in widths[c])
    if s.refill_store_rows:
        return _refill_programs(s, chunks)
    buckets = (s.slots,)
    if s.compaction_floor is not None:
        buckets += tuple(sorted({b for _, b in compaction_moves(s.slots, s.compaction_floor)}))
    streamed = s.scorers if s.stream else ()
    # models that prefill: the actor, and the streaming scorers but a reference it serves
    prefilled = 1 + len(streamed) - (s.reference_is_actor and "reference" in streamed)
    replay = replay_shapes(s.slots, s.max_carried, (s.prompt_width, s.response_len))
    families = [
        Family("admission prefill", ("prompts",), prefilled),
        Family("decode start", ("slots",), 1),
        Family("replay", tuple(replay), prefilled),
        Family("decode", tuple((b, c, w) for b in buckets for c, w in chunks), 1),
        Family("streamed scoring", chunks if s.stream else (), len(s.scorers)),
        Family("sync scoring", () if s.stream else ("packed",), len(s.scorers)),
        Family("experience", ("batch",), 1),
        Family("update", (s.update[0],), 1),
    ]
    return [f for f in families if f.programs]


def _refill_programs(s: RunShapes, chunks: tuple) -> list[Family]:
    """A refilling run's families (``pipeline.refill_step``): its empty rows; the replay of
    the rows in flight (every row may hold one; prompts not shared); the prompt stores (a
    bucket of groups each, ``RefillRule.store_rows`` at most) and the placements into rows (a
    bucket of rows); the decode at S rows; the batch's packed scoring, the actor's old
    log-probs among them where they are read; the batch and the update. The stores and
    the placements come in power-of-four buckets (``shapes.pow4_bucket``)."""
    replay = replay_shapes(s.slots, s.slots, (s.prompt_width, s.response_len))
    stores, places = pow4_buckets(s.refill_store_rows), pow4_buckets(s.slots)
    families = [
        Family("refill start", ("rows",), 1),
        Family("admission prefill", ("prompts",), 1),
        Family("replay", tuple(replay), 1),
        Family("decode start", ("slots",), 1),
        Family("refill prompts", stores, 1),
        Family("refill place", places, 1),
        Family("decode", tuple((s.slots, c, w) for c, w in chunks), 1),
        Family("sync scoring", ("packed",), len(s.scorers) + int(s.refill_old_logprobs)),
        Family("experience", ("batch",), 1),
        Family("update", (s.update[0],), 1),
    ]
    return [f for f in families if f.programs]


def kept_rows(shapes: RunShapes) -> tuple[int, ...]:
    """Row buckets of the frozen scorers' kept caches (``scoring.carried``) a run can fill; their
    keep and restore are small gathers, not kernels."""
    if not shapes.keeps_frozen:
        return ()
    carried = range(1, shapes.max_carried + 1)
    return tuple(sorted({kept_bucket(n, shapes.max_carried) for n in carried}))
