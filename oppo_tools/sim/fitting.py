"""Fitting a CostModel to measured steps: from timelines (traces) or, roughly, from stage sums.

With traces (``oppo-jax bench`` records them; the simulator too) every cost is fitted to what
that cost explains, counted as the engine that recorded the traces computes it
(``engines.recorded_engine``, ``work.step_work``):

    decode   solo + ρ·shared = n·chunk + F·a + Σslots·b + Σslots·ctx·c   (n chunks, F steps
             that ran the model; slots and context as the engine computes them)
    scorers  solo + ρ·shared = calls·p0 + tokens·p1   (tokens as the engine computes them)
    actor    solo + ρ·shared = q0 + q1·admitted tokens;  update likewise over its tokens
    build    its own time, after the last scorer call ended (before it, it only waits)

``solo`` is time a stage ran with the other group idle, ``shared`` time both ran; ρ (the
overlap rate) is the speed a group keeps while the other runs, measured on decode: fitted to
the steps that decoded alone, compared with those that decoded beside the scorers. Fits are
least absolute deviations: a busy machine's timings have long tails, and medians are what
is predicted. The host delays are medians of the gaps the timeline shows (see
``CostModel``). Without traces (a run's metrics.jsonl),
``calibrate`` falls back to stage sums: waits (the build's wait for the scorers, the host's
gaps) are then not separated from the stages, and predictions are rougher.
"""

from __future__ import annotations

import math

import numpy as np

from oppo_tools.sim.engines import Engine, recorded_engine
from oppo_tools.sim.model import CostModel, kv_copy_s
from oppo_tools.sim.trace import observe, scorer_names
from oppo_tools.sim.work import StepFacts, step_work

_NEEDED = ("stage_time_s", "step_time_s", "response_len_mean", "response_len_max", "chunk_size")
_EPS = 1e-4  # s: a gap shorter than this is no gap (the stage waited for its group instead)


def _fit(x: np.ndarray, y: np.ndarray, iterations: int = 50) -> np.ndarray:
    """Least absolute deviations (IRLS) with non-negative coefficients: step times on a busy
    machine have long tails, and the median, not the mean, is what is predicted. A column the
    earlier ones already span (a constant beside an intercept, S·F when S never varied) is
    left at 0: the data cannot tell it apart. A negative coefficient (noise) is dropped."""
    unit = x / np.maximum(np.linalg.norm(x, axis=0), 1e-300)
    keep = np.zeros(x.shape[1], bool)
    for j in range(x.shape[1]):
        trial = keep.copy()
        trial[j] = True
        keep[j] = np.linalg.matrix_rank(unit[:, trial], tol=1e-6) == trial.sum()
    weight, floor = np.ones(len(y)), 1e-6 * max(float(np.abs(y).max(initial=0.0)), 1e-12)
    for _ in range(iterations):
        coef = _nonneg_lstsq(x * weight[:, None], y * weight, keep)
        weight = 1.0 / np.sqrt(np.maximum(np.abs(y - x @ coef), floor))
    return coef


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray, keep: np.ndarray) -> np.ndarray:
    keep = keep.copy()
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all() or keep.sum() <= 1:
            return np.maximum(coef, 0.0)
        keep &= coef >= 0


def _median(values, default: float = 0.0) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(max(np.median(values), 0.0)) if values else default


def _decode_and_rate(x: np.ndarray, solo: np.ndarray, shared: np.ndarray):
    """(decode coefficients, overlap rate ρ): decode fitted to the steps where it ran alone;
    ρ = the median of (work − solo) / shared over steps where it shared the machine (a
    regression on the shared time itself would bias ρ to 0: that time carries the noise).
    Without enough of both kinds of steps, or no slowdown seen: fitted to all, ρ = 1."""
    total = solo + shared
    alone, mixed = shared <= 0.1 * total, shared >= 0.2 * total
    if alone.sum() < max(3, x.shape[1]) or mixed.sum() < max(3, 0.1 * len(total)):
        return _fit(x, total), 1.0
    rate = 1.0
    for _ in range(5):  # the "alone" steps may share a little too: refine both together
        coef = _fit(x[alone], solo[alone] + rate * shared[alone])
        rate = float(np.median((x[mixed] @ coef - solo[mixed]) / shared[mixed]))
        rate = float(np.clip(rate, 0.05, 1.0)) if rate > 0 else 1.0
    return coef, rate


