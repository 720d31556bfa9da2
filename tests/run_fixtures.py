"""Small end-to-end runs of the demo shared by the training and reliability tests."""

from oppo_jax.config import Config, load_config
from oppo_jax.run.log import read_metrics

# Wall-clock metrics, and compilations (they depend on what the process compiled before):
# everything else in metrics.jsonl must reproduce bit for bit.
TIMING_KEYS = {"step_time_s", "stage_time_s", "busy_fraction", "compiles", "compile_time_s"}

# Small demo assets (the real demo trains them longer); the `demo_cache` fixture holds them.
DEMO_TEST_STEPS = ("train.sft_steps=40", "train.rm_steps=40")

# An oppo schedule that carries sequences across steps from the first step on.
OPPO_WITH_CARRYING = (
    "pipeline.mode=oppo", "pipeline.overcommit=3", "pipeline.adaptive_overcommit=true",
    "pipeline.overcommit_window=1", "pipeline.chunk_size=4",
)  # fmt: skip


def small_demo_args(*extra: str) -> list[str]:
    """Overrides of a 4-step sync demo run at B = 8 (later items override earlier ones)."""
    return [
        *DEMO_TEST_STEPS, "train.steps=4", "train.checkpoint_every=2",
        "rollout.batch_size=8", "rollout.max_response_len=32", "pipeline.mode=sync", *extra,
    ]  # fmt: skip


def small_demo_config(*extra: str) -> Config:
    return load_config(None, small_demo_args(*extra))


def metric_values(path) -> list[dict]:
    """The records of a metrics.jsonl file without their wall-clock entries."""
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_metrics(path)]


def sigterm_in_first_step(monkeypatch) -> None:
    """Make the next run's first step receive a SIGTERM as it starts (then run as usual)."""
    import signal

    import oppo_jax.train as train_module

    real = train_module.run_step

    def run_step(*args):
        signal.raise_signal(signal.SIGTERM)
        return real(*args)

    monkeypatch.setattr(train_module, "run_step", run_step)


# configs/qwen2.5-7b_gh200x1_lora_grpo.yaml as it was before it refilled: Δ adaptive from 2 up
# to 4 groups (the projections and reports of a carrying schedule without refill)
GH200_GRPO_UNREFILLED = (
    "rollout.refill_every=0", "pipeline.adaptive_overcommit=true", "pipeline.overcommit=2",
    "pipeline.overcommit_max=4",
)  # fmt: skip
