"""Tests of the typed configuration: YAML files, overrides, validation errors, round trip, docs."""

import ast
import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oppo_jax.config import (
    CONFIG_DIR,
    STABLE_KEYS,
    Config,
    ConfigError,
    DataConfig,
    PipelineConfig,
    RolloutConfig,
    config_keys_doc,
    load_config,
    to_dict,
    to_yaml,
    validate,
    validate_mesh,
)

YAML_FILES = sorted(CONFIG_DIR.glob("*.yaml"))


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


ALL_KEYS = list(_flat(to_dict(Config())))  # declaration order


def _write(tmp_path: Path, text: str, name: str = "run.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_configs_directory_has_the_shipped_files():
    names = {p.name for p in YAML_FILES}
    assert {"demo_cpu.yaml", "qwen2.5-7b_gh200x4.yaml", "qwen2.5-7b_tpu-v5p-8.yaml"} <= names


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_every_yaml_parses_and_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    validate(cfg)  # idempotent on a loaded config
    if cfg.pipeline.placement == "disaggregated":
        assert cfg.mesh.scoring_devices >= 1
    mesh = cfg.mesh
    validate_mesh(cfg, mesh.data * mesh.fsdp * mesh.tensor + mesh.scoring_devices)


@pytest.mark.parametrize(
    "name, devices, preset",
    [
        ("qwen2.5-3b_gh200x1", 1, "qwen2.5-3b"),
        ("qwen2.5-7b_gh200x1", 1, "qwen2.5-7b"),
        ("qwen2.5-7b_gh200x4", 4, "qwen2.5-7b"),
        ("qwen2.5-7b_tpu-v5p-8", 4, "qwen2.5-7b"),
        ("qwen2.5-3b_tpu-v5p-8", 4, "qwen2.5-3b"),
        ("qwen2.5-32b_tpu-v5p-64", 32, "qwen2.5-32b"),
        ("qwen2.5-32b_h100x32", 32, "qwen2.5-32b"),
    ],
)
def test_real_size_configs(name, devices, preset):
    cfg = load_config(name)  # a bare name is looked up in configs/
    validate_mesh(cfg, devices)
    assert cfg.model.preset == preset and cfg.model.dtype == "bfloat16"
    assert cfg.rollout.max_response_len == 1024 and cfg.pipeline.chunk_size == 256
    assert cfg.pipeline.overcommit == 8 and cfg.pipeline.adaptive_overcommit
    # Real-size configs are colocated: a 3+1 split cannot shard their widths (see the YAML).
    assert cfg.pipeline.placement == "colocated"


def test_defaults_follow_trl():
    cfg = Config()
    ppo = cfg.ppo
    assert (ppo.kl_coef, ppo.cliprange, ppo.cliprange_value, ppo.vf_coef) == (0.05, 0.2, 0.2, 0.1)
    assert (ppo.gamma, ppo.lam, ppo.ppo_epochs, ppo.num_minibatches) == (1.0, 0.95, 4, 1)
    assert ppo.kl_estimator == "k1" and not ppo.whiten_rewards and ppo.missing_eos_penalty is None
    assert cfg.rollout.temperature == 0.7
    validate(cfg)


def test_default_load_is_the_cpu_demo():
    cfg = load_config()
    assert cfg == load_config(CONFIG_DIR / "demo_cpu.yaml")
    assert cfg.model.actor_path == "demo" and cfg.rollout.batch_size == 16
    assert cfg.pipeline.mode == "sync" and cfg.pipeline.chunk_size == 16
    assert cfg.rollout.max_response_len == 64


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.rollout.batch_size = 3  # type: ignore[misc]


def test_overrides_apply_with_type_conversion():
    cfg = load_config(
        overrides=[
            "rollout.batch_size=32",
            "pipeline.mode=sync",
            "ppo.missing_eos_penalty=1.0",
            "rollout.temperature=1",
            "pipeline.chunk_candidates=[4,8]",
            "model.preset=qwen2.5-7b",
        ]
    )
    assert cfg.rollout.batch_size == 32 and type(cfg.rollout.batch_size) is int
    assert cfg.pipeline.mode == "sync"
    assert cfg.ppo.missing_eos_penalty == 1.0
    assert cfg.rollout.temperature == 1.0 and type(cfg.rollout.temperature) is float
    assert cfg.pipeline.chunk_candidates == [4, 8]
    assert cfg.model.preset == "qwen2.5-7b"
    # Later overrides win; null resets an optional field.
    cfg = load_config(overrides=["ppo.missing_eos_penalty=1.0", "ppo.missing_eos_penalty=null"])
    assert cfg.ppo.missing_eos_penalty is None


def _raises(match_all: list[str], **kwargs) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    message = str(info.value)
    for text in match_all:
        assert text in message, (text, message)
    assert "Traceback" not in message and "object_type" not in message
    return message


def test_unknown_key_in_yaml_names_file_key_and_value(tmp_path):
    path = _write(tmp_path, "rollout:\n  batch_sise: 8\n")
    message = _raises(["run.yaml", "rollout.batch_sise", "8", "unknown key"], path=path)
    assert "did you mean rollout.batch_size" in message


def test_unknown_section_in_yaml(tmp_path):
    path = _write(tmp_path, "rolout:\n  batch_size: 8\n")
    _raises(["run.yaml", "rolout", "unknown key"], path=path)


def test_unknown_key_in_override():
    _raises(["--set", "pipeline.chunksize=8", "unknown key"], overrides=["pipeline.chunksize=8"])


def test_wrong_type_in_override():
    _raises(["rollout.batch_size", "abc"], overrides=["rollout.batch_size=abc"])
    _raises(["rollout.greedy", "maybe"], overrides=["rollout.greedy=maybe"])
    _raises(["rollout.batch_size", "2.5"], overrides=["rollout.batch_size=2.5"])


def test_wrong_type_in_yaml(tmp_path):
    path = _write(tmp_path, "train:\n  steps: many\n")
    _raises(["run.yaml", "train.steps", "many"], path=path)


def test_a_list_key_given_one_value_names_the_key_and_the_list_it_takes(tmp_path):
    """A single value is refused, not taken as a one-element list (OmegaConf's message named
    AnyNode and ListConfig, and a mapping gave 'Cannot merge incompatible container types')."""
    fn = "oppo_jax.rewards.demo:sentiment"
    hint = f"reward.functions takes a list, e.g. --set 'reward.functions=[{fn}]'"
    _raises([f"--set reward.functions={fn}: {hint}"], overrides=[f"reward.functions={fn}"])
    _raises(["pipeline.chunk_candidates=[16]'"], overrides=["pipeline.chunk_candidates=16"])
    for value in ("null", "{a: 1}"):
        _raises(["reward.functions takes a list"], overrides=[f"reward.functions={value}"])
    path = _write(tmp_path, f"reward:\n  functions: {fn}\n")
    _raises([f"run.yaml: reward.functions='{fn}': reward.functions takes a list, e.g. "
             f"functions: [{fn}]"], path=path)  # fmt: skip
    assert load_config(None, [f"reward.functions=[{fn}]"]).reward.functions == [fn]


def test_override_without_equals_sign():
    _raises(["rollout.batch_size", "key=value"], overrides=["rollout.batch_size"])


@pytest.mark.parametrize(
    "overrides, texts",
    [
        (["rollout.batch_size=0"], ["rollout.batch_size=0", "positive"]),
        (["pipeline.chunk_size=0"], ["pipeline.chunk_size=0", "positive"]),
        (["pipeline.chunk_size=-16"], ["pipeline.chunk_size=-16"]),
        (["pipeline.overcommit=-1"], ["pipeline.overcommit=-1", ">= 0"]),
        (
            ["pipeline.overcommit_min=5", "pipeline.overcommit_max=2"],
            ["pipeline.overcommit_min=5", "pipeline.overcommit_max=2"],
        ),
        (["pipeline.overcommit=9"], ["pipeline.overcommit=9", "adaptive"]),  # demo is adaptive
        (["pipeline.mode=async"], ["pipeline.mode='async'", "sync, intra, inter, oppo"]),
        (["pipeline.placement=split"], ["pipeline.placement='split'"]),
        (["ppo.kl_estimator=k4"], ["ppo.kl_estimator='k4'", "k1, k2, k3"]),
        (["ppo.loss_agg=sum"], ["ppo.loss_agg='sum'"]),
        (["optim.schedule=step"], ["optim.schedule='step'"]),
        (["model.dtype=float16"], ["model.dtype='float16'"]),
        (["model.critic_init=random"], ["model.critic_init='random'"]),
        (["rollout.prompt_too_long=drop"], ["rollout.prompt_too_long='drop'"]),
        (["rollout.temperature=0"], ["rollout.temperature=0.0", "greedy"]),
        (["rollout.top_p=0"], ["rollout.top_p=0.0"]),
        (["rollout.top_p=1.5"], ["rollout.top_p=1.5"]),
        (["ppo.cliprange=0"], ["ppo.cliprange=0.0"]),
        (["ppo.gamma=1.1"], ["ppo.gamma=1.1", "[0, 1]"]),
        (["ppo.lam=-0.1"], ["ppo.lam=-0.1"]),
        (["ppo.ppo_epochs=0"], ["ppo.ppo_epochs=0"]),
        (["ppo.num_minibatches=3"], ["rollout.batch_size=16", "ppo.num_minibatches"]),
        (["mesh.fsdp=3"], ["rollout.batch_size=16", "mesh.data*mesh.fsdp=3"]),
        (["mesh.data=0"], ["mesh.data=0"]),
        (["train.steps=0"], ["train.steps=0"]),
        (["pipeline.placement=disaggregated"], ["mesh.scoring_devices=0"]),
        (["mesh.scoring_devices=1"], ["mesh.scoring_devices=1", "colocated"]),
        (["ppo.kl_coef=nan"], ["ppo.kl_coef=nan", "finite"]),
        (["pipeline.chunk_candidates=[]"], ["pipeline.chunk_candidates=[]"]),
        (["pipeline.compact_min_slots=3"], ["pipeline.compact_min_slots=3", "power of two"]),
        (["pipeline.compact_min_slots=0"], ["pipeline.compact_min_slots=0"]),
    ],
)
def test_bad_values_name_key_and_value(overrides, texts):
    _raises(texts, overrides=overrides)


def test_greedy_allows_zero_temperature():
    cfg = load_config(overrides=["rollout.greedy=true", "rollout.temperature=0"])
    assert cfg.rollout.greedy and cfg.rollout.temperature == 0.0


def test_microbatches_must_split_over_the_batch_axes():
    # 16 % 4 == 0, but microbatches of 16 / (2*2) = 4 do not split over 8 batch shards.
    with pytest.raises(ConfigError, match=r"microbatches of 4 .*mesh.data\*mesh.fsdp=8"):
        load_config(overrides=["mesh.data=2", "mesh.fsdp=4", "ppo.grad_accum_steps=2",
                               "ppo.num_minibatches=2"])  # fmt: skip
    cfg = load_config(overrides=["mesh.data=2", "mesh.fsdp=4", "rollout.batch_size=32"])
    assert cfg.mesh.data * cfg.mesh.fsdp == 8


def test_several_problems_are_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["train.steps=0", "pipeline.mode=x"])
    assert len(info.value.problems) == 2
    assert "train.steps=0" in str(info.value) and "pipeline.mode='x'" in str(info.value)


