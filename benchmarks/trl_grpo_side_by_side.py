"""TRL's GRPOTrainer and oppo-jax's GRPO step side by side: same tiny weights, same settings.

One tiny random Qwen2 (``_models.save_tiny_qwen2``) with a word-level tokenizer, a set of
prompts of random words and a rule reward (``word_overlap``: the fraction of the response's
words that appear in its prompt). TRL 1.9.0's ``GRPOTrainer`` (PyTorch, CPU, float32, no vLLM)
and oppo-jax (``sync`` and ``oppo`` schedules) each train it for ``--warmup`` + ``--steps``
batches with the same G, B, L, iterations, beta and loss type. Every run is a subprocess of this
one, one after another (TRL's process never holds JAX, and each run has the whole machine);
TRL with ``--threads`` torch threads (default 1), oppo-jax with XLA's own thread pool.

What is timed, per batch (B completions: a generation and ``--iterations`` optimizer updates):
  TRL: wall between ``on_step_end`` callbacks, summed over the ``--iterations`` optimizer steps
      that share a generation batch (TRL generates on the first of them).
  oppo-jax: ``step_time_s`` of metrics.jsonl. Its warm-up compiles every shape before step 1
      (``warmup_s``, reported apart as the compile time, with any compile time a step still
      logs).
The first ``--warmup`` batches of every run train but are not in the medians.

TRL as shipped, and with ``gc.collect`` a no-op: ``gc.collect`` is replaced for the whole
process by a wrapper that counts and times every call (or skips it), and every ``trl`` module
holding ``gc`` gets the same wrapper. (TRL 1.9.0's GRPO path calls ``gc.collect`` nowhere, unlike
its PPO trainer: the count says so for each run.)

How the knobs map (TRL GRPOConfig <- oppo-jax key):
  per_device_train_batch_size (gradient_accumulation_steps 1, one generation batch per
      optimizer step) <- rollout.batch_size;  num_generations <- rollout.group_size
  max_completion_length <- rollout.max_response_len;  temperature 1, top_p 1, top_k 0 both
  num_iterations <- ppo.ppo_epochs (ppo.num_minibatches 1);  beta <- ppo.kl_coef
      (ppo.kl_in_reward false, ppo.kl_estimator k3);  epsilon <- ppo.cliprange
  loss_type <- ppo.loss_agg: bnpo token_mean, grpo seq_mean, dr_grpo dr_grpo, dapo dapo
  scale_rewards <- ppo.scale_rewards (group);  learning_rate <- optim.actor_lr, constant
      schedule, no warm-up, AdamW (0.9, 0.999, 1e-8), no weight decay, gradient norm clipped
      at 1 on both sides
  reward: reward.functions=[trl_grpo_side_by_side:word_overlap], reward.model_weight 0

Run from the repository root (the whole run: a few minutes on a 2-core CPU):
  .venv/bin/python benchmarks/trl_grpo_side_by_side.py --steps 20 --out /tmp/grpo_side.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SPECIALS = ("<pad>", "<eos>", "<bos>")  # ids 0, 1, 2 (_models.PAD_ID is 0)
LOSS_AGG = {"bnpo": "token_mean", "grpo": "seq_mean", "dr_grpo": "dr_grpo", "dapo": "dapo"}


# ---------------------------------------------------------------- the task (both sides)


def word_overlap(prompt: str, response: str, record: dict | None = None) -> float:
    """The rule reward: the fraction of the response's words found in the prompt (0 if none)."""
    words = response.split()
    if not words:
        return 0.0
    seen = set(prompt.split())
    return sum(w in seen for w in words) / len(words)


def trl_reward(prompts, completions, **kwargs) -> list[float]:
    """``word_overlap`` in TRL's reward-function form (batches of texts)."""
    return [word_overlap(p, c) for p, c in zip(prompts, completions, strict=True)]


def make_assets(work: Path, args) -> dict:
    """The model directory (weights and tokenizer) and the prompts file; returns their paths."""
    sys.path.insert(0, str(HERE))
    from _models import save_tiny_qwen2
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    model_dir = work / "model"
    save_tiny_qwen2(model_dir, args.hidden, args.layers, args.vocab, seed=args.seed)
    words = [f"w{i}" for i in range(args.vocab - len(SPECIALS))]
    vocab = {tok: i for i, tok in enumerate((*SPECIALS, *words))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.save(str(model_dir / "tokenizer.json"))
    special = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, **special}
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    (model_dir / "special_tokens_map.json").write_text(json.dumps(special))
    rng = np.random.default_rng(args.seed)
    prompts = [
        " ".join(rng.choice(words, size=int(rng.integers(4, 9)))) for _ in range(args.num_prompts)
    ]
    prompts_file = work / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return {"model": str(model_dir), "prompts": str(prompts_file)}


