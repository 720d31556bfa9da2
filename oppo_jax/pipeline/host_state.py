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
from oppo_jax.pipeline.refill import Pool, RefillRule
from oppo_jax.pipeline.refill_loop import Rollout
from oppo_jax.pipeline.schedule import Schedule
from oppo_jax.pipeline.step import StepPlan, StepResult
from oppo_jax.ppo.kl_control import make_kl_controller
from oppo_jax.scoring.carried import KeptCaches


def sampling_key(seed: int) -> jax.Array:
    """The run's one sampling key: a token's randomness depends on (seed, prompt id, sample
    index, position) only, never on the step, slot or chunk that sampled it."""
    return jax.random.key(seed)


KEY_BLOCK = 64  # update keys derived per compiled call: one dispatch serves 64 steps


def update_key(seed: int, step: int) -> jax.Array:
    """The key of step ``step``'s update (its minibatch shuffles): ``fold_in(key(seed + 1),
    step)``. ``HostState.plan`` takes it from ``update_keys``' blocks instead."""
    return update_keys(seed, step)[0]


def update_keys(seed: int, first: int) -> tuple[jax.Array, ...]:
    """``update_key(seed, s)`` for ``s = first .. first + KEY_BLOCK - 1``, from one compiled
    call: a dispatch right after a step costs the loop's thread ~0.2 ms of cold-cache CPU, a
    tenth of the host's budget between two steps, so it is paid once per block."""
    return _update_keys(np.int32(seed + 1), np.int32(first))


@jax.jit
def _update_keys(seed, first):
    base = jax.random.key(seed)
    keys = jax.vmap(lambda s: jax.random.fold_in(base, s))(first + jnp.arange(KEY_BLOCK))
    return tuple(keys[i] for i in range(KEY_BLOCK))  # separate arrays: no slicing per step


def refill_rollout(cfg: Config) -> Rollout | None:
    """A refilling run's rollout before its first step (None: refill off; the carrying
    schedules refill, the others ignore the setting): B + Δ·G rows, the pool's rule from the
    config."""
    r, p = cfg.rollout, cfg.pipeline
    if not r.refill_every:
        return None
    g = r.group_size
    rule = RefillRule(
        rows=r.batch_size + p.overcommit * g,
        every=r.refill_every,
        batch_groups=r.batch_size // g,
        group_size=g,
        max_staleness=r.max_staleness,
        on_stale=r.on_stale,
    )
    return Rollout(None, Pool(rule))


def _read(result: StepResult, key: str) -> float:
    """One of the step's metrics on the host (``np.asarray``: a quarter of ``device_get``'s
    cost on a cold cache, right after the step)."""
    return float(np.asarray(result.metrics[key]))


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
    refill: Rollout | None = None  # a refilling run's rows and their groups (rollout.refill_every)
    # (seed, first step, keys): the block of update keys the next steps take theirs from
    _keys: tuple = dataclasses.field(default=(None, 0, ()), repr=False)

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
            refill=refill_rollout(cfg) if schedule.carry else None,
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
            update_key=self._update_key(cfg.seed),
            group_size=g,
        )

    def _update_key(self, seed: int) -> jax.Array:
        """This step's ``update_key``, from the block holding it (a new block past its end)."""
        block_seed, first, keys = self._keys
        if block_seed != seed or not first <= self.step < first + len(keys):
            first, keys = self.step, update_keys(seed, self.step)
            self._keys = seed, first, keys
        return keys[self.step - first]

    def observe(self, plan: StepPlan, result: StepResult) -> dict:
        """Feed a finished step to the controllers and count skipped updates. Reads only the
        metrics they need (the record reads the rest, off the loop's thread: ``RunLog``);
        returns the keys this adds to the step's record, ``update_skipped`` and
        ``nonfinite_total``."""
        skipped = bool(_read(result, "nonfinite_batch") or _read(result, "nonfinite_update"))
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped else 0
        self.nonfinite_total += skipped
        if not skipped:  # a NaN reward or KL would poison the controllers for good
            self.kl_ctl = self.kl_ctl.update(_read(result, "kl"), plan.batch_size)
            self.deltas.observe(_read(result, "reward"))
        self.chunks.observe(plan.step, plan.chunk_size, result.wall_s)
        self.step = plan.step + 1
        return {"update_skipped": skipped, "nonfinite_total": self.nonfinite_total}

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
            **({"refill": self.refill.pool.state()} if self.refill is not None else {}),
        }

    def arrays(self) -> dict | None:
        """The arrays a checkpoint keeps beside ``to_json``: the frozen scorers' kept caches
        of the carried rows (``scoring.carried``), or None."""
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
        if self.refill is not None:  # the rows are rebuilt from it (replayed) at the next step
            self.refill = Rollout(None, Pool.from_state(self.refill.pool.rule, data["refill"]))
