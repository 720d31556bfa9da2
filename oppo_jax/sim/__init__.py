"""A discrete-event simulator of the PPO-RLHF pipeline: predicted step time per schedule.

Pure Python and numpy (no JAX). It answers "how fast would sync / intra / inter / oppo be for
this response-length distribution on this hardware, and which chunk size C and overcommit Δ
should I use?" before spending GPU hours.

Model
-----
- Device groups. ``generation`` runs the actor's admission prefill and decode, then the PPO
  batch build, the update and the parameter copy. ``scoring`` runs the reference, critic and
  reward prefills. Colocated: both kinds of work queue on one group, serially.
  Disaggregated: two groups run concurrently, each in dispatch order; score chunk k waits
  for decode k; while both work, each keeps ``overlap_rate`` of its speed (1 on separate
  chips; below 1 for two fake devices sharing a CPU's cores) (``engine``).
- Costs (``CostModel``, seconds): decode_step_s(S, ctx) = a + b·S + c·S·ctx per lockstep
  step, plus decode_chunk_s per chunk; prefill_s(n) = p0 + p1·n per scorer call
  (×n_scorers); admit_s(n) = q0 + q1·n for the actor's prefill of prompts + carried
  prefixes; build_s; update_s(B, n) = u0 + u1·n over the batch's n tokens; copy_s; and
  host_* delays before the dispatches the host makes late (the first decode, the scorers
  after the rollout, the build, the update).
- Engines. Active (a serving engine: finished slots stop costing, real token counts) or
  ``padded_decode`` (this project's JAX engine: fixed shapes, whole chunks plus the one
  dispatched before the host reads the cut, every slot every step until all finished,
  admission and scorer calls over padded [S, width], the update over [B, P + R]).
- Schedules. sync: decode all B to the longest, then score, then update. intra: the scorers
  prefill each chunk of C tokens while the actor decodes the next (Δ = 0). inter: B + Δ slots
  start, the step's rollout is cut when B have finished (the B-th shortest remaining length;
  later if a slot carried ``max_deferrals`` times still runs), the rest are carried with their
  tokens and re-prefilled next step; scoring after generation. oppo: both (``events``).
- Step time = the end of the last stage (the copy after the update).

Calibration (``fitting``): ``calibrate_from_bench`` fits every cost to the per-step
timelines ``oppo-jax bench`` records (``trace``); ``calibrate`` also takes a run's
metrics.jsonl (stage sums only: a rougher fit). ``validate`` (``validation``) checks the
simulator against a bench.json on held-out steps. Projections: ``roofline_cost_model`` /
``project_cost_model`` with GH200 and TPU v5p presets and Qwen2.5-3B/7B shapes; their
outputs say PROJECTION. Not modelled: varying prompt lengths (one length for all), memory
limits, compilations (a bench step that compiles is an outlier the medians ignore).
"""

from oppo_jax.pipeline.events import Event
from oppo_jax.sim.events import (
    PLACEMENTS,
    SCHEDULES,
    LengthSource,
    SimResult,
    compare,
    recommend,
    simulate,
)
from oppo_jax.sim.fitting import calibrate, calibrate_from_bench, calibrate_traces
from oppo_jax.sim.model import (
    HARDWARE,
    MODELS,
    CostModel,
    Hardware,
    ModelShape,
    project_cost_model,
    roofline_cost_model,
)
from oppo_jax.sim.validation import validate

__all__ = [
    "HARDWARE", "MODELS", "PLACEMENTS", "SCHEDULES", "CostModel", "Event", "Hardware",
    "LengthSource", "ModelShape", "SimResult", "calibrate", "calibrate_from_bench",
    "calibrate_traces", "compare", "project_cost_model", "recommend", "roofline_cost_model",
    "simulate", "validate",
]  # fmt: skip