# ---------------------------------------------------------------- TRL (subprocess side)


class _GCProbe:
    """Stands in for ``gc.collect``: counts and times each call, collects only if ``enabled``."""

    def __init__(self, collect, enabled: bool):
        self.collect_fn, self.enabled, self.calls, self.spent = collect, enabled, 0, 0.0

    def collect(self, *args, **kwargs) -> int:
        self.calls += 1
        if not self.enabled:
            return 0
        t0 = time.perf_counter()
        n = self.collect_fn(*args, **kwargs)
        self.spent += time.perf_counter() - t0
        return n


def _patch_gc(enabled: bool) -> _GCProbe:
    """Route every ``gc.collect`` (the module's, and any ``trl`` module's ``gc``) to a probe."""
    import gc
    import types

    probe = _GCProbe(gc.collect, enabled)
    gc.collect = probe.collect
    stand_in = types.SimpleNamespace(collect=probe.collect)
    for name, module in list(sys.modules.items()):
        if name.startswith("trl") and getattr(module, "gc", None) is gc:
            module.gc = stand_in
    return probe


def run_trl(spec: dict) -> dict:
    """One GRPOTrainer run; per-optimizer-step wall times and gc counts."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import GRPOConfig, GRPOTrainer

    a = spec["args"]
    torch.set_num_threads(a["threads"])
    torch.manual_seed(a["seed"])
    tok = PreTrainedTokenizerFast.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    lines = Path(spec["prompts"]).read_text().splitlines()
    dataset = Dataset.from_list([json.loads(line) for line in lines])
    batches = a["warmup"] + a["steps"]
    config = GRPOConfig(
        output_dir=spec["work"],
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        fp16=False,
        disable_tqdm=True,
        logging_steps=1,
        seed=a["seed"],
        per_device_train_batch_size=a["B"],
        gradient_accumulation_steps=1,
        num_generations=a["G"],
        max_completion_length=a["L"],
        max_steps=batches * a["iterations"],
        num_iterations=a["iterations"],
        beta=a["beta"],
        loss_type=a["loss_type"],
        epsilon=0.2,
        scale_rewards="group",
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        learning_rate=a["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        dataloader_num_workers=0,
    )
    probe = _patch_gc(spec["gc"])
    log = {"step_time_s": [], "gc_calls": [], "gc_time_s": [], "reward": [], "len": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            self.t, self.calls, self.spent = time.perf_counter(), probe.calls, probe.spent

        def on_step_end(self, *a, **k):
            now = time.perf_counter()
            log["step_time_s"].append(now - self.t)
            log["gc_calls"].append(probe.calls - self.calls)
            log["gc_time_s"].append(probe.spent - self.spent)
            self.t, self.calls, self.spent = now, probe.calls, probe.spent

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "reward" in logs:
                log["reward"].append(logs["reward"])
                log["len"].append(logs.get("completions/mean_length"))

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=trl_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Clock()],
    )
    for cb in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(cb)
    trainer.train()
    return log


# ---------------------------------------------------------------- oppo-jax (subprocess side)


def oppo_overrides(spec: dict) -> list[str]:
    """The oppo-jax keys of one run (the mapping in the module docstring)."""
    a = spec["args"]
    return [
        f"seed={a['seed']}",
        f"model.actor_path={spec['model']}",
        f"model.reward_path={spec['model']}",
        "model.dtype=float32",
        "model.param_dtype=float32",
        f"data.prompts={spec['prompts']}",
        "data.prompt_field=prompt",
        "reward.model_weight=0",
        "reward.functions=[trl_grpo_side_by_side:word_overlap]",
        f"rollout.batch_size={a['B']}",
        f"rollout.group_size={a['G']}",
        "rollout.max_prompt_len=16",
        f"rollout.max_response_len={a['L']}",
        "rollout.temperature=1.0",
        "rollout.top_k=0",
        "rollout.top_p=1.0",
        "ppo.advantage=grpo",
        "ppo.scale_rewards=group",
        f"ppo.ppo_epochs={a['iterations']}",
        "ppo.num_minibatches=1",
        "ppo.grad_accum_steps=1",
        f"ppo.kl_coef={a['beta']}",
        "ppo.kl_in_reward=false",
        "ppo.kl_estimator=k3",
        "ppo.adaptive_kl=false",
        "ppo.cliprange=0.2",
        f"ppo.loss_agg={LOSS_AGG[a['loss_type']]}",
        "ppo.entropy_coef=0.0",
        f"optim.actor_lr={a['lr']}",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "optim.weight_decay=0.0",
        "optim.max_grad_norm=1.0",
        f"pipeline.mode={spec['mode']}",
        "pipeline.overcommit=1",
        "pipeline.adaptive_overcommit=false",
        "pipeline.compact_slots=false",
        f"train.steps={a['warmup'] + a['steps']}",
        "train.checkpoint_every=0",
        "train.log_every=1",
    ]


def run_oppo_jax(spec: dict) -> dict:
    """One oppo-jax run through the public entry point (warm-up on); its metrics.jsonl."""
    sys.path.insert(0, str(HERE))  # reward.functions imports this file as a module
    from oppo_jax.config import load_config
    from oppo_jax.train import train

    cfg = load_config(None, oppo_overrides(spec))
    t0 = time.perf_counter()
    summary = train(cfg, spec["work"], progress=False, warmup=True)
    lines = (Path(spec["work"]) / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {
        "step_time_s": [r["step_time_s"] for r in records],
        "compile_time_s": [r.get("compile_time_s", 0.0) for r in records],
        "reward": [r["reward"] for r in records],
        "len": [r["response_len_mean"] for r in records],
        "warmup_s": summary.get("warmup_s"),
        "run_s": time.perf_counter() - t0,
    }


def worker(spec_file: str, out_file: str) -> None:
    spec = json.loads(Path(spec_file).read_text())
    run = run_trl if spec["kind"] == "trl" else run_oppo_jax
    Path(out_file).write_text(json.dumps(run(spec)))


# ---------------------------------------------------------------- parent: lanes and table


def lanes(args) -> list[dict]:
    """TRL as shipped, oppo-jax, TRL without gc.collect, oppo-jax (alternating)."""
    trl = [{"name": f"trl_{g}", "kind": "trl", "gc": g == "gc"} for g in args.trl_gc]
    jax_lanes = [{"name": f"oppo_jax_{m}", "kind": "oppo_jax", "mode": m} for m in args.modes]
    out = []
    while trl or jax_lanes:
        out += [lst.pop(0) for lst in (trl, jax_lanes) if lst]
    return out


def run_lane(lane: dict, assets: dict, args, work: Path) -> dict:
    """One lane in a fresh interpreter (JAX on one host device, no persistent cache)."""
    spec = {**lane, **assets, "args": vars(args), "work": str(work / lane["name"])}
    spec_file, out_file = work / f"{lane['name']}.spec.json", work / f"{lane['name']}.out.json"
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", OPPO_JAX_COMPILATION_CACHE="off")
    cmd = [sys.executable, __file__, "--worker", str(spec_file), str(out_file)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{lane['name']} failed:\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}")
    result = json.loads(out_file.read_text())
    result["lane_wall_s"] = time.perf_counter() - t0
    return result


def per_batch(result: dict, kind: str, iterations: int) -> list[float]:
    """Seconds per batch (a generation and its ``iterations`` updates)."""
    times = result["step_time_s"]
    if kind == "trl":
        times = [sum(times[i : i + iterations]) for i in range(0, len(times), iterations)]
    return times


def _steady(run: dict, name: str, args) -> list[float]:
    """A run's seconds per batch after its first ``--warmup`` batches."""
    kind = "trl" if name.startswith("trl") else "oppo_jax"
    return per_batch(run, kind, args.iterations)[args.warmup :]


