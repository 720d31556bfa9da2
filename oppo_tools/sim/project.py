"""Projections with their settings stated: from a run config or from flags, and the regime map.

A projection's numbers depend on the run as much as on the hardware: the PPO epochs and the
trained models set the update's cost (a critic-free run of the GRPO family trains the actor
alone), the scorers (reference when β > 0, critic, reward model) the scoring work, the prompt
and response widths what a fixed-shape engine computes, B, G, C, Δ and the placement what
overlaps. ``Projection`` holds all of them,
says where each came from (the config, ``--set``, a flag, or a stated default) and prints
them with every table. ``regime_map`` projects OPPO's speedup over sync across PPO epochs
{1, 2, 4} × median response {128, 512, 2048} tokens (log-normal, σ 0.94, capped at
R = 8 × the median, so about 1.3% of responses hit R), holding everything else, so a user sees
where OPPO pays before renting hardware. A run of groups (G > 1) gets the group regime map
instead (``group_map``: the schedules' speedups over Δ groups × median response).
"""

from __future__ import annotations

import dataclasses

from oppo_tools.sim.engines import ACTIVE, Engine, built_for
from oppo_tools.sim.events import Workload, simulate
from oppo_tools.sim.lengths import LONGTAIL, LogNormal
from oppo_tools.sim.model import CostModel
from oppo_tools.sim.packing import UpdateGroups
from oppo_tools.sim.roofline import TrainSettings, parse_spec, roofline_cost_model

EPOCHS = (1, 2, 4)
MEDIANS = (128, 512, 2048)
SIGMA = 0.94
CAP_RATIO = 8  # R = 8 × the median in the regime map


# Settings of a projection without a config (each printed as "default").
DEFAULTS = {
    "batch": 112,
    "prompt_len": 0,
    "capacity": None,
    "epochs": 4,
    "minibatches": 1,
    "grad_accum": 1,
    "row_multiple": 1,
    "width_factor": 1,
    "trained": ("actor", "critic"),
    "chunk": 256,
    "delta": 16,
    "placement": "disaggregated",
    "max_deferrals": 2,
    "chips": 1,
    "mfu": 0.5,
    "steps": 200,
    "seed": 0,
    "lengths": LONGTAIL,
    "lora_rank": 0,
    "group_size": 1,
    "reference": True,
    "reward_model": True,
}
# Which printed setting each value belongs to.
_SETTING = {
    "batch": "batch",
    "prompt_len": "prompt",
    "capacity": "capacity",
    "epochs": "ppo",
    "minibatches": "ppo",
    "grad_accum": "ppo",
    "row_multiple": "model",
    "width_factor": "ppo",
    "trained": "trained",
    "chunk": "schedule",
    "delta": "schedule",
    "placement": "schedule",
    "max_deferrals": "schedule",
    "chips": "model",
    "mfu": "model",
    "steps": "steps",
    "seed": "steps",
    "lengths": "lengths",
    "lora_rank": "trained",
    "group_size": "batch",
    "reference": "trained",
    "reward_model": "trained",
}
# Config keys (of --set) and the printed setting they change.
_CONFIG_KEYS = {
    "rollout.batch_size": "batch",
    "rollout.group_size": "batch",
    "rollout.max_prompt_len": "prompt",
    "rollout.max_response_len": "capacity",
    "rollout.length": "lengths",
    "ppo.ppo_epochs": "ppo",
    "ppo.num_minibatches": "ppo",
    "ppo.grad_accum_steps": "ppo",
    "ppo.pack_width_factor": "ppo",
    "pipeline.": "schedule",
    "mesh.data": "model",
    "mesh.fsdp": "model",
    "mesh.tensor": "model",
    "model.lora_rank": "trained",
    "ppo.advantage": "trained",
    "ppo.kl_coef": "trained",
    "ppo.adaptive_kl": "trained",
    "reward.model_weight": "trained",
}


