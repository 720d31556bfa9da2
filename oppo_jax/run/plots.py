"""Plots of a run (reward, gold, KL, lengths and step time against the step; the held-out
exact match of its evaluations) and of benchmark
results (reward against wall time, step times, step Gantt charts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    return plt


# plots/<name>.png of a training run: (title, y label, metrics.jsonl keys drawn)
RUN_PLOTS = {
    "reward": ("reward-model score", "mean reward", ("reward",)),
    "gold": ("gold score (demo task)", "mean gold", ("gold",)),
    "kl": ("KL to the reference", "KL", ("kl",)),
    "lengths": ("response lengths", "tokens", ("response_len_mean", "response_len_max")),
    "step_time": ("step time", "seconds", ("step_time_s", "compile_time_s")),
}


# plots/<name>.png of a run's held-out evaluations: (title, y label, eval.jsonl keys drawn)
EVAL_PLOTS = {
    "eval_exact_match": ("held-out exact match (eval)", "share exactly right", ("exact_match",)),
    # reward.functions[0]'s mean: greedy, and over k samples at the training temperature
    "eval_accuracy": ("held-out accuracy (eval)", "share right", ("pass@1", "mean@k")),
}


def plot_run(metrics_path: Path, out: Path, reference: bool = True) -> list[Path]:
    """Write one ``<name>.png`` per ``RUN_PLOTS`` entry that the records hold into ``out``
    (a run without a gold score gets no gold plot; one without a reference, ``reference``
    false (``ppo.uses_reference``: β = 0), no KL plot, whose zeros would read as a policy that
    never moved), and per ``EVAL_PLOTS`` entry that the ``eval.jsonl`` beside the metrics
    holds; returns the files written."""
    from oppo_jax.run.log import read_metrics

    records = read_metrics(metrics_path) if Path(metrics_path).exists() else []
    eval_path = Path(metrics_path).parent / "eval.jsonl"
    evals = read_metrics(eval_path) if records and eval_path.exists() else []
    plots = RUN_PLOTS if reference else {k: v for k, v in RUN_PLOTS.items() if k != "kl"}
    return _draw(records, plots, out) + _draw(evals, EVAL_PLOTS, out)


def _draw(records: list[dict], plots: dict, out: Path) -> list[Path]:
    """One figure per ``plots`` entry whose keys some record holds, against the step."""
    if not records:
        return []
    plt, written = pyplot(), []
    out.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in records]
    for name, (title, ylabel, keys) in plots.items():
        present = [k for k in keys if any(r.get(k) is not None for r in records)]
        if not present:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key in present:  # null (a skipped step's NaN) leaves a gap
            ys = [np.nan if r.get(key) is None else r[key] for r in records]
            ax.plot(steps, ys, label=key, marker="." if len(steps) < 30 else None)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        if len(present) > 1:
            ax.legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=100)
        plt.close(fig)
        written.append(out / f"{name}.png")
    return written


def plot_gantt(events, path: Path, title: str = "") -> None:
    """One row per device group; one bar per stage run, coloured by stage kind."""
    plt = pyplot()
    groups = sorted({e.group for e in events})
    kinds = sorted({e.stage.split()[0] for e in events})
    colours = dict(zip(kinds, plt.cm.tab10.colors, strict=False))
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.6 * len(groups)))
    for e in events:
        y = groups.index(e.group)
        ax.barh(y, max(e.end - e.start, 1e-4), left=e.start, color=colours[e.stage.split()[0]])
    ax.set_yticks(range(len(groups)), groups)
    ax.set_xlabel("seconds since the step began")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
