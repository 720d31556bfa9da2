"""The run configuration's schema: frozen typed dataclasses, one per section.

Every field has a comment saying what it means and its unit, trailing or in the lines just
above it (read as one text); ``config.docs`` turns them into the key reference. Defaults
follow TRL's PPO trainer where TRL has the knob. YAML files hold values only
(``config.load``); ``config.validate`` checks them. No jax here.
"""

from dataclasses import dataclass, field
from typing import Any

# Keys promised to users (DESIGN §7): documented and kept across versions.
STABLE_KEYS = (
    "seed", "train.steps", "rollout.batch_size", "pipeline.mode", "pipeline.chunk_size",
    "pipeline.overcommit", "pipeline.adaptive_overcommit", "pipeline.placement",
)  # fmt: skip

# Every projection a LoRA adapter can sit on (model.lora_targets).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class ModelConfig:
    """Where the actor, reference, critic and reward model start from, and their numerics."""

    # actor and reference weights: local HF directory | demo | demo_arith (the addition task's
    # SFT actor, built on first use) | demo_word_problems (the word problems' SFT actor, the
    # same) | random (model.preset, eos 1, pad 0)
    actor_path: str = "demo"
    # reward-model weights: a local Hugging Face directory | demo | random (as model.actor_path)
    reward_path: str = "demo"
    critic_init: str = "reward"  # checkpoint the critic's backbone starts from: reward | actor
    # built-in architecture (tiny, small, qwen2.5-0.5b/1.5b/3b/7b/32b, qwen2.5-math-7b) of random
    # models and shape checks
    preset: str | None = None
    dtype: str = "float32"  # activation dtype: float32 | bfloat16
    param_dtype: str = "float32"  # parameter dtype: float32 | bfloat16
    trust_remote_code: bool = False  # let transformers run code shipped inside a checkpoint
    # recompute each layer in the update's backward: none | full | dots (keep matmul outputs)
    remat: str = "none"
    # attention kernel of every model: auto (cuDNN on GPU and the ragged kernel for decode
    # steps, splash on TPU, else XLA) | xla | cudnn | splash | ragged (decode steps only; off a
    # GPU in Pallas's interpreter); a call a kernel cannot take runs on XLA (models.attention)
    attention: str = "auto"
    # LoRA rank of the actor's and critic's adapters on frozen bases; 0 = full-parameter training
    lora_rank: int = 0
    lora_alpha: float = 16.0  # adapters scale by lora_alpha / lora_rank
    # projections that carry an adapter (q/k/v/o_proj, gate/up/down_proj)
    lora_targets: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    # with LoRA, also train the actor's untied LM head in full (PEFT's modules_to_save), as the
    # critic's value head is: on the demo, adapters alone hardly raise gold (BENCHMARKS.md,
    # "LoRA on the demo"); a tied head is the embedding table and stays frozen
    lora_train_head: bool = True


@dataclass(frozen=True)
class RolloutConfig:
    """What the actor generates each step."""

    batch_size: int = 16  # B, completed sequences per update (a multiple of group_size)
    # G, responses sampled per prompt (distinct sampling keys); a group is admitted, cut and
    # carried whole. G > 1 with a group estimator (ppo.advantage) is the GRPO family
    group_size: int = 1
    max_prompt_len: int = 16  # longest prompt, tokens
    max_response_len: int = 64  # longest response, tokens (a response without EOS ends here)
    temperature: float = 0.7  # sampling temperature; log-probs use logits / temperature too
    top_k: int = 0  # sample only among the k most likely tokens; 0 = off
    top_p: float = 1.0  # nucleus sampling: smallest token set with this probability mass
    greedy: bool = False  # take the most likely token instead of sampling
    prompt_too_long: str = "truncate"  # prompts over max_prompt_len: truncate | reject (error)
    # who ends a response: policy (its EOS) | lognormal (benchmarks: EOS forced at a drawn length)
    length_sampler: str = "policy"
    length_median: float = 32.0  # lognormal: median response length, tokens
    length_p99: float = 256.0  # lognormal: 99th-percentile length, tokens (capped at the max)
    # bound on a trained token's age, policy versions (steps between sampling it and training on
    # it): a group carried this many times is at the bound (a carry is one step)
    max_staleness: int = 2
    # a group at max_staleness: finish (its step's rollout waits until it completes, and it is
    # trained first) | drop (if the cut leaves it out it is dropped, never trained, its prompt
    # counted in the step's `dropped`)
    on_stale: str = "finish"
    # continuous refill (the carrying schedules, inter | oppo): every this many decode positions
    # (a multiple of pipeline.chunk_size) the rows whose sequence ended take samples of new
    # prompts' groups, and the groups in flight at the cut decode on into the next step in
    # their rows; the B + Δ·G rows stay busy. 0 = off (rows of ended sequences idle until the
    # cut, and the groups left at the cut are carried and re-admitted)
    refill_every: int = 0
    # refill: the rows in flight when the weights change: replay (their prompt and response so
    # far re-prefilled under the new weights: exact, and a resume equals the run) | keep (their
    # stale keys and values kept: no replay cost; a resume replays them once)
    carry_kv: str = "replay"