@dataclasses.dataclass(frozen=True)
class Projection:
    """Everything a projection depends on; ``sources`` says where each setting came from."""

    spec: str  # MODEL:HARDWARE, e.g. qwen2.5-7b:gh200
    workload: Workload  # B, C, Δ, P, R, placement, deferral cap, steps, seed
    train: TrainSettings  # PPO epochs, minibatches, trained models, scorers
    lengths: LogNormal = LONGTAIL  # new prompts' response lengths
    chips: int = 1  # chips per device group, sharded perfectly
    mfu: float = 0.5  # model-FLOPs utilisation of prefills and the update
    sources: tuple[tuple[str, str], ...] = ()  # (setting, where it came from)
    # engine FEATURES switched on as what-ifs (``--with``), in every table, map and refill row
    features: tuple[str, ...] = ()

    def cost_model(self) -> CostModel:
        """The roofline CostModel (no parameter copy when colocated: the roles share devices)."""
        model, hardware = parse_spec(self.spec)
        cost = roofline_cost_model(
            model, hardware, self.train, self.workload.batch, self.mfu, self.chips
        )
        if self.workload.placement == "colocated":
            cost = dataclasses.replace(cost, copy_s=0.0)
        return cost

    @property
    def built_engine(self) -> Engine:
        """This engine as built on the projection's hardware (``engines.built_for``), with
        the what-if ``features`` switched on."""
        return built_for(parse_spec(self.spec)[1].backend).with_features(self.features)

    def source(self, setting: str) -> str:
        return dict(self.sources).get(setting, "default")

    def lines(self) -> list[str]:
        """The settings, one per line, each with its source."""
        model, hardware = parse_spec(self.spec)
        w, t = self.workload, self.train
        lora = f" (LoRA rank {t.lora_rank} on frozen bases)" if t.lora_rank else ""
        g = w.group_size
        groups = f" = {w.batch // g} prompts × G = {g}" if g > 1 else ""
        free = "" if "critic" in t.trained else " (critic-free)"
        scorers = ", ".join(t.scorers) or "none"
        beta = "" if t.reference else " (β = 0: no reference)"
        delta = f"Δ = {w.delta} groups ({w.delta * g} sequences)" if g > 1 else f"Δ = {w.delta}"
        rows = [
            ("model", f"{model.name} on {self.chips}× {hardware.name}, mfu {self.mfu:g}"),
            ("batch", f"B = {w.batch} sequences per PPO batch{groups}"),
            ("prompt", f"P = {w.prompt_len} prompt tokens (one width for all prompts)"),
            ("capacity", f"R = {w.capacity} tokens of response capacity"),
            ("lengths", f"responses {self.lengths.describe()}"),
            (
                "ppo",
                f"{t.ppo_epochs} PPO epoch(s) × {t.num_minibatches} minibatch(es) × "
                f"{w.update_groups.chunks} accumulation step(s), packed rows "
                f"{w.update_groups.width_factor} × (P + R)",
            ),
            (
                "trained",
                f"trained: {' + '.join(t.trained)}{free}{lora}; {t.n_scorers} scorers: "
                f"{scorers}{beta}",
            ),
            (
                "schedule",
                f"C = {w.chunk_size}, {delta}, {w.placement}, max deferrals {w.max_deferrals}",
            ),
            ("steps", f"{w.steps} simulated steps per schedule, seed {w.seed}"),
        ]
        return [f"  {text:<76} [{self.source(key)}]" for key, text in rows]

    def with_regime(self, epochs: int, median: int | float) -> Projection:
        """This projection at ``epochs`` PPO epochs and log-normal lengths of ``median``."""
        cap = int(CAP_RATIO * median)
        groups = dataclasses.replace(self.workload.update_groups, passes=epochs)
        return dataclasses.replace(
            self,
            workload=dataclasses.replace(self.workload, capacity=cap, update_groups=groups),
            train=dataclasses.replace(self.train, ppo_epochs=epochs),
            lengths=LogNormal(float(median), SIGMA, cap),
        )


def sync_vs_oppo(projection: Projection, engine: Engine) -> dict:
    """Mean step time of sync and oppo and OPPO's speedup, for one engine."""
    cost, w = projection.cost_model(), projection.workload
    lengths = projection.lengths.sample(seed=w.seed or 0)
    sync = float(simulate(cost, "sync", w, lengths, engine).step_times.mean())
    oppo = float(simulate(cost, "oppo", w, lengths, engine).step_times.mean())
    return {"sync_s": sync, "oppo_s": oppo, "speedup": sync / oppo}


def regime_map(
    projection: Projection, engines=None, epochs=EPOCHS, medians=MEDIANS, progress=None
) -> dict:
    """OPPO's projected speedup over sync per engine (default: as built on the projection's
    hardware, and active), PPO epochs and median length (rows: epochs, columns: medians),
    everything else as ``projection`` says. ``progress`` (a callable) hears of each cell as
    it starts: a map takes minutes."""
    engines = engines or (projection.built_engine, ACTIVE)
    cells, total, done = {}, len(engines) * len(epochs) * len(medians), 0
    for e in engines:
        cells[e.name] = []
        for n in epochs:
            row = []
            for m in medians:
                done += 1
                if progress:
                    progress(f"regime map, engine {e.name}: {n} epoch(s), median {m} "
                             f"({done}/{total})")  # fmt: skip
                row.append(sync_vs_oppo(projection.with_regime(n, m), e))
            cells[e.name].append(row)
    return {
        "epochs": list(epochs),
        "medians": list(medians),
        "sigma": SIGMA,
        "cap_ratio": CAP_RATIO,
        "cells": cells,
    }


def format_regime_map(result: dict) -> list[str]:
    """The regime map as text lines: speedup, and sync's seconds per step in brackets."""
    head = "".join(f"{'median ' + str(m):>20}" for m in result["medians"])
    lines = [
        "PROJECTION regime map: OPPO's speedup over sync (sync s/step in brackets); lengths "
        f"log-normal σ {result['sigma']}, R = {result['cap_ratio']} × median",
        f"{'':<12}{head}",
    ]
    for engine, rows in result["cells"].items():
        lines.append(f"engine {engine}")
        for n, row in zip(result["epochs"], rows, strict=True):
            cells = "".join(f"{c['speedup']:>9.2f}× ({_seconds(c['sync_s'])})" for c in row)
            lines.append(f"{f'  {n} epoch(s)':<12}{cells}")
    return lines


