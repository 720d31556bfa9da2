"""A discrete-event simulator of the PPO-RLHF pipeline: predicted step time per schedule.

Pure Python and numpy (no JAX). It answers "how fast would sync / intra / inter / oppo be for
this response-length distribution on this hardware and this engine, and which chunk size C
and overcommit Δ should I use?" before spending GPU hours.

Model
-----
- Device groups. ``generation`` runs the actor's admission prefill and decode, then the PPO
  batch build, the update and the parameter copy. ``scoring`` runs the reference, critic and
  reward prefills. Colocated: both kinds of work queue on one group, serially.
  Disaggregated: two groups run concurrently, each in dispatch order; score chunk k waits
  for decode k; while both work, each keeps ``overlap_rate`` of its speed (1 on separate
  chips; below 1 for two fake devices sharing a CPU's cores) (``engine``).
- Engines (``engines``): what each stage computes. ``built`` is this project's engine as it
  runs now (fixed shapes; the decode loop stops at the cut), with a named switch for each
  token-proportional engine change not built yet (``FEATURES``); ``padded`` the engine before
  the decode stopped at the cut; ``active`` the token-proportional reference. ``work`` counts
  a step's work under an engine: tokens per prefill, per decode chunk the steps, slots and
  context read, the update's tokens.
- Costs (``CostModel``, seconds per unit of that work; ``model``), fitted to measurements
  (``fitting``) or from a roofline (``roofline``: GH200, TPU v5p; Qwen2.5-3B/7B; PPO epochs,
  minibatches, trained models and scorers from a config: a critic-free run trains the actor
  alone and has no critic scorer, β = 0 no reference, reward functions no reward model;
  outputs say PROJECTION).
- Schedules. sync: decode all B to the longest, then score, then update. intra: the scorers
  prefill each chunk of C tokens while the actor decodes the next (Δ = 0). inter: B + Δ·G
  slots start (Δ groups of G responses per prompt; G = 1 for PPO), the step's rollout is cut
  when B/G groups have finished (a group with its longest member; later if a group carried
  ``max_deferrals`` times still runs), the other groups are carried whole with their tokens;
  scoring after generation. oppo: both (``events``).
- Step time = the end of the last stage (the copy after the update).

Calibration: ``calibrate_from_bench`` fits every cost to the per-step timelines ``oppo-jax
bench`` records (``trace``), as the engine that recorded them computed; ``calibrate`` also
takes a run's metrics.jsonl (stage sums only: a rougher fit). ``validate`` (``validation``)
checks the simulator against any bench.json on held-out steps. ``project`` builds a
projection's settings from a config and the regime map (OPPO's speedup over PPO epochs ×
median response length); ``group_map`` the regime map of a run of groups (intra, inter and
oppo over Δ groups × median response length). ``refill`` prices every row busy (issue 44: S
rows refilled every ``refill_every`` tokens, shared prompt prefill, carry_kv, bounded
staleness) and ``refill_report`` shows what each buys beside its bound. Not modelled: varying
prompt lengths (one width for all), memory limits, compilations (a bench step that compiles is an
outlier the medians ignore).
"""

from oppo_jax.pipeline.events import Event
from oppo_tools.sim.engines import (
    ACTIVE,
    BUILT,
    ENGINES,
    FEATURES,
    FIXED,
    PADDED,
    Engine,
    built_for,
)
from oppo_tools.sim.events import (
    PLACEMENTS,
    SCHEDULES,
    LengthSource,
    SimResult,
    Workload,
    compare,
    recommend,
    simulate,
)
from oppo_tools.sim.fitting import calibrate, calibrate_from_bench, calibrate_traces
from oppo_tools.sim.group_map import group_regime_map
from oppo_tools.sim.model import CostModel
from oppo_tools.sim.project import Projection, regime_map
from oppo_tools.sim.roofline import (
    HARDWARE,
    MODELS,
    Hardware,
    ModelShape,
    TrainSettings,
    project_cost_model,
    roofline_cost_model,
)
from oppo_tools.sim.validation import validate

__all__ = [
    "ACTIVE", "BUILT", "ENGINES", "FEATURES", "FIXED", "HARDWARE", "MODELS", "PADDED", "PLACEMENTS",
    "SCHEDULES", "CostModel", "Engine", "Event", "Hardware", "LengthSource", "ModelShape",
    "Projection", "SimResult", "TrainSettings", "Workload", "calibrate", "calibrate_from_bench",
    "calibrate_traces", "compare", "group_regime_map", "project_cost_model", "recommend",
    "regime_map", "built_for", "roofline_cost_model", "simulate", "validate",
]  # fmt: skip