def test_malformed_yaml_names_the_file(tmp_path):
    path = _write(tmp_path, "rollout:\n  batch_size: [16\ntrain: {\n", name="broken.yaml")
    message = _raises(["broken.yaml", "line"], path=path)
    assert re.search(r"line \d+, column \d+", message)


def test_duplicate_yaml_key_is_rejected(tmp_path):
    path = _write(tmp_path, "seed: 1\nseed: 2\n")
    _raises(["run.yaml", "duplicate key"], path=path)


def test_yaml_list_at_top_level_is_rejected(tmp_path):
    _raises(["run.yaml", "mapping"], path=_write(tmp_path, "- 1\n- 2\n"))


def test_python_tags_are_rejected_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    text = f'seed: !!python/object/apply:os.system ["touch {marker}"]\n'
    message = _raises(["run.yaml", "python/object/apply:os.system", "not allowed"],
                      path=_write(tmp_path, text))  # fmt: skip
    assert "line 1" in message
    with pytest.raises(ConfigError, match="not allowed"):
        load_config(overrides=[f'seed=!!python/object/apply:os.system ["touch {marker}"]'])
    assert not marker.exists()


def test_missing_file(tmp_path):
    _raises(["nope.yaml", "not found"], path=tmp_path / "nope.yaml")
    # an unknown name lists the names there are (those of configs/), on the same line
    names = ", ".join(sorted(p.stem for p in YAML_FILES))
    message = _raises(
        ["no_such_config", "not found", f"{CONFIG_DIR}: {names}"], path="no_such_config"
    )
    assert "demo_cpu, grpo_demo_cpu" in message and "\n" not in message


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(
        CONFIG_DIR / "qwen2.5-7b_gh200x4.yaml",
        overrides=["seed=7", "ppo.missing_eos_penalty=0.5", "data.prompts='1e-6'",
                   "data.prompt_field='yes'", "optim.actor_lr=3.3e-7"],
    )  # fmt: skip
    assert cfg.data.prompts == "1e-6" and cfg.data.prompt_field == "yes"
    text = to_yaml(cfg)
    again = load_config(_write(tmp_path, text))
    assert again == cfg
    assert to_dict(again) == to_dict(cfg) and to_dict(cfg)["pipeline"]["chunk_size"] == 256


