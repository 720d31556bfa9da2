"""Bytes per device of a run: its state from shapes and shardings, its kernels from XLA's own
memory analysis. Nothing is allocated.

Every array is a ``jax.ShapeDtypeStruct`` carrying the sharding the run gives it. Each kernel
(the PPO update, the actor's admission prefill, a decode chunk, a scorer's chunk) is
jitted as the run jits it (same donation), lowered with those inputs and compiled for fake CPU
devices (or, ``Lowering.target``, for a deviceless TPU v5p topology), one per mesh device;
``compiled.memory_analysis()`` then gives one device's argument, output, aliased (donated) and
temporary bytes.

XLA:CPU computes bfloat16 arithmetic in float32, so kernel temporaries of a bf16 model are
upper bounds there (arguments and state keep their dtypes; ``memory.target``). A kernel's
"with resident" adds its temporaries and new outputs (output − aliased) to everything a step
keeps resident: trained and frozen parameters, optimizer state, the KV caches of the actor
and of each scorer the run has (``ReportModels.roles``: a critic-free run has no critic
anywhere, β = 0 no reference, reward functions no reward model) and the PPO batch; "with
live" adds them to what the step holds while that kernel runs (``live_during``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from oppo_jax.config import OptimConfig, PPOConfig
from oppo_jax.models.kv_cache import init_cache
from oppo_jax.models.model_config import ModelConfig
from oppo_jax.parallel import offload
from oppo_jax.parallel.sharding import (
    abstract_params,
    padded_slot_count,
    param_shardings,
    replicated,
    slot_shardings,
)
from oppo_jax.pipeline.program_walk import shape_checks_off
from oppo_jax.pipeline.refill_loop import STORES_HELD
from oppo_jax.ppo.optimizer import make_optimizer
from oppo_jax.ppo.packed_update import make_update
from oppo_jax.ppo.packing import padding_indices
from oppo_jax.ppo.update import UpdateSpec, train_state_shardings
from oppo_jax.rollout.admission import Admission, prompt_prefill
from oppo_jax.rollout.decode import ChunkTokens, CutRule, admit_decode, decode_chunk
from oppo_jax.rollout.sampling import SamplingConfig
from oppo_jax.rollout.spec import RolloutSpec
from oppo_jax.run.trained_params import abstract_train_state
from oppo_jax.scoring.carried import REPLAY_CHUNK, replay_chunk
from oppo_jax.scoring.stream import ROLES, ScorerSpec, score_chunk, scorer_admit
from oppo_tools.memory.abstract import (
    PROMPT_STORES,
    KernelMemory,
    abstract_model_params,
    abstract_ppo_batch,
    abstract_prompt_store,
    abstract_tree,
    bytes_by_memory,
    describe_model,
    live_during,
    model_config,
    on_slots,
    per_device_bytes,
    sds,
    shaped,
    update_shape,
    warmup_peak,
)
from oppo_tools.memory.target import target_meshes, target_note

KERNELS = ("update", "admission", "replay", "decode_chunk", "score_chunk")


@dataclasses.dataclass(frozen=True)
class RunShapes:
    """The shapes a run compiles its kernels for."""

    batch_size: int  # B, sequences per PPO update
    prompt_len: int  # P, prompt width, tokens
    response_len: int  # R, response capacity, tokens
    slots: int  # S, rollout slots (B + Δ_max·G), before padding to a multiple of data x fsdp
    chunk_size: int  # C, decode steps per chunk (and the scorer chunk's width), tokens
    replay_rows: int = 0  # leading slots of the widest replay of carried prefixes (0: none)
    refill_store_rows: int = 0  # a refilling run's rows of each prompt store (0: no refill)


@dataclasses.dataclass(frozen=True)
class _Run:
    """The models, shapes and meshes one report lowers kernels for."""

    spec: UpdateSpec  # actor and critic (None: critic-free) as the update runs them, optimizers
    master: str  # dtype of the trained parameters and their moments (optim.master_dtype)
    policy: ModelConfig  # the actor's architecture as the rollout runs it; also the reference's
    reward: ModelConfig
    roles: tuple[str, ...]  # the scorers the run has (``ROLES``), in dispatch order
    shapes: RunShapes
    sampling: SamplingConfig
    mesh: jax.sharding.Mesh  # generation and training
    scoring_mesh: jax.sharding.Mesh  # reference and reward (and the critic's scoring copy)

    @functools.cached_property
    def slots(self) -> int:
        return padded_slot_count(self.shapes.slots, self.mesh)

    def at_depth(self, layers: int) -> _Run:
        """The same run with every model cut to ``layers`` layers."""
        cut = lambda m: m and m.replace(num_layers=layers)  # noqa: E731
        spec = dataclasses.replace(
            self.spec, actor=cut(self.spec.actor), critic=cut(self.spec.critic)
        )
        return dataclasses.replace(
            self, spec=spec, policy=cut(self.policy), reward=cut(self.reward)
        )

    def admission(self, mesh) -> Admission:
        """Abstract admission of every slot, with room for a carried prefix of R tokens."""
        s, r, n = self.shapes, self.shapes.response_len, self.slots
        i32, flag = ((n,), jnp.int32), ((n,), jnp.bool_)
        admission = shaped(
            Admission,
            ((n, s.prompt_len + r), jnp.int32),
            i32,
            i32,
            flag,
            ((n, r), jnp.float32),
            i32,
            i32,
            flag,
            flag,
        )
        return on_slots(admission, mesh)

    @functools.cached_property
    def packed_update_shape(self):
        """((Rp, W, N), K) of the packed update (``PackedUpdate.shape``)."""
        s = self.shapes
        full = s.prompt_len + s.response_len
        return make_update(self.spec, self.mesh).shape(s.batch_size, full, s.response_len)

    def update(self):
        """(the update as the run jits it, at ``packed_update_shape``; its abstract
        arguments)."""
        state_sh = train_state_shardings(self.spec, self.mesh)
        s, repl = self.shapes, replicated(self.mesh)
        batch = abstract_ppo_batch(s.batch_size, s.prompt_len, s.response_len, self.mesh)
        state = abstract_tree(abstract_train_state(self.spec, self.master), state_sh)
        kl_coef = sds((), jnp.float32, repl)
        packed, (shape, count) = make_update(self.spec, self.mesh), self.packed_update_shape
        ppo = self.spec.ppo
        outer = (ppo.ppo_epochs, ppo.num_minibatches, count)
        indices = padding_indices(outer, shape, s.batch_size // ppo.num_minibatches)
        indices = jax.tree.map(lambda x: sds(x.shape, x.dtype, repl), indices)
        return packed, (state, batch, indices, kl_coef)

    def admit(self):
        """(the actor's admission: its prompt prefill and the decode state started from it;
        its abstract arguments)."""
        s, actor = self.shapes, self.policy
        rollout = RolloutSpec(
            self.sampling, s.prompt_len, s.response_len, (1,), 0, self.mesh, self.scoring_mesh
        )

        def admit(params, admission, key):
            shape, r = (s.prompt_len, s.response_len), s.response_len
            cache, hidden = prompt_prefill(actor, params, admission, shape, self.mesh)
            logprobs = jnp.zeros((admission.num_slots, r), jnp.float32)
            return admit_decode(actor, params, admission, key, rollout, (cache, hidden, logprobs))

        key = sds((), jax.random.key(0).dtype, replicated(self.mesh))
        params = abstract_model_params(actor, self.mesh)
        return jax.jit(admit), (params, self.admission(self.mesh), key)

    def replay(self):
        """(the actor's widest replay chunk of carried prefixes, donating its state: the
        ``replay_rows`` leading slots reading the whole P + R cache; its abstract arguments)."""
        s, mesh, n = self.shapes, self.mesh, self.slots
        spec = ScorerSpec(self.policy, "logprob", s.response_len, self.sampling.temperature, mesh)
        params = abstract_model_params(self.policy, mesh)
        admit = functools.partial(scorer_admit, spec, prompt_width=s.prompt_len)
        state = on_slots(jax.eval_shape(admit, params, self.admission(mesh)), mesh)
        rows, repl = max(min(s.replay_rows, n), 1), replicated(mesh)
        tokens = sds((rows, REPLAY_CHUNK), jnp.int32, repl)
        count = sds((rows,), jnp.int32, repl)
        fn = functools.partial(replay_chunk, spec, kv_width=s.prompt_len + s.response_len)
        return jax.jit(fn, donate_argnums=(1,)), (params, state, tokens, count)

    def decode_chunk(self):
        """(one decode chunk, donating its state, and its abstract arguments)."""
        admit, args = self.admit()
        state = on_slots(jax.eval_shape(admit, *args), self.mesh)
        flag = ((self.slots,), jnp.bool_)
        rule = on_slots(shaped(CutRule, flag, flag, ((), jnp.int32)), self.mesh)
        fn = functools.partial(
            decode_chunk, self.policy, self.sampling, self.shapes.chunk_size, mesh=self.mesh
        )
        return jax.jit(fn, donate_argnums=(1,)), (args[0], state, rule)

    def score_chunk(self):
        """(one chunk of the run's first scorer (the reference, else the critic, else the
        reward model), donating its state, and its abstract arguments)."""
        s, mesh, n = self.shapes, self.scoring_mesh, self.slots
        model, kind = {
            "reference": (self.policy, "logprob"),
            "critic": (self.spec.critic, "value"),
            "reward": (self.reward, "score"),
        }[self.roles[0]]
        spec = ScorerSpec(model, kind, s.response_len, self.sampling.temperature, mesh)
        params = abstract_model_params(model, mesh)
        admit = functools.partial(scorer_admit, spec, prompt_width=s.prompt_len)
        state = on_slots(jax.eval_shape(admit, params, self.admission(mesh)), mesh)
        count = ((n,), jnp.int32)
        chunk = shaped(ChunkTokens, ((n, s.chunk_size), jnp.int32), count, count, ((), jnp.bool_))
        fn = jax.jit(functools.partial(score_chunk, spec), donate_argnums=(1,))
        return fn, (params, state, on_slots(chunk, mesh))

    def kernel(self, name: str) -> KernelMemory:
        """Lower and compile one of ``KERNELS``; its memory per device."""
        with shape_checks_off():
            fn, args = getattr(self, "admit" if name == "admission" else name)()
            lowered = fn.lower(*args)
        return KernelMemory.of(lowered.compile())

    def resident(self) -> dict:
        """Bytes per device of everything a step keeps resident."""
        spec, mesh, scoring, s = self.spec, self.mesh, self.scoring_mesh, self.shapes
        state = abstract_train_state(spec, self.master)
        state_sh = train_state_shardings(spec, mesh)

        def params(cfg, on):
            return per_device_bytes(abstract_params(cfg), param_shardings(cfg, on))

        def cache(cfg, on):
            width = s.prompt_len + s.response_len
            abstract = jax.eval_shape(lambda: init_cache(cfg, self.slots, width))
            return per_device_bytes(abstract, slot_shardings(abstract, on))

        stores = {}
        if s.refill_store_rows:  # every store alike (``pipeline.refill_loop.STORES_HELD``)
            rows = padded_slot_count(s.refill_store_rows, mesh)
            store = abstract_prompt_store(self.policy, rows, s.prompt_len + s.response_len)
            one = per_device_bytes(store, slot_shardings(store, mesh))
            stores = {PROMPT_STORES: STORES_HELD * one}

        batch = abstract_ppo_batch(s.batch_size, s.prompt_len, s.response_len, mesh)
        opt, opt_host = bytes_by_memory(
            (state.actor_opt, state.critic_opt), (state_sh.actor_opt, state_sh.critic_opt)
        )
        # LoRA's frozen bases are the reference and the reward model themselves (one copy each)
        # when colocated; disaggregated, the training devices hold their own copy. The LoRA
        # actor's base is resident with or without a reference (β = 0), the LoRA critic's
        # base with or without a reward model.
        frozen = 0
        if state.frozen is not None and scoring is not mesh:
            frozen = per_device_bytes(state.frozen, state_sh.frozen)
        base = lambda cfg: cfg.replace(lora_rank=0)  # noqa: E731
        lora, roles = bool(self.policy.lora_rank), self.roles
        critic = spec.critic is not None
        has = {"reference": "reference" in roles or lora,
               "reward": "reward" in roles or (lora and critic)}  # fmt: skip
        scorers = {"critic": spec.critic, "reference": self.policy, "reward": self.reward}
        return {
            "actor_params": per_device_bytes(state.actor_params, state_sh.actor_params),
            "critic_params": per_device_bytes(state.critic_params, state_sh.critic_params),
            "frozen_params": frozen,
            "optimizer": opt,
            "reference_params": params(base(self.policy), scoring) if has["reference"] else 0,
            "reward_params": params(base(self.reward), scoring) if has["reward"] else 0,
            "kv_caches": {
                "actor": cache(self.policy, mesh),
                **stores,
                **{r: cache(m, scoring) for r, m in scorers.items() if r in roles},
            },
            "ppo_batch": per_device_bytes(batch, [x.sharding for x in jax.tree.leaves(batch)]),
            "host": {"optimizer": opt_host},  # pinned host memory (optim.offload), not device
        }


@dataclasses.dataclass(frozen=True)
class ReportModels:
    """The architectures of a run (ModelConfigs or preset names)."""

    actor: ModelConfig | str  # the actor's (and the reference's)
    critic: ModelConfig | str | None = None  # default: the actor's with a score head
    reward: ModelConfig | str | None = None  # default: the critic's
    # the scorers the run has (``compile_plan.scorer_roles``): no "critic" is a critic-free
    # run (no critic parameters, moments, cache or update), no "reference" β = 0, no "reward"
    # reward functions only
    roles: tuple[str, ...] = ROLES


@dataclasses.dataclass(frozen=True)
class ReportSettings:
    """Where and how a run runs: meshes and the update's and rollout's settings."""

    mesh: tuple[int, int, int] = (1, 1, 1)  # (data, fsdp, tensor) of generation and training
    scoring_mesh: tuple[int, int, int] | None = None  # disaggregated scorers; None: colocated
    ppo: PPOConfig | None = None  # defaults when None
    optim: OptimConfig | None = None
    sampling: SamplingConfig | None = None


@dataclasses.dataclass(frozen=True)
class Lowering:
    """Which kernels to compile, and how."""

    kernels: Sequence[str] = KERNELS  # which of ``KERNELS``
    # lower at this depth and one more and extrapolate linearly to the models' depth (faster);
    # None: full depth. State bytes are exact either way.
    layers: int | None = None
    remat: str | None = None  # the update's per-layer remat (none | full | dots); None: as is
    target: str = "cpu"  # the compiler: "cpu" (fake devices) or "tpu-v5p" (memory.target)


def memory_report(
    models: ReportModels,
    shapes: RunShapes,
    settings: ReportSettings = ReportSettings(),  # noqa: B008 (frozen, so a safe default)
    lowering: Lowering = Lowering(),  # noqa: B008
) -> dict:
    """Bytes per device of a PPO run's resident state and of its compiled kernels.

    Args:
        models: actor, critic and reward architectures (see ``ReportModels``).
        shapes: the run's B, P, R, slots, chunk size and carried admission rows.
        settings: meshes and the update's and rollout's settings (``ReportSettings``).
        lowering: which kernels to compile, at which depth, with which remat (``Lowering``).

    Returns:
        A JSON-ready dict: ``bytes`` (parameters, AdamW moments, KV caches, batch),
        ``resident`` (their sum) and ``kernels``: per kernel its memory analysis, ``peak``,
        ``with_resident`` (everything resident on top, the admission's output cache being the
        resident actor cache: an upper bound), ``live`` (what the step holds while it runs,
        ``live_during``) and ``with_live``; ``warmup``: its peak (``warmup_peak``).
    """
    actor = model_config(models.actor, "lm")
    critic = models.critic and model_config(models.critic, "score")
    critic = critic or actor.replace(head="score")
    plain_critic = critic.replace(lora_rank=0)  # the reward model carries no adapter
    reward = plain_critic if models.reward is None else model_config(models.reward, "score")
    remat, layers, roles = lowering.remat, lowering.layers, tuple(models.roles)
    critic = critic if "critic" in roles else None  # critic-free: none anywhere
    trained = [m and (m if remat is None else m.replace(remat=remat)) for m in (actor, critic)]
    ppo, optim = settings.ppo or PPOConfig(), settings.optim or OptimConfig()
    sampling = settings.sampling or SamplingConfig()
    mesh, scoring_mesh = settings.mesh, settings.scoring_mesh
    txs = [make_optimizer(optim, lr, 1000) for lr in (optim.actor_lr, optim.critic_lr)]
    txs = [offload.offloaded(tx) if optim.offload else tx for tx in txs]
    txs[1] = txs[1] if critic else None
    spec = UpdateSpec(*trained, ppo, sampling.temperature, *txs)
    meshes = target_meshes(mesh, scoring_mesh, lowering.target)
    run = _Run(spec, optim.master_dtype, actor, reward, roles, shapes, sampling, *meshes)
    state = run.resident()
    device = {k: v for k, v in state.items() if k != "host"}
    resident = sum(v if isinstance(v, int) else sum(v.values()) for v in device.values())
    depth = actor.num_layers
    cut = layers is not None and layers < depth
    note = target_note(lowering.target) + (
        f"; kernels lowered at {layers} and {layers + 1} layers, extrapolated linearly to {depth}"
        " (an estimate: XLA's buffer packing is not linear in depth)"
        if cut
        else ""
    )
    report = {
        "mesh": "x".join(map(str, mesh)),
        "scoring_mesh": "x".join(map(str, scoring_mesh or mesh)),
        "roles": list(roles),
        "models": {
            n: describe_model(m)
            for n, m in zip(("actor", "critic", "reward"), (*trained, reward), strict=True)
            if m is not None and (n != "reward" or "reward" in roles)
        },
        "shapes": dataclasses.asdict(shapes)
        | {"slots_padded": run.slots, **update_shape(run.packed_update_shape)},
        "note": note,
        "bytes": state,
        "resident": resident,
        "kernels": {},
    }
    kept_fraction = (shapes.slots - shapes.batch_size) / run.slots  # Δ_max·G of the slots
    for name in (k for k in lowering.kernels if roles or k != "score_chunk"):
        if cut:
            shallow = run.at_depth(layers).kernel(name)
            mem = shallow.extrapolate(run.at_depth(layers + 1).kernel(name), depth - layers)
        else:
            mem = run.kernel(name)
        live = live_during(name, resident, state["kv_caches"], kept_fraction)
        # The admission's output cache is the actor's resident one: counted once.
        own = state["kv_caches"]["actor"] if name == "admission" else 0
        report["kernels"][name] = dataclasses.asdict(mem) | {
            "peak": mem.peak,
            "with_resident": resident + mem.temp + mem.output - mem.alias - own,
            "live": live,
            "with_live": live + mem.temp + mem.output - mem.alias,
        }
    report["warmup"] = warmup_peak(state, report["kernels"])
    return report