def _rows(records: list[dict], engine: Engine, streamed: bool) -> list[dict]:
    """Per step: the regressors (the work ``engine`` did, ``sim.work``) and observed times."""
    rows = []
    for r in records:
        t, obs = r["trace"], observe(r["trace"])
        n = len(obs["decode"])
        facts = StepFacts.of_trace(t, r["chunk_size"], n)
        # A measured timeline names its scorers (none: a critic-free run at β = 0 with reward
        # functions); a simulated one counts them.
        names = scorer_names(t)
        k = t["n_scorers"] if "n_scorers" in t else len(names)
        trained = int("critic" in names)  # older simulated traces: the critic among k
        trained = t.get("trained_scorers", trained if names else max(min(k - 1, 1), 0))
        work = step_work(engine, facts, k, trained)
        st = bool(r.get("streamed", streamed))
        decode = np.sum(work.decode, axis=0) if work.decode else np.zeros(3)
        calls = len(work.score_chunks) if st else 1  # per scorer, after its admission
        scored = sum(work.score_chunks) if st else work.sync_score_tokens
        admit = work.scorer_admit_tokens
        if not st and work.sync_admit_tokens is not None:
            admit = work.sync_admit_tokens
        calls += 0 if not st and work.sync_admit_tokens == 0 else 1  # 0: no admission call
        build = obs["first"]["build batch"]  # its own time starts when the last score ends
        rows.append(
            {
                "obs": obs,
                "streamed": st,
                "n_scorers": k,
                "trained_scorers": trained,
                "build_own": build[1] - max(build[0], obs["scoring_end"]),
                "tail": r["step_time_s"] - obs["last"]["update"][1],
                "decode": [n, *decode],
                "scorer": [k * calls, admit + scored],
                "actor": [1.0, work.actor_tokens],
                "copied": work.copied_positions,  # a shared prompt's K and V copied
                "update": [1.0, work.update_tokens],
            }
        )
    return rows


def _stage(rows, key: str, part: str) -> np.ndarray:
    return np.array([r["obs"][part].get(key, 0.0) for r in rows])


def _km_median(values: list[float], exact: list[bool]) -> float:
    """Median of delays seen exactly or only as upper bounds (a stage that waited for its
    group hides the host's delay): Kaplan–Meier on the negated values; 0 without evidence."""
    order = sorted(zip((-v for v in values), exact, strict=True), key=lambda p: (p[0], not p[1]))
    survival, at_risk = 1.0, len(order)
    for u, seen in order:
        if seen:
            survival *= 1.0 - 1.0 / at_risk
            if survival <= 0.5:
                return max(-u, 0.0)
        at_risk -= 1
    return 0.0


def _host(rows: list[dict]) -> dict:
    """Host delays from the gaps on the generation group (see CostModel): a gap shows a
    delay exactly; no gap bounds it (``_km_median``)."""
    h = {k: ([], []) for k in ("admit", "setup", "stream", "collect", "dispatch", "finish")}
    h["update"] = ([], [])

    def note(key: str, value: float, exact: bool = True) -> None:
        h[key][0].append(value)
        h[key][1].append(exact)

    for r in (r for r in rows if r["streamed"]):
        o = r["obs"]
        actor, dec = o["first"]["prefill actor"], o["decode"]
        if "scorer" in o["first"]:  # the scorers' admission is dispatched between the two
            scorers = o["first"]["scorer"][0]
            note("setup", scorers - actor[0])
            note("stream", dec[0][0] - scorers, dec[0][0] - actor[1] > _EPS)
        else:
            note("setup", dec[0][0] - actor[0], dec[0][0] - actor[1] > _EPS)
        note("finish", o["first"]["build batch"][0] - dec[-1][1])
    finish = _km_median(*h["finish"]) if h["finish"][0] else None
    for r in rows:
        o = r["obs"]
        actor, dec, build = o["first"]["prefill actor"], o["decode"], o["first"]["build batch"]
        note("admit", actor[0])
        update = o["first"]["update"][0]
        note("update", update - build[0], update - build[1] > _EPS)
        if r["streamed"]:
            continue
        note("setup", dec[0][0] - actor[0], dec[0][0] - actor[1] > _EPS)
        seen = dec[-2][1] if len(dec) > 1 else actor[1]  # the host read the cut after it
        collect = o["first"]["scorer"][0] - seen if "scorer" in o["first"] else None
        if collect is not None:
            note("collect", collect)
        if finish is None:  # not streamed only: the dispatches and the finish in one delay
            ready = max(dec[-1][1], seen + (collect or 0.0))
            note("finish", build[0] - ready)
        else:
            dispatched = build[0] - finish
            note("dispatch", dispatched - seen, dispatched - dec[-1][1] > _EPS)
    out = {f"host_{k}_s": _km_median(*v) if v[0] else 0.0 for k, v in h.items()}
    if finish is None:
        out["host_dispatch_s"] = out["host_collect_s"]
    return out