@dataclass(frozen=True)
class PPOConfig:
    """Rewards, advantages and the clipped policy-gradient losses (TRL's numerics)."""

    # estimator of the advantages: gae (PPO: a critic, the KL in the reward) | grpo | rloo |
    # reinforce_pp (critic-free, from each group's G scores: GRPO's (r - group mean) / scale,
    # RLOO's leave-one-out baseline, REINFORCE++'s r - group mean whitened over the batch)
    advantage: str = "gae"
    # grpo: the scale dividing r - group mean: group (its std) | batch (the batch's std) |
    # none (Dr. GRPO)
    scale_rewards: str = "group"

    kl_coef: float = 0.05  # β, weight of the per-token KL penalty (initial β if adaptive_kl)
    kl_estimator: str = "k1"  # per-token KL estimate of log π/π_ref: k1 | k2 | k3
    kl_in_reward: bool = True  # penalise KL in the per-token reward; False: add it to the loss
    adaptive_kl: bool = False  # steer β toward target_kl (Ziegler et al. controller)
    target_kl: float = 6.0  # KL the adaptive controller aims for, nats per sequence
    kl_horizon: int = 10000  # horizon of the adaptive KL controller, sequences
    cliprange: float = 0.2  # ε (ε_low), clip range of the policy ratio below 1
    cliprange_high: float | None = None  # ε_high above 1 (DAPO's clip-higher); None = ε
    cliprange_value: float = 0.2  # ε_v, clip range of values around the old values, reward units
    vf_coef: float = 0.1  # weight of the value loss in the total loss
    entropy_coef: float = 0.0  # weight of the entropy bonus (0 = off)
    gamma: float = 1.0  # discount per token
    lam: float = 0.95  # λ of generalised advantage estimation
    ppo_epochs: int = 4  # passes over each batch of B sequences
    num_minibatches: int = 1  # optimizer updates per epoch
    grad_accum_steps: int = 1  # microbatches whose gradients are summed per update
    whiten_rewards: bool = False  # whiten per-token rewards over valid tokens before GAE
    # subtracted from the score of responses without EOS, reward units; None = off (TRL)
    missing_eos_penalty: float | None = None
    # loss average: token_mean (all valid tokens of a microbatch: TRL's bnpo) | seq_mean (each
    # sequence's token mean, averaged: TRL's grpo) | dr_grpo (token sum / (sequences x
    # max_response_len)) | dapo (token sum / the minibatch's valid tokens)
    loss_agg: str = "token_mean"
    # the policy ratio: token (one per token, PPO's) | sequence (GSPO: exp of the mean log-ratio
    # over the sequence's tokens, on each of them; TRL's importance_sampling_level sequence) |
    # sequence_sum (TRL RLOOTrainer's loss: exp of the summed log-ratio, with loss_agg seq_mean);
    # the sequence levels need a critic-free advantage (docs/GRPO.md)
    importance_sampling_level: str = "token"
    # correction of tokens sampled by an older policy (carried sequences) by the ratio
    # ρ = π_old / π_behaviour: none | tis (each token's loss times min(ρ_t, importance_clip):
    # token-level truncated IS, decoupled PPO) | mis (a sequence whose geometric-mean ratio
    # exp(mean_t log ρ_t) leaves [mis_lower, mis_upper] is masked out of the loss: verl's
    # geometric rejection); docs/NUMERICS.md maps them to verl's and TRL's names
    off_policy_correction: str = "none"
    importance_clip: float = 2.0  # tis: upper truncation of the token weight min(ρ_t, clip)
    mis_lower: float = 0.5  # mis: a sequence whose ratio is below this is masked (verl: 1/upper)
    mis_upper: float = 2.0  # mis: a sequence whose ratio is above this is masked
    pack_granule: int = 16  # the packed update's row width is P + R rounded up to this, tokens
    # the packed update's rows are this many times P + R wide: 2 lets any two sequences share a
    # row (long fixed prompts pack badly in one P + R) at twice a row's attention; the chunks
    # hold no more tokens than a padded microbatch whatever the width
    pack_width_factor: int = 1

    @property
    def uses_reference(self) -> bool:
        """A KL term (in the reward or the loss) reads the reference; with β = 0 it is never
        loaded or run."""
        return self.kl_coef > 0 or self.adaptive_kl

    @property
    def old_is_first_forward(self) -> bool:
        """One epoch of one minibatch: the update's forward of every token runs at the step's own
        parameters, so π_old of its ratio is that forward, detached (TRL's GRPO with
        num_iterations 1 and generation aligned to the optimizer step: ``per_token_logps.detach()``,
        no separate old-log-prob pass)."""
        return self.ppo_epochs == 1 and self.num_minibatches == 1

    @property
    def reads_old_logprobs(self) -> bool:
        """Something reads the batch's π_old log-probs: the update's ratio and the off-policy
        correction (weights and metrics) unless ``old_is_first_forward`` (then the update's
        forward is π_old for both), or a KL term (in the reward, and the rollout's KL
        statistic). Where nothing does, a refilling step skips the actor's pass over tokens
        sampled under earlier weights (``refill_step.old_logprobs``)."""
        return not self.old_is_first_forward or self.uses_reference


