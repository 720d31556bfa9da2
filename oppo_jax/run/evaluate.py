"""Held-out evaluation (``eval.*``): decode held-out prompts with the current actor, without
training, through the run's own rollout and scorer kernels, and report the reward (and each
reward function), the demo's gold score, the KL to the reference, the lengths and, where the
prompts' records carry an answer (``data.prompts: arith``), the exact-match accuracy.

Accuracy as the field reports it, from the first reward function (``reward.functions[0]``,
e.g. the math verifier: 1 right, 0 wrong): ``pass@1``, its mean over the greedy responses
(one per prompt, ``eval.greedy``), and ``mean@k``, its mean over ``eval.mean_at_k`` = k
responses per prompt sampled as training samples (``rollout.temperature``), with ``k`` beside
it. Each pass decodes ``rollout.batch_size`` responses at a time in that many slots, so it holds no
more KV cache than a step's batch and compiles its programs once whatever
``eval.num_prompts`` is. The programs it adds to the run's: the greedy pass, the admission
prefill, decode start and whole-cache decode with greedy sampling at B slots (the sampling
is part of the program); the mean@k pass, the same three with the training's sampling at B
slots (training's own run at B + overcommit slots, so these are new shapes of the same jits).

An evaluation at step N reads the parameters after N steps and nothing else that changes, and
its randomness comes from (seed, prompt, sample index, position) under its own key, so it is
deterministic from the seed and gives the same numbers again after a resume. It runs at step
0, every ``eval.every`` steps and at the end; each writes one line of ``eval.jsonl``, a sample
table ``samples/step_<N>.jsonl`` (prompt, response, reward; the mean@k pass's in
``step_<N>_k.jsonl``) and TensorBoard scalars and text.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import jax
import numpy as np

from oppo_jax.data.prompt_set import load_prompt_set
from oppo_jax.parallel.sharding import to_host
from oppo_jax.pipeline.carry import AdmitRule, CarryBuffer, admit
from oppo_jax.pipeline.kernels import oppo_streamed_scoring
from oppo_jax.pipeline.step import slot_admission
from oppo_jax.rewards.arith import exact_match
from oppo_jax.rollout.decode import CutRule

EVAL_KEY = 0xE7A1  # folded into the run's sampling key: eval samples never repeat training's
DEMO_EVAL_SEED = 54321  # held-out demo prompts (training's come from seed 12345)
TEXT_SAMPLES = 4  # rows of each sample table shown in TensorBoard's text tab


class _Fixed:
    """``take(k)`` over a fixed list of (prompt_id, tokens), as ``admit`` expects."""

    def __init__(self, items):
        self.items = list(items)

    def take(self, k):
        out, self.items = self.items[:k], self.items[k:]
        return out


def eval_prompts(ctx) -> tuple[list[np.ndarray], list[dict]]:
    """The held-out prompts (the first ``eval.num_prompts`` of the source) and their records."""
    cfg, ev = ctx.cfg, ctx.cfg.eval
    if ev.prompts == "demo":
        from oppo_jax.data.demo_task import DemoTaskSpec, sample_prompts

        spec = DemoTaskSpec(max_response_len=cfg.rollout.max_response_len)
        prompts = sample_prompts(spec, ev.num_prompts, np.random.default_rng(DEMO_EVAL_SEED))
        text = ctx.tokenizer.decode
        return prompts, [{"prompt": text(list(p), skip_special_tokens=True)} for p in prompts]
    from oppo_jax.run.setup import prompt_format

    source = ev.prompts if ev.prompts is not None else cfg.data.prompts
    r = cfg.rollout
    prompt_set, _ = load_prompt_set(
        source, ctx.tokenizer, r.max_prompt_len, r.prompt_too_long, prompt_format(cfg), ev.split
    )
    n = min(ev.num_prompts, len(prompt_set))
    return [prompt_set[i] for i in range(n)], [prompt_set.record(i) for i in range(n)]


@dataclasses.dataclass
class Evaluator:
    """Runs the evaluations of one run and writes their records."""

    ctx: object  # RunContext
    out: Path
    prompts: list[np.ndarray]
    records: list[dict]
    done: set = dataclasses.field(default_factory=set)

    def due(self, step: int) -> bool:
        every, last = self.ctx.cfg.eval.every, self.ctx.cfg.train.steps
        return step not in self.done and (
            step == 0 or step == last or (every > 0 and step % every == 0)
        )

    def __call__(self, step: int, train_state) -> dict | None:
        """Evaluate the parameters after ``step`` steps if an evaluation is due then."""
        if not self.due(step):
            return None
        self.done.add(step)
        rows, record, sampled = evaluate(self.ctx, train_state, self.prompts, self.records)
        record = {"step": step, **record}
        with open(self.out / "eval.jsonl", "a") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        (self.out / "samples").mkdir(exist_ok=True)
        for name, table in ((f"step_{step}", rows), (f"step_{step}_k", sampled)):
            if table:  # step_<N>_k.jsonl: the mean@k pass's k responses per prompt
                lines = "".join(json.dumps(row, sort_keys=True) + "\n" for row in table)
                (self.out / "samples" / f"{name}.jsonl").write_text(lines)
        _tensorboard(self.out, step, record, rows)
        return record


def make_evaluator(ctx, out: Path, start_step: int):
    """The run's evaluator, or a no-op when ``eval`` is off (neither ``eval.prompts`` nor
    ``eval.split`` set). On a resume at ``start_step``, ``eval.jsonl`` keeps the evaluations
    before it; the one at ``start_step`` (if due) runs again, with the same result."""
    ev = ctx.cfg.eval
    if ev.prompts is None and ev.split is None:
        return lambda step, state: None
    path = out / "eval.jsonl"
    if path.exists():
        kept = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in kept if json.loads(line)["step"] < start_step]
        path.write_text("".join(line + "\n" for line in kept))
    return Evaluator(ctx, out, *eval_prompts(ctx))


def _eval_kernels(ctx, greedy: bool):
    """The run's kernels with the evaluation's sampling (greedy, or the training's). Its
    programs are its own, outside the run's registry (``Kernels.registry``: the step's plan):
    another sampling, its own slot count, the whole cache; they compile at the first
    evaluation, before step 0 and outside every step's ``compiles``."""
    k = ctx.engine.kernels
    sampling = dataclasses.replace(k.rollout.sampling, greedy=greedy)
    rollout = dataclasses.replace(k.rollout, sampling=sampling)
    return dataclasses.replace(k, rollout=rollout, registry=None)