@pytest.mark.parametrize("text", ["${x}", "a\\${seed}", "1e-6", "yes", "null", "~", "", "a: b"])
def test_round_trip_keeps_literal_strings(tmp_path, text):
    cfg = dataclasses.replace(Config(), data=DataConfig(prompts=text))
    assert load_config(_write(tmp_path, to_yaml(cfg))).data.prompts == text


def test_round_trip_of_defaults(tmp_path):
    assert load_config(_write(tmp_path, to_yaml(Config()))) == Config()


def test_validate_checks_hand_built_configs():
    validate(Config())
    # Bypass the constructor (its annotations are runtime-checked under pytest).
    rollout = RolloutConfig()
    object.__setattr__(rollout, "batch_size", "16")
    with pytest.raises(ConfigError, match=r"rollout.batch_size='16': expected int"):
        validate(Config(rollout=rollout))
    with pytest.raises(ConfigError, match=r"pipeline.overcommit_min=3: must be <= .*max=1"):
        validate(Config(pipeline=PipelineConfig(overcommit_min=3, overcommit_max=1)))


def test_validate_mesh_counts_scoring_devices():
    cfg = load_config("qwen2.5-7b_gh200x4")
    validate_mesh(cfg, 4)
    with pytest.raises(ConfigError, match=r"uses 4 devices, but 8 are available"):
        validate_mesh(cfg, 8)
    with pytest.raises(ConfigError, match=r"mesh.data\*mesh.fsdp\*mesh.tensor=1\*1\*1"):
        validate_mesh(load_config(), 2)