@dataclass(frozen=True)
class OptimConfig:
    """AdamW for the actor and the critic."""

    actor_lr: float = 1e-6  # peak learning rate of the actor, per optimizer update
    critic_lr: float = 1e-5  # peak learning rate of the critic, per optimizer update
    # with LoRA (model.lora_rank > 0), both rates times this: adapters start at zero and need
    # larger steps than full weights (PEFT/TRL recipes: 3-10x). On the demo 1x barely moves the
    # policy (KL 0.01-0.03 in 40 steps), 3x does (0.1-0.5) (BENCHMARKS.md, "LoRA on the demo")
    lora_lr_scale: float = 3.0
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay, per update
    max_grad_norm: float = 1.0  # clip each model's global gradient norm to this
    warmup_steps: int = 0  # linear learning-rate warm-up, optimizer updates
    schedule: str = "constant"  # learning rate after warm-up: constant | cosine | linear decay
    adam_b1: float = 0.9  # Adam β1, decay of the first moment
    adam_b2: float = 0.999  # Adam β2, decay of the second moment
    adam_eps: float = 1e-8  # Adam ε, added to the root of the second moment
    # dtype of trained weights (master copy) and their AdamW moments: float32 | bfloat16
    master_dtype: str = "float32"
    # keep the AdamW moments in host memory (pinned_host), streamed in for each update
    offload: bool = False


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh of actor generation and training; scorers may sit on devices outside it."""

    data: int = 1  # data-parallel axis, devices (batch sharded, parameters replicated)
    fsdp: int = 1  # fully-sharded axis, devices (batch and parameters sharded)
    tensor: int = 1  # tensor-parallel axis, devices (heads and hidden units sharded)
    scoring_devices: int = 0  # extra devices for the scorers when placement is disaggregated
    multihost: bool = False  # call jax.distributed.initialize() (GPU clusters, TPU pods)
    # what `oppo-jax compile-plan` and `memory` compile for (oppo_jax.parallel.targets: host,
    # tpu-v5p[:2x2x1], gh200[:1x4x1], h100[:1x4x8]...); None: the hardware the config's file
    # name names, else this host
    target: str | None = None


@dataclass(frozen=True)
class PipelineConfig:
    """The scheduler: sync baseline or OPPO's intra- and inter-step overlap."""

    # schedule: sync (score after generation) | intra (streamed) | inter (B + Δ, carry) | oppo
    mode: str = "oppo"
    chunk_size: int = 16  # C, tokens decoded per streamed chunk
    # chunk sizes the online tuner tries, tokens
    chunk_candidates: list[int] = field(default_factory=lambda: [8, 16, 32])
    chunk_tuning: bool = False  # tune chunk_size online by measured step time
    chunk_tuning_every: int = 50  # steps between two tuning rounds
    # Δ, extra prompts (groups of rollout.group_size) started per step (start value if
    # adaptive); 0 = off
    overcommit: int = 0
    adaptive_overcommit: bool = False  # raise Δ while mean reward rises, else lower it
    overcommit_min: int = 0  # Δ_min, lower clamp of adaptive Δ, prompts
    overcommit_max: int = 8  # Δ_max, upper clamp of adaptive Δ, prompts
    overcommit_window: int = 3  # w, steps averaged in the reward trend
    # device roles: colocated (all share the mesh) | disaggregated (scorers on own devices)
    placement: str = "colocated"
    # gather the still-running decode slots into a smaller slot bucket once they fit in half of
    # it (one more compiled bucket each), where the decode's attention reads every slot's keys
    # and no mesh splits the slots; null: on for the CPU (the ragged decode of GPU/TPU already
    # skips finished slots, so nothing compacts there)
    compact_slots: bool | None = None
    # smallest bucket compaction moves into, slots (a power of two); a smaller one saves a
    # little decode in a long tail but compiles its own decode programs (BENCHMARKS.md, "Slot
    # compaction's smallest bucket")
    compact_min_slots: int = 4


