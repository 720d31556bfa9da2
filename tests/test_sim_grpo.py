"""The simulator for the GRPO family: the cut takes whole groups (a group ends with its longest
member) and carries the others whole; Δ counts groups; critic-free steps train one model and
score with the reference only at β > 0; the group regime map."""

import statistics
import subprocess
import sys

import numpy as np
import pytest

from oppo_tools.sim import ACTIVE, CostModel, TrainSettings, Workload, simulate
from oppo_tools.sim.cli import main
from oppo_tools.sim.group_map import format_group_map, group_length_median, group_regime_map
from oppo_tools.sim.lengths import LogNormal
from oppo_tools.sim.project import Projection, build_projection
from oppo_tools.sim.roofline import project_cost_model
from tests.run_fixtures import GH200_GRPO_UNREFILLED

GH200 = "qwen2.5-7b_gh200x1_lora_grpo"
TPU = "qwen2.5-7b_tpu-v5p-8_grpo"
COST = CostModel(decode_a=1e-3, decode_b=1e-5, prefill_p1=1e-6, update_u1=1e-6)


def test_the_cut_takes_whole_groups_and_carries_the_others_whole():
    # G = 2, B = 4 (2 groups), Δ = 1 group: 6 slots. Lengths in order, so the groups are
    # (10, 50), (20, 30), (5, 100): they finish at 50, 30 and 100.
    w = Workload(4, chunk_size=8, delta=1, capacity=128, steps=2, seed=None, group_size=2)
    lengths = [10, 50, 20, 30, 5, 100, 7, 9, 11, 13]
    inter = simulate(COST, "inter", w, lengths, ACTIVE)
    first, second = (r["trace"] for r in inter.records)
    assert inter.records[0]["cut"] == 50  # the 2nd group to finish, with its longest member
    assert first["lengths"] == [20, 30, 10, 50]  # whole groups, by finish: group 1, then 0
    assert inter.records[0]["carried"] == 2  # the third group, whole
    # It comes back first, one member complete (5 of 5), the other with 50 of 100 tokens.
    assert second["prefix"][:2] == [5, 50] and second["slots"] == 6
    assert second["finish"][0] == 0  # complete when admitted
    # Sync starts B sequences (2 groups) and waits for the longest.
    sync = simulate(COST, "sync", w, lengths, ACTIVE)
    assert sync.records[0]["cut"] == 50 and sync.records[0]["trace"]["slots"] == 4
    with pytest.raises(ValueError, match="multiple of the group size"):
        Workload(6, group_size=4).check()


def test_groups_finish_with_their_longest_member():
    """With G samples per prompt the group's length is the max of G draws: the median group
    outgrows the median response as G grows."""
    p = build_projection("qwen2.5-7b:gh200", GH200)
    medians = [
        group_length_median(Projection(p.spec, w, p.train), 512)
        for w in (p.workload.__class__(8, group_size=g) for g in (1, 4, 8, 16))
    ]
    assert medians[0] == pytest.approx(512, rel=0.05)
    assert np.all(np.diff(medians) > 0)
    # the median of the max of 8 log-normal draws (σ 0.94): exp(σ·Φ⁻¹(0.5^(1/8))) x 512
    z = statistics.NormalDist().inv_cdf(0.5 ** (1 / 8))
    assert medians[2] == pytest.approx(512 * np.exp(0.94 * z), rel=0.05)


def test_critic_free_steps_train_one_model_and_score_with_what_they_have():
    ppo = TrainSettings(1, 1)
    free = TrainSettings(1, 1, ("actor",), reward_model=False, reference=False)
    beta = TrainSettings(1, 1, ("actor",), reward_model=False, reference=True)
    assert (ppo.n_scorers, free.n_scorers, beta.n_scorers) == (3, 0, 1)
    assert beta.scorers == ("reference",) and free.scorers == ()
    a, b = (project_cost_model("qwen2.5-7b:gh200", 112, t) for t in (ppo, free))
    assert b.update_u1 == pytest.approx(a.update_u1 / 2) and b.update_u0 == pytest.approx(
        a.update_u0 / 2
    )
    assert (b.n_scorers, b.trained_scorers, a.trained_scorers) == (0, 0, 1)
    assert b.decode_a == a.decode_a and b.admit_p1 == a.admit_p1


def test_grpo_configs_project_their_groups_and_scorers():
    p = build_projection("qwen2.5-7b:gh200", GH200, GH200_GRPO_UNREFILLED)
    w, t = p.workload, p.train
    assert (w.batch, w.group_size, w.delta, w.slots) == (112, 8, 2, 128)
    assert t.trained == ("actor",) and t.n_scorers == 0 and t.lora_rank == 64
    assert t.ppo_epochs == 1
    lines = "\n".join(p.lines())
    expected = ("B = 112 sequences per PPO batch = 14 prompts × G = 8", "actor (critic-free)",
                "0 scorers: none (β = 0: no reference)", "Δ = 2 groups (16 sequences)")  # fmt: skip
    for text in expected:
        assert text in lines, text
    tpu = build_projection("qwen2.5-7b:tpu-v5p", TPU)
    assert tpu.train.scorers == ("reference",) and tpu.workload.slots == 96 + 16
    assert tpu.cost_model().n_scorers == 1
    # --set moves them, and says so
    more = build_projection("qwen2.5-7b:gh200", GH200, ["ppo.kl_coef=0.04"])
    assert more.train.scorers == ("reference",) and more.source("trained") == "--set"