def summarize(results: dict, args) -> dict:
    """Per lane: the median seconds per batch over every round's steady batches, compile
    seconds and gc calls; per TRL lane and oppo-jax lane: the ratio of their medians in each
    round (TRL / oppo-jax, > 1: oppo-jax faster)."""
    lanes_out = {}
    for name, runs in results.items():
        pooled = [t for r in runs for t in _steady(r, name, args)]
        lane = {
            "batch_time_median_s": statistics.median(pooled),
            "batch_time_mean_s": float(np.mean(pooled)),
            "round_medians_s": [statistics.median(_steady(r, name, args)) for r in runs],
            "response_len_mean": float(np.mean([x for r in runs for x in r["len"] if x])),
        }
        if name.startswith("trl"):
            lane["gc_calls"] = sum(sum(r["gc_calls"]) for r in runs)
            lane["gc_time_s"] = sum(sum(r["gc_time_s"]) for r in runs)
        else:
            lane["warmup_compile_s"] = statistics.median(r["warmup_s"] for r in runs)
            lane["step_compile_s"] = max(sum(r["compile_time_s"]) for r in runs)
        lanes_out[name] = lane
    ratios = {}
    for t in (n for n in lanes_out if n.startswith("trl")):
        for o in (n for n in lanes_out if n.startswith("oppo_jax")):
            pair = (lanes_out[t]["round_medians_s"], lanes_out[o]["round_medians_s"])
            per_round = [a / b for a, b in zip(*pair, strict=True)]  # a failed lane is dropped
            ratios[f"{t}/{o}"] = {"median": statistics.median(per_round), "rounds": per_round}
    return {"lanes": lanes_out, "ratios": ratios}


