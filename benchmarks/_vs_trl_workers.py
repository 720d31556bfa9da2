"""The subprocess side of ``vs_trl.py``: one TRL or one oppo-jax run, records to a JSON file.

Run as ``python benchmarks/_vs_trl_workers.py SPEC.json OUT.json`` by ``vs_trl.py`` only. A TRL
run imports torch and trl, never JAX (whose heap would inflate TRL's ``gc.collect()``).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _worker_oppo_jax(spec: dict) -> dict:
    """One oppo-jax run through the public training entry point; its metrics.jsonl records."""
    from oppo_jax.config import load_config
    from oppo_jax.train import train

    overrides = [
        *spec["overrides"],
        f"pipeline.mode={spec['mode']}",
        "train.checkpoint_every=0",
        f"train.steps={spec['warmup'] + spec['steps']}",
    ]
    train(load_config(spec["config"], overrides), spec["work"], progress=False)
    lines = (Path(spec["work"]) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    keys = ("step_time_s", "gold", "reward", "response_len_mean", "response_len_max", "kl")
    return {k: [r[k] for r in records] for k in keys}


class _TimedGC:
    """Stands in for the ``gc`` module inside TRL's trainer: collect() timed, or skipped."""

    def __init__(self, enabled: bool):
        import gc

        self.enabled, self._gc, self.spent = enabled, gc, 0.0

    def collect(self, *args, **kwargs) -> int:
        if not self.enabled:
            return 0
        t0 = time.perf_counter()
        n = self._gc.collect(*args, **kwargs)
        self.spent += time.perf_counter() - t0
        return n


def _optimizer(policy, value, hp):
    """AdamW with oppo-jax's optimizer semantics (per-model lr, clip and warm-up)."""
    import torch

    class ClippedWarmupAdamW(torch.optim.AdamW):
        """Clips each group's gradient norm, then warms its lr up over the first updates."""

        updates = 0

        def step(self, closure=None):
            frac = min(self.updates / hp["warmup_updates"], 1.0) if hp["warmup_updates"] else 1.0
            for group in self.param_groups:
                torch.nn.utils.clip_grad_norm_(group["params"], hp["max_grad_norm"])
                group["lr"] = group["peak_lr"] * frac  # optax.linear_schedule(0, lr, warmup)
            self.updates += 1
            return super().step(closure)

    groups = [
        {"params": list(m.parameters()), "lr": lr, "peak_lr": lr}
        for m, lr in ((policy, hp["actor_lr"]), (value, hp["critic_lr"]))
    ]
    opt = ClippedWarmupAdamW(
        groups, betas=tuple(hp["betas"]), eps=hp["eps"], weight_decay=hp["weight_decay"]
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)


def _trl_config(hp: dict, steps: int, work: str):
    """TRL's PPOConfig: the matched hyper-parameters, float32 on the CPU, nothing saved."""
    from trl.experimental.ppo import PPOConfig

    return PPOConfig(
        output_dir=work,
        report_to="none",
        save_strategy="no",
        push_to_hub=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
        logging_steps=1,
        num_sample_generations=0,
        seed=hp["seed"],
        per_device_train_batch_size=hp["batch_size"],
        gradient_accumulation_steps=1,
        local_rollout_forward_batch_size=hp["batch_size"],
        total_episodes=hp["batch_size"] * steps,
        response_length=hp["response_length"],
        stop_token="eos",
        temperature=hp["temperature"],
        kl_coef=hp["kl_coef"],
        kl_estimator=hp["kl_estimator"],
        cliprange=hp["cliprange"],
        cliprange_value=hp["cliprange_value"],
        vf_coef=hp["vf_coef"],
        gamma=hp["gamma"],
        lam=hp["lam"],
        whiten_rewards=hp["whiten_rewards"],
        missing_eos_penalty=hp["missing_eos_penalty"],
        num_ppo_epochs=hp["num_ppo_epochs"],
        num_mini_batches=hp["num_mini_batches"],
        dataloader_num_workers=0,
    )


def _worker_trl(spec: dict) -> dict:
    """One TRL PPO run; step times from callbacks, responses from a generation wrapper."""
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        PreTrainedTokenizerFast,
        TrainerCallback,
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl.experimental.ppo import PPOTrainer, ppo_trainer

    torch.set_num_threads(spec["threads"])
    job, hp = spec["job"], spec["job"]["hp"]
    torch.manual_seed(hp["seed"])
    # Not AutoTokenizer: it ignores the demo's WordLevel tokenizer.json (PITFALLS.md).
    tok = PreTrainedTokenizerFast.from_pretrained(job["actor_dir"], padding_side="left")
    f32 = {"dtype": torch.float32}
    policy = AutoModelForCausalLM.from_pretrained(job["actor_dir"], **f32)
    ref = AutoModelForCausalLM.from_pretrained(job["actor_dir"], **f32)
    reward = AutoModelForSequenceClassification.from_pretrained(job["reward_dir"], **f32)
    value = AutoModelForSequenceClassification.from_pretrained(job["reward_dir"], **f32)
    policy.generation_config.pad_token_id = tok.pad_token_id
    prompts = json.loads(Path(job["prompts"]).read_text())
    dataset = Dataset.from_dict({"input_ids": prompts})

    log = {
        "step_time_s": [],
        "gen_time_s": [],
        "gc_time_s": [],
        "reward": [],
        "kl": [],
        "responses": [],
    }
    timed_gc = _TimedGC(spec["gc"])
    ppo_trainer.gc = timed_gc  # the trainer's module-level `gc` (two collect() calls per step)
    generate = ppo_trainer.batch_generation

    def capture(model, queries, *args, **kwargs):
        t0 = time.perf_counter()
        query_responses, logits = generate(model, queries, *args, **kwargs)
        log["gen_time_s"].append(time.perf_counter() - t0)
        log["responses"].append(query_responses[:, queries.shape[1] :].tolist())
        return query_responses, logits

    ppo_trainer.batch_generation = capture

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t, self.gc = time.perf_counter(), timed_gc.spent

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            log["step_time_s"].append(now - self.t)
            log["gc_time_s"].append(timed_gc.spent - self.gc)
            self.t, self.gc = now, timed_gc.spent

        def on_log(self, args, state, control, logs=None, **k):
            log["reward"].append(logs["objective/scores"])
            log["kl"].append(logs["objective/kl"])

    trainer = PPOTrainer(
        args=_trl_config(hp, spec["warmup"] + spec["steps"], spec["work"]),
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
        optimizers=_optimizer(policy, value, hp),
        callbacks=[Clock()],
    )
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    trainer.train()
    # A step's trailing gc.collect() runs after its on_step_end: it is billed to the next step.
    return log


def main(spec_file: str, out_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    run = _worker_trl if spec["kind"] == "trl" else _worker_oppo_jax
    Path(out_file).write_text(json.dumps(run(spec)))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