@dataclass(frozen=True)
class TrainConfig:
    """Length of the run, checkpoints and logging."""

    steps: int = 100  # PPO steps, each one update on B sequences
    checkpoint_every: int = 25  # steps between checkpoints; 0 = none
    max_to_keep: int = 3  # checkpoints kept on disk
    log_every: int = 1  # steps between metric records
    sft_steps: int = 3000  # optimizer updates of `oppo-jax sft` (supervised actor)
    rm_steps: int = 500  # optimizer updates of `oppo-jax rm` (reward model)
    max_nonfinite_in_a_row: int = 3  # skipped non-finite updates in a row before the run stops


@dataclass(frozen=True)
class DataConfig:
    """Where prompts come from."""

    # JSONL/parquet file | `datasets` save_to_disk dir | Hub-cache dataset name | demo | random |
    # arith (built-in two-digit addition with answers; splits train, test) | word_problems
    # (built-in GSM8K-shaped word problems, answers '... #### n'; splits train, test)
    prompts: str = "demo"
    prompt_field: str = "prompt"  # field of each record that holds the prompt text
    split: str | None = None  # split of a saved DatasetDict or Hub dataset (None: its only one)
    messages_field: str | None = None  # field holding chat messages (needs data.chat_template)
    # render prompts with the actor tokenizer's chat template, adding the generation prompt
    chat_template: bool = False
    system_prompt: str | None = None  # system message put before each prompt (needs chat_template)
    # field holding the reference answer (GSM8K's 'answer' ending in '#### n', MATH's 'solution'
    # with \boxed{}, or a bare answer): extracted once at load and handed to reward functions
    # as the record's 'reference' (oppo_jax.rewards.math:verify reads it)
    answer_field: str | None = None
    # data.prompts=random: [shortest, longest] prompt, tokens (uniform, inclusive)
    random_prompt_len: list[int] = field(default_factory=lambda: [4, 16])


@dataclass(frozen=True)
class RewardConfig:
    """The score of a response: model_weight x reward model + sum of weights x functions."""

    model_weight: float = 1.0  # weight of the reward model's score; 0 = no reward model loaded
    # Python reward functions, "package.module:function" (prompt, response, record) -> float
    functions: list[str] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)  # one per function; empty = all 1.0
    # keyword arguments of each function, one mapping per function (empty = none), e.g.
    # [{extract: gsm8k}] for oppo_jax.rewards.math:verify
    kwargs: list[dict[str, Any]] = field(default_factory=list)
    nonfinite: str = "error"  # a function's NaN/Inf: error (names it) | skip (the step's guard)
    workers: int = 4  # host threads that run the functions while the actor decodes


@dataclass(frozen=True)
class EvalConfig:
    """Held-out evaluation: decode without training, at step 0, every N steps and at the end."""

    prompts: str | None = None  # held-out source (as data.prompts); None: data.prompts + eval.split
    split: str | None = None  # split of the held-out prompts (e.g. test); None with eval.prompts
    every: int = 0  # steps between evaluations besides step 0 and the end; 0 = those two only
    num_prompts: int = 64  # held-out prompts per evaluation (the first ones of the source)
    greedy: bool = True  # decode greedily; False: sample at rollout.temperature
    samples_per_prompt: int = 1  # responses per prompt (> 1 needs eval.greedy=false)
    # k of mean@k: a second pass of k responses per prompt at rollout.temperature, scored by
    # reward.functions[0] (greedy pass@1 comes from the first pass); 0 = no second pass
    mean_at_k: int = 0


@dataclass(frozen=True)
class Config:
    """A whole run; `load_config` builds one, `validate` checks one built by hand."""

    seed: int = 0  # root of every random stream (initialisation, sampling, data order)
    model: ModelConfig = field(default_factory=ModelConfig)  # checkpoints and dtypes
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # generation
    ppo: PPOConfig = field(default_factory=PPOConfig)  # PPO objective and hyper-parameters
    optim: OptimConfig = field(default_factory=OptimConfig)  # optimizers
    mesh: MeshConfig = field(default_factory=MeshConfig)  # devices
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)  # scheduling
    train: TrainConfig = field(default_factory=TrainConfig)  # run length and checkpoints
    data: DataConfig = field(default_factory=DataConfig)  # prompts
    reward: RewardConfig = field(default_factory=RewardConfig)  # reward model and functions
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation

    def learning_rate(self, model: str) -> float:
        """The peak learning rate of ``model`` (actor, critic): ``optim.<model>_lr``, times
        ``optim.lora_lr_scale`` when the models train LoRA adapters."""
        lr = {"actor": self.optim.actor_lr, "critic": self.optim.critic_lr}[model]
        return lr * self.optim.lora_lr_scale if self.model.lora_rank else lr