def _decode_all(ctx, k, actor, admission):
    """Decode every admitted slot to its end (the cut rule takes them all)."""
    n = int(np.sum(np.asarray(admission.active)))
    rule = CutRule(admission.active, admission.must_finish, np.int32(n))  # host, as the step's
    key = jax.random.fold_in(ctx.engine.sample_key, EVAL_KEY)
    state, _ = k.prefill_actor(actor, admission, key, ())  # new prompts only: nothing to replay
    chunk_size = ctx.cfg.pipeline.chunk_size
    for _ in range(k.rollout.max_response_len // chunk_size + 2):
        # over the whole cache: an evaluation is not timed
        state, chunk = k.decode_tokens(actor, state, rule, chunk_size)
        if jax.device_get(chunk.ready):
            return state
    raise RuntimeError("evaluation decode did not finish within the response length")


def _score(ctx, k, admission, decoding) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(reference log-probs [S, R] or None, reward-model scores [S] or None), sync-style."""
    engine, place = ctx.engine, ctx.engine.placement
    chunk = place.to_scoring(k.responses(decoding, admission.prefix_len))
    on_scoring = place.to_scoring(admission)
    out = {}
    for role, params in (("reference", engine.ref_params), ("reward", engine.reward_params)):
        if params is None:
            continue
        state, _ = k.prefill_prompts(role, params, on_scoring)
        # Every slot's whole response in one call over every slot: an evaluation is not timed.
        spec = getattr(k.scorer_specs, role)
        state, _ = oppo_streamed_scoring(
            params, state, chunk, None, spec=spec, kv_width=None, packed=False
        )
        out[role] = state
    # β = 0: no reference is loaded, and the evaluation reports no KL
    ref = np.asarray(to_host(out["reference"].per_token)) if "reference" in out else None
    rm = np.asarray(to_host(out["reward"].score)) if "reward" in out else None
    return ref, rm


def evaluate(ctx, train_state, prompts, records) -> tuple[list[dict], dict, list[dict]]:
    """Decode ``prompts`` (x ``eval.samples_per_prompt``) with the current actor, and again
    ``eval.mean_at_k`` times sampled when set; returns the first pass's sample rows, the
    metrics and the mean@k pass's sample rows (empty without one)."""
    ev = ctx.cfg.eval
    rows, record, raw = _evaluate_pass(
        ctx, train_state, prompts, records, ev.greedy, ev.samples_per_prompt
    )
    if ev.greedy and raw.shape[1]:
        record["pass@1"] = float(np.mean(raw[:, 0]))  # greedy: one response per prompt
    sampled_rows = []
    if ev.mean_at_k:
        sampled_rows, _, raw = _evaluate_pass(
            ctx, train_state, prompts, records, False, ev.mean_at_k
        )
        if raw.shape[1]:
            record["mean@k"] = float(np.mean(raw[:, 0]))
            record["k"] = ev.mean_at_k
    return rows, record, sampled_rows


def _evaluate_pass(ctx, train_state, prompts, records, greedy: bool, per: int):
    """One pass: ``per`` responses to each prompt, decoded ``rollout.batch_size`` at a time
    (one slot count for every part, so a pass compiles its programs once and holds no more KV
    cache than a step's batch); (sample rows, metrics, [N, F] raw reward-function values)."""
    k = _eval_kernels(ctx, greedy)
    items = [(i, p) for i, p in enumerate(prompts) for _ in range(per)]
    samples = [j for _ in prompts for j in range(per)]
    width = min(len(items), ctx.cfg.rollout.batch_size)
    actor = getattr(train_state, "actor_model_params", None) or train_state.actor_params
    parts = [
        _decode_part(ctx, k, actor, items[i : i + width], samples[i : i + width], width)
        for i in range(0, len(items), width)
    ]
    slots = SimpleNamespace(
        **{key: np.concatenate([part[0][key] for part in parts]) for key in _SLOT_KEYS}
    )
    tokens, lengths = (np.concatenate([part[j] for part in parts]) for j in (1, 2))
    kl, rm = (
        None if parts[0][j] is None else np.concatenate([part[j] for part in parts]) for j in (3, 4)
    )
    return _summarize(ctx, slots, np.arange(len(items)), tokens, lengths, kl, rm, records)


_SLOT_KEYS = ("prompt_ids", "context", "prompt_len")  # what the summary reads of the slots


def _decode_part(ctx, k, actor, items, samples, width: int):
    """Decode and score ``items`` in ``width`` slots (padded to the generation mesh); returns
    the used slots' ({prompt_ids, context, prompt_len}, tokens, lengths, KL or None, reward
    model score or None)."""
    place, r = ctx.engine.placement, k.rollout
    rule = AdmitRule(len(items), place.num_slots(width), False, 0)  # all must finish
    slots = admit(CarryBuffer(), _Fixed(items), rule, r.prompt_width, r.max_response_len, r.pad_id)
    index = np.zeros(slots.num_slots, np.int32)
    index[: len(items)] = samples
    admission = slot_admission(slots).replace(sample_index=index)  # host arrays, as the step's
    decoding = _decode_all(ctx, k, actor, admission)
    ref, rm = _score(ctx, k, admission, decoding)
    tokens, logp, lengths = map(
        np.asarray, to_host((decoding.tokens, decoding.logprobs, decoding.num_generated))
    )
    n = len(items)
    mask = np.arange(r.max_response_len)[None, :] < lengths[:n, None]
    kl = None if ref is None else np.where(mask, logp[:n] - ref[:n], 0.0).sum(axis=1)
    used = {key: np.asarray(getattr(slots, key))[:n] for key in _SLOT_KEYS}
    return used, tokens[:n], lengths[:n], kl, None if rm is None else rm[:n]


def _function_values(ctx, slots, rows, tokens, lengths, records) -> np.ndarray:
    """[N, F] raw reward-function values of the evaluation's responses."""
    fns = ctx.engine.rewards
    if fns is None or not fns.functions:
        return np.zeros((len(rows), 0))
    futures = [
        fns.submit(
            int(slots.prompt_ids[s]),
            slots.context[s, : slots.prompt_len[s]],
            tokens[s, : lengths[s]],
            records[int(slots.prompt_ids[s])],
        )
        for s in rows
    ]
    return np.stack([f.result() for f in futures])


def _summarize(ctx, slots, rows, tokens, lengths, kl, rm, records):
    fns, model_weight = ctx.engine.rewards, ctx.cfg.reward.model_weight
    raw = _function_values(ctx, slots, rows, tokens, lengths, records)
    reward = np.zeros(len(rows)) if rm is None else model_weight * rm[rows].astype(np.float64)
    if raw.shape[1]:
        reward = reward + fns.weighted(raw)
    record = {
        "reward": float(np.mean(reward)),
        "response_len_mean": float(np.mean(lengths[rows])),
        "response_len_max": int(np.max(lengths[rows])),
        "num_samples": len(rows),
    }
    if kl is not None:
        record["kl"] = float(np.mean(kl))
    if rm is not None:
        record["reward_model"] = float(np.mean(rm[rows]))
    for i, f in enumerate(fns.functions if raw.shape[1] else []):
        record[f"reward_fn/{f.short_name}"] = float(np.mean(raw[:, i]))
    if ctx.gold_fn is not None:
        record["gold"] = float(np.mean(ctx.gold_fn(tokens[rows], lengths[rows])))
    decode = ctx.tokenizer.decode
    samples = [
        {
            "prompt": decode(
                list(slots.context[s, : slots.prompt_len[s]]), skip_special_tokens=True
            ),
            "response": decode(list(tokens[s, : lengths[s]]), skip_special_tokens=True),
            "reward": float(reward[j]),
            "prompt_index": int(slots.prompt_ids[s]),
        }
        for j, s in enumerate(rows)
    ]
    answers = [records[row["prompt_index"]].get("answer") for row in samples]
    if all(isinstance(a, str) for a in answers):  # records with answers (data.prompts: arith)
        for row, answer in zip(samples, answers, strict=True):
            row["answer"] = answer
        hits = [exact_match(row["prompt"], row["response"], row) for row in samples]
        record["exact_match"] = float(np.mean(hits))  # the share of exactly right responses
    return samples, record, raw


def _tensorboard(out: Path, step: int, record: dict, rows: list[dict]) -> None:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # optional, as for the training metrics
        return
    # The event file is named by the second it opens: the step in its name keeps two
    # evaluations of one second from writing the same file (the later one replaced the earlier).
    suffix = f".step{step}.eval"
    with SummaryWriter(str(out / "tensorboard"), filename_suffix=suffix) as tb:
        for key, value in record.items():
            if key != "step" and isinstance(value, int | float):
                tb.add_scalar(f"eval/{key}", value, step)
        table = "\n\n".join(
            f"**prompt** {r['prompt']}  \n**response** {r['response']}  \n"
            f"**reward** {r['reward']:.4f}"
            for r in rows[:TEXT_SAMPLES]
        )
        tb.add_text("eval/samples", table, step)
