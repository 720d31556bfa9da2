"""One PPO step of a refilling run (``rollout.refill_every``; issue 44): the rows in flight
resume (replayed under the new weights, or kept), the rollout refills rows until the cut
(``pipeline.refill_loop``), the batch's B/G groups come out of the pool, are scored and
trained; every other group decodes on into the next step in its rows.

The same contract as ``pipeline.step.run_step``: it returns (train state, sequences in flight,
StepResult), the result's ``slots`` and ``rollout`` holding the batch's B samples in batch
order (``selection.batch`` = 0..B-1), so the run's records read it as any step's.

What differs from a carrying step without refill:
- the batch is read from the pool, not from the rows: the scorers (reference, critic, reward
  model) score it after the cut, packed (``StepScorers.score_packed``); chunk streaming to the
  scorer models is not built for refilling rows. The reward functions of a sample start as it
  ends under ``oppo`` (``rewards_on_end``), at the cut under ``inter``;
- PPO's old log-probs: a token sampled in this step has the one its decode recorded, and a row
  replayed at the step's start has this step's for its earlier tokens; a sample that finished
  in an earlier step (or a kept row's) gets this step's from one packed forward of the actor
  (``old_logprobs``: a call of one shape, the others entering as one token each), unless
  nothing reads them (``PPOConfig.reads_old_logprobs``: one epoch of one minibatch takes π_old
  from the update's own forward, as TRL does). The behaviour log-probs are those recorded at
  sampling.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from oppo_jax.parallel.sharding import to_host
from oppo_jax.pipeline.carry import HostRollout, Selection, SlotBatch
from oppo_jax.pipeline.kernels import Kernels, oppo_sync_scoring
from oppo_jax.pipeline.placement import GENERATION
from oppo_jax.pipeline.refill import Group, Pool
from oppo_jax.pipeline.refill_loop import Rollout, refill_rollout, start_rows
from oppo_jax.pipeline.step import StepResult, critic_params, on_device
from oppo_jax.pipeline.step_scorers import StepScorers, batch_sequences, packed_inputs
from oppo_jax.rollout.admission import Admission
from oppo_jax.rollout.decode import ResponseBatch
from oppo_jax.scoring.carried import plan_replay
from oppo_jax.scoring.packed import plan_packing
from oppo_jax.scoring.stream import ScorerParams


def run_refill_step(engine, schedule, plan, train_state, run: Rollout, prompts, timeline):
    """One step of a refilling run; see the module docstring. ``run`` (the rows and their
    pool) is updated in place and lives on into the next step."""
    k: Kernels = engine.kernels
    work = k.recorder.start(timeline, GENERATION, engine.placement.scoring_group)
    actor = train_state.actor_model_params
    replayed = resume_rows(k, actor, run, engine.sample_key, engine.carry_kv)
    start = int(np.asarray(to_host(run.state.step)))
    on_end = rewards_on_end(engine, run) if schedule.stream else None
    refill_rollout(k, actor, run, plan.step, prompts, plan.chunk_size, replayed, on_end)
    steps = int(np.asarray(to_host(run.state.step))) - start
    groups, dropped = run.pool.take_batch(plan.step)
    started = started_rewards(run, groups)
    real = sampled_in(plan.step, [*groups, *dropped, *run.pool.groups])
    slots, host = batch_of(groups, k.rollout, plan.step, engine.max_staleness)
    rows = np.arange(len(host.num_generated), dtype=np.int32)
    # the old log-probs where their packed call leaves them (one program downstream)
    logprobs = jax.device_put(host.logprobs, scoring_replicated(engine))
    view = ResponseBatch(on_device(host.tokens), logprobs, on_device(host.num_generated))
    old = old_logprobs(engine, actor, view, slots, host.num_generated, plan.step, groups)
    view = view.replace(logprobs=old)
    scorers = refill_scorers(engine, train_state, slots, host.num_generated, started)
    scorers.score_packed(view, rows, slots)
    kl_coef = np.float32(plan.kl_coef)
    scored = scorers.outputs(view, rows)
    batch, stats = k.experience(view, on_device(rows), experience_admission(slots), scored, kl_coef)
    stats.update(scorers.rewards.metrics if scorers.rewards is not None else {})
    scorers.close()
    lengths = (slots.prompt_len, host.num_generated)
    train_state, update_metrics = k.train_models(
        train_state, batch, plan.update_key, kl_coef, lengths=lengths
    )
    work.close_refill_decode(steps, plan.chunk_size, real)
    events, wall = k.recorder.stop()
    metrics, selection = {**stats, **update_metrics}, Selection(rows, steps)
    refill = {"dropped": len(dropped), "in_flight_groups": len(run.pool.groups)}
    result = StepResult(metrics, selection, slots, host, events, wall, batch, work, refill)
    in_flight = [s for g in run.pool.groups for s in g.samples]
    return train_state, in_flight, result


def resume_rows(k: Kernels, params, run: Rollout, key, carry_kv: str) -> bool:
    """Make ``run.state`` this step's rows: empty ones at a run's start; the rows in flight
    replayed under ``params`` (carry_kv replay, and after a resume whatever the setting:
    their keys and values are not in a checkpoint), or kept as they are. Returns whether the
    rows' earlier tokens now have this step's log-probs (they were replayed)."""
    if run.state is None and not run.pool.holder():
        run.state = start_rows(k, key, run.pool.rule.rows)
        return True
    if run.state is not None and carry_kv == "keep":
        return False
    held = held_rows(run.pool, k.rollout)
    shape = (k.rollout.prompt_width, k.rollout.max_response_len)
    replay = plan_replay(held["context"], held["prompt_len"], held["prefix_len"], shape)
    real = int(held["prompt_len"].sum() + held["prefix_len"].sum())
    admission = host_admission(held)
    run.state = None  # the old rows' cache goes before the replay fills a new one
    run.state, _ = k.prefill_actor(params, admission, key, replay, 1, real)
    run.stores.of.clear()  # their prompts' keys and values were the old weights'
    return True


def held_rows(pool: Pool, rollout) -> dict[str, np.ndarray]:
    """The rows in flight as an admission's host arrays (``Admission``'s fields): row r holds
    its sample's prompt and response so far; free rows are empty."""
    s, p, r = pool.rule.rows, rollout.prompt_width, rollout.max_response_len
    context = np.full((s, p + r), rollout.pad_id, np.int32)
    prompt_len, prefix_len = np.zeros(s, np.int32), np.zeros(s, np.int32)
    prompt_id, sample_index = np.zeros(s, np.int32), np.zeros(s, np.int32)
    active = np.zeros(s, bool)
    for row, (g, x) in pool.holder().items():
        seq = g.prompt + x.tokens
        context[row, : len(seq)] = seq
        prompt_len[row], prefix_len[row] = len(g.prompt), len(x.tokens)
        prompt_id[row], sample_index[row], active[row] = g.prompt_id, x.index, True
    return dict(
        context=context,
        prompt_len=prompt_len,
        prefix_len=prefix_len,
        prefix_finished=np.zeros(s, bool),
        prefix_behaviour=np.zeros((s, r), np.float32),
        prompt_id=prompt_id,
        sample_index=sample_index,
        active=active,
        must_finish=np.zeros(s, bool),
    )


