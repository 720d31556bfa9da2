"""The host side of a run between steps: the controllers, the prompt position, the carried
sequences, and the two random keys. Its JSON goes into every checkpoint beside the arrays."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from oppo_jax.config.schema import Config
from oppo_jax.data.prompts import PromptIterator
from oppo_jax.pipeline.carry import CarryBuffer
from oppo_jax.pipeline.chunk_control import ChunkSizeController
from oppo_jax.pipeline.overcommit import OvercommitController
from oppo_jax.pipeline.placement import Placement, move
from oppo_jax.pipeline.schedule import Schedule
from oppo_jax.pipeline.step import StepPlan
from oppo_jax.ppo.kl_control import make_kl_controller
from oppo_jax.scoring.kept import KeptCaches


def sampling_key(seed: int) -> jax.Array:
    """The run's one sampling key: a token's randomness depends on (seed, prompt id, sample
    index, position) only, never on the step, slot or chunk that sampled it."""
    return jax.random.key(seed)


def update_key(seed: int, step: int) -> jax.Array:
    """The key of step ``step``'s update (its minibatch shuffles): ``fold_in(key(seed + 1),
    step)``, as one compiled call (two eager ops cost the loop ~1.4 ms a step between steps)."""
    return _update_key(np.int32(seed + 1), np.int32(step))


@jax.jit
def _update_key(seed, step):
    return jax.random.fold_in(jax.random.key(seed), step)


@dataclasses.dataclass
class HostState:
    """Everything host-side that a checkpoint must carry besides the arrays."""

    step: int  # next step to run
    kl_ctl: object  # KL controller (its coefficient is the only state)
    prompts: PromptIterator  # position in the prompt stream
    chunks: ChunkSizeController
    deltas: OvercommitController
    buffer: CarryBuffer  # sequences carried into the next step
    nonfinite_in_a_row: int = 0  # consecutive steps whose update was skipped (NaN/Inf)
    nonfinite_total: int = 0  # all skipped updates of the run

    @classmethod
    def fresh(cls, cfg: Config, schedule: Schedule, prompts: PromptIterator) -> HostState:
        p = cfg.pipeline
        return cls(
            step=0,
            kl_ctl=make_kl_controller(
                cfg.ppo.kl_coef, cfg.ppo.adaptive_kl, cfg.ppo.target_kl, cfg.ppo.kl_horizon
            ),
            prompts=prompts,
            chunks=ChunkSizeController(
                p.chunk_size, tuple(p.chunk_candidates), p.chunk_tuning_every, p.chunk_tuning
            ),
            # Δ is the carrying schedules' setting: the others never overcommit.
            deltas=OvercommitController(
                p.overcommit if schedule.carry else 0,
                p.overcommit_min,
                p.overcommit_max,
                p.overcommit_window,
                p.adaptive_overcommit and schedule.carry,
            ),
            buffer=CarryBuffer(),
        )

    def plan(self, cfg: Config) -> StepPlan:
        """The next step's settings, as the controllers chose them."""
        b, g = cfg.rollout.batch_size, cfg.rollout.group_size
        return StepPlan(  # Δ counts groups of G
            step=self.step,
            batch_size=b,
            overcommit=self.deltas.delta * g,
            reserved=b + self.deltas.slots_needed * g,
            chunk_size=self.chunks.size_for(self.step),
            kl_coef=float(self.kl_ctl.value),
            update_key=update_key(cfg.seed, self.step),
            group_size=g,
        )

    def observe(self, plan: StepPlan, record: dict) -> None:
        """Feed a finished step's record to the controllers and count skipped updates."""
        skipped = bool(record["nonfinite_batch"] or record["nonfinite_update"])
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped else 0
        self.nonfinite_total += skipped
        record["update_skipped"], record["nonfinite_total"] = skipped, self.nonfinite_total
        if not skipped:  # a NaN reward or KL would poison the controllers for good
            self.kl_ctl = self.kl_ctl.update(record["kl"], plan.batch_size)
            self.deltas.observe(record["reward"])
        self.chunks.observe(plan.step, plan.chunk_size, record["step_time_s"])
        self.step = plan.step + 1

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "kl_coef": float(self.kl_ctl.value),
            "prompts": self.prompts.state(),
            "chunks": self.chunks.state(),
            "deltas": self.deltas.state(),
            "buffer": self.buffer.state(),
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "nonfinite_total": self.nonfinite_total,
        }

    def arrays(self) -> dict | None:
        """The arrays a checkpoint keeps beside ``to_json``: the frozen scorers' kept caches
        of the carried rows (``scoring.kept``), or None."""
        kept = self.buffer.kept
        return None if kept is None else {"kept": kept.to_tree()}

    def restore_arrays(self, arrays: dict | None, placement: Placement) -> None:
        """Take the arrays saved by ``arrays`` (after ``restore``), onto the scoring group."""
        if arrays is None or "kept" not in arrays:
            return
        tree = dict(arrays["kept"])
        ids = tree.pop("ids")
        replicated = NamedSharding(placement.scoring_mesh, PartitionSpec())
        self.buffer.kept = KeptCaches.from_tree({**move(tree, replicated), "ids": ids})

    def restore(self, data: dict, prompts: PromptIterator) -> None:
        """Take the state saved by ``to_json``; ``prompts`` is the stream at its position."""
        self.step = int(data["step"])
        self.kl_ctl = self.kl_ctl.replace(value=jnp.float32(data["kl_coef"]))
        self.prompts = prompts
        self.chunks.restore(data["chunks"])
        self.deltas.restore(data["deltas"])
        self.buffer = CarryBuffer.from_state(data["buffer"])
        self.nonfinite_in_a_row = int(data.get("nonfinite_in_a_row", 0))
        self.nonfinite_total = int(data.get("nonfinite_total", 0))