def calibrate_traces(records: list[dict], streamed: bool = True) -> CostModel:
    """Fit a CostModel to records that carry a ``trace`` (module docstring), as the engine
    that recorded them computed (``engines.recorded_engine``)."""
    engine = recorded_engine([r["trace"] for r in records])
    rows = _rows(records, engine, streamed)
    solo, shared = (lambda k: _stage(rows, k, "solo")), (lambda k: _stage(rows, k, "shared"))
    x = np.array([r["decode"] for r in rows], float)
    dec, rate = _decode_and_rate(x, solo("decode"), shared("decode"))
    own = {k: solo(k) + rate * shared(k) for k in ("prefill actor", "scorer", "update")}
    # the shared prompts' K and V copies, at the fitted decode's cache-read rate (``_plan``)
    copies = np.array([kv_copy_s(float(dec[3]), r["copied"]) for r in rows])
    own["prefill actor"] = own["prefill actor"] - copies
    pre = _fit(np.array([r["scorer"] for r in rows], float), own["scorer"])
    adm = _fit(np.array([r["actor"] for r in rows], float), own["prefill actor"])
    upd = _fit(np.array([r["update"] for r in rows], float), own["update"])
    k, trained = int(rows[0]["n_scorers"]), int(rows[0]["trained_scorers"])
    return CostModel(
        decode_chunk_s=float(dec[0]),
        decode_a=float(dec[1]),
        decode_b=float(dec[2]),
        decode_c=float(dec[3]),
        prefill_p0=float(pre[0]),
        prefill_p1=float(pre[1]),
        n_scorers=k,
        trained_scorers=trained,
        admit_p0=float(adm[0]),
        admit_p1=float(adm[1]),
        build_s=_median(r["build_own"] for r in rows),
        update_u0=float(upd[0]),
        update_u1=float(upd[1]),
        copy_s=_median(r["tail"] for r in rows),
        overlap_rate=rate,
        **_host(rows),
        label=f"calibrated from {len(rows)} measured steps (timelines, {engine.name} engine)",
    )


def _approx_counts(r: dict, batch: int | None, prompt_len: int, streamed: bool) -> dict:
    """Regressors of a record without a trace, approximated from its mean and max lengths."""
    missing = [k for k in _NEEDED if k not in r]
    if missing:
        raise ValueError(f"metrics record of step {r.get('step')} lacks {missing}")
    b = int(r.get("batch_size", batch or 0))
    if b <= 0:
        raise ValueError("calibration needs the batch size: pass batch= or a 'batch_size' key")
    p = float(r.get("prompt_len", prompt_len))
    slots = b + int(r.get("overcommit", 0))
    mean, cut, c = float(r["response_len_mean"]), int(r["response_len_max"]), r["chunk_size"]
    chunks = math.ceil(cut / c)
    admit = slots * p + float(r.get("stale_token_frac", 0.0)) * b * mean
    k = len({s.split(" ", 1)[1] for s in r["stage_time_s"] if " " in s} - {"actor", "batch"})
    calls = 1 + (chunks if r.get("streamed", streamed) else 1)
    return {
        "decode": [cut, b * mean, b * (p * mean + mean * (mean - 1) / 2)],
        "scorer": [(k or 3) * calls, (k or 3) * (admit + b * mean)],
        "admit": admit,
        "tokens": b * (p + mean),
        "n_scorers": k or 3,
    }