def batch_of(groups: list[Group], rollout, step: int, bound: int):
    """The batch's samples (groups in batch order, each's samples in index order) as the
    host's (SlotBatch, HostRollout) of B rows. A slot's ``prefix_len`` counts its tokens
    sampled in earlier steps (``prefix_behaviour``, ``prefix_version``: theirs); ``logprobs``
    holds this step's log-probs where the pool has them (zero where ``old_logprobs`` adds
    them)."""
    samples = [(g, x) for g in groups for x in g.samples]
    b, p, r = len(samples), rollout.prompt_width, rollout.max_response_len
    slots = SlotBatch(
        context=np.full((b, p + r), rollout.pad_id, np.int32),
        prompt_len=np.zeros(b, np.int32),
        prefix_len=np.zeros(b, np.int32),
        prefix_finished=np.ones(b, bool),
        prefix_behaviour=np.zeros((b, r), np.float32),
        prefix_version=np.zeros((b, r), np.int32),
        prompt_ids=np.array([g.prompt_id for g, _ in samples], np.int64),
        sample_index=np.array([x.index for _, x in samples], np.int32),
        deferrals=np.array([step - g.version for g, _ in samples], np.int32),
        active=np.ones(b, bool),
        must_finish=np.array([g.version + bound <= step for g, _ in samples]),
        drop_if_left=np.zeros(b, bool),
        entries=[None] * b,
    )
    host = HostRollout(
        tokens=np.full((b, r), rollout.pad_id, np.int32),
        logprobs=np.zeros((b, r), np.float32),
        num_generated=np.zeros(b, np.int32),
        finish_step=np.zeros(b, np.int32),
    )
    for i, (g, x) in enumerate(samples):
        n, seq = len(x.tokens), g.prompt + x.tokens
        slots.context[i, : len(seq)], slots.prompt_len[i] = seq, len(g.prompt)
        slots.prefix_len[i] = sum(v < step for v in x.versions)
        slots.prefix_behaviour[i, :n], slots.prefix_version[i, :n] = x.behaviour, x.versions
        host.tokens[i, :n], host.num_generated[i] = x.tokens, n
        host.finish_step[i] = x.finished_at
        if x.scored_at == step:
            host.logprobs[i, :n] = x.old
    return slots, host


