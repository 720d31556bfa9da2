"""Memory per device of the real-size configs, from shapes and shardings only (nothing allocated).

For each config with a ``model.preset`` (or the ones named on the command line) this builds the
actor/critic train state abstractly (``jax.eval_shape``), lays it out with the shardings the
run uses (``oppo_jax.ppo.update.train_state_shardings`` on the config's mesh), sums one device's
shards (``oppo_jax.sharding.per_device_bytes``) and lowers the sharded update
(``oppo_jax.specs.abstract_update_check``) to show it partitions on that mesh. It adds:

- the frozen reference and reward models, laid out as the run lays them out
  (``Placement.scoring_params``: ``param_shardings`` on the scoring mesh, which is the
  training mesh when colocated);
- the four KV caches of the rollout (actor, critic, reference, reward), each
  ``2 x L x S x (P + R) x K x Dh`` in the activation dtype with S = B + Δ_max slots padded to
  a multiple of data x fsdp (``Placement.num_slots``), laid out as the rollout kernels
  constrain them (``oppo_jax.sharding.slot_shardings``: slots over data x fsdp, kv-heads over
  tensor where they divide). With disaggregated placement the reference/reward parts are per
  scoring device; every real config is colocated;
- the PPO batch's shard;
- one float32 logits tensor of an update microbatch, ``B / (grad_accum_steps x data x fsdp)``
  rows x (P + R) tokens x V / tensor (the actor's log-softmax runs in float32): the largest
  single activation, as a floor on what the update needs beyond the state.

Other activations and XLA temporaries (attention scores, the logits' gradient, remat
buffers) are not counted. Run from the repository root:

    .venv/bin/python benchmarks/memory_per_device.py                       # every real config
    .venv/bin/python benchmarks/memory_per_device.py qwen2.5-7b_gh200x4 --set mesh.fsdp=8
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=64")

import jax  # noqa: E402

from oppo_jax.config import CONFIG_DIR, Config, devices_needed, load_config  # noqa: E402
from oppo_jax.models.kv_cache import init_cache  # noqa: E402
from oppo_jax.models.model_config import ModelConfig  # noqa: E402
from oppo_jax.pipeline.placement import Placement  # noqa: E402
from oppo_jax.ppo.update import (  # noqa: E402
    batch_shardings,
    init_train_state,
    train_state_shardings,
)
from oppo_jax.sharding import (  # noqa: E402
    abstract_params,
    make_device_groups,
    param_shardings,
    per_device_bytes,
    slot_shardings,
)
from oppo_jax.specs import (  # noqa: E402
    abstract_batch,
    abstract_update_check,
    preset_models,
    update_spec,
)

GIB = 2**30


def kv_cache_bytes(cfg: Config, model: ModelConfig, placement: Placement, mesh) -> int:
    """One device's share of one model's rollout KV cache (keys, values, lengths) for the
    run's slots of P + R tokens, laid out on ``mesh`` as the rollout kernels lay it out."""
    p, r = cfg.pipeline, cfg.rollout
    delta = 0 if p.mode == "sync" else (p.overcommit_max if p.adaptive_overcommit else p.overcommit)
    slots = placement.num_slots(r.batch_size + delta)
    cache = jax.eval_shape(lambda: init_cache(model, slots, r.max_prompt_len + r.max_response_len))
    return per_device_bytes(cache, slot_shardings(cache, mesh))


def _placement(cfg: Config) -> Placement:
    m = cfg.mesh
    devices = jax.devices()[: devices_needed(cfg)]
    groups = make_device_groups(
        cfg.pipeline.placement, m.data, m.fsdp, m.tensor, m.scoring_devices, devices
    )
    return Placement(groups)


def memory_report(cfg: Config) -> dict:
    """Bytes per device of each part of a run of ``cfg`` (see the module docstring)."""
    actor, critic = preset_models(cfg)  # critic_init=reward: the reward model's architecture
    m = cfg.mesh
    placement = _placement(cfg)
    mesh, scoring = placement.groups.training, placement.scoring_mesh
    spec = update_spec(cfg, actor, critic)
    abstract_state = jax.eval_shape(
        lambda a, c: init_train_state(spec, a, c), abstract_params(actor), abstract_params(critic)
    )
    state_sh = train_state_shardings(spec, mesh)
    part = {
        "actor_params": per_device_bytes(abstract_state.actor_params, state_sh.actor_params),
        "critic_params": per_device_bytes(abstract_state.critic_params, state_sh.critic_params),
        "optimizer": per_device_bytes(
            (abstract_state.actor_opt, abstract_state.critic_opt),
            (state_sh.actor_opt, state_sh.critic_opt),
        ),
    }
    part["frozen_models"] = sum(
        per_device_bytes(abstract_params(c), param_shardings(c, scoring)) for c in (actor, critic)
    )
    part["kv_caches"] = sum(
        kv_cache_bytes(cfg, model, placement, on)
        for model, on in ((actor, mesh), (critic, scoring), (actor, scoring), (critic, scoring))
    )
    part["ppo_batch"] = per_device_bytes(abstract_batch(cfg), batch_shardings(mesh))
    rows = cfg.rollout.batch_size // (cfg.ppo.grad_accum_steps * m.data * m.fsdp)
    tokens = cfg.rollout.max_prompt_len + cfg.rollout.max_response_len
    part["logits"] = rows * tokens * -(-actor.vocab_size // m.tensor) * 4
    check = abstract_update_check(cfg, actor, critic, list(mesh.devices.flat))
    assert check["actor_bytes_per_device"] == part["actor_params"]  # one source of truth
    return {
        "mesh": f"{m.data}x{m.fsdp}x{m.tensor}",
        "params_b": (actor.num_params() / 1e9, critic.num_params() / 1e9),
        **part,
        "train_state": part["actor_params"] + part["critic_params"] + part["optimizer"],
        "total": sum(part.values()),
    }


def _row(name: str, rep: dict) -> str:
    gib = lambda key: f"{rep[key] / GIB:.1f}"  # noqa: E731
    cells = [name, rep["mesh"], gib("actor_params"), gib("critic_params"), gib("optimizer"),
             gib("train_state"), gib("frozen_models"), gib("kv_caches"), gib("ppo_batch"),
             gib("logits"), gib("total")]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="*", help="config names or files (default: all real)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    args = parser.parse_args()
    names = args.configs or sorted(
        p.stem for p in CONFIG_DIR.glob("*.yaml") if load_config(p).model.preset
    )
    print("GiB per device (2^30 bytes). train state = actor + critic params + AdamW moments,")
    print("frozen models and KV caches as the run shards them, all per device.\n")
    print("| config | mesh d×f×t | actor | critic | AdamW | train state | ref + reward | "
          "KV caches | batch | logits | sum |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        print(_row(name, memory_report(load_config(name, args.overrides))), flush=True)


if __name__ == "__main__":
    main()
