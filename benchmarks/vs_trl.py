"""The paper's comparison, reproduced on the demo task: TRL's PPOTrainer vs oppo-jax sync/oppo.

Hugging Face TRL 1.9.0 (``trl.experimental.ppo.PPOTrainer``, PyTorch, CPU) and oppo-jax (the
``sync`` and ``oppo`` schedules) train the same SFT actor and reward model (the demo's cached
Hugging Face directories; the critic starts from the reward model on both sides) on the same
prompt set (the demo's 4096 prompts, fed to TRL as token ids) with the hyper-parameters of the
oppo-jax config (default ``configs/demo_cpu.yaml``). Every run is a subprocess of this one
invocation (``_vs_trl_workers.py``), one after another, so TRL's process never holds JAX (whose
heap would inflate TRL's ``gc.collect()``) and each run gets the whole machine. Needs the
``[peers]`` extra (trl, torch).

Reported per run: the step times (wall between TRL's ``on_step_end`` callbacks; oppo-jax's
``step_time_s``), the gold score of each step's batch (TRL's generated responses are captured by
wrapping ``ppo_trainer.batch_generation`` and scored by the demo's own ``gold_scores``), and
the time to a target gold: the first step whose 5-step moving average of gold reaches
``start + 0.7 (worst final - start)``, the rule of ``oppo_tools/bench.py``. The first
``--warmup`` steps of every run train but are not timed (oppo-jax compiles there). A step over
5x its run's median (oppo-jax compiling a shape first met mid-run) is counted as an outlier,
and "steady" time to target bills such steps at the median.

TRL variants: its PPO step calls ``gc.collect()`` twice, so TRL runs with it (timed, to show
its cost) and with the module's ``gc`` replaced by a no-op; and with ``torch.set_num_threads``
1 and 2 (on a 2-core machine shared with other work, 2 torch threads can wait on a descheduled
one; 1 is the setting to trust). Thread counts after the first run ``--probe-steps`` steps only.

How the knobs map (TRL PPOConfig <- oppo-jax key):
  per_device_train_batch_size <- rollout.batch_size (gradient_accumulation_steps 1)
  response_length <- rollout.max_response_len;  temperature <- rollout.temperature
  kl_coef, kl_estimator, cliprange, cliprange_value, vf_coef, gamma, lam, whiten_rewards,
  missing_eos_penalty <- ppo.* of the same name;  num_ppo_epochs <- ppo.ppo_epochs;
  num_mini_batches <- ppo.num_minibatches;  seed <- seed
  optimizers <- optim.*: AdamW with two parameter groups (actor_lr, critic_lr; TRL's own
      optimizer has one learning rate), each group's gradient clipped to max_grad_norm (TRL does
      not clip), linear warm-up over optim.warmup_steps optimizer updates then constant (TRL's
      scheduler steps once per PPO step, so the warm-up lives in the optimizer's step)
  value_model <- the reward model's weights (model.critic_init: reward)
  float32, no bf16, no gradient checkpointing, report_to none, nothing saved, local paths.
Where they cannot match:
  stop token: TRL generates the whole batch until every row has emitted EOS (or the length
      cap), pads after EOS and truncates at it; oppo-jax stops each sequence at EOS (sync waits
      for all B too; oppo starts B + delta and carries the stragglers).
  reward placement: TRL adds the score one token past EOS (its value loss covers that token);
      oppo-jax adds it at the last valid token (see reference/OPPO_NOTES.md).
  sampling: TRL hard-codes top_k 0 / top_p 1; other oppo-jax values are refused here.
  prompt order: both sides draw from the same 4096 prompts, each in its own seeded order.

Run from the repository root:
  .venv/bin/python benchmarks/vs_trl.py --steps 60 --out /tmp/vs_trl.json
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

MOVING_AVERAGE = 5  # steps in the gold score's moving average (as oppo_tools/bench.py)
TARGET_FRACTION = 0.7  # target gold: this fraction of the way from start to the worst final
WORKERS = Path(__file__).with_name("_vs_trl_workers.py")  # the subprocess side
OUTLIER = 5.0  # a step slower than this many lane medians is reported as an outlier


# ---------------------------------------------------------------- parent: set-up and lanes


def _load_cfg(args):
    from oppo_jax.config import load_config

    return load_config(args.config, args.set)


def _check_matchable(cfg) -> None:
    """Refuse oppo-jax settings that TRL's PPO trainer has no knob for."""
    p, r, o = cfg.ppo, cfg.rollout, cfg.optim
    wanted = {
        "rollout.top_k": (r.top_k, 0),
        "rollout.top_p": (r.top_p, 1.0),
        "rollout.greedy": (r.greedy, False),
        "ppo.kl_in_reward": (p.kl_in_reward, True),
        "ppo.adaptive_kl": (p.adaptive_kl, False),
        "ppo.entropy_coef": (p.entropy_coef, 0.0),
        "ppo.loss_agg": (p.loss_agg, "token_mean"),
        "ppo.grad_accum_steps": (p.grad_accum_steps, 1),
        "ppo.off_policy_correction": (p.off_policy_correction, "none"),
        "optim.schedule": (o.schedule, "constant"),
    }
    for key, (have, need) in wanted.items():
        if have != need:
            raise ValueError(f"{key}={have!r} has no TRL counterpart here (needs {need!r})")
    if p.kl_estimator not in ("k1", "k3"):
        raise ValueError(f"ppo.kl_estimator={p.kl_estimator!r}: TRL offers k1 and k3 only")