def _seconds(s: float) -> str:
    return f"{s:>6.1f} s" if s < 1000 else f"{s:>6.0f} s"


def build_projection(spec: str, config=None, overrides=(), given: dict | None = None):
    """The projection of ``spec`` (MODEL:HARDWARE) with a run's settings: from ``config``
    (a YAML path or a name in configs/, with ``overrides`` as ``--set``), else ``DEFAULTS``;
    ``given`` (explicit flags, None = not given) wins over both."""
    parse_spec(spec)
    values, sources = dict(DEFAULTS), {}
    if config is not None:
        from oppo_jax.config import load_config  # JAX-free; OmegaConf only when asked

        cfg = load_config(config, list(overrides))
        values |= _config_values(cfg, spec)
        name = f"config {getattr(config, 'name', config)}"
        sources |= {_SETTING[k]: name for k in _config_values(cfg, spec)}
        for item in overrides:
            key = item.split("=", 1)[0].strip()
            hits = [v for k, v in _CONFIG_KEYS.items() if key.startswith(k)]
            sources |= dict.fromkeys(hits, "--set")
    for key, value in (given or {}).items():
        if value is not None:
            values[key] = value
            sources[_SETTING[key]] = "flag"
    lengths = values["lengths"]
    capacity = values["capacity"] or lengths.cap
    if lengths.cap != capacity:
        lengths = dataclasses.replace(lengths, cap=capacity)
    workload = Workload(
        batch=values["batch"],
        chunk_size=values["chunk"],
        delta=values["delta"],
        prompt_len=values["prompt_len"],
        capacity=capacity,
        placement=values["placement"],
        max_deferrals=values["max_deferrals"],
        steps=values["steps"],
        seed=values["seed"],
        update_groups=UpdateGroups(
            values["epochs"],
            values["minibatches"] * values["grad_accum"],
            values["row_multiple"],
            values["minibatches"],
            values["width_factor"],
        ),
        group_size=values["group_size"],
    )
    workload.check()
    train = TrainSettings(
        values["epochs"],
        values["minibatches"],
        tuple(values["trained"]),
        reward_model=bool(values["reward_model"]),
        lora_rank=int(values.get("lora_rank") or 0),
        reference=bool(values["reference"]),
    )
    if "actor" not in train.trained or not set(train.trained) <= {"actor", "critic"}:
        raise ValueError(f"--trained {','.join(train.trained)}: expected actor or actor,critic")
    if train.ppo_epochs < 1 or train.num_minibatches < 1:
        raise ValueError("need at least 1 PPO epoch and 1 minibatch")
    chips, mfu = values["chips"], values["mfu"]
    return Projection(spec, workload, train, lengths, chips, mfu, tuple(sources.items()))


def _config_values(cfg, spec: str) -> dict:
    """The projection's settings a run config gives."""
    preset, model = cfg.model.preset, spec.lower().partition(":")[0]
    if preset is not None and preset.lower() != model:
        raise ValueError(f"--project {spec}: the config's model.preset is {preset}")
    r, p, m = cfg.rollout, cfg.pipeline, cfg.mesh
    values = {
        "batch": r.batch_size,
        "prompt_len": r.max_prompt_len,
        "capacity": r.max_response_len,
        "epochs": cfg.ppo.ppo_epochs,
        "minibatches": cfg.ppo.num_minibatches,
        "grad_accum": cfg.ppo.grad_accum_steps,
        "width_factor": getattr(cfg.ppo, "pack_width_factor", 1),
        "row_multiple": m.data * m.fsdp,  # the batch shards the packed rows split over
        # the models the estimator trains (oppo_jax.ppo.estimators, which imports JAX: the
        # simulator does not): GAE a critic beside the actor; the GRPO family is critic-free
        "trained": ("actor", "critic") if cfg.ppo.advantage == "gae" else ("actor",),
        "reference": cfg.ppo.uses_reference,  # a KL term reads it (β > 0)
        "reward_model": cfg.reward.model_weight > 0,  # else reward functions on host threads
        "group_size": r.group_size,
        "chunk": p.chunk_size,
        "delta": p.overcommit,
        "placement": p.placement,
        "max_deferrals": r.max_staleness,  # a group carried this often must finish
        "chips": m.data * m.fsdp * m.tensor,
        "lora_rank": getattr(cfg.model, "lora_rank", 0),  # 0 also before the schema had LoRA
    }
    if getattr(r, "length_sampler", "policy") == "lognormal":
        values["lengths"] = LogNormal.from_p99(r.length_median, r.length_p99, r.max_response_len)
    return values