def test_without_scorers_intra_is_sync_and_the_cut_pays():
    """GRPO at β = 0 with a rule reward, colocated: nothing scores on the device, so streaming
    hides nothing (intra = sync); carrying still cuts the long tail."""
    p = build_projection("qwen2.5-7b:gh200", GH200, GH200_GRPO_UNREFILLED, {"steps": 12})
    cost, w = p.cost_model(), p.workload
    lengths = LogNormal(512, 0.94, 4096).sample()
    w = w.__class__(**{**w.__dict__, "capacity": 4096})
    steps = {s: simulate(cost, s, w, lengths, ACTIVE).step_times.mean() for s in
             ("sync", "intra", "inter")}  # fmt: skip
    assert steps["intra"] == pytest.approx(steps["sync"])
    assert steps["inter"] < steps["sync"]


def test_group_regime_map_shape_and_sanity():
    sets = ["rollout.batch_size=32", "ppo.grad_accum_steps=4"]
    p = build_projection("qwen2.5-7b:gh200", GH200, sets, {"steps": 6})
    # 4 groups of 8: Δ = 8 groups is left out (Δ·G > B)
    result = group_regime_map(p, medians=(128, 512))
    assert result["deltas"] == [1, 2, 4] and result["medians"] == [128, 512]
    assert set(result["cells"]) == {"built", "active"}
    assert result["group_medians"][0] > 128 and result["group_medians"][1] > 512
    for rows in result["cells"].values():
        intra = np.array([[c["intra"] for c in row] for row in rows])
        sync = np.array([[c["sync_s"] for c in row] for row in rows])
        assert (intra == intra[0]).all()  # intra starts B: the same whatever Δ
        assert (sync == sync[0]).all() and (np.diff(sync, axis=1) > 0).all()
        for row in rows:
            assert all(0.5 < c[s] < 3.0 for c in row for s in ("intra", "inter", "oppo"))
    lines = format_group_map(result)
    assert lines[0].startswith("PROJECTION group regime map: B = 32 = 4 prompts × G = 8")
    assert "  Δ = 1 group " in "\n".join(lines) and len(lines) == 2 + 2 * (1 + 3)


def test_cli_prints_the_group_map_for_groups(capsys):
    argv = ["--project", "qwen2.5-7b:gh200", "--config", GH200, "--steps", "3",
            "--candidates-c", "256", "--candidates-delta", "2", "--set",
            "rollout.max_response_len=256"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "PROJECTION group regime map" in out and "trained: actor (critic-free)" in out
    assert main([*argv, "--regime-map", "epochs", "--no-reference", "--group-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "PROJECTION regime map: OPPO's speedup" in out and "= 28 prompts × G = 4" in out


def test_sim_of_a_grpo_config_stays_jax_free():
    code = (
        "import sys; from oppo_tools.sim.cli import main; "
        f"rc = main(['--project', 'qwen2.5-7b:gh200', '--config', '{GH200}', '--steps', '2', "
        "'--no-regime-map', '--candidates-c', '256', '--candidates-delta', '2']); "
        "assert rc == 0 and 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=120)


def test_calibration_reads_a_timeline_without_scorers():
    """A critic-free bench at β = 0 with reward functions records no scorer stage: the fit
    prices none (and no trained scorer), and recovers the costs its steps were made with."""
    import copy

    from oppo_tools.sim import BUILT
    from oppo_tools.sim.fitting import calibrate_traces
    from oppo_tools.sim.validation import settings

    cost = CostModel(decode_a=2e-3, decode_b=1e-5, decode_c=1e-8, admit_p0=1e-3, admit_p1=1e-6,
                     update_u0=1e-2, update_u1=2e-6, n_scorers=0, trained_scorers=0)  # fmt: skip
    w = Workload(16, 32, 2, 16, 512, "colocated", steps=12, group_size=4)
    lengths = LogNormal(56, 0.9, 512).sample()
    records = []
    for schedule in ("sync", "intra", "inter", "oppo"):
        for r in simulate(cost, schedule, w, lengths, BUILT).records:
            r = copy.deepcopy(r)  # as a measured timeline: no stamps, no scorer stage
            t = r["trace"]
            del t["n_scorers"], t["trained_scorers"]
            t["events"] = [e for e in t["events"] if not e[0].startswith(("prefill s", "score"))]
            records.append(r)
    fit = calibrate_traces(records)
    assert (fit.n_scorers, fit.trained_scorers) == (0, 0)
    for name in ("decode_a", "decode_b", "admit_p1", "update_u1"):
        assert getattr(fit, name) == pytest.approx(getattr(cost, name), rel=1e-3), name
    bench = {"workload": {"config": {
        "rollout": {"batch_size": 16, "group_size": 4, "max_prompt_len": 16,
                    "max_response_len": 512},
        "pipeline": {"chunk_size": 32, "overcommit": 2, "placement": "colocated",
                     "max_deferrals": 2}}}}  # fmt: skip
    assert settings(bench).slots == 24  # the bench's Δ counts groups
