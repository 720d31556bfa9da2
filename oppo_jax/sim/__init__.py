"""A discrete-event simulator of the PPO-RLHF pipeline: predicted step time per schedule.

Pure Python and numpy (no JAX). It answers "how fast would sync / intra / inter / oppo be for
this response-length distribution on this hardware, and which chunk size C and overcommit Δ
should I use?" before spending GPU hours.

Model
-----
- Device groups. ``generation`` runs the actor's admission prefill and decode, then the PPO
  update and the parameter copy. ``scoring`` runs the reference, critic and reward prefills.
  Colocated: both kinds of work queue on one group, serially. Disaggregated: two groups run
  concurrently; a group runs its stages in dispatch order; score chunk k waits for decode k.
- Costs (``CostModel``, seconds): decode_step_s(S, ctx) = a + b·S + c·S·ctx for S active slots
  at mean context ctx; prefill_s(n) = p0 + p1·n per scorer call (×n_scorers);
  admit_s(n) = q0 + q1·n for the actor's prefill of prompts + carried prefixes;
  update_s(B, n) = u0 + u1·n over the batch's n tokens; copy_s once per step.
- Schedules. sync: decode all B to the longest, then score, then update. intra: the scorers
  prefill each chunk of C tokens while the actor decodes the next (Δ = 0). inter: B + Δ slots
  start, the step's rollout is cut when B have finished (the B-th shortest remaining length;
  later if a slot carried ``max_deferrals`` times still runs), the rest are carried with their
  tokens and re-prefilled next step; scoring after generation. oppo: both.
- Step time = the end of the last stage (the copy after the update).
- ``padded_decode`` models a fixed-shape engine like this project's JAX decode (every slot
  costs, whole chunks); otherwise finished slots stop costing (a serving engine).

Calibration: ``calibrate`` (metrics.jsonl records) and ``calibrate_from_bench`` (bench.json,
when it holds per-stage times). Projections: ``roofline_cost_model`` / ``project_cost_model``
with GH200 and TPU v5p presets and Qwen2.5-3B/7B shapes; their outputs say PROJECTION.
Not modelled: varying prompt lengths (one length for all), memory limits, host overheads
other than ``copy_s``, contention between scorers and decode on one group.
"""

from oppo_jax.sim.events import (
    PLACEMENTS,
    SCHEDULES,
    Event,
    LengthSource,
    SimResult,
    compare,
    recommend,
    simulate,
)
from oppo_jax.sim.model import (
    HARDWARE,
    MODELS,
    CostModel,
    Hardware,
    ModelShape,
    calibrate,
    calibrate_from_bench,
    project_cost_model,
    roofline_cost_model,
)

__all__ = [
    "HARDWARE", "MODELS", "PLACEMENTS", "SCHEDULES", "CostModel", "Event", "Hardware",
    "LengthSource", "ModelShape", "SimResult", "calibrate", "calibrate_from_bench", "compare",
    "project_cost_model", "recommend", "roofline_cost_model", "simulate",
]  # fmt: skip