def trl_hparams(cfg) -> dict:
    """TRL's settings from the oppo-jax config (the mapping in the module docstring)."""
    _check_matchable(cfg)
    p, r, o = cfg.ppo, cfg.rollout, cfg.optim
    return {
        "seed": cfg.seed,
        "batch_size": r.batch_size,
        "response_length": r.max_response_len,
        "temperature": r.temperature,
        **{k: getattr(p, k) for k in ("kl_coef", "kl_estimator", "cliprange", "cliprange_value")},
        **{k: getattr(p, k) for k in ("vf_coef", "gamma", "lam", "whiten_rewards")},
        "missing_eos_penalty": p.missing_eos_penalty,
        "num_ppo_epochs": p.ppo_epochs,
        "num_mini_batches": p.num_minibatches,
        "actor_lr": o.actor_lr,
        "critic_lr": o.critic_lr,
        "warmup_updates": o.warmup_steps,
        "max_grad_norm": o.max_grad_norm,
        "weight_decay": o.weight_decay,
        "betas": [o.adam_b1, o.adam_b2],
        "eps": o.adam_eps,
    }


def _prepare(args, cfg, work: Path) -> dict:
    """Build (or find) the demo assets and write the prompt set; returns the TRL job."""
    from oppo_jax.data.demo_task import DemoTaskSpec, sample_prompts
    from oppo_jax.demo.assets import ensure_demo_assets
    from oppo_jax.run.setup import NUM_DEMO_PROMPTS, cache_dir

    if (cfg.model.actor_path, cfg.model.reward_path) != ("demo", "demo"):
        raise ValueError("vs_trl compares on the demo task: model.actor_path/reward_path = demo")
    if cfg.model.critic_init != "reward" or cfg.model.dtype != "float32":
        raise ValueError("vs_trl matches model.critic_init=reward and float32 only")
    spec = DemoTaskSpec(max_response_len=cfg.rollout.max_response_len)
    actor_dir, reward_dir = ensure_demo_assets(
        cache_dir() / "demo", spec, cfg.train.sft_steps, cfg.train.rm_steps, progress=False
    )
    # The same prompt set oppo_jax.run.setup builds for the demo (same seed 12345).
    prompts = sample_prompts(spec, NUM_DEMO_PROMPTS, np.random.default_rng(12345))
    (work / "prompts.json").write_text(json.dumps([p.tolist() for p in prompts]))
    return {
        "actor_dir": str(actor_dir),
        "reward_dir": str(reward_dir),
        "prompts": str(work / "prompts.json"),
        "hp": trl_hparams(cfg),
    }


def _lanes(args) -> list[dict]:
    """The runs, TRL and oppo-jax alternating so that slow periods spread over both."""
    trl = [
        {"name": f"trl_t{t}_{'gc' if gc else 'nogc'}", "kind": "trl", "threads": t, "gc": gc,
         "steps": args.steps if t == args.threads[0] else min(args.steps, args.probe_steps)}
        for t in args.threads
        for gc in args.gc
    ]  # fmt: skip
    jax_lanes = [
        {"name": f"oppo_jax_{m}", "kind": "oppo_jax", "mode": m, "steps": args.steps}
        for m in args.modes
    ]
    lanes = []
    while trl or jax_lanes:
        lanes += [lst.pop(0) for lst in (trl, jax_lanes) if lst]
    return lanes


