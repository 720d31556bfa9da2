"""What a shared-prefix update would buy the 7B GRPO config: an estimate, not a build.

The packed update computes every sample's prompt: B·(P + r_i) tokens. A GRPO group's G samples
share one prompt, so an update that computes each prompt once and lets each response attend to
its group's prompt (as Prefix Grouper does; same loss and gradients) computes
B/G·P + Σ r_i tokens and fewer query-key pairs. Nothing of it is built (docs/PROJECTIONS.md §8c).

The estimate, per simulated step of `oppo-jax sim --project qwen2.5-7b:gh200 --config
qwen2.5-7b_gh200x1_lora_grpo` (the config's settings; its refill: every 32, S = B, shared
prompt prefill, carry_kv keep, max staleness 3):
- the update's cost with and without sharing, token-proportional (the cost model's update_s of
  tokens and causal pairs; no packing waste on either side), gives a ratio;
- that ratio scales the built engine's update stage; `sync` and `oppo` with refill both keep
  the rest of their simulated step (the update is the same batch in both).

    python benchmarks/shared_prefix_update_estimate.py
"""

from __future__ import annotations

import numpy as np

from oppo_tools.sim.project import build_projection
from oppo_tools.sim.refill import Refill
from oppo_tools.sim.refill_report import _refill_row, _sync

CONFIG = "qwen2.5-7b_gh200x1_lora_grpo"
REFILL = Refill(every=32, shared_prefill=True, carry_kv="keep", max_staleness=3)


def update_ratio(cost, lengths, batch: int, group: int, prompt: int, steps=200) -> float:
    """Mean update seconds with each group's prompt computed once, over those with every
    sample's, token-proportional, over ``steps`` batches drawn from ``lengths`` (seed 0)."""
    rng, own, shared = np.random.default_rng(0), [], []
    for _ in range(steps):
        r = rng.choice(lengths, batch).reshape(batch // group, group).astype(float)
        seq = prompt + r
        own.append(cost.update_s(seq.sum(), (seq * (seq + 1) / 2).sum()))
        prompts = batch // group
        pairs = prompts * prompt * (prompt + 1) / 2 + (r * prompt + r * (r + 1) / 2).sum()
        shared.append(cost.update_s(prompts * prompt + r.sum(), pairs))
    return float(np.mean(shared) / np.mean(own))


def main() -> None:
    base = build_projection("qwen2.5-7b:gh200", CONFIG)
    for label, proj in (("config lengths", base), ("median 512", base.with_regime(1, 512))):
        w, cost = proj.workload, proj.cost_model()
        lengths = proj.lengths.sample(seed=w.seed or 0)
        sync, update = _sync(proj, lengths)
        refill = _refill_row(proj, lengths, REFILL, sync, update)["step_s"]
        ratio = update_ratio(cost, lengths, w.batch, w.group_size, w.prompt_len)
        saved = update * (1 - ratio)
        print(f"{label}: sync {sync:.2f} s (update {update:.2f} s), oppo refill {refill:.2f} s "
              f"= {sync / refill:.2f}x; update x{ratio:.2f} shared -> sync {sync - saved:.2f} s, "
              f"oppo refill {refill - saved:.2f} s = {(sync - saved) / (refill - saved):.2f}x, "
              f"sync alone {sync / (sync - saved):.2f}x faster")  # fmt: skip


if __name__ == "__main__":
    main()