def old_logprobs(engine, params, view: ResponseBatch, slots: SlotBatch, lengths, step, groups):
    """[B, R] this step's log-probs of every batch token (``lengths``: the host's response
    lengths of the view's rows): the view's, and for the samples the
    pool has none of this step's for (``Sample.scored_at``), the actor's packed forward (its
    packed scoring program, ``actor_spec``). The call packs all B sequences, one shape every
    step: a sample that has its log-probs enters as its first token alone, and its row is not
    written."""
    k: Kernels = engine.kernels
    samples = [x for g in groups for x in g.samples]
    stale = np.array([x.scored_at != step for x in samples])
    if not stale.any() or not k.spec.ppo.reads_old_logprobs:
        return view.logprobs  # (where unread, a stale sample's entries are zeros)
    r, b = k.rollout, len(samples)
    generated = np.where(stale, np.asarray(lengths), 0).astype(np.int32)
    prompt_len = np.where(stale, slots.prompt_len, 1).astype(np.int32)
    plans = plan_packing(prompt_len + generated, r.prompt_width + r.max_response_len)
    # where the packed scoring's inputs live (``step_scorers.batch_sequences``: replicated)
    sequences, _ = batch_sequences(k, engine.placement, view, np.arange(b, dtype=np.int32), slots)
    put = functools.partial(jax.device_put, device=sequences.sharding)
    at = put(np.where(stale, np.arange(b), b).astype(np.int32))  # b: not written
    out, spec, lengths = put(view.logprobs), k.actor_spec, put(generated)
    for plan in plans:
        batch = packed_inputs(sequences, lengths, prompt_len, plan)
        k.planned("sync scoring", ("packed",), "actor")
        out, marker = oppo_sync_scoring(
            params, out, batch, at, spec=spec, pad_id=r.pad_id, num_slots=b
        )
        tokens = ("scoring", plan.computed_tokens, plan.real_tokens)
        k.recorder.dispatched("score actor", marker, tokens=tokens)
    return out


def scoring_replicated(engine) -> NamedSharding:
    """Where the batch's packed scoring keeps its inputs and outputs: replicated over the
    scoring mesh (``step_scorers.batch_sequences``)."""
    return NamedSharding(engine.placement.scoring_mesh, P())


def refill_scorers(engine, train_state, slots: SlotBatch, lengths, started) -> StepScorers:
    """The step's scorers over the batch ``slots``; the reward functions take every sequence
    (each slot's whole response, ``lengths`` tokens, ended) whose functions have not started
    (``started``: slot -> (tokens, future))."""
    k = engine.kernels
    params = ScorerParams(
        reference=engine.ref_params,
        critic=critic_params(engine, train_state),
        reward=engine.reward_params if k.scorer_specs.reward is not None else None,
    )
    ended = dataclasses.replace(slots, prefix_len=np.asarray(lengths, np.int32))
    rewards = engine.rewards.start(ended, started) if engine.rewards is not None else None
    return StepScorers(k, engine.placement, params, rewards)


def rewards_on_end(engine, run: Rollout):
    """A streaming schedule's (``oppo``) intra-step overlap under refill: each sample's reward
    functions start on the host's threads as it ends, at the refill point that harvests it,
    while the rows decode on (``inter`` starts them at the cut). A result is used only for the
    tokens it was computed on, so timing changes no score. None without reward functions."""
    rewards = engine.rewards
    if rewards is None:
        return None

    def on_end(group: Group, sample) -> None:
        future = rewards.submit(group.prompt_id, group.prompt, sample.tokens)
        run.ended[(group.gid, sample.index)] = (tuple(sample.tokens), future)

    return on_end


def started_rewards(run: Rollout, groups: list[Group]) -> dict:
    """The batch's reward functions started as its samples ended, by batch slot (its groups'
    samples in order); the run forgets every group's that is not in flight any more."""
    keys = [(g.gid, x.index) for g in groups for x in g.samples]
    started = {i: run.ended[key] for i, key in enumerate(keys) if key in run.ended}
    live = {g.gid for g in run.pool.groups}
    run.ended = {key: v for key, v in run.ended.items() if key[0] in live}
    return started


def experience_admission(slots: SlotBatch) -> Admission:
    """The batch's prompts, carried-token counts and behaviour log-probs on the device, as
    ``ppo.experience`` reads an admission (prompt columns only)."""
    p = slots.context.shape[1] - slots.prefix_behaviour.shape[1]
    return host_admission(
        dict(
            context=slots.context[:, :p],
            prompt_len=slots.prompt_len,
            prefix_len=slots.prefix_len,
            prefix_finished=slots.prefix_finished,
            prefix_behaviour=slots.prefix_behaviour,
            prompt_id=slots.prompt_ids.astype(np.int32),
            sample_index=slots.sample_index,
            active=slots.active,
            must_finish=slots.must_finish,
        )
    )


def host_admission(fields: dict[str, np.ndarray]) -> Admission:
    """An ``Admission`` of the host arrays named by its fields: the programs that take it
    transfer them to their own shardings (no reslicing program on a mesh)."""
    return Admission(**{name: np.asarray(x) for name, x in fields.items()})


def sampled_in(step: int, groups) -> int:
    """Tokens the samples of ``groups`` (every group the step decoded: trained, dropped and in
    flight) sampled in step ``step``."""
    return sum(x.versions.count(step) for g in groups for x in g.samples)