def _run_lane(lane: dict, job: dict, args, work: Path) -> dict:
    """Run one lane in a fresh interpreter; returns its records."""
    spec = {**lane, "job": job, "warmup": args.warmup}
    spec.update(config=args.config, overrides=args.set, work=str(work / lane["name"]))
    spec_file, out_file = work / f"{lane['name']}.spec.json", work / f"{lane['name']}.out.json"
    spec_file.write_text(json.dumps(spec))
    load_before, t0 = os.getloadavg()[0], time.perf_counter()
    cmd = [sys.executable, str(WORKERS), str(spec_file), str(out_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stdout[-3000:] + proc.stderr[-5000:]
        raise RuntimeError(f"run {lane['name']} failed:\n{tail}")
    result = json.loads(out_file.read_text())
    result.update(
        lane_wall_s=time.perf_counter() - t0, load_before=load_before, load_after=os.getloadavg()[0]
    )
    return result


# ---------------------------------------------------------------- parent: summary


def _moving_average(xs, window: int = MOVING_AVERAGE) -> np.ndarray:
    xs = np.asarray(xs, float)
    return np.array([xs[max(0, i - window + 1) : i + 1].mean() for i in range(len(xs))])


def _time_to(target: float, times, golds) -> float | None:
    reached = np.flatnonzero(_moving_average(golds) >= target)
    return float(np.cumsum(times)[reached[0]]) if len(reached) else None


def _steady(times) -> tuple[list[float], int]:
    """Step times with outliers (> OUTLIER x the median: oppo-jax compiling a new shape mid-run)
    billed at the median instead; and how many there were."""
    median = statistics.median(times)
    slow = [t > OUTLIER * median for t in times]
    return [median if s else t for t, s in zip(times, slow, strict=True)], sum(slow)


def _trl_gold(result: dict, cfg) -> None:
    """Gold of each TRL step's batch by the demo's own rule (responses as captured)."""
    from oppo_jax.data.demo_task import EOS_ID, DemoTaskSpec, gold_scores

    spec = DemoTaskSpec(max_response_len=cfg.rollout.max_response_len)
    golds, lens = [], []
    for resp in result.pop("responses"):
        resp = np.asarray(resp)
        golds.append(float(np.mean(gold_scores(resp, np.full(len(resp), resp.shape[1]), spec))))
        has_eos = (resp == EOS_ID).any(axis=1)
        lens.append(np.where(has_eos, (resp == EOS_ID).argmax(axis=1) + 1, resp.shape[1]))
    result["gold"] = golds
    result["response_len_mean"] = [float(np.mean(x)) for x in lens]
    result["response_len_max"] = [int(np.max(x)) for x in lens]


def summarize(results: dict, warmup: int, target: float | None) -> dict:
    """Per-lane medians, finals and time to target; ratios of oppo-jax's best to each TRL lane."""
    timed = {
        n: {k: v[warmup:] for k, v in r.items() if isinstance(v, list)} for n, r in results.items()
    }
    if target is None:  # from the full-length runs (probes of other thread counts are shorter)
        longest = max(len(t["gold"]) for t in timed.values())
        full = [t["gold"] for t in timed.values() if len(t["gold"]) == longest]
        start = np.mean([g[0] for g in full])
        worst = min(_moving_average(g)[-1] for g in full)
        target = float(start + TARGET_FRACTION * (worst - start))
    lanes = {}
    for name, t in timed.items():
        times, golds = t["step_time_s"], t["gold"]
        steady, outliers = _steady(times)
        lanes[name] = {
            "step_time_median_s": statistics.median(times),
            "step_time_mean_s": float(np.mean(times)),
            "time_to_target_s": _time_to(target, times, golds),
            "outlier_steps": outliers,
            "time_to_target_steady_s": _time_to(target, steady, golds),
            "setup_s": results[name]["lane_wall_s"] - sum(results[name]["step_time_s"]),
            "gold_start": golds[0],
            "gold_final": float(np.mean(golds[-MOVING_AVERAGE:])),
            "response_len_mean": float(np.mean(t["response_len_mean"])),
        }
        for key in ("gen_time_s", "gc_time_s"):
            if key in t:
                lanes[name][f"{key[:-2]}_median_s"] = statistics.median(t[key])
    return {"target_gold": target, "lanes": lanes, "speedup_vs_trl": _ratios(lanes)}


RATIO_METRICS = {  # speed-up name -> lane metric (seconds, lower is better)
    "step_time": "step_time_median_s",
    "time_to_target": "time_to_target_s",
    "time_to_target_steady": "time_to_target_steady_s",
}


def _ratios(lanes: dict) -> dict:
    """For each TRL run and metric: TRL's seconds / the best oppo-jax schedule's (>1: oppo-jax
    faster), and which schedule that was."""
    jax_names = [n for n in lanes if n.startswith("oppo_jax")]
    out = {}
    for trl in (n for n in lanes if n.startswith("trl")):
        out[trl] = {}
        for ratio, metric in RATIO_METRICS.items():
            have = [n for n in jax_names if lanes[n][metric]]
            best = min(have, key=lambda n: lanes[n][metric]) if have else None
            mine = lanes[trl][metric]
            value = mine / lanes[best][metric] if best and mine else None
            out[trl][ratio] = {"speedup": value, "oppo_jax": best}
    return out


def _table(summary: dict) -> str:
    """The printed Markdown tables: per run, then the speed-ups over each TRL run."""

    def f(x, fmt="{:.3f}"):
        return "-" if x is None else fmt.format(x)

    rows = [
        "| run | step median s | gen median s | gc median s | time to target s (steady) "
        "| outlier steps | setup s | gold start -> final | resp len |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in summary["lanes"].items():
        ttt = f"{f(s['time_to_target_s'], '{:.1f}')} ({f(s['time_to_target_steady_s'], '{:.1f}')})"
        rows.append(
            f"| {name} | {f(s['step_time_median_s'])} | {f(s.get('gen_time_median_s'))} "
            f"| {f(s.get('gc_time_median_s'))} | {ttt} | {s['outlier_steps']} "
            f"| {s['setup_s']:.0f} | {s['gold_start']:.3f} -> {s['gold_final']:.3f} "
            f"| {s['response_len_mean']:.1f} |"
        )
    rows += [
        "",
        f"target gold {summary['target_gold']:.3f}; speed-up = TRL seconds / best oppo-jax "
        "schedule's seconds (>1: oppo-jax faster)",
        "| TRL run | per-step median | time to target | time to target (steady) |",
        "|---|---|---|---|",
    ]
    for name, r in summary["speedup_vs_trl"].items():
        cells = [f"{f(v['speedup'], '{:.2f}x')} ({v['oppo_jax'] or '-'})" for v in r.values()]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None) -> dict:
    args = _parse(argv)
    cfg = _load_cfg(args)
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        work = Path(tmp)
        job = _prepare(args, cfg, work)
        results = {}
        for lane in _lanes(args):
            print(f"running {lane['name']} ...", flush=True)
            results[lane["name"]] = r = _run_lane(lane, job, args, work)
            if lane["kind"] == "trl":
                _trl_gold(r, cfg)
            median = statistics.median(r["step_time_s"][args.warmup :])
            print(f"  median step {median:.3f} s, run {r['lane_wall_s']:.0f} s", flush=True)
    summary = summarize(results, args.warmup, args.target_gold)
    report = {
        "settings": {**vars(args), "trl_hparams": job["hp"]},
        "versions": _versions(),
        "summary": summary,
        "runs": results,
    }
    print(_table(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("trl", "torch", "transformers", "accelerate", "jax", "flax", "oppo_jax"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    out["cpu_count"] = os.cpu_count()
    return out


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo_cpu.yaml", help="oppo-jax config (demo)")
    ap.add_argument("--set", action="append", default=[], help="oppo-jax override key=value")
    ap.add_argument("--steps", type=int, default=60, help="timed PPO steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="untimed first steps per run")
    ap.add_argument("--threads", type=_ints, default=[1, 2], help="torch threads, e.g. 1,2")
    ap.add_argument(
        "--probe-steps", type=int, default=10, help="timed steps of TRL at threads after the first"
    )
    ap.add_argument("--gc", type=_gcs, default=[True, False], help="TRL gc.collect: on,off")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["sync", "oppo"])
    ap.add_argument("--target-gold", type=float, default=None, help="default: 70%% rule")
    ap.add_argument("--out", default=None, help="JSON report")
    args = ap.parse_args(argv)
    if min(args.steps, args.probe_steps) < 1 or args.warmup < 0:
        ap.error("--steps and --probe-steps must be >= 1, --warmup >= 0")
    return args


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",")]


def _gcs(s: str) -> list[bool]:
    table = {"on": True, "off": False}
    return [table[x] for x in s.split(",")]


if __name__ == "__main__":
    main()