def table(summary: dict) -> str:
    """Markdown: each lane's median seconds per batch, then TRL / oppo-jax for each pair."""
    rows = [
        "| run | median s / batch (rounds) | compile s (warm-up + steps) | gc calls | resp len |",
        "|---|---|---|---|---|",
    ]
    for name, s in summary["lanes"].items():
        comp = "-"
        if "warmup_compile_s" in s:
            comp = f"{s['warmup_compile_s']:.1f} + {s['step_compile_s']:.1f}"
        rounds = ", ".join(f"{x:.3f}" for x in s["round_medians_s"])
        rows.append(
            f"| {name} | {s['batch_time_median_s']:.3f} ({rounds}) | {comp} "
            f"| {s.get('gc_calls', '-')} | {s['response_len_mean']:.1f} |"
        )
    rows += ["", "| TRL / oppo-jax, per round | median (rounds) |", "|---|---|"]
    for pair, r in summary["ratios"].items():
        rounds = ", ".join(f"{x:.2f}" for x in r["rounds"])
        rows.append(f"| {pair} | {r['median']:.2f}x ({rounds}) |")
    return "\n".join(rows)


def main(argv=None) -> dict:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="grpo_side_") as tmp:
        work = Path(tmp)
        assets = make_assets(work, args)
        results, failed = {}, {}
        for round_ in range(args.rounds):
            for lane in lanes(args):
                if lane["name"] in failed:
                    continue
                print(f"round {round_}: running {lane['name']} ...", flush=True)
                try:
                    r = run_lane(lane, assets, args, work)
                except RuntimeError as e:  # reported, and the other runs go on
                    failed[lane["name"]] = str(e)[-3000:]
                    print(f"  FAILED: {str(e).strip().splitlines()[-1]}", flush=True)
                    continue
                results.setdefault(lane["name"], []).append(r)
                median = statistics.median(_steady(r, lane["name"], args))
                print(f"  median {median:.3f} s / batch, run {r['lane_wall_s']:.0f} s", flush=True)
    results = {k: v for k, v in results.items() if k not in failed}
    summary = summarize(results, args)
    print(table(summary))
    report = {
        "settings": vars(args),
        "versions": versions(),
        "summary": summary,
        "runs": results,
        "failed": failed,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"cpu_count": os.cpu_count()}
    for pkg in ("trl", "torch", "transformers", "jax", "oppo_jax"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20, help="timed batches per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of every lane, interleaved")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first batches per run")
    ap.add_argument("--G", type=int, default=4, help="completions per prompt")
    ap.add_argument("--B", type=int, default=16, help="completions per batch")
    ap.add_argument("--L", type=int, default=32, help="max completion length, tokens")
    ap.add_argument("--iterations", type=int, default=1, help="updates per batch (mu)")
    ap.add_argument("--beta", type=float, default=0.04, help="KL coefficient (k3, in the loss)")
    ap.add_argument("--loss-type", default="dapo", choices=list(LOSS_AGG))
    ap.add_argument("--lr", type=float, default=1e-5, help="learning rate (constant)")
    ap.add_argument("--hidden", type=int, default=64, help="model width (head_dim 16)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    # 1: on a 2-core machine shared with other work, 2 torch threads wait on a descheduled one
    # (a batch took 2.6 s with 2 threads, 0.22 s with 1, under the same load)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--modes", type=_names, default=["sync", "oppo"], help="oppo-jax schedules")
    ap.add_argument("--trl-gc", type=_names, default=["gc", "nogc"], help="TRL runs: gc,nogc")
    ap.add_argument("--out", default=None, help="JSON report")
    args = ap.parse_args(argv)
    if args.B % args.G or min(args.steps, args.rounds) < 1 or args.warmup < 0:
        ap.error("--B must be a multiple of --G; --steps and --rounds >= 1; --warmup >= 0")
    return args


def _names(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3])
    else:
        main()