def calibrate(
    measurements: list[dict],
    batch: int | None = None,
    prompt_len: int = 0,
    streamed: bool = True,
) -> CostModel:
    """Fit a CostModel by least squares to per-step records (bench or ``metrics.jsonl`` lines).

    Records with a ``trace`` go to ``calibrate_traces``. Others need
    ``stage_time_s``, ``step_time_s``, ``response_len_mean``, ``response_len_max`` and
    ``chunk_size`` (``overcommit``, ``stale_token_frac``, ``batch_size``, ``prompt_len`` and
    ``streamed`` are used when present) and get the rough stage-sum fit: decode per step,
    slot-step and context token, scorers per call and token, the build (with its waits) and
    update per token, copy_s the "copy" stage or else the median unexplained time.
    """
    if not measurements:
        raise ValueError("calibration needs at least one metrics record")
    if all("trace" in r for r in measurements):
        return calibrate_traces(measurements, streamed)
    rows = [_approx_counts(r, batch, prompt_len, streamed) for r in measurements]
    st = [r["stage_time_s"] for r in measurements]
    if not any("decode" in s for s in st):
        raise ValueError("the records have no 'decode' stage time (an older metrics format?)")

    def stage(pred) -> np.ndarray:
        return np.array([sum(v for k, v in s.items() if pred(k)) for s in st], float)

    def cols(key: str) -> np.ndarray:
        return np.array([r[key] if isinstance(r[key], list) else [1.0, r[key]] for r in rows])

    dec = _fit(cols("decode"), stage(lambda k: k == "decode"))
    pre = _fit(
        cols("scorer"),
        stage(lambda k: k.startswith(("score", "prefill ")) and k != "prefill actor"),
    )
    adm = _fit(cols("admit"), stage(lambda k: k == "prefill actor"))
    upd = _fit(cols("tokens"), stage(lambda k: k in ("update", "build batch")))
    unexplained = np.array([r["step_time_s"] for r in measurements]) - stage(lambda k: True)
    copy = stage(lambda k: k == "copy") if any("copy" in s for s in st) else unexplained
    return CostModel(
        decode_a=float(dec[0]),
        decode_b=float(dec[1]),
        decode_c=float(dec[2]),
        prefill_p0=float(pre[0]),
        prefill_p1=float(pre[1]),
        n_scorers=rows[0]["n_scorers"],
        admit_p0=float(adm[0]),
        admit_p1=float(adm[1]),
        update_u0=float(upd[0]),
        update_u1=float(upd[1]),
        copy_s=_median([float(np.median(copy))]),
        label=f"calibrated from {len(rows)} measured steps (sums)",
    )


def bench_records(bench_json: dict) -> dict[str, list[dict]]:
    """Per schedule, the per-step records of a ``bench.json`` (all seeds), with ``streamed``."""
    out = {}
    for name, s in bench_json.get("schedules", {}).items():
        recs = s.get("records") or []
        flat = (x for item in recs for x in (item if isinstance(item, list) else [item]))
        out[name] = [{"streamed": name in ("intra", "oppo"), **r} for r in flat]
    return out


def calibrate_from_bench(bench_json: dict) -> CostModel:
    """Fit a CostModel to the per-step records of a ``bench.json``: every schedule's, but a
    refilling one's (``rollout.refill_every`` in a carrying schedule: its timeline is the
    refill loop's, which this fit does not model; the simulator prices refill itself)."""
    rollout = bench_json.get("workload", {}).get("config", {}).get("rollout", {})
    refills = ("inter", "oppo") if rollout.get("refill_every", 0) else ()
    lanes = {n: rs for n, rs in bench_records(bench_json).items() if n not in refills}
    records = [r for rs in lanes.values() for r in rs if "stage_time_s" in r]
    if not records:
        raise ValueError(
            "bench.json has step times but no per-stage times (stage_time_s): "
            "calibrate from a run's metrics.jsonl instead (--metrics)"
        )
    return calibrate(records, rollout.get("batch_size"), int(rollout.get("max_prompt_len", 0)))