def test_keys_doc_covers_every_key_with_a_comment():
    doc = config_keys_doc()
    for key in STABLE_KEYS:
        assert f"`{key}`" in doc
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    assert len(rows) == len(ALL_KEYS)
    for key, row in zip(ALL_KEYS, rows, strict=True):
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert cells[0] == f"`{key}`"
        assert len(cells[3]) > 8, f"{key} has no comment"
    assert "| `rollout.batch_size` | `int` | `16` | B, completed sequences" in doc
    assert "(stable key)" in doc


_VALUES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["0", "-1", "1.5", "null", "true", "[1, 2]", "{a: 1}", "${seed}", "???",
                     "nan", "1e-6", "oppo", "sync", "[", "'", "!!binary x", "a=b"]),
)  # fmt: skip


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(ALL_KEYS + ["rollout", "nope.key"]), _VALUES),
                max_size=4))  # fmt: skip
def test_random_overrides_load_or_raise_config_error(pairs):
    overrides = [f"{key}={value}" for key, value in pairs]
    try:
        cfg = load_config(overrides=overrides)
    except ConfigError as e:
        assert str(e)
        return
    validate(cfg)
    assert isinstance(cfg, Config)


def test_config_modules_do_not_import_jax():
    # A config must load and validate before anything compiles (the package __init__ aside).
    modules = sorted((Path(__file__).parents[1] / "oppo_jax" / "config").glob("*.py"))
    assert len(modules) >= 4
    for module in modules:
        tree = ast.parse(module.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        assert not [m for m in names if m.split(".")[0] in ("jax", "flax", "optax")], module


def test_overcommit_larger_than_the_batch_is_rejected():
    with pytest.raises(
        ConfigError, match=r"pipeline.overcommit_max=20: must be <= rollout.batch_size / "
    ):
        load_config(None, ["pipeline.overcommit_max=20", "pipeline.adaptive_overcommit=true",
                           "pipeline.mode=oppo"])  # fmt: skip
    # Δ counts groups: 5 groups of 4 do not fit beside a batch of 16 (4 groups)
    with pytest.raises(ConfigError, match=r"pipeline.overcommit=5: .* \(16/4\)=4 \(groups\)"):
        load_config(
            None,
            [
                "pipeline.overcommit=5",
                "rollout.group_size=4",
                "pipeline.adaptive_overcommit=false",
                "pipeline.mode=oppo",
            ],  # fmt: skip
        )


def test_group_keys_are_checked():
    with pytest.raises(ConfigError, match=r"rollout.batch_size=16: must be a multiple of"):
        load_config(None, ["rollout.group_size=3"])
    with pytest.raises(ConfigError, match=r"group_size=1: ppo.advantage=grpo needs groups"):
        load_config(None, ["ppo.advantage=grpo"])
    with pytest.raises(ConfigError, match=r"compact_slots=true: slot compaction does not keep"):
        load_config(None, ["rollout.group_size=2", "pipeline.compact_slots=true"])
    with pytest.raises(ConfigError, match=r"ppo.scale_rewards='x'"):
        load_config(None, ["ppo.scale_rewards=x"])


def test_sequence_level_ratios_are_checked():
    """ppo.importance_sampling_level: its values, and the combinations it refuses."""
    grpo = ["rollout.group_size=4", "ppo.advantage=grpo", "ppo.loss_agg=seq_mean"]
    assert load_config(None, [*grpo, "ppo.importance_sampling_level=sequence"])
    rloo = ["rollout.group_size=4", "ppo.advantage=rloo", "ppo.loss_agg=seq_mean"]
    assert load_config(None, [*rloo, "ppo.importance_sampling_level=sequence_sum"])
    with pytest.raises(ConfigError, match=r"level='seq': must be one of token, sequence, seq"):
        load_config(None, [*grpo, "ppo.importance_sampling_level=seq"])
    with pytest.raises(ConfigError, match=r"level=sequence: .* ppo.advantage=gae gives each"):
        load_config(None, ["ppo.importance_sampling_level=sequence"])
    with pytest.raises(ConfigError, match=r"level=sequence: ppo.off_policy_correction=tis"):
        load_config(None, [*grpo, "ppo.importance_sampling_level=sequence",
                           "ppo.off_policy_correction=tis"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"sequence_sum: .* set ppo.loss_agg=seq_mean \(not dapo"):
        load_config(
            None, [*rloo, "ppo.importance_sampling_level=sequence_sum", "ppo.loss_agg=dapo"]
        )


def test_config_modules_import_each_other_without_a_cycle():
    """schema <- validate <- docs <- load: each module imports only those before it."""
    order = ["schema", "validate", "docs", "load"]
    root = Path(__file__).parents[1] / "oppo_jax" / "config"
    for i, name in enumerate(order):
        tree = ast.parse((root / f"{name}.py").read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {
            f"oppo_jax.config.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module == "oppo_jax.config"
            for a in n.names
        }
        later = {f"oppo_jax.config.{m}" for m in order[i:]}
        assert not imported & later, (name, imported & later)


def test_set_takes_several_pairs_after_one_flag():
    from oppo_jax.cli import _parser

    args = _parser().parse_args(
        ["train", "--set", "seed=3", "rollout.batch_size=8", "--set", "train.steps=2"]
    )
    assert args.overrides == ["seed=3", "rollout.batch_size=8", "train.steps=2"]
    cfg = load_config(args.config, args.overrides)
    assert (cfg.seed, cfg.rollout.batch_size, cfg.train.steps) == (3, 8, 2)


def test_every_schedule_is_a_mode():
    from oppo_jax.pipeline.schedule import SCHEDULES, Schedule

    for name, schedule in SCHEDULES.items():
        cfg = load_config(None, [f"pipeline.mode={name}"])
        assert Schedule.named(cfg.pipeline.mode) == schedule and schedule.name == name
    with pytest.raises(ConfigError, match="pipeline.mode='fast'"):
        load_config(None, ["pipeline.mode=fast"])


def test_remat_reaches_the_update_models_only():
    from oppo_jax.run.specs import update_spec
    from tests.ppo_fixtures import ACTOR, CRITIC

    spec = update_spec(load_config(None, ["model.remat=dots"]), ACTOR, CRITIC)
    assert spec.actor.remat == spec.critic.remat == "dots"
    assert ACTOR.remat == "none"  # the rollout's own configs are untouched
    with pytest.raises(ConfigError, match="model.remat='some'"):
        load_config(None, ["model.remat=some"])
